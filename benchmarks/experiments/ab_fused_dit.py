"""Temporary A/B (not committed): the served fused_dit.py against benchmarks/fused_dit_next.py
variants, one process, paired repeats."""
import importlib.util, json, sys, time, copy
import torch
sys.path.insert(0, 'benchmarks')
import common
from benchmark_fused_dit import build, flow_loop, bound_steps
from molmobot_policy.runtime import fused_dit
from molmobot_policy.runtime.graphs import StaticRunner

spec = importlib.util.spec_from_file_location('fused_dit_next', sys.argv[3] if len(sys.argv) > 3 else 'benchmarks/fused_dit_next.py')
nxt = importlib.util.module_from_spec(spec); spec.loader.exec_module(nxt)
iters = int(sys.argv[1]) if len(sys.argv) > 1 else 150
out_path = sys.argv[2] if len(sys.argv) > 2 else None
dev = torch.device('cuda'); steps = 10
rows = []
with torch.inference_mode():
    ae, hidden, mask, states, noise = build(1664, dev)
    ae32 = copy.deepcopy(ae).float()
    ctx32 = ae32.prepare_context(hidden.float(), mask, states)
    cond32 = [ae32.time_conditioning(torch.full((1,), i / steps, device=dev)) for i in range(steps)]
    reference = flow_loop(ae32, ctx32, cond32, steps)(noise)
    del ae32, ctx32, cond32
    scale = float(reference.abs().max())
    ctx = ae.prepare_context(hidden, mask, states.to(torch.bfloat16))
    cond = [ae.time_conditioning(torch.full((1,), i / steps, device=dev)) for i in range(steps)]
    fused_dit.StackedBlockWeights.from_blocks_(ae.blocks)
    base_out = None
    variants = [('v9 served', fused_dit, {}), ('counters SYNC=1', nxt, dict(SYNC=1)),
                ('counters SYNC=0 (grid barrier)', nxt, dict(SYNC=0)),
                ('v9 barriers only', fused_dit, dict(SKIP=1)),
                ('counters only', nxt, dict(SYNC=1, SKIP=1)),
                ('grid barrier only (next)', nxt, dict(SYNC=0, SKIP=1))]
    for rep in range(2):
        for label, mod, tiles in variants:
            try:
                t0 = time.perf_counter()
                step = mod.FusedDiTStep(ae, tiles=tiles)
                runner = StaticRunner(flow_loop(ae, ctx, cond, steps, bound_steps(step, cond)),
                                      {'noise': noise}, cuda_graph=True)
                warm = time.perf_counter() - t0
                a, b = runner.run(), runner.run()
                t = common.summary(common.time_replays(runner, iters))
                if base_out is None:
                    base_out = a
                row = dict(variant=label, rep=rep, p50=t['p50'], p99=t['p99'], warm_s=round(warm, 1),
                           stable=bool(torch.equal(a, b)),
                           vs_fp32=float((a - reference).abs().max()) / scale,
                           vs_v9=float((a - base_out).abs().max()) / scale)
                k = getattr(mod, '_dit_step_kernel')
                try:
                    for cache in k.device_caches.values():
                        for kern in cache[0].values():
                            row.setdefault('regs_spills', []).append((kern.n_regs, kern.n_spills))
                except Exception as exc:
                    row['regs_err'] = str(exc)[:80]
            except Exception as exc:
                row = dict(variant=label, rep=rep, error=f'{type(exc).__name__}: {str(exc)[:600]}')
            rows.append(row)
            print(json.dumps(row), flush=True)
print(f"\n{'variant':28s} {'p50':>7s} {'p99':>7s}  vs_fp32   vs_v9   stable")
for r in rows:
    if 'error' in r:
        print(r['variant'], 'ERROR', r['error'][:200]); continue
    print(f"{r['variant']:28s} {r['p50']:7.3f} {r['p99']:7.3f}  {r['vs_fp32']:.2e} {r['vs_v9']:.2e} {r['stable']}")
if out_path:
    common.write_json(out_path, {**common.provenance(), 'rows': rows})
