"""The LLM's masked attention at the served shape, one layer, per kernel (CUDA).

    python benchmarks/benchmark_llm_attention.py --out benchmarks/out/llm_attention.json
    python benchmarks/benchmark_llm_attention.py --extra 8,16 --text-tiles 64x64x4,32x64x4

One layer of the full-size LLM (1 x 32 query / 8 KV heads x 1664 tokens x 128, bf16, the
8-camera prompt's token kinds: BOS, per image a 3-token label + <im_start> + 196 patches +
<im_end>, chat text to 1639 tokens, padding), timed as CUDA graphs of 36 calls (one per
layer), median of 60 replays, us per call:

  served: SDPA (cuDNN) with the (L, L) additive mask     (`llm_attention: masked`)
  SDPA without a mask                                    (the wrong result: the dense bound)
  image runs, E extra dims: cuDNN with [q | extra] x [k | extra], unmasked; the text-row
      kernel alone; the whole op; the mask call (the q / k concatenations + the op)
                                                         (`llm_attention: image_runs`)
  text-row kernel per configuration (BLOCK_ROWS x BLOCK_KEYS x warps x KEY_SPLITS; its
      error over the non-image rows only)
  one compiled LLM block (torch.compile, fullgraph) with each mask form

Errors: max |out - ref| / max |ref| against float32 attention under the boolean mask. The
JSON also names the kernels of the unmasked calls (torch.profiler: which cuDNN engine runs a
score head of 128 + E). Prints a table; writes JSON with `common.provenance()`. docs/PERFORMANCE.md quotes the figures.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import common
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.model.llm import OLMoSequentialBlock, rope_tables
from molmobot_policy.model.molmobot import attention_allowed
from molmobot_policy.runtime import llm_attention as la

CALLS, REPLAYS = 36, 60


def graph_us(fn) -> float:
    """Median us per call of `fn` captured CALLS times in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def kernel_names(fn) -> list[str]:
    """The CUDA kernels one call of `fn` launches (which cuDNN engine ran a head width), as
    'name: us'."""
    from torch.profiler import ProfilerActivity, profile
    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception as error:     # noqa: BLE001 - reported in the row's error already
        return [f'{type(error).__name__}']
    return [f'{e.key[:120]}: {e.device_time_total:.1f}' for e in prof.key_averages()
            if e.device_time_total > 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--extra', default='8', help='comma list of extra score dims E to time')
    ap.add_argument('--text-tiles',
                    default='64x64x4x1,32x64x4x1,64x128x4x1,64x64x4x4,32x64x4x4,64x64x4x8',
                    help='text-row kernel configurations BLOCK_ROWSxBLOCK_KEYSxWARPSxKEY_SPLITS')
    ap.add_argument('--no-block', action='store_true', help='skip the compiled-block rows')
    ap.add_argument('--out', default='benchmarks/out/llm_attention.json')
    args = ap.parse_args()
    dev, dt = 'cuda', torch.bfloat16
    cfg = MolmoBotConfig.from_name('molmobot-4b-8cam')
    tok = cfg.tokens
    ids = [tok.bos]
    for k in range(8):
        ids += [100 + k, 200, 300 + k, tok.im_start] + [tok.im_patch] * 196 + [tok.im_end]
    n_valid, length = 1639, 1664
    ids += list(range(1000, 1000 + n_valid - len(ids))) + [tok.bos] * (length - n_valid)
    input_ids = torch.tensor([ids], device=dev)
    valid = torch.zeros(1, length, dtype=torch.bool, device=dev)
    valid[:, :n_valid] = True
    image_ids = torch.tensor(tok.image_special_ids, device=dev)
    n_patch = ids.count(tok.im_patch)
    allowed = attention_allowed(input_ids, image_ids, valid)
    bias = torch.zeros(allowed.shape, dtype=dt, device=dev).masked_fill(~allowed,
                                                                         torch.finfo(dt).min)
    hq, hk, hd = cfg.llm.n_heads, cfg.llm.n_kv_heads, cfg.llm.head_dim
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, length, h, hd, device=dev, generator=gen).mul(2).to(dt)
               .transpose(1, 2) for h in (hq, hk, hk))
    ref = la.masked_reference(q, k, v, allowed)
    scale = 1.0 / math.sqrt(hd)

    rows = []

    def row(name: str, fn, output=None) -> None:
        try:
            us = graph_us(fn)
            err = None
            if output is not None:
                err = float((output().float() - ref).abs().max() / ref.abs().max())
            rows.append(dict(kernel=name, us=us, ms_36_layers=us * 36e-3, rel_err=err))
        except Exception as error:     # noqa: BLE001 - a variant that cannot run is a result
            rows.append(dict(kernel=name, error=f'{type(error).__name__}: {error}'[:300]))
        print(rows[-1], flush=True)

    row('served: SDPA + additive mask',
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True),
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                               enable_gqa=True).transpose(1, 2))
    row('SDPA without a mask (wrong result: the dense bound)',
        lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    rows[-1]['kernels'] = kernel_names(
        lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    for extra in (int(e) for e in args.extra.split(',')):
        mask = la.ImageRunMask.build(input_ids, valid, image_ids, n_patch, extra, dt)
        q_aug = torch.cat([q.transpose(1, 2), mask.q_extra.expand(1, length, hq, extra)],
                          -1).transpose(1, 2)
        k_aug = torch.cat([k.transpose(1, 2), mask.k_extra.expand(1, length, hk, extra)],
                          -1).transpose(1, 2)
        row(f'image runs E={extra}: cuDNN [q|extra] x [k|extra], unmasked',
            lambda: F.scaled_dot_product_attention(q_aug, k_aug, v, scale=scale,
                                                   enable_gqa=True))
        rows[-1]['kernels'] = kernel_names(
            lambda: F.scaled_dot_product_attention(q_aug, k_aug, v, scale=scale,
                                                   enable_gqa=True))
        out = torch.empty(1, length, hq, hd, device=dev, dtype=dt).transpose(1, 2)
        row(f'image runs E={extra}: text-row kernel alone',
            lambda: la.text_rows_attention(out, q_aug, k_aug, v, mask.rows, mask.n_rows,
                                           mask.key_valid, scale))
        op = torch.ops.molmobot.image_run_attention
        row(f'image runs E={extra}: the op (cuDNN + text-row kernel)',
            lambda: op(q_aug, k_aug, v, mask.rows, mask.n_rows, mask.key_valid, scale),
            lambda: op(q_aug, k_aug, v, mask.rows, mask.n_rows, mask.key_valid, scale))
        row(f'image runs E={extra}: mask call (q / k concatenations + op)',
            lambda: mask(q, k, v), lambda: mask(q, k, v))

    mask = la.ImageRunMask.build(input_ids, valid, image_ids, n_patch, 8, dt)
    q_aug = torch.cat([q.transpose(1, 2), mask.q_extra.expand(1, length, hq, 8)],
                      -1).transpose(1, 2)
    k_aug = torch.cat([k.transpose(1, 2), mask.k_extra.expand(1, length, hk, 8)],
                      -1).transpose(1, 2)
    out = torch.empty(1, length, hq, hd, device=dev, dtype=dt).transpose(1, 2)
    tiles = (la.BLOCK_ROWS, la.BLOCK_KEYS, la.WARPS, la.KEY_SPLITS)
    for spec in args.text_tiles.split(','):
        la.BLOCK_ROWS, la.BLOCK_KEYS, la.WARPS, la.KEY_SPLITS = (int(x) for x in spec.split('x'))
        row(f'text-row kernel {spec}',
            lambda: la.text_rows_attention(out, q_aug, k_aug, v, mask.rows, mask.n_rows,
                                           mask.key_valid, scale))
        got = out.transpose(1, 2)[0, mask.rows[0, :int(mask.n_rows[0])]].float()
        want = ref[0, mask.rows[0, :int(mask.n_rows[0])]]
        rows[-1]['rel_err'] = float((got - want).abs().max() / want.abs().max())
    la.BLOCK_ROWS, la.BLOCK_KEYS, la.WARPS, la.KEY_SPLITS = tiles

    if not args.no_block:
        block = OLMoSequentialBlock(cfg.llm).to(dev, dt).eval().requires_grad_(False)
        gen_w = torch.Generator(device=dev).manual_seed(1)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, device=dev, generator=gen_w) / p.shape[-1] ** 0.5
                        if p.dim() > 1 else 1.0)
        cos, sin = rope_tables(hd, length, cfg.llm.rope_theta, dev)
        cos, sin = cos[None, None], sin[None, None]
        x = torch.randn(1, length, cfg.llm.d_model, device=dev, dtype=dt, generator=gen)
        compiled = torch.compile(block, fullgraph=True, dynamic=False)
        with torch.inference_mode():
            base = compiled(x, cos, sin, bias).float()
            diff = float((compiled(x, cos, sin, mask).float() - base).abs().max()
                         / base.abs().max())
            print(f'compiled block: image runs vs additive mask, max rel. diff {diff:.2e}')
            row('compiled LLM block, additive mask', lambda: compiled(x, cos, sin, bias))
            row('compiled LLM block, image-run mask E=8', lambda: compiled(x, cos, sin, mask))

    result = {**common.provenance(), 'shape': [1, hq, hk, length, hd],
              'calls_per_graph': CALLS, 'replays': REPLAYS, 'rows': rows}
    common.write_json(args.out, result)
    common.print_table(['kernel', 'us', 'x36 ms', 'rel. err'],
                       [[r['kernel'], r.get('us', float('nan')),
                         r.get('ms_36_layers', float('nan')),
                         r.get('rel_err') if r.get('rel_err') is not None else '']
                        for r in rows], digits=4)


if __name__ == '__main__':
    main()
