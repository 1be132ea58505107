"""Where a block-step of the cluster DiT kernel (runtime/cluster_dit.py) spends its time.

Builds the full-size action expert alone (36 blocks x 768, random N(0, 0.02) weights, bf16)
and one flow step's inputs (a 1664-token context + the state token), then:

- times one step (median of `--iters` launches, CUDA events, tables precomputed) in the
  kernel's benchmark modes (wrong outputs by design): 0 as served, 1 nothing streams
  (weights and K/V left in the ring: the rest of the kernel alone), 2 the exchanges through
  global memory do not wait, 3 both, 4 the copies issued with zero bytes (the issue's cost
  without the traffic);
- runs one step with the kernel's clock trace (thread 0 of every CTA stamps clock64 at 24
  points of each block) and prints, per phase, the median over blocks 1..35 of CTA 0, the
  median over the 64 CTAs and their maximum, in us at `--mhz`.

    python3 benchmarks/profile_cluster_dit.py --out $OUT/profile_cluster_dit.json   (H200: ~1 min,
                                                            of which ~15 s builds the kernel)

Writes JSON with `common.provenance()`. CUDA (sm_90) only; elsewhere it says why and exits 2.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import common
from benchmark_fused_dit import build
from molmobot_policy.runtime import cluster_dit

# a GEMM's warps (and the scores') wait for their own ring slots inside the phase since
# 2026-12-07; the phases that were those waits before stay, empty, so the trace keeps its points
PHASES = ['LN1 broadcast', '(q|k|v slots: in the GEMM)', 'q|k|v GEMM + its slots',
          'peers\' q|k|v wait', 'self-attention', 'self proj', 'copies issued 1',
          'exchange 1 (poll) + residual 1', 'LN2 broadcast', 'cross q + peers\' wait',
          '(K slots: in the scores)', 'scores + softmax + K slots', 'V wait', 'P V',
          'partials wait (combine barrier)', 'combine + o_h wait', 'cross proj', 'copies issued 2',
          'exchange 2 (poll) + residual 2 + LN3', '(fc1 slots: in the GEMM)',
          'fc1 + its slots + peers\' wait', 'fc2',
          'copies issued 3 + exchange 3 (poll) + residual 3']
MODES = {0: 'as served', 1: 'no streaming', 2: 'exchanges do not wait', 3: 'neither',
         4: 'copies issued empty'}


def median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--iters', type=int, default=50)
    parser.add_argument('--mhz', type=float, default=1980.0,
                        help='SM clock for the trace (the H200 runs at up to 1980 MHz)')
    parser.add_argument('--out', default=None)
    args = parser.parse_args(argv)
    dev = torch.device('cuda')
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print('needs an sm_90 CUDA device')
        return 2
    with torch.inference_mode():
        ae, hidden, mask, states, noise = build(1664, dev)    # benchmark_fused_dit's expert
    reason = cluster_dit.unavailable_reason(ae, dev, torch.bfloat16, 1680)
    if reason:
        print(f'the cluster kernel cannot serve: {reason}')
        return 2
    with torch.inference_mode():
        ctx = ae.prepare_context(hidden, mask, states.to(torch.bfloat16))
        mod = ae.time_conditioning(torch.full((1,), 0.3, device=dev)).blocks
        x = ae.embed_actions(noise, ctx.state_tokens)
        step = cluster_dit.ClusterDiTStep(ae)
        tables = step.tables(mod)
        modes = {}
        for mode, label in MODES.items():
            step.mode = mode
            modes[label] = median_ms(lambda: step(x, mod, ctx, tables), args.iters)
            print(f'mode {mode} ({label}): {modes[label]:.3f} ms per step', flush=True)
        step.mode = 0
        nb = len(ae.blocks)
        step.trace = torch.zeros(64, nb, len(PHASES) + 1, dtype=torch.int64, device=dev)
        step(x, mod, ctx, tables)
        torch.cuda.synchronize()
        stamps = step.trace.cpu().double() / args.mhz             # us
    per_phase = (stamps[:, 1:, 1:] - stamps[:, 1:, :-1]).median(dim=1).values   # (64, 23)
    block = (stamps[:, 1:, 0] - stamps[:, :-1, 0]).median()
    rows = [{'phase': name, 'cta0_us': float(per_phase[0, i]),
             'median_us': float(per_phase[:, i].median()), 'max_us': float(per_phase[:, i].max())}
            for i, name in enumerate(PHASES)]
    print(f'\nblock-step (median over blocks and CTAs): {float(block):.2f} us at '
          f'{args.mhz:.0f} MHz')
    common.print_table(['phase', 'CTA 0 us', 'median us', 'max us'],
                       [[r['phase'], r['cta0_us'], r['median_us'], r['max_us']] for r in rows])
    if args.out:
        common.write_json(args.out, {**common.provenance(), 'step_ms_by_mode': modes,
                                     'block_step_us': float(block), 'mhz': args.mhz,
                                     'phases': rows})
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
