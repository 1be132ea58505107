"""Probe (issue 20): the LLM's masked attention through FlashAttention-4's Hopper kernel
(`flash_attn.cute`, CuTe DSL) with the served mask as a `mask_mod` and tile classes given as
block sparsity, against the served SDPA (cuDNN) call with the additive mask.

One layer at the served shape (1 x 32 query / 8 KV heads x 1664 x 128, bf16, the 8-camera
layout), CUDA graphs of 36 calls, medians of `--replays` replays; errors against float32 math
attention with the boolean mask (||out - ref|| / ||ref|| over the valid rows). Prints a table,
writes JSON. Needs a Hopper GPU and flash-attn-4 (`pip install -r requirements/gpu.txt`).

    python3 benchmarks/probe_flash_masked_attention.py --out $OUT/flash_probe.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit('/', 2)[0])
from benchmarks.common import print_table, provenance  # noqa: E402

H, HKV, D = 32, 8, 128
IMAGE, OTHER, PAD = 2, 1, 0


def served_layout(length: int, cameras: int = 8, label: int = 3, per_image: int = 198,
                  chat: int = 45) -> torch.Tensor:
    """Token kinds int32 (L,) of one padded prompt: BOS, per camera `label` text tokens then
    `per_image` image tokens (im_start, 196 patches, im_end), the chat turn, padding. Fixed
    so that runs compare (the served prompt's labels are 2 tokens and its chat turn ~20:
    test/_prompt_layouts.py builds that one from the product's prompt builder)."""
    kinds = [OTHER]
    for _ in range(cameras):
        kinds += [OTHER] * label + [IMAGE] * per_image
    kinds += [OTHER] * chat
    if len(kinds) > length:
        raise ValueError(f'layout of {len(kinds)} tokens does not fit {length}')
    kinds += [PAD] * (length - len(kinds))
    return torch.tensor(kinds, dtype=torch.int32)


def allowed_mask(kind: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """bool (L, L) [query, key]: key valid and (pos[key] <= pos[query] or both image)."""
    img = kind == IMAGE
    causal = pos[None, :] <= pos[:, None]
    return (kind[None, :] != PAD) & (causal | (img[:, None] & img[None, :]))


class _Cfg:
    """The LLM's head layout, as `unavailable_reason` / `self_check` read it."""
    class llm:
        n_heads, n_kv_heads, head_dim = H, HKV, D


def graph_time(fn, calls: int, replays: int) -> float:
    """us per call: median over replays of a CUDA graph of `calls` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument('--length', type=int, default=1664)
    ap.add_argument('--calls', type=int, default=36)
    ap.add_argument('--replays', type=int, default=60)
    ap.add_argument('--out', default='')
    ap.add_argument('--rules-only', action='store_true',
                    help="time only the op and the 'FA4 tile classes, ...' rows (mask rules)")
    args = ap.parse_args()
    full = not args.rules_only
    dev = torch.device('cuda')
    torch.manual_seed(0)
    L = args.length
    kind_orig = served_layout(L).to(dev)
    pos_orig = torch.arange(L, dtype=torch.int32, device=dev)
    valid = kind_orig != PAD

    q = torch.randn(1, L, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, L, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, L, HKV, D, device=dev, dtype=torch.bfloat16)
    scale = 1.0 / math.sqrt(D)

    allowed = allowed_mask(kind_orig, pos_orig)
    bias = torch.zeros(L, L, device=dev, dtype=torch.bfloat16).masked_fill(~allowed, float('-inf'))
    bias = bias[None, None]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))          # (B, H, L, D) views

    def reference():
        qf, kf, vf = (t.float() for t in (qh, kh, vh))
        kf = kf.repeat_interleave(H // HKV, dim=1)
        vf = vf.repeat_interleave(H // HKV, dim=1)
        s = (qf @ kf.transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed[None, None], float('-inf'))
        return (s.softmax(-1) @ vf).transpose(1, 2)               # (B, L, H, D)

    ref = reference()

    def rel_err(out_blhd):
        o = out_blhd.float()[0][valid]
        r = ref[0][valid]
        return float((o - r).norm() / r.norm()), float((o - r).abs().max())

    rows, results = [], {}

    def record(name, fn, exact=True):
        try:
            out = fn()
            torch.cuda.synchronize()
            err = rel_err(out) if exact else (float('nan'), float('nan'))
            us = graph_time(fn, args.calls, args.replays)
            results[name] = dict(us_per_layer=us, ms_36=us * 36 / 1000, rel_err=err[0],
                                 max_abs_err=err[1], exact=exact)
            rows.append([name, us, us * 36 / 1000, err[0] if exact else '(wrong by design)'])
        except Exception as e:   # noqa: BLE001 - a probe: report and go on
            traceback.print_exc()
            results[name] = dict(error=f'{type(e).__name__}: {e}')
            rows.append([name, 'error', '', f'{type(e).__name__}: {str(e)[:80]}'])
        print(rows[-1], flush=True)

    if full:
        record('served: SDPA + additive mask',
               lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias,
                                                      enable_gqa=True).transpose(1, 2))
        record('SDPA, no mask (bound)',
               lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True).transpose(1, 2),
               exact=False)
        record('SDPA, causal',
               lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                                      enable_gqa=True).transpose(1, 2), exact=False)

    from molmobot_policy.runtime import flash_attention as FA
    reason = FA.unavailable_reason(_Cfg(), dev, torch.bfloat16)
    results['unavailable_reason'] = reason
    if reason:
        print('FA4 unavailable:', reason)
    else:
        from flash_attn.cute.interface import _flash_attn_fwd
        kinds = kind_orig[None].contiguous()
        limits = FA.key_limits(kinds)

        def fa(qq, kk_, vv, **kw):
            return _flash_attn_fwd(qq, kk_, vv, softmax_scale=scale, **kw)[0]

        if full:
            t0 = time.perf_counter()
            record('FA4 dense (bound)', lambda: fa(q, k, v), exact=False)
            results['first_compile_s'] = time.perf_counter() - t0
            record('FA4 causal', lambda: fa(q, k, v, causal=True), exact=False)
            record('FA4 mask_mod, every tile masked',
                   lambda: fa(q, k, v, mask_mod=FA.image_tokens_mask(), aux_tensors=[limits]))
        t = FA.tile_classes(kinds)
        results['tiles_served_order'] = dict(partial=int(t.partial_count.sum()),
                                             full=int(t.full_count.sum()),
                                             total=t.partial_index.shape[-1] ** 2)
        t0 = time.perf_counter()
        record('FA4 mask_mod + tile classes (the op)',
               lambda: FA.image_tokens_attention(q, k, v, limits, t.partial_count,
                                                 t.partial_index, t.full_count, t.full_index,
                                                 scale))
        results['op_first_s'] = time.perf_counter() - t0
        if full:
            mask = FA.ImageTokensMask(kinds, t)
            record('ImageTokensMask (B,H,L,D) in: transposes + op', lambda: mask(qh, kh, vh))
            record('tile_classes alone (once per query)', lambda: FA.tile_classes(kinds).full_index,
                   exact=False)
            self_check = FA.self_check(_Cfg(), dev, torch.bfloat16)
            results['self_check'] = self_check or 'passed'
            print('self_check:', self_check or 'passed')

        # what the tile lists cost by themselves: every visited tile listed as full (no mask
        # work: the wrong result)
        nm = t.full_index.shape[-1]
        all_full_count = (t.full_count + t.partial_count).contiguous()
        merged = torch.sort(torch.cat([
            torch.where(torch.arange(nm, device=dev) < t.full_count[..., None],
                        t.full_index, nm),
            torch.where(torch.arange(nm, device=dev) < t.partial_count[..., None],
                        t.partial_index, nm)], -1), -1).values[..., :nm].to(torch.int32)
        zero = torch.zeros_like(t.partial_count)
        record('FA4 tile lists, every visited tile full (no mask work)',
               lambda: FA.image_tokens_attention(q, k, v, limits, zero, t.partial_index,
                                                 all_full_count, merged.contiguous(),
                                                 scale), exact=False)

        # where a partial tile's time goes: the same tiles under cheaper rules (wrong results
        # on padded rows or everywhere: bounds). Without the padding check the rule is exact on
        # the real rows of a right-padded prompt (padding follows every real query).
        import cutlass
        import cutlass.cute as cute
        from flash_attn.cute import utils
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
        tiles = BlockSparseTensorsTorch(t.partial_count, t.partial_index, t.full_count,
                                        t.full_index, block_size=(FA.TILE_M, FA.TILE_N))

        def at(tensor, batch, index):
            # one per-token value as the rule's int32 (called while a rule is traced)
            return utils.scalar_to_ssa(tensor[batch[0], index[0]], cutlass.Int32)

        def const(value):
            return utils.scalar_to_ssa(value, cutlass.Int32)

        @cute.jit
        def rule_without_padding(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
            query, key = at(aux_tensors[0], batch, q_idx), at(aux_tensors[0], batch, kv_idx)
            image = const(FA.KIND_IMAGE)
            return (kv_idx <= q_idx) | ((query == image) & (key == image))

        @cute.jit
        def key_kind_only(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
            return (kv_idx <= q_idx) | (at(aux_tensors[0], batch, kv_idx) == const(FA.KIND_IMAGE))

        @cute.jit
        def index_compare_only(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
            return kv_idx <= q_idx

        def periodic_image_rule(start, period, length, count):
            # image tokens as arithmetic on the index: runs of `length` every `period` from
            # `start` (the layout of `served_layout`), constants of the compiled kernel; no
            # loads, exact on the real rows like the rule without the padding check
            span = period * count

            @cute.jit
            def rule(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
                zero = const(0)
                dq, dk = q_idx - start, kv_idx - start
                q_image = (dq >= zero) & (dq < span) & (dq % period < length)
                k_image = (dk >= zero) & (dk < span) & (dk % period < length)
                return (kv_idx <= q_idx) | (q_image & k_image)
            return rule

        # Variants of the op's rule (`FA.key_limits`, `FA.rule`): the query's kind as a second
        # tensor, and one table [image queries' limits | other queries' limits (the index)] read
        # at the row's offset (0 for an image query, L for any other): one load, no select.
        index = torch.arange(L, dtype=torch.int32, device=dev)[None]
        table = torch.cat([limits, index], -1).contiguous()
        row_offset = torch.where(kinds == FA.KIND_IMAGE, 0, L).to(torch.int32).contiguous()

        @cute.jit
        def key_limit_rule(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
            query, limit = at(aux_tensors[0], batch, q_idx), at(aux_tensors[1], batch, kv_idx)
            return cute.where(query == const(FA.KIND_IMAGE), limit, kv_idx) <= q_idx

        @cute.jit
        def kinds_rule(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
            # the mask's own form on the kinds, padding check included (served until 2026-12-07)
            query, key = at(aux_tensors[0], batch, q_idx), at(aux_tensors[0], batch, kv_idx)
            image = const(FA.KIND_IMAGE)
            return (((kv_idx <= q_idx) & (key != const(FA.KIND_PAD)))
                    | ((query == image) & (key == image)))

        @cute.jit
        def row_offset_rule(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
            offset = at(aux_tensors[0], batch, q_idx)
            return at(aux_tensors[1], batch, offset + kv_idx) <= q_idx

        label, per_image = 3, 198                      # served_layout's defaults
        periodic = periodic_image_rule(1 + label, label + per_image, per_image, 8)
        for name, rule, aux, exact in (
                ('the key limit per score, the query kind per row', key_limit_rule,
                 [kinds, limits], True),
                ("the mask's own form on the kinds (padding check)", kinds_rule, [kinds], True),
                ('one table load per score at the row offset', row_offset_rule,
                 [row_offset, table], True),
                ('the rule without the padding check', rule_without_padding, [kinds], True),
                ('image runs as index arithmetic (no loads)', periodic, [kinds], True),
                ('one load (the key kind) per score', key_kind_only, [kinds], False),
                ('no load (the index compare)', index_compare_only, [kinds], False)):
            record(f'FA4 tile classes, {name}',
                   lambda rule=rule, aux=aux: fa(q, k, v, mask_mod=rule, aux_tensors=aux,
                                                 block_sparse_tensors=tiles), exact=exact)
        # the op again: the first and last rows bracket the variants (clock drift)
        record('FA4 mask_mod + tile classes (the op), again',
               lambda: FA.image_tokens_attention(q, k, v, limits, t.partial_count,
                                                 t.partial_index, t.full_count, t.full_index,
                                                 scale))

    print_table(['attention', 'us per layer', 'x 36 ms', 'rel. err vs fp32'], rows)
    for key in sorted(k for k in results if k.startswith(('tiles', 'self', 'unavail'))):
        print(key, results[key])
    print('import s', results.get('import_s'), 'first compile s', results.get('first_compile_s'))
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(dict(provenance=provenance(), device=torch.cuda.get_device_name(),
                           results=results), f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
