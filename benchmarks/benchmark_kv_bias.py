"""The action expert's K/V cache GEMM with and without kv_proj's bias, full size (CUDA only).

`ActionExpert.context_key_values` projects every block's context (36 blocks x S context rows
x 768) with the blocks' stacked kv_proj weights (768 -> 1536) in one batched GEMM. With the
bias (`torch.baddbmm`, the form until 2026-11-30) cuBLAS needs the (36, S, 1536) bias
broadcast materialized before the GEMM reads it back; without (`torch.bmm`) the key bias is
dropped (softmax-invariant) and the value bias is folded into the output projection's bias
(`ActionExpert.cross_output_bias`, once per set of weights). Both timed as CUDA-graph replays
at the 8-camera context (S = 1680: 1664 prompt tokens + 1 state token, aligned to 16), bf16,
plus the fold itself for reference. The rows' K/V agree up to the bias (checked).

    python3 benchmarks/benchmark_kv_bias.py --out $OUT/kv_bias.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmark_llm_attention import time_graph  # noqa: E402

from molmobot_policy.model import checkpoint as ckpt  # noqa: E402
from molmobot_policy.model.config import MolmoBotConfig  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--context', type=int, default=1680, help='context rows S')
    parser.add_argument('--iters', type=int, default=200)
    parser.add_argument('--out', default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print('needs CUDA')
        return 1
    dev = torch.device('cuda')
    cfg = MolmoBotConfig.from_name('molmobot-4b-8cam')
    ae = ckpt.random_model(cfg, 0, dev, torch.bfloat16).action_expert.eval()
    ae.stack_kv_projections_()
    weight, bias = ae._stacked_kv_projections()
    n, d = weight.shape[0], weight.shape[2]
    ctx = torch.randn(n, args.context, d, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():
        variants = {
            'baddbmm, bias broadcast (before)':
                lambda: torch.baddbmm(bias.unsqueeze(1), ctx, weight.transpose(1, 2)),
            'bmm, no bias (now)': lambda: torch.bmm(ctx, weight.transpose(1, 2)),
            'cross_output_bias (the fold, per set of weights)': ae.cross_output_bias,
        }
        rows = []
        for name, fn in variants.items():
            rows.append({'variant': name, **time_graph(fn, args.iters)})
        diff = (variants['baddbmm, bias broadcast (before)']()
                - variants['bmm, no bias (now)']() - bias.unsqueeze(1)).abs().max()
    print(f'\nK/V cache GEMM: {n} blocks x {args.context} rows x {d} -> {2 * d}, bf16; '
          f'{torch.cuda.get_device_name()}, torch {torch.__version__}')
    print(f"{'variant':<52}{'median ms':>10}{'p99 ms':>9}")
    for r in rows:
        print(f"{r['variant']:<52}{r['median_ms']:>10.4f}{r['p99_ms']:>9.4f}")
    print(f'max |baddbmm - (bmm + bias)|: {float(diff):.3g} (bf16 rounding of the output)')
    if args.out:
        with open(args.out, 'w') as f:
            json.dump({'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'), 'command': ' '.join(sys.argv),
                       'gpu': torch.cuda.get_device_name(), 'torch': torch.__version__,
                       'context_rows': args.context, 'rows': rows,
                       'max_abs_diff_up_to_bias': float(diff)}, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
