"""The LLM's masked attention through the cuDNN frontend's graph API, one layer (CUDA).

    python benchmarks/probe_cudnn_masked_attention.py --out benchmarks/out/cudnn_mask.json

One layer of the full-size LLM (1 x 32 query / 8 KV heads x 1664 tokens x 128, bf16, the
8-camera prompt's token kinds), timed as CUDA graphs of 36 calls, median of 60 replays:

  served: SDPA (cuDNN through PyTorch) with the (L, L) additive mask
  SDPA without a mask (the wrong result: the dense bound)
  frontend graph, no mask / additive bias / the mask as a score modifier: the served rule
  "key <= limit[query] or both image tokens" computed per score from a per-query limit and
  per-token image flags (no (L, L) read), for every execution plan the frontend offers.

Errors: max |out - ref| / max |ref| against float32 attention under the boolean mask.
"""
from __future__ import annotations

import argparse
import math
import traceback

import torch
import torch.nn.functional as F

import common
from molmobot_policy.model.config import MolmoBotConfig

CALLS, REPLAYS = 36, 60


def graph_us(fn) -> float:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', default='benchmarks/out/cudnn_mask.json')
    args = ap.parse_args()
    dev, dt = 'cuda', torch.bfloat16
    cfg = MolmoBotConfig.from_name('molmobot-4b-8cam')
    tok = cfg.tokens
    ids = [tok.bos]
    for k in range(8):
        ids += [100 + k, 200, 300 + k, tok.im_start] + [tok.im_patch] * 196 + [tok.im_end]
    n_valid, length = 1639, 1664
    ids += list(range(1000, 1000 + n_valid - len(ids))) + [tok.bos] * (length - n_valid)
    input_ids = torch.tensor(ids, device=dev)
    valid = torch.arange(length, device=dev) < n_valid
    is_image = (input_ids[:, None] == torch.tensor(tok.image_special_ids, device=dev)).any(-1)
    allowed = (torch.ones(length, length, dtype=torch.bool, device=dev).tril()
               | (is_image[:, None] & is_image[None, :])) & valid[None, :]
    allowed = allowed[None, None]
    bias = torch.zeros(allowed.shape, dtype=dt, device=dev).masked_fill(~allowed,
                                                                         torch.finfo(dt).min)
    hq, hk, hd = cfg.llm.n_heads, cfg.llm.n_kv_heads, cfg.llm.head_dim
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, length, h, hd, device=dev, generator=gen).mul(2).to(dt)
               .transpose(1, 2) for h in (hq, hk, hk))
    scale = 1.0 / math.sqrt(hd)
    scores = torch.einsum('bhqd,bhkd->bhqk', q.float(), k.float().repeat_interleave(hq // hk, 1))
    scores = (scores * scale).masked_fill(~allowed, float('-inf'))
    ref = torch.einsum('bhqk,bhkd->bhqd', scores.softmax(-1),
                       v.float().repeat_interleave(hq // hk, 1))
    del scores
    # the rule's per-token tensors: key j visible to query i iff j <= limit[i] or both image
    pos = torch.arange(length, device=dev)
    limit = torch.minimum(pos, torch.tensor(n_valid - 1, device=dev)).to(torch.int32)
    img = is_image.to(torch.int32)
    rule_ok = ((pos[None, :] <= limit[:, None]) | (is_image[:, None] & is_image[None, :]))
    assert torch.equal(rule_ok, allowed[0, 0]), 'rule differs from the served mask'

    rows = []

    def err_of(out):     # over the valid query rows (padded rows are never read)
        out, r = out[:, :, :n_valid].float(), ref[:, :, :n_valid]
        return float((out - r).abs().max() / r.abs().max())

    def row(name, fn, out_fn=None, **extra):
        try:
            us = graph_us(fn)
            rows.append(dict(kernel=name, us=us, ms_36_layers=us * 36e-3,
                             rel_err=err_of(out_fn()) if out_fn else None, **extra))
        except Exception as error:     # noqa: BLE001 - a variant that cannot run is a result
            rows.append(dict(kernel=name, error=f'{type(error).__name__}: {error}'[:400],
                             **extra))
        print(rows[-1], flush=True)

    row('served: SDPA + additive mask',
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True),
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True))
    row('SDPA without a mask (wrong result: dense bound)',
        lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    row('SDPA causal (wrong result)',
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

    info = {}
    try:
        import cudnn
        info.update(frontend=cudnn.__version__, backend=cudnn.backend_version(),
                    torch_cudnn=torch.backends.cudnn.version())
    except Exception as error:     # noqa: BLE001
        info['import_error'] = traceback.format_exc()[-1500:]
        print(info, flush=True)
        common.write_json(args.out, dict(rows=rows, info=info))
        return
    print(info, flush=True)
    handle = cudnn.create_handle()

    limit_t = limit.view(1, 1, length, 1).contiguous()
    img_q = img.view(1, 1, length, 1).contiguous()
    img_k = img.view(1, 1, 1, length).contiguous()
    qimg_t = torch.where(is_image, pos + 1, 0).to(torch.int32).view(1, 1, length, 1)
    kimg_t = torch.where(is_image, pos + 1, 0).to(torch.int32).view(1, 1, 1, length)
    qoff_t = torch.where(is_image, 0, 1 << 20).to(torch.int32).view(1, 1, length, 1)
    neg = torch.full((1, 1, 1, 1), -1e9, dtype=torch.float32)

    def build(kind: str, form: str = 'scale'):
        g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16,
                          intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        qt, kt, vt = g.tensor_like(q), g.tensor_like(k), g.tensor_like(v)
        pack = {qt: q, kt: k, vt: v}
        kw = {}
        if kind == 'bias':
            bt = g.tensor_like(bias)
            pack[bt] = bias
            kw['bias'] = bt
        elif kind == 'causal':
            kw['use_causal_mask'] = True
        elif kind == 'mod':
            lt, qt_img, kt_img, qt_off = (g.tensor_like(limit_t), g.tensor_like(qimg_t),
                                          g.tensor_like(kimg_t), g.tensor_like(qoff_t))
            pack.update({lt: limit_t, qt_img: qimg_t, kt_img: kimg_t, qt_off: qoff_t})
            D = cudnn.data_type

            def typed(t, dtype):
                t.set_data_type(dtype)
                return t

            def select(sg, s, keep):
                neg_t = sg.tensor(name='neg', dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                                  is_pass_by_value=True, data_type=D.FLOAT)
                pack[neg_t] = neg
                return sg.binary_select(input0=s, input1=neg_t, mask=keep)

            def index(sg, s, axis):
                return typed(sg.gen_index(input=s, axis=axis, compute_data_type=D.INT32), D.INT32)

            def causal_rule(sg, s):       # V1: the reference causal functor's form
                keep = typed(sg.cmp_ge(input=index(sg, s, 2), comparison=index(sg, s, 3),
                                       compute_data_type=D.BOOLEAN), D.BOOLEAN)
                return select(sg, s, keep)

            def limit_rule(sg, s):        # V2: key <= limit[query] (a broadcast tensor)
                keep = typed(sg.cmp_le(input=index(sg, s, 3), comparison=lt,
                                       compute_data_type=D.BOOLEAN), D.BOOLEAN)
                return select(sg, s, keep)

            def image_col(sg, s):       # key is an image token: key < kimg[key]
                return typed(sg.cmp_lt(input=index(sg, s, 3), comparison=kt_img,
                                       compute_data_type=D.BOOLEAN), D.BOOLEAN)

            def image_row(sg, s):       # query is an image token: query < qimg[query]
                return typed(sg.cmp_lt(input=index(sg, s, 2), comparison=qt_img,
                                       compute_data_type=D.BOOLEAN), D.BOOLEAN)

            def causal_b(sg, s):
                return typed(sg.cmp_le(input=index(sg, s, 3), comparison=lt,
                                       compute_data_type=D.BOOLEAN), D.BOOLEAN)

            def both_b(sg, s):
                return typed(sg.logical_and(a=image_row(sg, s), b=image_col(sg, s),
                                            compute_data_type=D.BOOLEAN), D.BOOLEAN)

            def a_col(sg, s):
                return select(sg, s, image_col(sg, s))

            def b_row(sg, s):
                return select(sg, s, image_row(sg, s))

            def c_both(sg, s):
                return select(sg, s, both_b(sg, s))

            def causal_idx(sg, s):      # key <= query (indices only)
                return typed(sg.cmp_le(input=index(sg, s, 3), comparison=index(sg, s, 2),
                                       compute_data_type=D.BOOLEAN), D.BOOLEAN)

            def image_pair(sg, s):      # key + offset[query] < kimg[key]: both image
                shifted = typed(sg.add(a=index(sg, s, 3), b=qt_off,
                                       compute_data_type=D.INT32), D.INT32)
                return typed(sg.cmp_lt(input=shifted, comparison=kt_img,
                                       compute_data_type=D.BOOLEAN), D.BOOLEAN)

            def scalar_i(sg, name, value):
                t = sg.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                              is_pass_by_value=True, data_type=D.INT32)
                pack[t] = torch.full((1, 1, 1, 1), value, dtype=torch.int32)
                return t

            def m_min(sg, s):           # min(key - query - 1, key + off - kimg) < 0
                key, query = index(sg, s, 3), index(sg, s, 2)
                a = typed(sg.sub(a=key, b=query, compute_data_type=D.INT32), D.INT32)
                a = typed(sg.sub(a=a, b=scalar_i(sg, 'one', 1), compute_data_type=D.INT32),
                          D.INT32)
                key2 = index(sg, s, 3)
                b = typed(sg.add(a=key2, b=qt_off, compute_data_type=D.INT32), D.INT32)
                b = typed(sg.sub(a=b, b=kt_img, compute_data_type=D.INT32), D.INT32)
                m = typed(sg.min(input0=a, input1=b, compute_data_type=D.INT32), D.INT32)
                keep = typed(sg.cmp_lt(input=m, comparison=scalar_i(sg, 'zero', 0),
                                       compute_data_type=D.BOOLEAN), D.BOOLEAN)
                return select(sg, s, keep)

            def m_mul(sg, s):           # key - query - BIG * [both] <= 0
                key, query = index(sg, s, 3), index(sg, s, 2)
                a = typed(sg.sub(a=key, b=query, compute_data_type=D.INT32), D.INT32)
                key2 = index(sg, s, 3)
                shifted = typed(sg.add(a=key2, b=qt_off, compute_data_type=D.INT32), D.INT32)
                both = typed(sg.cmp_lt(input=shifted, comparison=kt_img,
                                       compute_data_type=D.INT32), D.INT32)
                big = typed(sg.mul(a=both, b=scalar_i(sg, 'big', 1 << 20),
                                   compute_data_type=D.INT32), D.INT32)
                u = typed(sg.sub(a=a, b=big, compute_data_type=D.INT32), D.INT32)
                keep = typed(sg.cmp_le(input=u, comparison=scalar_i(sg, 'zero', 0),
                                       compute_data_type=D.BOOLEAN), D.BOOLEAN)
                return select(sg, s, keep)

            def m_eq(sg, s):            # keep = [key > query and not both] == 0, shared index
                key, query = index(sg, s, 3), index(sg, s, 2)
                later = typed(sg.cmp_gt(input=key, comparison=query,
                                        compute_data_type=D.BOOLEAN), D.BOOLEAN)
                shifted = typed(sg.add(a=key, b=qt_off, compute_data_type=D.INT32), D.INT32)
                apart = typed(sg.cmp_ge(input=shifted, comparison=kt_img,
                                        compute_data_type=D.BOOLEAN), D.BOOLEAN)
                hide = typed(sg.logical_and(a=later, b=apart, compute_data_type=D.INT32),
                             D.INT32)
                keep = typed(sg.cmp_eq(input=hide, comparison=scalar_i(sg, 'zero', 0),
                                       compute_data_type=D.BOOLEAN), D.BOOLEAN)
                return select(sg, s, keep)

            def m_mul1(sg, s):          # m_mul with one key index
                key, query = index(sg, s, 3), index(sg, s, 2)
                a = typed(sg.sub(a=key, b=query, compute_data_type=D.INT32), D.INT32)
                shifted = typed(sg.add(a=key, b=qt_off, compute_data_type=D.INT32), D.INT32)
                both = typed(sg.cmp_lt(input=shifted, comparison=kt_img,
                                       compute_data_type=D.INT32), D.INT32)
                big = typed(sg.mul(a=both, b=scalar_i(sg, 'big', 1 << 20),
                                   compute_data_type=D.INT32), D.INT32)
                keep = typed(sg.cmp_le(input=a, comparison=big,
                                       compute_data_type=D.BOOLEAN), D.BOOLEAN)
                return select(sg, s, keep)

            def m_hide(sg, s):          # select(-inf, score, key > query and not both)
                key, query = index(sg, s, 3), index(sg, s, 2)
                later = typed(sg.cmp_gt(input=key, comparison=query,
                                        compute_data_type=D.BOOLEAN), D.BOOLEAN)
                key2 = index(sg, s, 3)
                shifted = typed(sg.add(a=key2, b=qt_off, compute_data_type=D.INT32), D.INT32)
                apart = typed(sg.cmp_ge(input=shifted, comparison=kt_img,
                                        compute_data_type=D.BOOLEAN), D.BOOLEAN)
                hide = typed(sg.logical_and(a=later, b=apart, compute_data_type=D.BOOLEAN),
                             D.BOOLEAN)
                neg_t = sg.tensor(name='negf', dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                                  is_pass_by_value=True, data_type=D.FLOAT)
                pack[neg_t] = neg
                return sg.binary_select(input0=neg_t, input1=s, mask=hide)

            kw['score_mod'] = dict(c_both=c_both, m_min=m_min, m_mul=m_mul,
                                   m_hide=m_hide, m_eq=m_eq, m_mul1=m_mul1)[form]
        o, _ = g.sdpa(name='sdpa', q=qt, k=kt, v=vt, generate_stats=False, attn_scale=scale,
                      **kw)
        out = torch.empty_like(q.transpose(1, 2).contiguous()).transpose(1, 2)
        o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride()))
        pack[o] = out
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)
        ws = torch.empty(max(g.get_workspace_size(), 1), device=dev, dtype=torch.uint8)
        return g, pack, out, ws

    for kind, form in (('mod', 'c_both'), ('mod', 'm_eq'), ('mod', 'm_mul1')):
        name = f'frontend {kind} {form}'.strip()
        try:
            g, pack, out, ws = build(kind, form)
        except Exception as error:     # noqa: BLE001
            rows.append(dict(kernel=name, error=f'build: {type(error).__name__}: {error}'[:600]))
            print(rows[-1], flush=True)
            continue
        n_plans = g.get_execution_plan_count()
        for index in range(min(n_plans, 1)):
            def run(index=index, g=g, pack=pack, ws=ws):
                cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
                g.execute_plan_at_index(pack, ws, index, handle=handle)
            try:
                plan = g.get_plan_name_at_index(index)
            except Exception as error:     # noqa: BLE001
                plan = f'{type(error).__name__}'
            row(f'{name} plan {index}/{n_plans}', run, lambda out=out: out, plan=plan)

        def run_default(g=g, pack=pack, ws=ws):
            cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
            g.execute(pack, ws, handle=handle)
        row(f'{name} execute()', run_default, lambda out=out: out)
        if kind == 'mod' and form in ('m_eq', 'm_mul1'):
            from torch.profiler import ProfilerActivity, profile
            run_default()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run_default()
                torch.cuda.synchronize()
            rows[-1]['kernels'] = [f'{e.key[:140]}: {e.device_time_total:.1f}'
                                   for e in prof.key_averages() if e.device_time_total > 0]
    try:
        from molmobot_policy.runtime import cudnn_attention as ca
        info['self_check'] = ca.self_check(cfg, torch.device(dev), dt)
        print('self_check', repr(info['self_check']), flush=True)
        mask = ca.RuleMask.build(input_ids[None], torch.tensor(tok.image_special_ids,
                                                                device=dev))
        row('module: RuleMask op', lambda: mask(q, k, v),
            lambda: mask(q, k, v).transpose(1, 2))
    except Exception as error:     # noqa: BLE001
        info['module_error'] = traceback.format_exc()[-1500:]
        print(info['module_error'], flush=True)
    result = dict(rows=rows, info=info, shape=dict(length=length, n_valid=n_valid, hq=hq,
                                                   hk=hk, head_dim=hd))
    result.update(common.provenance())
    common.write_json(args.out, result)
    for r in rows:
        print(f"{r['kernel'][:60]:60s} {r.get('us', float('nan')):8.1f} us  "
              f"{r.get('rel_err') or '':>10} {r.get('error', '')[:80]}")


if __name__ == '__main__':
    main()
