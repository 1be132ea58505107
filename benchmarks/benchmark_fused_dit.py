"""The flow loop (10 Euler steps x 36 DiT blocks): compiled torch blocks vs the fused kernel.

Builds the full-size action expert alone (36 blocks x 768, 8 heads, MLP 3072, cross-attention
to an aligned 1680-token context: a 1664-token bucket + 1 state token, padded to 16; random
weights N(0, 0.02), bf16), precomputes the context and the 10 steps' conditioning as the
engine does, and replays the 10-step loop as one CUDA graph in these variants:

- `torch`: the blocks compiled as the engine compiles them (`fused_action_expert: off`);
- `persistent`: `molmobot_policy.runtime.fused_dit.FusedDiTStep`, one launch per flow step
  with grid barriers between phases (what the engine serves), then the barriers alone
  (`SKIP`: the phases left out, so its output is wrong by design: it times the
  synchronization);
- `--baseline FILE`: another fused_dit.py (e.g. `git show HEAD:molmobot_policy/runtime/
  fused_dit.py > /tmp/fused_dit_head.py`), timed in the same process: how to measure a
  change to the kernel (`--repeat 2` alternates them);
- `--cluster-baseline FILE`: likewise for the cluster kernel (`runtime/cluster_dit.py`, its
  `.cu` beside the file), with whether the served one gives the same bits;
- `cluster whole steps`: the cluster kernel running each whole Euler step (embedding, blocks,
  final layer, update) in one launch, as the engine serves it; the `cluster (prefetch N)` rows
  run its blocks alone with the rest as torch ops;
- `phased`: the same kernel launched once per phase (9 x 36 launches per step, no barrier);
  then each phase alone (36 launches of it captured as a graph), in us per block.

Each row: p50 / p99 ms over `--iters` replays, warm-up + capture seconds, max |difference|
of the loop output from `torch` and from a float32 eager reference (the same bf16 weights
upcast), both relative to the reference's max |value|, and whether two replays gave the same
bits. CUDA only (on a CPU it says so and exits 2; the kernel's math is tested on the CPU by
test/test_fused_dit_interpreter.py):

    python3 benchmarks/benchmark_fused_dit.py --out $OUT/fused_dit.json        (H200: ~1 min)

Writes JSON with `common.provenance()`.
"""
from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import os
import time

import torch

import common
from molmobot_policy.model import action_expert as ae_mod
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.runtime import cluster_dit, fused_dit
from molmobot_policy.runtime.graphs import StaticRunner

TILE_VARIANTS = {   # label -> tiles (FusedDiTStep); the first is the module default
    'persistent': {},
    'barriers only (wrong output)': {'SKIP': 1},
}


def build(context: int, dev: torch.device, preset: str = 'molmobot-4b-8cam',
          dtype: torch.dtype = torch.bfloat16):
    """The action expert of `preset` alone, random N(0, 0.02) weights in `dtype`, and one
    query's inputs: LLM hidden states (one per block, `context` tokens, the last 25 masked as
    bucket padding), the float32 state and the flow noise."""
    cfg = MolmoBotConfig.from_name(preset)
    torch.manual_seed(0)
    ae = ae_mod.ActionExpert(cfg.action_expert, cfg.llm.d_model, cfg.action_dim,
                             cfg.action_horizon, cfg.states_mode)
    with torch.no_grad():
        for p in ae.parameters():
            p.normal_(0.0, 0.02)
    ae = ae.to(dev, dtype).eval()
    hidden = torch.randn(len(ae.blocks), 1, context, cfg.llm.d_model, device=dev, dtype=dtype)
    mask = torch.ones(1, context, dtype=torch.bool, device=dev)
    mask[:, -25:] = False                           # some padding, as in a bucket
    states = torch.randn(1, cfg.n_obs_steps, cfg.state_dim, device=dev)
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, device=dev)
    return ae, hidden, mask, states, noise


def flow_loop(ae, ctx, cond, steps, step_fns=None):
    """The Euler loop; step_fns: per step, the fused kernel bound to its tables (or None)."""
    def loop_fn(noise):
        x = noise
        for i in range(steps):
            fn = step_fns[i] if step_fns else None
            x = x + (1.0 / steps) * ae.velocity_from_conditioning(x, cond[i], ctx, fn)
        return x.float()
    return loop_fn


def bound_steps(step, cond):
    return [functools.partial(step, tables=step.tables(c.blocks)) for c in cond]


def whole_steps(step, ctx, cond, steps):
    """The loop as `ServedActionExpert.flow` serves it with the cluster kernel: each Euler step
    (embedding, blocks, final layer, update) one launch (`ClusterDiTStep.flow_step`)."""
    tables = [(step.tables(c.blocks), step.final_tables(c.final)) for c in cond]

    def loop_fn(noise):
        x = noise.float().contiguous()
        for c, (t, final) in zip(cond, tables):
            x = step.flow_step(x, c.blocks, c.final, ctx, 1.0 / steps, t, final)
        return x
    return loop_fn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--context', type=int, default=1664, help='LLM tokens (the bucket)')
    parser.add_argument('--iters', type=int, default=100)
    parser.add_argument('--variant', action='append', default=None,
                        help='a label of TILE_VARIANTS to run (repeatable; default: all)')
    parser.add_argument('--baseline', default=None,
                        help='another fused_dit.py (e.g. the last commit\'s) timed as a row in '
                             'the same process')
    parser.add_argument('--repeat', type=int, default=1,
                        help='run the list of kernel variants this many times (paired runs)')
    parser.add_argument('--no-phases', action='store_true',
                        help='skip the phased launches and the phase-by-phase timings')
    parser.add_argument('--cluster-prefetch', default='0',
                        help='the cluster kernel (runtime.cluster_dit) with these L2 prefetch '
                             'distances in stream slots, comma-separated ("" skips it)')
    parser.add_argument('--cluster-baseline', default=None,
                        help='another cluster_dit.py with its cluster_dit.cu beside it (e.g. '
                             'the last commit\'s), built under another name and timed as a row '
                             'in the same process, before each cluster row')
    parser.add_argument('--out', default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print('needs a CUDA device')
        return 2
    dev = torch.device('cuda')
    steps = 10
    rows = []
    with torch.inference_mode():
        ae, hidden, mask, states, noise = build(args.context, dev)
        ae32 = copy.deepcopy(ae).float()
        ctx32 = ae32.prepare_context(hidden.float(), mask, states)
        cond32 = [ae32.time_conditioning(torch.full((1,), i / steps, device=dev))
                  for i in range(steps)]
        reference = flow_loop(ae32, ctx32, cond32, steps)(noise)
        del ae32, ctx32, cond32
        scale = float(reference.abs().max())
        ctx = ae.prepare_context(hidden, mask, states.to(torch.bfloat16))
        cond = [ae.time_conditioning(torch.full((1,), i / steps, device=dev))
                for i in range(steps)]

        def measure(label, step_fns, loop_fn=None):
            t0 = time.perf_counter()
            runner = StaticRunner(loop_fn or flow_loop(ae, ctx, cond, steps, step_fns),
                                  {'noise': noise}, cuda_graph=True)
            warm = time.perf_counter() - t0
            a, b = runner.run(), runner.run()
            timing = common.summary(common.time_replays(runner, args.iters))
            row = {'variant': label, 'p50_ms': timing['p50'], 'p99_ms': timing['p99'],
                   'warmup_s': warm, 'bitwise_stable': bool(torch.equal(a, b)),
                   'rel_diff_vs_fp32': float((a - reference).abs().max()) / scale}
            return row, a

        fused_dit.StackedBlockWeights.from_blocks_(ae.blocks)   # before compiling the blocks
        for block in ae.blocks:
            block.compile(dynamic=False, fullgraph=True)
        row, torch_out = measure('torch (compiled blocks)', None)
        rows.append(row)
        print(row, flush=True)
        chosen = args.variant or list(TILE_VARIANTS)
        unknown = [c for c in chosen if c not in TILE_VARIANTS]
        if unknown:
            parser.error(f'unknown variants {unknown}; known: {list(TILE_VARIANTS)}')
        variants = [(label, fused_dit, dict(tiles=TILE_VARIANTS[label])) for label in chosen]
        if args.baseline:
            spec = importlib.util.spec_from_file_location('fused_dit_baseline', args.baseline)
            baseline = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(baseline)
            variants.insert(0, (f'baseline ({os.path.basename(args.baseline)})', baseline, {}))
        variants = [(label + (f' #{i + 1}' if i else ''), module, kwargs)
                    for i in range(args.repeat) for label, module, kwargs in variants]
        if not args.no_phases:
            variants.append(('phased', fused_dit, dict(phased=True)))
        reason = cluster_dit.unavailable_reason(ae, dev, torch.bfloat16, ctx.keys.shape[-2])
        if args.cluster_prefetch and reason:
            print(f'cluster kernel skipped: {reason}')
        elif args.cluster_prefetch:
            cluster_base = None
            if args.cluster_baseline:
                spec = importlib.util.spec_from_file_location('cluster_dit_baseline',
                                                              args.cluster_baseline)
                cluster_base = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(cluster_base)
                cluster_base._EXT_NAME = 'molmobot_cluster_dit_baseline'
            for i in range(args.repeat):
                suffix = f' #{i + 1}' if i else ''
                if cluster_base is not None:
                    variants.append((f'cluster baseline ({args.cluster_baseline}){suffix}',
                                     cluster_base, {}))
                variants += [(f'cluster (prefetch {pf}){suffix}', cluster_dit,
                              dict(prefetch=int(pf))) for pf in args.cluster_prefetch.split(',')]
                variants.append((f'cluster whole steps{suffix}', cluster_dit,
                                 dict(whole_steps=True)))
        base_out = None             # the last cluster baseline's loop output
        for label, module, kwargs in variants:
            try:
                step_cls = (module.ClusterDiTStep if hasattr(module, 'ClusterDiTStep')
                            else module.FusedDiTStep)
                kwargs = dict(kwargs)
                whole = kwargs.pop('whole_steps', False)
                step = step_cls(ae, **kwargs)
                if whole:
                    row, out = measure(label, None, whole_steps(step, ctx, cond, steps))
                else:
                    row, out = measure(label, bound_steps(step, cond))
                row['rel_diff_vs_torch'] = float((out - torch_out).abs().max()) / scale
                if module is cluster_dit and base_out is not None:
                    row['same_bits_as_cluster_baseline'] = bool(torch.equal(out, base_out))
                if module is not cluster_dit and hasattr(module, 'ClusterDiTStep'):
                    base_out = out
            except Exception as exc:  # noqa: BLE001 - a tile shape may not compile
                row = {'variant': label, 'error': f'{type(exc).__name__}: {str(exc)[:400]}'}
            rows.append(row)
            print(row, flush=True)
        # each phase alone: one step's 36 launches of it as a graph (phased mode)
        phase_rows = []
        x_tokens = ae.embed_actions(noise, ctx.state_tokens)
        for p in range(0 if args.no_phases else fused_dit.N_PHASES):
            try:
                step = bound_steps(fused_dit.FusedDiTStep(ae, phased=True, phases=(p,)), cond)[0]
                runner = StaticRunner(lambda x: step(x, cond[0].blocks, ctx), {'x': x_tokens},
                                      cuda_graph=True)
                us = 1e3 * common.summary(common.time_replays(runner, args.iters))['p50'] \
                    / len(ae.blocks)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f'phase {p}: {type(exc).__name__}: {str(exc)[:300]}')
                us = float('nan')
            phase_rows.append({'phase': p, 'us_per_block': us})
            print(phase_rows[-1], flush=True)
    base = rows[0]['p50_ms']
    print(f'\nflow loop: {steps} steps x {len(ae.blocks)} blocks x {ae.cfg.hidden_size}, context '
          f'{ctx.keys.shape[-2]} tokens, bf16; {torch.cuda.get_device_name()}')
    common.print_table(
        ['variant', 'p50 ms', 'p99 ms', 'x torch', 'vs fp32', 'vs torch', 'stable',
         'bits = cluster baseline'],
        [[r['variant'], r['p50_ms'], r['p99_ms'], base / r['p50_ms'],
          f"{r['rel_diff_vs_fp32']:.2e}", f"{r.get('rel_diff_vs_torch', 0.0):.2e}",
          r['bitwise_stable'], r.get('same_bits_as_cluster_baseline', '')]
         for r in rows if 'error' not in r])
    for r in rows:
        if 'error' in r:
            print(f"{r['variant']}: failed: {r['error']}")
    if phase_rows:
        print('phased launches, us per block (incl. the launch gap): ' + ', '.join(
            f"p{r['phase']} {r['us_per_block']:.1f}" for r in phase_rows))
    if args.out:
        common.write_json(args.out, {**common.provenance(),
                                     'triton': getattr(fused_dit.triton, '__version__', None),
                                     'rows': rows, 'phases': phase_rows})
    return 0 if all('error' not in r for r in rows) else 1


if __name__ == '__main__':
    raise SystemExit(main())
