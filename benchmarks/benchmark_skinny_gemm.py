"""Does a hand-written Triton skinny GEMM beat cuBLAS for the action expert's M = 16 Linears?

The action expert runs its Linear layers on 16 rows (batch 1 x 16 action tokens), bf16. On the
H200 cuBLAS takes ~4.2 us per 16 x 768 @ 768 x 768 bias GEMM in 64 x 8 tiles (a few dozen
thread blocks on 132 SMs), where reading the 1.2 MB of weights at HBM speed takes ~0.4 us
(benchmarks/RESULTS.md). This times, for y = x @ W^T + b (nn.Linear layout, fp32 accumulation):

- `cuBLAS`: F.linear;
- `no-split`: a Triton kernel with a grid over N in BLOCK_N columns, each program looping over
  all of K (optionally `swap`: computes W x^T so that N is the MMA's long side);
- `split-K`: grid (N / BLOCK_N, SPLIT_K), partial sums atomically added into a zeroed fp32
  workspace, then `torch.add(ws, b, out=y)`; `incl` = memset + kernel + combine, `excl` =
  the kernel alone (the floor for a design whose combine pass is fused elsewhere);
- fused epilogues on the best three no-split configs: exact (erf) GELU, as nn.GELU() after
  Mlp.fc1, and the gated residual y = r + g * (x @ W^T + b) of the DiT block, against
  F.linear followed by the same torch ops.

Each figure is the median per-call time of CUDA graph replays, each graph holding back-to-back
calls (the real policy replays one graph, so launch cost is the in-graph one), in two modes:
`warm` (20 calls on one weight, L2-resident) and `cold` (one call per copy of the weight, the
copies adding up to 2x the L2, so weights come from HBM as in the real 36-layer model).
Every variant is checked against F.linear in fp32 (max |err| / max |ref| < 1e-2).
Figures count only from the H200:

    python3 benchmarks/benchmark_skinny_gemm.py --out $OUT/skinny_gemm.json

Without CUDA it exits with a message; with TRITON_INTERPRET=1 it instead runs a correctness
smoke test of the kernel on CPU tensors through the Triton interpreter (no timing).
"""
import argparse
import concurrent.futures
import itertools
import json
import math
import multiprocessing
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
M_ROWS = 16
SHAPES = ((768, 768), (1536, 768), (2304, 768), (3072, 768), (768, 3072))  # (N, K)
EPI_NONE, EPI_GELU, EPI_GATED = 0, 1, 2
TOL = 1e-2

if triton is not None:
    @triton.jit
    def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, g_ptr, r_ptr, y_ptr, M, N, K, k_per_split,
                              HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
                              ATOMIC: tl.constexpr, SWAP_AB: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = pid_k * k_per_split + tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_ptrs = x_ptr + rm[:, None] * K + rk[None, :]  # (BLOCK_M, BLOCK_K), rows >= M masked
        w_ptrs = w_ptr + rn[:, None] * K + rk[None, :]  # (BLOCK_N, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, k_per_split, BLOCK_K):
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            if SWAP_AB:  # y^T = W x^T: N is the MMA's long side (wgmma-eligible at 64)
                acc = tl.dot(w, tl.trans(x), acc)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SWAP_AB:
            acc = tl.trans(acc)
        y_off = rm[:, None] * N + rn[None, :]
        y_ok = m_ok[:, None] & n_ok[None, :]
        if ATOMIC:
            tl.atomic_add(y_ptr + y_off, acc, mask=y_ok, sem='relaxed')
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if EPILOGUE == 1:  # exact GELU, as nn.GELU()
                acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
            elif EPILOGUE == 2:  # gated residual r + g * acc
                g = tl.load(g_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
                r = tl.load(r_ptr + y_off, mask=y_ok, other=0.0).to(tl.float32)
                acc = r + g[None, :] * acc
            tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=y_ok)


def launch(x, w, b, y, *, block_n, block_k, num_warps, split_k=1, swap_ab=False,
           epilogue=EPI_NONE, gate=None, residual=None):
    """y = epilogue(x @ w.T + b). With split_k > 1, y must be a zeroed fp32 (M, N) workspace
    and only gets x @ w.T (bias and cast are the caller's combine pass)."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= M_ROWS and k % (block_k * split_k) == 0, (m, k, block_k, split_k)
    assert x.is_contiguous() and w.is_contiguous() and y.is_contiguous()
    assert split_k == 1 or (y.dtype == torch.float32 and epilogue == EPI_NONE)
    grid = (triton.cdiv(n, block_n), split_k)
    _skinny_linear_kernel[grid](
        x, w, x if b is None else b, x if gate is None else gate,
        x if residual is None else residual, y, m, n, k, k // split_k,
        HAS_BIAS=b is not None and split_k == 1, EPILOGUE=epilogue, ATOMIC=split_k > 1,
        SWAP_AB=swap_ab, BLOCK_M=M_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps)


def split_k_linear(x, w, b, y, ws, cfg):
    """Full split-K path: zero the workspace, atomic kernel, combine (bias + cast to y)."""
    ws.zero_()
    launch(x, w, None, ws, **cfg)
    torch.add(ws, b, out=y)


def cfg_of(block_n, block_k, num_warps, split_k, swap_ab=False):
    return dict(block_n=block_n, block_k=block_k, num_warps=num_warps, split_k=split_k,
                swap_ab=swap_ab)


def configs(k):
    """The grid; swap only at BLOCK_N 64 with 4 warps (the MMA's long side needs 64 rows)."""
    for sk, bn, bk, nw in itertools.product((1, 2, 4, 8), (16, 32, 64), (64, 128, 256), (2, 4)):
        for swap in ((False, True) if (bn, nw) == (64, 4) else (False,)):
            if k % (bk * sk) == 0:
                yield cfg_of(bn, bk, nw, sk, swap)


def label(cfg):
    return (f"n{cfg['block_n']} k{cfg['block_k']} w{cfg['num_warps']} s{cfg['split_k']}"
            + (' swap' if cfg['swap_ab'] else ''))


def rel_err(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def make_inputs(m, n, k, device, copies=1, dtype=torch.bfloat16):
    gen = torch.Generator(device='cpu').manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)
    w = rnd(n, k, scale=k ** -0.5)
    return dict(x=rnd(m, k), w=w, wbuf=w.expand(copies, n, k).contiguous() if copies > 1
                else w[None], b=rnd(n, scale=0.1), gate=rnd(n, scale=0.5), res=rnd(m, n))


def references(t):
    lin = F.linear(t['x'].float(), t['w'].float(), t['b'].float())
    return {EPI_NONE: lin, EPI_GELU: F.gelu(lin),
            EPI_GATED: t['res'].float() + t['gate'].float() * lin}


def check(t, cfg, epilogue=EPI_NONE):
    """Max relative error of one variant on copy 0 against fp32 F.linear (+ epilogue)."""
    x, w, b = t['x'], t['w'], t['b']
    y = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    if cfg['split_k'] > 1:
        ws = torch.empty(y.shape, device=x.device, dtype=torch.float32)
        split_k_linear(x, w, b, y, ws, cfg)
    else:
        launch(x, w, b, y, **cfg, epilogue=epilogue, gate=t['gate'], residual=t['res'])
    return rel_err(y, references(t)[epilogue])


def smoke_test():
    """TRITON_INTERPRET=1: correctness only, CPU tensors, small shapes, no timing. In float16:
    the interpreter keeps bfloat16 as raw uint16 and its tl.dot multiplies the bit patterns
    (triton-lang/triton#11584, unsupported); the kernel itself is dtype-generic."""
    print(f'Triton {triton.__version__} interpreter smoke test (CPU, float16, no timing)')
    cfgs = [cfg_of(16, 64, 4, 1), cfg_of(32, 128, 2, 1), cfg_of(64, 64, 4, 1, True),
            cfg_of(16, 64, 4, 2), cfg_of(32, 64, 4, 4)]
    failed = 0
    for m, n, k in ((16, 64, 256), (5, 48, 128), (16, 96, 512)):
        t = make_inputs(m, n, k, 'cpu', dtype=torch.float16)
        for cfg in (c for c in cfgs if k % (c['block_k'] * c['split_k']) == 0):
            errs = []
            for epi in (EPI_NONE,) if cfg['split_k'] > 1 else (EPI_NONE, EPI_GELU, EPI_GATED):
                name = ('plain', 'gelu', 'gated')[epi]
                try:
                    err = check(t, cfg, epi)
                    errs.append(f'{name} {err:.2e}' + ('' if err < TOL else ' FAIL'))
                except Exception as exc:  # e.g. an interpreter without atomics
                    err = math.inf
                    errs.append(f'{name} ERROR {exc!r:.80}')
                failed += err >= TOL
            print(f'  M={m:2d} N={n:3d} K={k:3d} {label(cfg):22s} ' + '  '.join(errs))
    print(f'smoke test: {"all ok" if not failed else f"{failed} FAILED"}')
    return failed


def graph_us(fn, calls, replays):
    """Median per-call time (us) of fn(0..calls-1) captured back to back in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    del graph
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / calls


def _precompile(cfgs):
    """Worker: compile each config once (fills Triton's disk cache for the parent)."""
    for cfg in cfgs:
        t = make_inputs(M_ROWS, 64, cfg['block_k'] * cfg['split_k'] * 2, 'cuda')
        check(t, cfg)
    return len(cfgs)


def precompile(jobs):
    keys = {}
    for k in sorted({k for _, k in SHAPES}):
        for cfg in configs(k):
            key = (cfg['block_n'], cfg['block_k'], cfg['num_warps'], cfg['split_k'] > 1,
                   cfg['swap_ab'])
            keys.setdefault(key, cfg)
    todo = list(keys.values())
    ctx = multiprocessing.get_context('spawn')
    try:
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            list(pool.map(_precompile, [todo[i::jobs] for i in range(jobs)]))
    except Exception as exc:  # only a speed-up: the parent compiles whatever is missing
        print(f'precompile failed ({exc!r:.100}); compiling in-process')
    return len(todo)


def bench_shape(n, k, mode, args, l2_bytes, errs):
    """All timings for one (N, K) and one L2 mode -> rows; errs caches correctness by label."""
    copies = 1 if mode == 'warm' else max(2, math.ceil(2 * l2_bytes / (n * k * 2)))
    calls = args.calls if mode == 'warm' else max(args.calls, copies)
    t = make_inputs(M_ROWS, n, k, 'cuda', copies)
    x, wbuf, b, gate, res = t['x'], t['wbuf'], t['b'], t['gate'], t['res']
    y = torch.empty(M_ROWS, n, device='cuda', dtype=torch.bfloat16)
    ws = torch.zeros(M_ROWS, n, device='cuda', dtype=torch.float32)
    base = dict(shape=f'{n}x{k}', n=n, k=k, mode=mode, calls=calls, weight_copies=copies)
    rows = []

    def add(variant, cfg, us, err):
        rows.append(dict(base, variant=variant, cfg=cfg, us=us,
                         err=err if math.isfinite(err) else None, ok=err < TOL))

    def timed(fn):
        return graph_us(fn, calls, args.replays)

    add('cublas', None, timed(lambda i: F.linear(x, wbuf[i % copies], b)),
        rel_err(F.linear(x, t['w'], b), references(t)[EPI_NONE]))
    for cfg in configs(k):
        key = (n, k, label(cfg))
        try:
            if key not in errs:
                errs[key] = check(t, cfg)
            if cfg['split_k'] == 1:
                add('triton', label(cfg),
                    timed(lambda i: launch(x, wbuf[i % copies], b, y, **cfg)), errs[key])
            else:
                add('splitk_incl', label(cfg), timed(
                    lambda i: split_k_linear(x, wbuf[i % copies], b, y, ws, cfg)), errs[key])
                add('splitk_excl', label(cfg),
                    timed(lambda i: launch(x, wbuf[i % copies], None, ws, **cfg)), errs[key])
        except Exception as exc:  # a config that does not compile or launch: noted, skipped
            errs[key] = math.inf
            rows.append(dict(base, variant='error', cfg=label(cfg), us=None, err=None,
                             ok=False, error=f'{exc!r:.300}'))
    plain = sorted((r for r in rows if r['variant'] == 'triton' and r['ok']), key=lambda r: r['us'])
    by_label = {label(c): c for c in configs(k)}
    torch_fns = {EPI_GELU: lambda i: F.gelu(F.linear(x, wbuf[i % copies], b)),
                 EPI_GATED: lambda i: res + gate * F.linear(x, wbuf[i % copies], b)}
    for epi, name in ((EPI_GELU, 'gelu'), (EPI_GATED, 'gated')):
        ref_fn = torch_fns[epi]
        add(f'{name}_cublas', None, timed(ref_fn), rel_err(ref_fn(0), references(t)[epi]))
        for r in plain[:3]:
            cfg = by_label[r['cfg']]
            err = check(t, cfg, epi)
            add(f'{name}_fused', r['cfg'], timed(lambda i: launch(
                x, wbuf[i % copies], b, y, **cfg, epilogue=epi, gate=gate, residual=res)), err)
    return rows


def summarize(rows):
    def best(shape, mode, variant):
        ok = [r for r in rows if (r['shape'], r['mode'], r['variant']) == (shape, mode, variant)
              and r['ok']]
        return min(ok, key=lambda r: r['us']) if ok else None

    def fmt(r, with_cfg=True):
        if r is None:
            return '--'
        return f"{r['us']:.2f}" + (f" ({r['cfg']})" if with_cfg and r['cfg'] else '')

    cols = ('shape', 'L2', 'cuBLAS', 'no-split (cfg)', 'split-K incl (cfg)', 'split-K excl (cfg)',
            'GELU fused / lin+gelu', 'gated fused / lin+ops')
    widths = (9, 4, 6, 26, 26, 26, 21, 21)
    print('\n' + ' | '.join(f'{c:{w}s}' for c, w in zip(cols, widths)))
    for shape, mode in dict.fromkeys((r['shape'], r['mode']) for r in rows):
        cells = [shape, mode] + [fmt(best(shape, mode, v)) for v in (
            'cublas', 'triton', 'splitk_incl', 'splitk_excl')] + [
            f"{fmt(best(shape, mode, e + '_fused'), False)} / "
            f"{fmt(best(shape, mode, e + '_cublas'), False)}" for e in ('gelu', 'gated')]
        print(' | '.join(f'{c:{w}s}' for c, w in zip(cells, widths)))
    bad = {(r['shape'], r['variant'], r['cfg']): r for r in rows if not r['ok']}
    print(f'\n{len(rows)} rows (us per call), {len(bad)} variants FAILED the {TOL:g} check')
    for (shape, variant, cfg), r in bad.items():
        print(f"  FAIL {shape} {variant} {cfg}: {r.get('error') or r['err']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', default=None, help='write the JSON results here')
    parser.add_argument('--calls', type=int, default=20, help='calls per graph (warm mode)')
    parser.add_argument('--replays', type=int, default=15, help='graph replays per timing')
    parser.add_argument('--modes', default='warm,cold', help='comma list of warm, cold')
    parser.add_argument('--jobs', type=int, default=min(8, (os.cpu_count() or 2) // 2),
                        help='processes compiling the configs up front (0: none)')
    args = parser.parse_args()
    if INTERPRET:
        if triton is None:
            print('TRITON_INTERPRET=1 but triton is not installed')
            return 1
        return 1 if smoke_test() else 0
    if not torch.cuda.is_available() or triton is None:
        print('CUDA or Triton unavailable: nothing to time (figures count only from the H200; '
              'TRITON_INTERPRET=1 runs a CPU correctness smoke test)')
        return 0
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, 'L2_cache_size', 50 * 2 ** 20) or 50 * 2 ** 20
    print(f'{props.name}, L2 {l2_bytes / 2 ** 20:.0f} MiB, torch {torch.__version__}, '
          f'triton {triton.__version__}, M = {M_ROWS}')
    if args.jobs > 0:
        print(f'precompiled {precompile(args.jobs)} kernels with {args.jobs} processes '
              f'in {time.time() - t0:.1f} s')
    rows, errs = [], {}
    for n, k in SHAPES:
        for mode in args.modes.split(','):
            rows += bench_shape(n, k, mode, args, l2_bytes, errs)
        print(f'  {n}x{k} done at {time.time() - t0:.1f} s')
    summarize(rows)
    print(f'total {time.time() - t0:.1f} s')
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, 'w') as f:
            json.dump({'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'),
                       'command': ' '.join(['python3'] + sys.argv), 'gpu': props.name,
                       'l2_bytes': l2_bytes, 'torch': torch.__version__,
                       'triton': triton.__version__, 'm': M_ROWS, 'tolerance': TOL,
                       'rows': rows}, f, indent=1)
        print(f'wrote {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
