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
- `flash (no mask)`: causal flash, the wrong answer, as the speed floor;
- `image-block`: the sequence permuted image tokens first (every op but attention acts
  per token, RoPE follows position ids), so that the image rows need no bias: unmasked
  flash over the image rows and keys (GQA native, log-sum-exp returned), merged with the
  few pre-image text keys, and SDPA with a bias for the remaining rows only
  (`image_block_attention` below); eager and compiled, each as a CUDA graph (`graph` rows
  time a graph replay, so launch gaps are not counted twice). Tried for the model on
  2026-11-29 and not kept: the mask is ~94 % dense, so the bias kernel already does about
  the unmasked work (RESULTS.md).

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

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from molmobot_policy.model import llm  # noqa: E402
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


def additive_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (L, L), True = may attend -> additive (1, 1, L, L) in dtype: 0 or finfo.min."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[None, None]


def llm_block_inputs(cfg: MolmoBotConfig, n: int, device, dtype: torch.dtype):
    """(bias, cos, sin) of an LLM block at n tokens: the 8-camera prompt of INSTRUCTIONS[0]
    padded to n as an additive mask (1, 1, n, n), and RoPE tables (1, 1, n, head_dim)."""
    bias = additive_bias(allowed_matrix(*prompt_mask(cfg, INSTRUCTIONS[0], n, device)), dtype)
    cos, sin = llm.rope_tables(cfg.llm.head_dim, n, cfg.llm.rope_theta, device)
    return bias, cos[None, None], sin[None, None]


class ImageBlockMask(NamedTuple):
    """The LLM's attention mask for a sequence permuted so that its image tokens come first.

    "Causal OR both tokens are image tokens" (plus hidden padded keys) in the order
    [image tokens][other tokens], each part in prompt order (`image_first`):
    the image rows see every image key, the first `n_pre` other keys as the mask says (the
    non-image tokens before the last image token: BOS, the "Image k" texts), and nothing
    after them; the other rows need the general mask. So the image rows run an unmasked
    attention over the image keys, merged by log-sum-exp with a small masked one over the
    `n_pre` keys, and only the other rows read an additive bias (`image_block_attention`).

    n_image, n_pre: static token counts (the same for every instruction of a camera layout);
    pre_bias (B, 1, n_image, n_pre) and rest_bias (B, 1, L - n_image, L) additive, the
    attention dtype (0 visible, finfo.min hidden).
    """

    n_image: int
    n_pre: int
    pre_bias: torch.Tensor
    rest_bias: torch.Tensor


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked softmax(q k^T scale) v and its log-sum-exp, GQA without repeating K/V.

    q (B, H, Lq, D), k/v (B, Hkv, Lk, D), H a multiple of Hkv (query head h reads KV head
    h // (H / Hkv)). Returns out (B, H, Lq, D) in q's dtype and lse float32 (B, H, Lq).
    CUDA: the flash kernel (it returns the log-sum-exp and takes grouped K/V); CPU: its CPU
    counterpart.
    """
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, False, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, scale=scale)[:2]
    return out, lse


def merge_masked_keys(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      k_extra: torch.Tensor, v_extra: torch.Tensor, extra_bias: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Adds a few more keys to an attention result through log-sum-exps (float32 math).

    q (B, H, Lq, D); out (B, H, Lq, D), lse (B, H, Lq): the attention of q over other keys;
    k_extra / v_extra (B, Hkv, n, D), GQA as `attention_lse`; extra_bias additive (B, 1, Lq,
    n). Returns the attention over both key sets, (B, H, Lq, D) in q's dtype:
    (e^lse_a out_a + e^lse_p out_p) / (e^lse_a + e^lse_p).
    """
    b, h, n_q, d = q.shape
    h_kv = k_extra.shape[1]
    qg = q.float().view(b, h_kv, h // h_kv, n_q, d)
    scores = torch.einsum('bgrqd,bgkd->bgrqk', qg, k_extra.float()) * scale
    scores = scores + extra_bias.float().unsqueeze(1)
    lse_p = scores.logsumexp(-1)
    out_p = torch.einsum('bgrqk,bgkd->bgrqd', (scores - lse_p.unsqueeze(-1)).exp(),
                         v_extra.float())
    lse_p, out_p = lse_p.reshape(b, h, n_q), out_p.reshape(b, h, n_q, d)
    top = torch.maximum(lse.float(), lse_p)
    w_a, w_p = (lse.float() - top).exp(), (lse_p - top).exp()
    return ((w_a.unsqueeze(-1) * out.float() + w_p.unsqueeze(-1) * out_p)
            / (w_a + w_p).unsqueeze(-1)).to(q.dtype)


def attention_inputs(n: int, dev):
    """The molmobot-4b-8cam LLM's attention at n tokens: (cfg, q (1, H, n, hd), k / v
    (1, Hkv, n, hd)), bf16, seeded N(0, 1)."""
    cfg = MolmoBotConfig.from_name('molmobot-4b-8cam')
    lc = cfg.llm
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, lc.head_dim, device=dev, generator=g,
                           dtype=torch.bfloat16) for heads in (lc.n_heads, lc.n_kv_heads,
                                                                lc.n_kv_heads))
    return cfg, q, k, v


def image_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: ImageBlockMask) -> torch.Tensor:
    """Attention under an `ImageBlockMask`; equals SDPA with the full (L, L) bias.

    q (B, H, L, D), k/v (B, Hkv, L, D), all in the image-first order. Returns (B, H, L, D)
    in q's dtype. Image rows: the unmasked kernel over the n_image image keys, merged with
    the n_pre pre keys (float32 math, a few dozen keys) through their log-sum-exps:
    out = (e^lse_a out_a + e^lse_p out_p) / (e^lse_a + e^lse_p). Other rows: SDPA with
    `rest_bias` over every key.
    """
    n_img, n_pre = mask.n_image, mask.n_pre
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_img = q[:, :, :n_img]
    out_img, lse_img = attention_lse(q_img, k[:, :, :n_img], v[:, :, :n_img], scale)
    if n_pre:
        out_img = merge_masked_keys(q_img, out_img, lse_img, k[:, :, n_img:n_img + n_pre],
                                    v[:, :, n_img:n_img + n_pre], mask.pre_bias, scale)
    repeats = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    out_rest = F.scaled_dot_product_attention(q[:, :, n_img:], kr, vr, attn_mask=mask.rest_bias)
    return torch.cat([out_img, out_rest], dim=2)


def image_first(is_image, valid, q, k, v):
    """(order, ImageBlockMask, q, k, v permuted) as `llm_hidden_states_image_first` builds
    them (same formulas, one row)."""
    n = is_image.shape[0]
    n_img = int(is_image.sum())
    last = int(torch.nonzero(is_image).max())
    n_pre = int((~is_image[:last]).sum())
    order = torch.cat([torch.nonzero(is_image)[:, 0], torch.nonzero(~is_image)[:, 0]])
    vp = valid[order]
    rows, cols = order[:, None], order[None, :]
    minimum = torch.finfo(q.dtype).min
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    pre_ok = (cols[:, n_img:n_img + n_pre] <= rows[:n_img]) & vp[None, n_img:n_img + n_pre]
    rest_ok = (cols <= rows[n_img:]) & vp[None, :]
    mask = ImageBlockMask(n_img, n_pre, torch.where(pre_ok, zero, minimum)[None, None],
                              torch.where(rest_ok, zero, minimum)[None, None])
    assert n == len(order)
    return order, mask, q[:, :, order], k[:, :, order], v[:, :, order]


def time_graph(fn, iters: int) -> dict:
    """Median / p99 ms of replaying `fn` captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, iters)


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
    n = args.bucket
    cfg, q, k, v = attention_inputs(n, dev)
    h, hkv, hd = cfg.llm.n_heads, cfg.llm.n_kv_heads, cfg.llm.head_dim
    kr, vr = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
    masks = [prompt_mask(cfg, text, n, dev) for text in INSTRUCTIONS]
    is_image, valid = masks[0]
    allowed = allowed_matrix(is_image, valid)
    bias = additive_bias(allowed, torch.bfloat16)

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

    def add(name, fn, ref=refs[0], timer=time_cuda, **extra):
        try:
            out = fn()
            row = {'variant': name, 'rel_err': error(out, ref), **timer(fn, args.iters),
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

    order, ib_mask, qp, kp, vp = image_first(is_image, valid, q, k, v)
    inverse = torch.argsort(order)

    def image_block():
        return image_block_attention(qp, kp, vp, ib_mask)[:, :, inverse]

    compiled_ib = torch.compile(image_block_attention, dynamic=False, fullgraph=True)
    extra = {'n_image': ib_mask.n_image, 'n_pre': ib_mask.n_pre}
    add('image-block eager', image_block, **extra)
    add('image-block eager graph', image_block, timer=time_graph, **extra)
    add('image-block compiled graph',
        lambda: compiled_ib(qp, kp, vp, ib_mask)[:, :, inverse], timer=time_graph, **extra)
    add('default+bias graph', lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=bias),
        timer=time_graph)

    def cudnn_lse(q_, k_, v_, scale):     # the alternative kernel for the image rows
        rep = q_.shape[1] // k_.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q_, k_.repeat_interleave(rep, dim=1), v_.repeat_interleave(rep, dim=1), None, True,
            0.0, False, False, scale=scale)[:2]
        return out, lse.reshape(q_.shape[:3])
    global attention_lse
    flash_lse, attention_lse = attention_lse, cudnn_lse
    try:
        add('image-block (cuDNN, K/V repeated) graph', image_block, timer=time_graph, **extra)
    finally:
        attention_lse = flash_lse

    def bias_with_repeat():        # what the model's block does today, incl. the K/V repeat
        kk, vv = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=bias)
    add('bias + K/V repeat graph', bias_with_repeat, timer=time_graph)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        add('flash causal, GQA graph (wrong)', lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), timer=time_graph)

    print(f'\nLLM attention, one layer: 1 x {h}/{hkv} heads x {n} x {hd} bf16, 8-camera mask; '
          f'{torch.cuda.get_device_name()}, torch {torch.__version__}')
    print(f"{'variant':<34}{'median ms':>10}{'p99 ms':>9}{'x36 ms':>8}{'rel err':>10}")
    for r in rows:
        if 'median_ms' in r:
            print(f"{r['variant']:<34}{r['median_ms']:>10.3f}{r['p99_ms']:>9.3f}"
                  f"{36 * r['median_ms']:>8.2f}{r['rel_err']:>10.2e}")
        elif 'error' in r:
            print(f"{r['variant']:<34} failed: {r['error']}")
    if args.out:
        with open(args.out, 'w') as f:
            json.dump({'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'), 'command': ' '.join(sys.argv),
                       'gpu': torch.cuda.get_device_name(), 'torch': torch.__version__,
                       'bucket': n, 'rows': rows}, f, indent=1)
    return 0 if math.isfinite(rows[0].get('median_ms', math.nan)) else 1


if __name__ == '__main__':
    raise SystemExit(main())
