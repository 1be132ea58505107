"""Which kernel should run the LLM's masked attention? One layer's attention, full size.

The MolmoBot LLM attends with "causal OR both tokens are image tokens" over the 8-camera
prompt padded to its bucket (padded keys hidden): not a plain causal mask, so the flash
kernel cannot take it and SDPA falls back to a kernel that reads an additive (L, L) bias.
On the H200 that costs ~10 ms of the LLM's ~30 ms, against ~4 ms for unmasked flash
(benchmarks/RESULTS.md, "Where the time goes"). This times, at the real shape (1 x 32
query heads / 8 KV heads x L x 128, bf16, L = the bucket) and with the real mask:

- `efficient+bias`, `cudnn+bias`: SDPA with the additive bias (K/V repeated to 32 heads, as
  the model does now), each backend forced;
- `default+bias`: SDPA's own choice (what the model runs today);
- `flex`: torch.nn.attention.flex_attention with a BlockMask built from the same rule
  (`mask_mod`), compiled, GQA native; `flex (block fn)`: the same inside a compiled
  function that takes the BlockMask as an argument (the regional-compile situation),
  called with the masks of two instruction lengths to check that it neither recompiles per
  mask nor reuses a stale one;
- `flash (no mask)`: causal flash, the wrong answer, as the speed floor.

Errors are against float32 math attention with the boolean mask (max |diff| / max |ref|).

    python benchmarks/benchmark_llm_attention.py --out benchmarks/out/llm_attention.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from molmobot_policy.model.config import MolmoBotConfig  # noqa: E402
from molmobot_policy.preprocess import prompt, tokenizer  # noqa: E402

INSTRUCTIONS = ('pick up the red cube and put it in the bowl',
                'stack the blue brick on the red brick then push the bowl to the left edge')


def prompt_mask(cfg: MolmoBotConfig, instruction: str, bucket: int, device):
    """is_image bool (L,), valid bool (L,) for the 8-camera prompt padded to `bucket`."""
    ids = prompt.build_prompt_ids(tokenizer.tiny_tokenizer(), cfg.tokens, 8,
                                  cfg.tokens_per_image, instruction)
    assert len(ids) <= bucket, (len(ids), bucket)
    padded = np.full(bucket, cfg.tokens.bos, np.int64)
    padded[:len(ids)] = ids
    ids_t = torch.as_tensor(padded, device=device)
    specials = torch.tensor(cfg.tokens.image_special_ids, device=device)
    is_image = (ids_t[:, None] == specials).any(-1)
    valid = torch.arange(bucket, device=device) < len(ids)
    return is_image, valid


def allowed_matrix(is_image, valid):
    n = is_image.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=is_image.device).tril()
    return (causal | (is_image[:, None] & is_image[None, :])) & valid[None, :]


def time_cuda(fn, iters: int) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    a = np.asarray(samples)
    return {'median_ms': float(np.median(a)), 'p99_ms': float(np.percentile(a, 99))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--bucket', type=int, default=1664)
    parser.add_argument('--iters', type=int, default=50)
    parser.add_argument('--out', default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print('needs CUDA')
        return 1
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev = torch.device('cuda')
    cfg = MolmoBotConfig.from_name('molmobot-4b-8cam')
    lc = cfg.llm
    h, hkv, hd, n = lc.n_heads, lc.n_kv_heads, lc.head_dim, args.bucket
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, h, n, hd, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, n, hd, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, hkv, n, hd, device=dev, generator=g, dtype=torch.bfloat16)
    kr, vr = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
    masks = [prompt_mask(cfg, text, n, dev) for text in INSTRUCTIONS]
    is_image, valid = masks[0]
    allowed = allowed_matrix(is_image, valid)
    bias = torch.zeros(n, n, dtype=torch.bfloat16, device=dev).masked_fill(
        ~allowed, torch.finfo(torch.bfloat16).min)[None, None]

    def reference(mask_pair):
        a = allowed_matrix(*mask_pair)
        return F.scaled_dot_product_attention(q.float(), kr.float(), vr.float(),
                                              attn_mask=a[None, None])

    refs = [reference(m) for m in masks]

    def error(out, ref):
        return float((out.float() - ref).abs().max() / ref.abs().max())

    def block_mask_for(mask_pair):
        img, val = mask_pair

        def mask_mod(b, hh, qi, ki):
            return ((ki <= qi) | (img[qi] & img[ki])) & val[ki]
        return create_block_mask(mask_mod, 1, None, n, n, device=dev)

    rows = []

    def add(name, fn, ref=refs[0], **extra):
        try:
            out = fn()
            row = {'variant': name, 'rel_err': error(out, ref), **time_cuda(fn, args.iters),
                   **extra}
        except Exception as exc:  # noqa: BLE001 - a backend may refuse the inputs
            row = {'variant': name, 'error': f'{type(exc).__name__}: {str(exc)[:160]}'}
        rows.append(row)
        print(row, flush=True)

    add('default+bias', lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=bias))
    for label, backend in (('efficient+bias', SDPBackend.EFFICIENT_ATTENTION),
                           ('cudnn+bias', SDPBackend.CUDNN_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, kr, vr, attn_mask=bias)
        add(label, run)

    t0 = time.perf_counter()
    block_masks = [block_mask_for(m) for m in masks]
    torch.cuda.synchronize()
    mask_build_ms = (time.perf_counter() - t0) * 1e3 / len(masks)
    flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    add('flex', lambda: flex(q, k, v, block_mask=block_masks[0], enable_gqa=True),
        block_mask_build_ms=mask_build_ms, sparsity=float(block_masks[0].sparsity()))

    @torch.compile(dynamic=False, fullgraph=True)
    def block_fn(q, k, v, block_mask):
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True) * 1.0

    torch._dynamo.utils.counters.clear()
    for i in (0, 1, 0):
        add(f'flex (block fn, mask {i})', lambda i=i: block_fn(q, k, v, block_masks[i]),
            ref=refs[i])
    frames = dict(torch._dynamo.utils.counters['stats'])
    rows.append({'variant': 'flex (block fn) dynamo stats', **{k_: int(v_)
                                                                 for k_, v_ in frames.items()}})
    print(rows[-1])
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        add('flash (no mask, wrong)', lambda: F.scaled_dot_product_attention(
            q, kr, vr, is_causal=True), ref=refs[0])

    print(f'\nLLM attention, one layer: 1 x {h}/{hkv} heads x {n} x {hd} bf16, 8-camera mask; '
          f'{torch.cuda.get_device_name()}, torch {torch.__version__}')
    print(f"{'variant':<28}{'median ms':>10}{'p99 ms':>9}{'x36 ms':>8}{'rel err':>10}")
    for r in rows:
        if 'median_ms' in r:
            print(f"{r['variant']:<28}{r['median_ms']:>10.3f}{r['p99_ms']:>9.3f}"
                  f"{36 * r['median_ms']:>8.2f}{r['rel_err']:>10.2e}")
        elif 'error' in r:
            print(f"{r['variant']:<28} failed: {r['error']}")
    if args.out:
        with open(args.out, 'w') as f:
            json.dump({'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'), 'command': ' '.join(sys.argv),
                       'gpu': torch.cuda.get_device_name(), 'torch': torch.__version__,
                       'bucket': n, 'rows': rows}, f, indent=1)
    return 0 if math.isfinite(rows[0].get('median_ms', math.nan)) else 1


if __name__ == '__main__':
    raise SystemExit(main())
