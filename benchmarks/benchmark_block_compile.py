"""Inductor options and small variants on the ViT and one LLM block, full size.

- ViT: the 25 built blocks over 8 images (bf16 attention, the model's MLP), blocks compiled
  as the engine compiles them, under Inductor's defaults, `coordinate_descent_tuning`
  (tuned launch configurations) and `triton.multi_kernel` (persistent and looped reductions
  both compiled, the faster kept at the first call);
- one LLM block at L = 1664 with the real 8-camera mask: K/V repeated to 32 heads before
  SDPA (`repeat`, the model until 2026-11-29) or grouped by SDPA (`gqa`, `enable_gqa=True`,
  the model now), under the same three option sets.

Each variant is replayed as one CUDA graph; error = max |difference| / max |reference|
against the same module run eagerly.

    python3 benchmarks/benchmark_block_compile.py --out $OUT/block_compile.json   (CUDA only)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import types

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchmark_llm_attention as bla  # noqa: E402
from benchmark_vit_variants import build_vit, report, timed  # noqa: E402

from molmobot_policy.model import llm  # noqa: E402
from molmobot_policy.model.config import MolmoBotConfig  # noqa: E402

OPTIONS = {'default': {}, 'coordinate_descent': {'coordinate_descent_tuning': True},
           'multi_kernel': {'triton.multi_kernel': 1},
           'max_autotune_gemm': {'max_autotune_gemm': True}}


def attention_repeat(self, x, cos, sin, attn_bias):
    """The LLM block's attention with K/V repeated to every query head before SDPA."""
    b, n = x.shape[:2]
    q, k, v = self.att_proj(x).split(self.split, dim=-1)
    q = self.q_norm(q.view(b, n, self.n_heads, self.head_dim)).transpose(1, 2)
    k = self.k_norm(k.view(b, n, self.n_kv_heads, self.head_dim)).transpose(1, 2)
    v = v.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
    q, k = llm.apply_rope(q, cos, sin), llm.apply_rope(k, cos, sin)
    repeats = self.n_heads // self.n_kv_heads
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias)
    return self.attn_out(out.transpose(1, 2).reshape(b, n, -1))


ATTENTION = {'repeat': attention_repeat, 'gqa': llm.OLMoSequentialBlock.attention}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--iters', type=int, default=40)
    parser.add_argument('--options', default=','.join(OPTIONS),
                        help=f'comma-separated option sets (of {list(OPTIONS)})')
    parser.add_argument('--attention', default=','.join(ATTENTION),
                        help=f'comma-separated LLM-block attention variants (of {list(ATTENTION)})')
    parser.add_argument('--parts', default='vit,llm', help='vit, llm or both')
    parser.add_argument('--out', default=None)
    args = parser.parse_args(argv)
    options = {k: OPTIONS[k] for k in args.options.split(',')}
    attentions = {k: ATTENTION[k] for k in args.attention.split(',')}
    parts = args.parts.split(',')
    if not torch.cuda.is_available():
        print('needs CUDA')
        return 1
    dev = torch.device('cuda')
    cfg = MolmoBotConfig.from_name('molmobot-4b-8cam')
    rows = []

    def record(name, fn, ref):
        try:
            t0 = time.perf_counter()
            timing, out = timed(fn, args.iters)
            rows.append({'variant': name, **timing, 'compile_and_time_s': time.perf_counter() - t0,
                         'rel_err': float((out.float() - ref).abs().max() / ref.abs().max())})
        except Exception as exc:  # noqa: BLE001 - an option may fail to compile; report it
            rows.append({'variant': name, 'error': f'{type(exc).__name__}: {str(exc)[:200]}'})
        print(rows[-1], flush=True)

    with torch.inference_mode():
        if 'vit' in parts:
            vit = build_vit(cfg, dev)
            x = torch.randn(8, 729, cfg.vit.patch_dim, device=dev, dtype=torch.bfloat16)
            ref = vit(x)[-1].float()
            for blk in vit.transformer.resblocks:
                blk.compile(dynamic=False, fullgraph=True)
            for name, opts in options.items():
                torch._dynamo.reset()
                with torch._inductor.config.patch(opts):
                    record(f'ViT, {name}', lambda: vit(x)[-1], ref)
            del vit
        if 'llm' not in parts:
            report('Inductor options: ViT 25 blocks x 8 images; bf16', rows, args.out)
            return 0

        lc = cfg.llm
        block = llm.OLMoSequentialBlock(lc).to(dev, torch.bfloat16).eval()
        for p in block.parameters():
            p.data.normal_(0, 0.02)
        n = 1664
        bias, cos, sin = bla.llm_block_inputs(cfg, n, dev, torch.bfloat16)
        h = torch.randn(1, n, lc.d_model, device=dev, dtype=torch.bfloat16)
        ref = block(h, cos, sin, bias).float()
        compiled = torch.compile(block, dynamic=False, fullgraph=True)
        for name, opts in options.items():
            for attn_name, attention in attentions.items():
                torch._dynamo.reset()
                block.attention = types.MethodType(attention, block)
                with torch._inductor.config.patch(opts):
                    record(f'LLM block, {name}, {attn_name}',
                           lambda: compiled(h, cos, sin, bias), ref)

    report(f'Inductor options: ViT 25 blocks x 8 images; one LLM block at L = {n}; bf16', rows,
           args.out)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
