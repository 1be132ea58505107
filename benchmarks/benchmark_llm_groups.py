"""The LLM's decoder blocks compiled one by one (the engine) or in groups of consecutive blocks.

The engine compiles each repeated block on its own (`compile_repeated_blocks_`): seconds of
compile time, one Dynamo graph for all 36 blocks. Between two compiled blocks nothing fuses:
the closing residual add of block i and the RMSNorm that opens block i + 1 stay two passes,
and the stage profile counts ~13 kernels and ~1.3 ms of launch gaps per query for the LLM on
an H200 (benchmarks/RESULTS.md, "Where the time goes"). This benchmark compiles g
consecutive blocks as one region (g = 1: the engine's granularity, here through the same
function over one-block groups) and replays the whole stack of
`--blocks` blocks, as one CUDA graph on a GPU, at the real prompt length and mask:

  per group size: median / p99 ms of the stack, ms per block, first-call (compile) seconds,
  Dynamo graphs compiled, max |difference| from the eager stack / max |eager|.

    python3 benchmarks/benchmark_llm_groups.py --out $OUT/llm_groups.json          (H200)
    python3 benchmarks/benchmark_llm_groups.py --preset tiny --groups 1,2 --iters 5  (CPU smoke)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)

import benchmark_llm_attention as bla  # noqa: E402

from molmobot_policy.model import llm  # noqa: E402
from molmobot_policy.model.config import MolmoBotConfig  # noqa: E402


def run_blocks(blocks, x, cos, sin, bias):
    """The blocks in order (what a compiled group runs)."""
    for block in blocks:
        x = block(x, cos, sin, bias)
    return x


def time_cpu(fn, iters: int) -> dict:
    fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return {'median_ms': float(np.median(samples)), 'p99_ms': float(np.percentile(samples, 99))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--preset', default='molmobot-4b-8cam')
    parser.add_argument('--blocks', type=int, default=0, help='0: all of the preset\'s')
    parser.add_argument('--groups', default='1,2,4,12,36',
                        help='comma-separated group sizes (each must divide --blocks)')
    parser.add_argument('--iters', type=int, default=30)
    parser.add_argument('--out', default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device('cuda' if cuda else 'cpu')
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = MolmoBotConfig.from_name(args.preset)
    lc = cfg.llm
    n_blocks = args.blocks or lc.n_layers
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(llm.OLMoSequentialBlock(lc) for _ in range(n_blocks))
    blocks = blocks.to(dev, dtype).eval()
    for p in blocks.parameters():
        p.data.normal_(0, 0.02)
    length = len(bla.prompt.build_prompt_ids(bla.tokenizer.tiny_tokenizer(), cfg.tokens, 8,
                                             cfg.tokens_per_image, bla.INSTRUCTIONS[0]))
    n = -(-length // 64) * 64                         # a bucket: the prompt rounded up to 64
    bias, cos, sin = bla.llm_block_inputs(cfg, n, dev, dtype)
    x = torch.randn(1, n, lc.d_model, device=dev, dtype=dtype)
    rows = []
    from torch._dynamo.utils import counters
    with torch.inference_mode():
        ref = run_blocks(blocks, x, cos, sin, bias).float()
        for g in (int(v) for v in args.groups.split(',')):
            if n_blocks % g:
                rows.append({'group': g, 'error': f'{g} does not divide {n_blocks} blocks'})
                continue
            torch._dynamo.reset()
            compiled = torch.compile(run_blocks, dynamic=False, fullgraph=True)
            groups = [blocks[i:i + g] for i in range(0, n_blocks, g)]

            def stack(groups=groups, compiled=compiled):
                h = x
                for group in groups:
                    h = compiled(group, h, cos, sin, bias)
                return h

            before = counters['stats']['unique_graphs']
            t0 = time.perf_counter()
            out = stack()
            first_s = time.perf_counter() - t0
            graphs = counters['stats']['unique_graphs'] - before
            timing = bla.time_graph(stack, args.iters) if cuda else time_cpu(stack, args.iters)
            rows.append({'group': g, **timing, 'ms_per_block': timing['median_ms'] / n_blocks,
                         'first_call_s': first_s, 'dynamo_graphs': graphs,
                         'rel_err': float((out.float() - ref).abs().max() / ref.abs().max())})
            print(rows[-1], flush=True)
    print(f'\nLLM blocks compiled in groups: {n_blocks} blocks, {n} tokens (prompt {length}), '
          f'{dtype}; {torch.cuda.get_device_name() if cuda else "cpu"}, torch {torch.__version__}')
    print(f"{'group':>6}{'median ms':>11}{'p99 ms':>9}{'ms/block':>10}{'compile s':>11}"
          f"{'graphs':>8}{'rel err':>10}")
    for r in rows:
        if 'error' in r:
            print(f"{r['group']:>6}  {r['error']}")
            continue
        print(f"{r['group']:>6}{r['median_ms']:>11.3f}{r['p99_ms']:>9.3f}{r['ms_per_block']:>10.4f}"
              f"{r['first_call_s']:>11.1f}{r['dynamo_graphs']:>8}{r['rel_err']:>10.2e}")
    if args.out:
        with open(args.out, 'w') as f:
            json.dump({'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'), 'command': ' '.join(sys.argv),
                       'device': torch.cuda.get_device_name() if cuda else 'cpu',
                       'torch': torch.__version__, 'tokens': n, 'prompt_tokens': length,
                       'rows': rows}, f, indent=1)
    return 0 if all('error' not in r for r in rows) else 1


if __name__ == '__main__':
    raise SystemExit(main())
