"""Probe (issue 20, part 1): the LLM's masked attention as one Triton kernel that computes
the served mask in registers from the token kinds, instead of reading an (L, L) additive
bias for every tile, and skips the mask work on tiles that are wholly visible.

The served mask (`MolmoBot.attention_allowed`, golden README section 6): query i sees key j
when (j <= i or both are image tokens) and key j is not padding. Per 128-row query block the
key loop ends at `kv_end` (past both the block's last row and, for a block holding image
tokens, the last image token: no later key is visible); each (query block, key block) tile is
classified from the boolean mask, once per query, as empty (skipped), partial (mask computed
from positions and kinds) or full (no mask work). Grouped K/V heads as SDPA's `enable_gqa`.

Not in the product: this file decides whether it should be. On a GPU machine:

    python3 benchmarks/probe_masked_attention.py --out $OUT/masked_attention.json

checks the kernel against float32 math with the boolean mask (and the served bf16 SDPA
against the same), then times, one layer at the served shape (1 x 32 query / 8 KV heads x
1664 x 128, bf16, 8 cameras x 198 image tokens), 36 calls per CUDA graph, medians of replays:
the served SDPA with the additive mask, SDPA without a mask (the wrong result: the dense
bound) and the kernel for a few tile configurations; prints a table, writes JSON. The issue's
target is <= 3.8 ms for 36 layers (105 us per layer). test/test_masked_attention_probe.py
checks the kernel's math on the CPU through Triton's interpreter.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

EMPTY, PARTIAL, FULL = 0, 1, 2
LOG2E = 1.4426950408889634


@triton.jit
def _masked_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, is_image_ptr, valid_ptr, kv_end_ptr, kinds_ptr,
        stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
        stride_vb, stride_vh, stride_vl, stride_ob, stride_oh, stride_ol,
        L, n_heads, group, n_kblocks, scale_log2,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One (batch x query head, query block) per program; online softmax in float32."""
    bh = tl.program_id(0)
    mblock = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    hk = h // group
    offs_m = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < L
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_ql
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    img_m = tl.load(is_image_ptr + b * L + offs_m, mask=row_ok, other=0) != 0
    m_i = tl.full([BLOCK_M], float('-inf'), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kv_end = tl.load(kv_end_ptr + b * tl.cdiv(L, BLOCK_M) + mblock)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    for start in range(0, kv_end, BLOCK_N):
        kind = tl.load(kinds_ptr + (b * tl.cdiv(L, BLOCK_M) + mblock) * n_kblocks
                       + start // BLOCK_N)
        if kind != 0:
            offs_n = start + tl.arange(0, BLOCK_N)
            col_ok = offs_n < L
            k = tl.load(k_base + offs_n[:, None] * stride_kl + offs_d[None, :],
                        mask=col_ok[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k)) * scale_log2
            if kind == 1:
                img_n = tl.load(is_image_ptr + b * L + offs_n, mask=col_ok, other=0) != 0
                valid_n = tl.load(valid_ptr + b * L + offs_n, mask=col_ok, other=0) != 0
                seen = ((offs_n[None, :] <= offs_m[:, None])
                        | (img_m[:, None] & img_n[None, :])) & valid_n[None, :]
                qk = tl.where(seen, qk, float('-inf'))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            shift = tl.where(m_new == float('-inf'), 0.0, m_new)
            p = tl.math.exp2(qk - shift[:, None])
            alpha = tl.math.exp2(m_i - shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * stride_vl + offs_d[None, :],
                        mask=col_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ol
             + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, k_base, v_base, img_m, offs_m, is_image_row, valid_row,
                  lo, hi, L, stride_kl, stride_vl, offs_d,
                  MASKED: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """Keys [lo, hi) in BLOCK_N tiles, no branch in the loop body (so Triton pipelines the
    loads); MASKED computes "causal or both image, key not padding" in registers."""
    for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < L
        k = tl.load(k_base + offs_n[:, None] * stride_kl + offs_d[None, :],
                    mask=col_ok[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            img_n = tl.load(is_image_row + offs_n, mask=col_ok, other=0) != 0
            valid_n = tl.load(valid_row + offs_n, mask=col_ok, other=0) != 0
            seen = ((offs_n[None, :] <= offs_m[:, None])
                    | (img_m[:, None] & img_n[None, :])) & valid_n[None, :]
            qk = tl.where(seen, qk, float('-inf'))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        shift = tl.where(m_new == float('-inf'), 0.0, m_new)
        p = tl.math.exp2(qk - shift[:, None])
        alpha = tl.math.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_vl + offs_d[None, :],
                    mask=col_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _masked_attention_two_loop_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, is_image_ptr, valid_ptr, full_end_ptr, kv_end_ptr,
        stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
        stride_vb, stride_vh, stride_vl, stride_ob, stride_oh, stride_ol,
        L, n_heads, group, scale_log2,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        STAGES: tl.constexpr, DENSE_BOUND: tl.constexpr):
    """One (batch x query head, query block) per program: first the block's leading run of
    full tiles [0, full_end) without any mask work, then [full_end, kv_end) with the mask in
    registers. DENSE_BOUND: every key, no mask (the wrong result: Triton's dense speed)."""
    bh = tl.program_id(0)
    mblock = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    hk = h // group
    offs_m = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < L
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_ql
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q = (q * scale_log2).to(q_ptr.dtype.element_ty)
    img_m = tl.load(is_image_ptr + b * L + offs_m, mask=row_ok, other=0) != 0
    m_i = tl.full([BLOCK_M], float('-inf'), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    if DENSE_BOUND:
        full_end = L // BLOCK_N * BLOCK_N
        kv_end = L
    else:
        full_end = tl.load(full_end_ptr + b * tl.cdiv(L, BLOCK_M) + mblock)
        kv_end = tl.load(kv_end_ptr + b * tl.cdiv(L, BLOCK_M) + mblock)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, img_m, offs_m,
                                  is_image_ptr + b * L, valid_ptr + b * L, 0, full_end, L,
                                  stride_kl, stride_vl, offs_d, False, BLOCK_N, STAGES)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, img_m, offs_m,
                                  is_image_ptr + b * L, valid_ptr + b * L, full_end, kv_end,
                                  L, stride_kl, stride_vl, offs_d, not DENSE_BOUND, BLOCK_N,
                                  STAGES)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ol
             + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def full_prefix(kinds: torch.Tensor, block_n: int) -> torch.Tensor:
    """int32 (B, n_qblocks): keys covered by each query block's leading run of FULL tiles."""
    run = torch.cumprod((kinds == FULL).to(torch.int32), dim=2).sum(dim=2)
    return (run * block_n).to(torch.int32).contiguous()


def masked_attention_two_loop(q, k, v, is_image, valid, block_m: int = 128,
                              block_n: int = 64, num_warps: int = 8, num_stages: int = 3,
                              plan=None, dense_bound: bool = False):
    """As `masked_attention`, with the branch-free two-loop kernel (same arguments)."""
    bsz, n_heads, length, dim = q.shape
    if plan is None:
        plan = tile_plan(allowed_mask(is_image, valid), block_m, block_n)
    kinds, kv_end = plan
    full_end = full_prefix(kinds, block_n)
    out = torch.empty_like(q)
    grid = (bsz * n_heads, triton.cdiv(length, block_m))
    _masked_attention_two_loop_kernel[grid](
        q, k, v, out, is_image.to(torch.int8).contiguous(), valid.to(torch.int8).contiguous(),
        full_end, kv_end, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1),
        out.stride(2), length, n_heads, n_heads // k.shape[1], LOG2E / math.sqrt(dim),
        D=dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=num_stages,
        DENSE_BOUND=dense_bound, num_warps=num_warps)
    return out


def allowed_mask(is_image: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """bool (B, L, L) [query, key]: (j <= i or both image tokens) and key j not padding
    (`MolmoBot.attention_allowed`). is_image, valid: bool (B, L)."""
    length = is_image.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=is_image.device).tril()
    return (causal[None] | (is_image[:, :, None] & is_image[:, None, :])) & valid[:, None, :]


def tile_plan(allowed: torch.Tensor, block_m: int, block_n: int):
    """From the boolean mask (B, L, L): kinds int32 (B, n_qblocks, n_kblocks) (EMPTY /
    PARTIAL / FULL; a tile reaching past L counts as partial, its rows and columns beyond L
    are masked by bounds) and kv_end int32 (B, n_qblocks): one past the last key block with
    a visible pair, in keys (the kernel's loop bound). Torch ops only (CUDA-graph safe)."""
    b, length, _ = allowed.shape
    nq, nk = math.ceil(length / block_m), math.ceil(length / block_n)
    padded = torch.zeros(b, nq * block_m, nk * block_n, dtype=torch.bool, device=allowed.device)
    padded[:, :length, :length] = allowed
    tiles = padded.view(b, nq, block_m, nk, block_n)
    seen = tiles.sum(dim=(2, 4))
    kinds = torch.where(seen == 0, EMPTY, torch.where(seen == block_m * block_n, FULL, PARTIAL))
    kinds = kinds.to(torch.int32)
    edge_rows, edge_cols = length % block_m, length % block_n
    if edge_rows:
        kinds[:, -1] = torch.where(kinds[:, -1] == FULL, PARTIAL, kinds[:, -1])
    if edge_cols:
        kinds[:, :, -1] = torch.where(kinds[:, :, -1] == FULL, PARTIAL, kinds[:, :, -1])
    index = torch.arange(1, nk + 1, device=allowed.device, dtype=torch.int32)
    last = torch.where(kinds != EMPTY, index, 0).amax(dim=2)
    kv_end = (last * block_n).clamp(max=length).to(torch.int32)
    return kinds.contiguous(), kv_end.contiguous()


def masked_attention(q, k, v, is_image, valid, block_m: int = 128, block_n: int = 64,
                     num_warps: int = 8, num_stages: int = 2, plan=None):
    """softmax(q k^T / sqrt(D) under the served mask) v.

    q: (B, Hq, L, D), k, v: (B, Hkv, L, D), Hq a multiple of Hkv (query head h reads K/V head
    h // (Hq / Hkv)); last dimension contiguous; D a power of two >= 16; float16 / bfloat16.
    is_image, valid: bool (B, L). plan: `tile_plan(allowed_mask(...), block_m, block_n)` if
    already built (it depends on the tokens only, not the layer). Returns (B, Hq, L, D).
    """
    bsz, n_heads, length, dim = q.shape
    if plan is None:
        plan = tile_plan(allowed_mask(is_image, valid), block_m, block_n)
    kinds, kv_end = plan
    out = torch.empty_like(q)
    grid = (bsz * n_heads, triton.cdiv(length, block_m))
    _masked_attention_kernel[grid](
        q, k, v, out, is_image.to(torch.int8).contiguous(), valid.to(torch.int8).contiguous(),
        kv_end, kinds, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1),
        out.stride(2), length, n_heads, n_heads // k.shape[1], kinds.shape[2],
        LOG2E / math.sqrt(dim), D=dim, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages)
    return out


def reference(q, k, v, is_image, valid):
    """float32 math attention with the boolean mask, K/V heads repeated: (B, Hq, L, D)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed_mask(is_image, valid)[:, None], float('-inf'))
    return torch.softmax(scores, dim=-1) @ v


def served_layout(length: int = 1664, prompt: int = 1639, cameras: int = 8,
                  labels: int = 3, image_tokens: int = 198, device='cpu'):
    """is_image, valid bool (1, length) like the served 8-camera prompt: BOS, then per camera
    `labels` label tokens and `image_tokens` image tokens, then the text; padding after
    `prompt` tokens."""
    is_image = torch.zeros(1, length, dtype=torch.bool, device=device)
    at = 1
    for _ in range(cameras):
        at += labels
        is_image[0, at:at + image_tokens] = True
        at += image_tokens
    valid = torch.zeros(1, length, dtype=torch.bool, device=device)
    valid[0, :prompt] = True
    return is_image, valid


def _graph_us(fn, calls: int, replays: int) -> float:
    """Median us per call of `fn` captured `calls` times in one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    times = sorted(times[3:])
    return times[len(times) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', type=Path, default=None, help='JSON results path')
    parser.add_argument('--calls', type=int, default=36, help='calls per CUDA graph')
    parser.add_argument('--replays', type=int, default=60)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common
    import torch.nn.functional as F
    device = 'cuda'
    torch.manual_seed(0)
    length, n_heads, n_kv, dim = 1664, 32, 8, 128
    q = torch.randn(1, n_heads, length, dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, n_kv, length, dim, device=device, dtype=torch.bfloat16)
    v = torch.randn(1, n_kv, length, dim, device=device, dtype=torch.bfloat16)
    is_image, valid = served_layout(device=device)
    allowed = allowed_mask(is_image, valid)
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=device)
    bias = bias.masked_fill(~allowed, torch.finfo(q.dtype).min)[:, None]
    expected = reference(q, k, v, is_image, valid)
    scale = expected.abs().max().item()
    rows = []

    def served():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

    def dense():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    def show(row):
        rows.append(row)
        us, err = row['us'], row['rel_err']
        print(f'{row["kernel"]:<48}' + (f'{us:>10.1f}{us * 36e-3:>9.2f}' if us else
                                         f'{"failed":>19}')
              + (f'{err:>10.1e}' if err is not None else f'{"":>10}'), flush=True)

    def triton_row(block_m, block_n, warps, stages, dense_bound=False):
        name = f'triton {block_m}x{block_n} w{warps} s{stages}'
        plan = tile_plan(allowed, block_m, block_n)
        if dense_bound:     # every tile full, every key read: Triton's dense speed
            name += ' no mask (wrong result)'
            plan = (torch.full_like(plan[0], FULL), torch.full_like(plan[1], length))
        config = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                      plan=plan)
        try:
            got = masked_attention(q, k, v, is_image, valid, **config)
            err = None if dense_bound else (got.float() - expected).abs().max().item() / scale
            us = _graph_us(lambda: masked_attention(q, k, v, is_image, valid, **config),
                           args.calls, args.replays)
        except Exception as error:  # noqa: BLE001 - a config the compiler refuses: a row
            return show({'kernel': name, 'us': None, 'rel_err': None,
                         'error': str(error)[:300]})
        kinds = plan[0]
        show({'kernel': name, 'us': us, 'rel_err': err,
              'tiles_full': int((kinds == FULL).sum()),
              'tiles_partial': int((kinds == PARTIAL).sum()),
              'tiles_empty': int((kinds == EMPTY).sum())})

    print(f'{"kernel":<48}{"us/layer":>10}{"x36 ms":>9}{"rel err":>10}', flush=True)
    show({'kernel': 'served: SDPA + additive mask',
          'us': _graph_us(served, args.calls, args.replays),
          'rel_err': (served().float() - expected).abs().max().item() / scale})
    triton_row(128, 64, 8, 2)
    show({'kernel': 'SDPA, no mask (wrong result: the dense bound)',
          'us': _graph_us(dense, args.calls, args.replays), 'rel_err': None})
    for config in ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3),
                   (128, 64, 4, 4), (128, 128, 8, 3), (64, 128, 4, 3), (128, 32, 4, 3)):
        triton_row(*config)
    for config in ((128, 64, 4, 3), (128, 128, 8, 3)):
        triton_row(*config, dense_bound=True)

    def two_loop_row(block_m, block_n, warps, stages, dense_bound=False):
        name = f'two-loop {block_m}x{block_n} w{warps} s{stages}'
        name += ' no mask (wrong result)' if dense_bound else ''
        plan = tile_plan(allowed, block_m, block_n)
        config = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                      plan=plan, dense_bound=dense_bound)
        try:
            got = masked_attention_two_loop(q, k, v, is_image, valid, **config)
            err = None if dense_bound else (got.float() - expected).abs().max().item() / scale
            us = _graph_us(lambda: masked_attention_two_loop(q, k, v, is_image, valid,
                                                             **config),
                           args.calls, args.replays)
        except Exception as error:  # noqa: BLE001 - a config the compiler refuses: a row
            return show({'kernel': name, 'us': None, 'rel_err': None,
                         'error': str(error)[:300]})
        show({'kernel': name, 'us': us, 'rel_err': err})

    for config in ((128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4),
                   (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 3)):
        two_loop_row(*config)
    for config in ((128, 64, 8, 3), (128, 128, 8, 3)):
        two_loop_row(*config, dense_bound=True)
    if args.out is not None:
        common.write_json(args.out, {**common.provenance(), 'shape': [1, n_heads, n_kv, length,
                                                                      dim],
                                     'calls_per_graph': args.calls, 'rows': rows})
        print(f'wrote {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
