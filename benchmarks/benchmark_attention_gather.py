"""The LLM's masked attention split by rows without permuting the sequence: one layer, full size.

The image rows (1584 of them for 8 cameras) see every image key plus the few text keys
before them (BOS, the "Image k" texts): an unmasked attention over the gathered image keys,
merged by log-sum-exp with a tiny masked one over those text keys; the other rows (~80) read
the additive bias. Unlike `benchmark_llm_attention.py`'s image-block rows, the residual
stream keeps its order: the image rows' q / k / v are gathered and their output scattered
back inside the attention. Timed as CUDA graphs, component by component, against the
model's SDPA with the (L, L) bias:

  sdpa+bias            what the model runs (cuDNN with the bias, grouped K/V heads)
  cudnn dense image    the unmasked image x image part alone (cuDNN, no bias, no LSE)
  cudnn lse image      the same through the cuDNN op that returns the log-sum-exp (K/V
                       repeated to the query heads)
  flash lse image      the flash kernel with its log-sum-exp (grouped K/V heads)
  rest rows + bias     the ~80 other rows with the bias
  split (cudnn|flash)  the whole split, compiled, result compared with sdpa+bias

    python3 benchmarks/benchmark_attention_gather.py --out $OUT/attention_gather.json  (H200)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)

import benchmark_llm_attention as bla  # noqa: E402



def split_layout(is_image: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> dict:
    """Static index tensors and small biases of the split for one prompt layout."""
    n = is_image.shape[0]
    img = torch.nonzero(is_image)[:, 0]
    last = int(img.max())
    pre = torch.nonzero(~is_image[:last])[:, 0]
    rest = torch.nonzero(~is_image)[:, 0]
    allowed = bla.allowed_matrix(is_image, valid)
    minimum = torch.finfo(dtype).min
    zero = torch.zeros((), dtype=dtype, device=is_image.device)
    pre_bias = torch.where(allowed[img][:, pre], zero, minimum)[None, None]
    rest_bias = torch.where(allowed[rest], zero, minimum)[None, None]
    assert len(img) + len(rest) == n
    return dict(img=img, pre=pre, rest=rest, pre_bias=pre_bias, rest_bias=rest_bias)


def flash_lse(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, False, False, scale=scale)[:2]
    return out, lse


def cudnn_lse(q, k, v, scale):
    rep = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), None, True,
        0.0, False, False, scale=scale)[:2]
    return out, lse.reshape(q.shape[:3])


def split_attention(q, k, v, lay, lse_fn):
    """q (1, H, L, D), k / v (1, Hkv, L, D) in prompt order -> (1, H, L, D)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    img, pre, rest = lay['img'], lay['pre'], lay['rest']
    qi = q[:, :, img]
    out_i, lse_i = lse_fn(qi, k[:, :, img], v[:, :, img], scale)
    out_i = bla.merge_masked_keys(qi, out_i, lse_i, k[:, :, pre], v[:, :, pre],
                                  lay['pre_bias'], scale)
    out_r = F.scaled_dot_product_attention(q[:, :, rest], k, v, attn_mask=lay['rest_bias'],
                                           enable_gqa=True)
    out = torch.empty_like(q)
    out = out.index_copy(2, img, out_i)
    return out.index_copy(2, rest, out_r)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--bucket', type=int, default=1664)
    parser.add_argument('--iters', type=int, default=100)
    parser.add_argument('--out', default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print('needs CUDA')
        return 1
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dev = torch.device('cuda')
    n = args.bucket
    cfg, q, k, v = bla.attention_inputs(n, dev)
    h, hkv, hd = cfg.llm.n_heads, cfg.llm.n_kv_heads, cfg.llm.head_dim
    is_image, valid = bla.prompt_mask(cfg, bla.INSTRUCTIONS[0], n, dev)
    bias = bla.additive_bias(bla.allowed_matrix(is_image, valid), torch.bfloat16)
    lay = split_layout(is_image, valid, torch.bfloat16)
    img = lay['img']
    qi, ki, vi = q[:, :, img].contiguous(), k[:, :, img].contiguous(), v[:, :, img].contiguous()
    scale = 1.0 / math.sqrt(hd)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    keep = valid.nonzero()[:, 0]          # padded rows may differ; compare the real rows

    def err(out):
        return float((out[:, :, keep].float() - ref[:, :, keep].float()).abs().max()
                     / ref[:, :, keep].float().abs().max())

    rows = []

    def add(name, fn, check=False):
        try:
            out = fn()
            row = {'variant': name, **bla.time_graph(fn, args.iters)}
            if check:
                row['rel_err_vs_bias'] = err(out)
        except Exception as exc:  # noqa: BLE001 - a kernel may refuse the inputs
            row = {'variant': name, 'error': f'{type(exc).__name__}: {str(exc)[:200]}'}
        rows.append(row)
        print(row, flush=True)

    add('sdpa+bias', lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                            enable_gqa=True))

    def cudnn_dense():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True)
    add('cudnn dense image (gqa)', cudnn_dense)
    kr, vr = ki.repeat_interleave(h // hkv, dim=1), vi.repeat_interleave(h // hkv, dim=1)

    def cudnn_dense_rep():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qi, kr, vr)
    add('cudnn dense image (repeated)', cudnn_dense_rep)
    add('cudnn lse image', lambda: cudnn_lse(qi, ki, vi, scale)[0])
    add('flash lse image', lambda: flash_lse(qi, ki, vi, scale)[0])
    qr = q[:, :, lay['rest']].contiguous()
    add('rest rows + bias', lambda: F.scaled_dot_product_attention(
        qr, k, v, attn_mask=lay['rest_bias'], enable_gqa=True))
    for label, fn in (('cudnn', cudnn_lse), ('flash', flash_lse)):
        compiled = torch.compile(lambda q_, k_, v_, fn=fn: split_attention(q_, k_, v_, lay, fn),
                                 dynamic=False, fullgraph=False)
        add(f'split ({label}), compiled', lambda c=compiled: c(q, k, v), check=True)
        add(f'split ({label}), eager', lambda fn=fn: split_attention(q, k, v, lay, fn),
            check=True)

    print(f'\nLLM attention split by rows, 1 x {h}/{hkv} heads x {n} x {hd} bf16 '
          f'({len(img)} image rows, {len(lay["pre"])} pre keys, {len(lay["rest"])} other rows); '
          f'{torch.cuda.get_device_name()}, torch {torch.__version__}')
    print(f"{'variant':<32}{'median ms':>10}{'p99 ms':>9}{'x36 ms':>8}{'rel err':>10}")
    for r in rows:
        if 'median_ms' in r:
            e = r.get('rel_err_vs_bias')
            print(f"{r['variant']:<32}{r['median_ms']:>10.4f}{r['p99_ms']:>9.4f}"
                  f"{36 * r['median_ms']:>8.2f}{'' if e is None else f'{e:10.2e}'}")
        else:
            print(f"{r['variant']:<32} failed: {r['error']}")
    if args.out:
        with open(args.out, 'w') as f:
            json.dump({'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'),
                       'command': ' '.join(sys.argv), 'gpu': torch.cuda.get_device_name(),
                       'torch': torch.__version__, 'bucket': n, 'rows': rows}, f, indent=1)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
