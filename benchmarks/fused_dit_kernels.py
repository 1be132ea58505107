"""Triton kernels that fold a DiT block-step's adaLN prologues and epilogues into its GEMMs.

For the action expert's skinny Linears (M = B * T <= 16 rows of 768 features, bf16), a
kernel costs ~3-4 us inside a CUDA graph whatever it computes (benchmarks/RESULTS.md, the
skinny-GEMM table), so the block-step gets faster by launching fewer kernels that each do
more. Two operators, one launch each:

- `adaln_linear(x, shift, scale, W, b, gelu)`: per row LayerNorm over the features (fp32,
  biased variance, eps 1e-6, no affine), modulated by x_hat * (1 + scale) + shift, rounded
  once to the weight dtype, then @ W^T + b with fp32 accumulation and an optional exact (erf)
  GELU. Every program recomputes the statistics of its rows (a 16 x 768 input is tiny), so
  there is no separate norm kernel.
- `gated_linear(a, W, b, gate, residual)`: residual + gate * (a @ W^T + b), the gated
  residual of an AdaLN-Zero block.

Tiles follow the skinny-GEMM measurement on the H200 (Triton 3.6): no split-K, BLOCK_N 64,
BLOCK_K 256, 4 warps, "swapped" (W x^T, so N is the MMA's long side), the best config with
weights coming from HBM, as they do in the 36-block loop; see `CONFIG`.

Both are registered twice: as `torch.library.triton_op`s (inductor sees the kernels) and, as
a fallback, as opaque `torch.library.custom_op`s with fake implementations; both kinds work
inside `torch.compile(fullgraph=True)` and CUDA-graph capture (outputs are allocated inside
the op). Importing this module without Triton is fine: `AVAILABLE` is False and
`UNAVAILABLE_REASON` says why.

Measured on the H200 (benchmarks/RESULTS.md, "Flow-loop experiments", run 2): correct, but
the flow loop built from these took 40.6 ms against 26.2 ms for the shipped block-step, so
they are not used by the engine; kept as the record of that experiment.

`TRITON_INTERPRET=1 python3 benchmarks/fused_dit_kernels.py` checks both operators against
torch on CPU through the Triton interpreter (float16: the interpreter cannot run a bfloat16
tl.dot); `python3 benchmarks/fused_dit_kernels.py --sm90` compiles the kernels for sm_90a
without a GPU (ptxas register and spill counts).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the CPU CI machine has no Triton
    triton = None
    UNAVAILABLE_REASON = f'triton is not installed ({exc})'
else:
    UNAVAILABLE_REASON = (None if hasattr(torch.library, 'triton_op')
                          else f'torch {torch.__version__} has no torch.library.triton_op')
AVAILABLE = UNAVAILABLE_REASON is None

NORM_EPS = 1e-6       # molmobot_policy.model.action_expert.NORM_EPS
MAX_ROWS = 16         # rows per program (BLOCK_M); more rows use more programs along M
MAX_STATS_K = 1024    # adaln_linear: row-statistics chunk (K = 768 is read in one chunk)
CONFIG = dict(BLOCK_N=64, BLOCK_K=256, SWAP=True, num_warps=4)
LIB = 'molmobot_bench'

if triton is not None:
    @triton.jit
    def _mma(acc, a, w, SWAP: tl.constexpr):
        """acc += a @ w^T for a (BLOCK_M, BLOCK_K), w (BLOCK_N, BLOCK_K); acc is
        (BLOCK_N, BLOCK_M) when SWAP (computes w @ a^T: N is the MMA's long side, so 64-row
        tiles can use Hopper's warpgroup MMA), else (BLOCK_M, BLOCK_N)."""
        if SWAP:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        return acc

    @triton.jit
    def _adaln_linear_kernel(x_ptr, shift_ptr, scale_ptr, w_ptr, b_ptr, y_ptr, M, N, K, T, eps,
                             GELU: tl.constexpr, SWAP: tl.constexpr, STATS_K: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
        """y[m, n] = act(sum_k h[m, k] w[n, k] + b[n]) for BLOCK_M rows x BLOCK_N columns, with
        h = LayerNorm(x) * (1 + scale) + shift in fp32, rounded to w's dtype.

        x (M, K) rows, M = B * T; shift, scale (B, K), row m uses batch m // T; w (N, K);
        b (N,); y (M, N). All contiguous. STATS_K: a power of two, the feature chunk of the
        row statistics (>= K: one load and an exact two-pass mean / variance in registers).
        """
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        # Row statistics in fp32: per chunk two passes in registers, chunks merged as in
        # Chan et al.'s parallel variance (a single chunk for K <= STATS_K).
        mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
        m2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        rs = tl.arange(0, STATS_K)
        for k0 in range(0, K, STATS_K):
            ks_ok = (k0 + rs) < K
            xs = tl.load(x_ptr + rm[:, None] * K + (k0 + rs)[None, :],
                         mask=m_ok[:, None] & ks_ok[None, :], other=0.0).to(tl.float32)
            count = tl.minimum(K - k0, STATS_K).to(tl.float32)
            chunk_mean = tl.sum(xs, axis=1) / count
            centered = tl.where(ks_ok[None, :], xs - chunk_mean[:, None], 0.0)
            delta = chunk_mean - mean
            frac = count / (k0 + count)
            mean += delta * frac
            m2 += tl.sum(centered * centered, axis=1) + delta * delta * k0 * frac
        rstd = 1.0 / tl.sqrt(m2 / K + eps)
        mod_row = (rm // T) * K  # shift/scale row of each x row
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a_mask = m_ok[:, None] & (kk < K)[None, :]
            x = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=a_mask, other=0.0)
            shift = tl.load(shift_ptr + mod_row[:, None] + kk[None, :], mask=a_mask, other=0.0)
            scale = tl.load(scale_ptr + mod_row[:, None] + kk[None, :], mask=a_mask, other=0.0)
            a = ((x.to(tl.float32) - mean[:, None]) * rstd[:, None]
                 * (1.0 + scale.to(tl.float32)) + shift.to(tl.float32))
            w = tl.load(w_ptr + rn[:, None] * K + kk[None, :],
                        mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
            acc = _mma(acc, a.to(w.dtype), w, SWAP)
        if SWAP:
            acc = tl.trans(acc)
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GELU:  # exact, as nn.GELU()
            acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _gated_linear_kernel(a_ptr, w_ptr, b_ptr, g_ptr, r_ptr, y_ptr, M, N, K, T,
                             SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
        """y[m, n] = r[m, n] + g[m // T, n] * (sum_k a[m, k] w[n, k] + b[n]).

        a (M, K); w (N, K); b (N,); g (B, N), row m uses batch m // T; r, y (M, N).
        All contiguous; fp32 accumulation and epilogue, one rounding to y's dtype.
        """
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            a = tl.load(a_ptr + rm[:, None] * K + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
            acc = _mma(acc, a, w, SWAP)
        if SWAP:
            acc = tl.trans(acc)
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_mask = m_ok[:, None] & n_ok[None, :]
        gate = tl.load(g_ptr + (rm // T)[:, None] * N + rn[None, :], mask=y_mask, other=0.0)
        res = tl.load(r_ptr + rm[:, None] * N + rn[None, :], mask=y_mask, other=0.0)
        acc = res.to(tl.float32) + gate.to(tl.float32) * acc
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=y_mask)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _grid(m: int, n: int) -> tuple[int, int]:
    return (triton.cdiv(n, CONFIG['BLOCK_N']), triton.cdiv(m, MAX_ROWS))


def _launch_adaln_linear(kernel, x, shift, scale, weight, bias, gelu):
    """Checks shapes, allocates y (B, T, N) like x, launches `kernel` (the JIT function or
    its wrap_triton wrapper); arguments as in `adaln_linear`."""
    _check(x.dim() == 3, f'x must be (B, T, K), got {tuple(x.shape)}')
    bsz, t, k = x.shape
    n = weight.shape[0]
    _check(weight.shape == (n, k) and bias.shape == (n,),
           f'weight/bias must be ({n}, {k}) / ({n},), got {tuple(weight.shape)} / '
           f'{tuple(bias.shape)}')
    _check(shift.shape == (bsz, k) and scale.shape == (bsz, k),
           f'shift/scale must be ({bsz}, {k}), got {tuple(shift.shape)} / {tuple(scale.shape)}')
    y = x.new_empty(bsz, t, n)
    kernel[_grid(bsz * t, n)](
        x.contiguous(), shift.contiguous(), scale.contiguous(), weight.contiguous(),
        bias.contiguous(), y, bsz * t, n, k, t, NORM_EPS, GELU=gelu, SWAP=CONFIG['SWAP'],
        STATS_K=min(triton.next_power_of_2(k), MAX_STATS_K), BLOCK_M=MAX_ROWS,
        BLOCK_N=CONFIG['BLOCK_N'], BLOCK_K=CONFIG['BLOCK_K'], num_warps=CONFIG['num_warps'])
    return y


def _launch_gated_linear(kernel, a, weight, bias, gate, residual):
    """Checks shapes, allocates y like residual, launches `kernel`; arguments as in
    `gated_linear`."""
    _check(a.dim() == 3, f'a must be (B, T, K), got {tuple(a.shape)}')
    bsz, t, k = a.shape
    n = weight.shape[0]
    _check(weight.shape == (n, k) and bias.shape == (n,),
           f'weight/bias must be ({n}, {k}) / ({n},), got {tuple(weight.shape)} / '
           f'{tuple(bias.shape)}')
    _check(gate.shape == (bsz, n) and residual.shape == (bsz, t, n),
           f'gate/residual must be ({bsz}, {n}) / ({bsz}, {t}, {n}), got {tuple(gate.shape)} / '
           f'{tuple(residual.shape)}')
    y = residual.new_empty(bsz, t, n)
    kernel[_grid(bsz * t, n)](
        a.contiguous(), weight.contiguous(), bias.contiguous(), gate.contiguous(),
        residual.contiguous(), y, bsz * t, n, k, t, SWAP=CONFIG['SWAP'], BLOCK_M=MAX_ROWS,
        BLOCK_N=CONFIG['BLOCK_N'], BLOCK_K=CONFIG['BLOCK_K'], num_warps=CONFIG['num_warps'])
    return y


if AVAILABLE:
    from torch.library import custom_op, triton_op, wrap_triton

    @triton_op(f'{LIB}::adaln_linear', mutates_args=())
    def adaln_linear(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor, gelu: bool = False
                     ) -> torch.Tensor:
        """(GELU of) modulate(LayerNorm(x), shift, scale) @ weight^T + bias, one launch.

        x (B, T, K); shift, scale (B, K); weight (N, K); bias (N,); all one dtype (bf16 on
        the GPU). LayerNorm and modulation in fp32 (eps NORM_EPS, no affine), rounded once
        to the weight dtype before the GEMM; fp32 accumulation. Returns (B, T, N) in x's
        dtype.
        """
        return _launch_adaln_linear(wrap_triton(_adaln_linear_kernel), x, shift, scale,
                                    weight, bias, gelu)

    @triton_op(f'{LIB}::gated_linear', mutates_args=())
    def gated_linear(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     gate: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + gate[:, None, :] * (a @ weight^T + bias), one launch.

        a (B, T, K); weight (N, K); bias (N,); gate (B, N); residual (B, T, N); one dtype.
        fp32 accumulation and epilogue. Returns (B, T, N) in residual's dtype.
        """
        return _launch_gated_linear(wrap_triton(_gated_linear_kernel), a, weight, bias, gate,
                                    residual)

    @custom_op(f'{LIB}::adaln_linear_opaque', mutates_args=())
    def adaln_linear_opaque(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                            weight: torch.Tensor, bias: torch.Tensor, gelu: bool = False
                            ) -> torch.Tensor:
        """`adaln_linear` as an opaque custom op (torch.compile does not trace into it)."""
        return _launch_adaln_linear(_adaln_linear_kernel, x, shift, scale, weight, bias, gelu)

    @adaln_linear_opaque.register_fake
    def _(x, shift, scale, weight, bias, gelu=False):
        return x.new_empty(*x.shape[:2], weight.shape[0])

    @custom_op(f'{LIB}::gated_linear_opaque', mutates_args=())
    def gated_linear_opaque(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                            gate: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`gated_linear` as an opaque custom op (torch.compile does not trace into it)."""
        return _launch_gated_linear(_gated_linear_kernel, a, weight, bias, gate, residual)

    @gated_linear_opaque.register_fake
    def _(a, weight, bias, gate, residual):
        return torch.empty_like(residual)

    OPS = {'triton_op': (adaln_linear, gated_linear),
           'custom_op': (adaln_linear_opaque, gated_linear_opaque)}
else:
    OPS = {}


# -- references and checks ---------------------------------------------------------------

def adaln_linear_reference(x, shift, scale, weight, bias, gelu=False):
    """The unfused torch math of `adaln_linear` (as DiTBlock computes it), in x's dtype."""
    h = F.layer_norm(x, x.shape[-1:], eps=NORM_EPS)
    h = F.linear(h * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1), weight, bias)
    return F.gelu(h) if gelu else h


def gated_linear_reference(a, weight, bias, gate, residual):
    """The unfused torch math of `gated_linear`, in residual's dtype."""
    return residual + gate.unsqueeze(1) * F.linear(a, weight, bias)


def _rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def check(device='cpu', dtype=torch.float16, shapes=None, ops='triton_op', tol=1e-2):
    """Compares the operators of `OPS[ops]` to the unfused torch math in fp32 on the same
    (rounded) inputs, max |error| / max |reference|; for scale, also prints that error for
    the unfused torch math in `dtype`. One line per case.

    shapes: iterable of (B, T, N, K). Returns the number of failures (rel. error >= tol).
    """
    fused_adaln, fused_gated = OPS[ops]
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(device, dtype)

    failed = 0
    for bsz, t, n, k in shapes:
        # features with different offsets: chunks of the row statistics differ in mean
        x = rnd(bsz, t, k, std=2.0) + torch.linspace(-3, 4, k).to(device, dtype)
        shift, scale, gate = rnd(bsz, k, std=0.3), rnd(bsz, k, std=0.3), rnd(bsz, n, std=0.5)
        w, b = rnd(n, k, std=k ** -0.5), rnd(n, std=0.1)
        a, res = rnd(bsz, t, k), rnd(bsz, t, n)
        f32 = [v.float() for v in (x, shift, scale, w, b)]
        cases = [('adaln      ', fused_adaln(x, shift, scale, w, b),
                  adaln_linear_reference(*f32), adaln_linear_reference(x, shift, scale, w, b)),
                 ('adaln+gelu ', fused_adaln(x, shift, scale, w, b, True),
                  adaln_linear_reference(*f32, gelu=True),
                  adaln_linear_reference(x, shift, scale, w, b, gelu=True)),
                 ('gated      ', fused_gated(a, w, b, gate, res),
                  gated_linear_reference(*(v.float() for v in (a, w, b, gate, res))),
                  gated_linear_reference(a, w, b, gate, res))]
        for name, out, ref32, ref_lp in cases:
            err, err_lp = _rel_err(out, ref32), _rel_err(ref_lp, ref32)
            failed += err >= tol
            print(f'  B={bsz} T={t:2d} (M={bsz * t:2d}) N={n:4d} K={k:4d} {name} '
                  f'max rel err vs fp32 torch {err:.2e} (unfused torch in {dtype}: {err_lp:.2e})'
                  + ('' if err < tol else '  FAIL'), flush=True)
    return failed


def compile_sm90():
    """Compiles the kernels as the benchmark launches them (bf16, K = 768 / 3072, every
    pointer and M, N, K, T divisible by 16, as Triton specializes them at launch; also with M
    and T unaligned) for sm_90a without a GPU, with Triton's bundled ptxas, and prints
    registers, spills, shared memory and whether the dot became a warpgroup MMA."""
    import re
    import subprocess
    import tempfile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'ptxas')
    common = {'SWAP': CONFIG['SWAP'], 'BLOCK_M': MAX_ROWS, 'BLOCK_N': CONFIG['BLOCK_N'],
              'BLOCK_K': CONFIG['BLOCK_K']}
    ints = dict(M='i32', N='i32', K='i32', T='i32')
    adaln_sig = dict(dict.fromkeys(('x_ptr', 'shift_ptr', 'scale_ptr', 'w_ptr', 'b_ptr',
                                    'y_ptr'), '*bf16'), **ints, eps='fp32')
    gated_sig = dict(dict.fromkeys(('a_ptr', 'w_ptr', 'b_ptr', 'g_ptr', 'r_ptr', 'y_ptr'),
                                   '*bf16'), **ints)
    jobs = [(f'adaln_linear gelu={gelu}', _adaln_linear_kernel, adaln_sig,
             dict(common, GELU=gelu, STATS_K=MAX_STATS_K)) for gelu in (False, True)]
    jobs.append(('gated_linear', _gated_linear_kernel, gated_sig, common))
    for name, fn, sig, consts in jobs:
        for aligned_rows in (True, False):
            aligned = [k for k, v in sig.items() if v.startswith('*') or k in ('N', 'K')
                       or (aligned_rows and k in ('M', 'T'))]
            src = ASTSource(fn=fn, signature=dict(sig, **dict.fromkeys(consts, 'constexpr')),
                            constexprs=consts,
                            attrs={(fn.arg_names.index(k),): [['tt.divisibility', 16]]
                                   for k in aligned})
            compiled = triton.compile(src, target=GPUTarget('cuda', 90, 32), options={
                'num_warps': CONFIG['num_warps'], 'num_stages': 3})
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, 'kernel.ptx')
                with open(path, 'w') as f:
                    f.write(compiled.asm['ptx'])
                info = subprocess.run(
                    [ptxas, '-v', '--gpu-name=sm_90a', path, '-o', path + '.cubin'],
                    capture_output=True, text=True, check=True).stderr
            regs = re.search(r'Used (\d+) registers', info)
            spill = re.search(r'(\d+) bytes spill stores, (\d+) bytes spill loads', info)
            print(f'  {name:24s} M,T {"aligned  " if aligned_rows else "unaligned"}: '
                  f'{regs.group(1) if regs else "?"} registers, spill stores/loads '
                  f'{"/".join(spill.groups()) if spill else "?"} bytes, shared '
                  f'{compiled.metadata.shared} bytes, wgmma '
                  f'{"yes" if "wgmma" in compiled.asm["ptx"] else "no"}')


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--sm90', action='store_true',
                        help='compile for sm_90a with ptxas instead of the interpreter check')
    args = parser.parse_args(argv)
    if not AVAILABLE:
        print(f'fused DiT kernels unavailable: {UNAVAILABLE_REASON}')
        return 1
    print(f'triton {triton.__version__}, torch {torch.__version__}, config {CONFIG}')
    if args.sm90:
        compile_sm90()
        return 0
    if os.environ.get('TRITON_INTERPRET') != '1' and not torch.cuda.is_available():
        print('needs CUDA or TRITON_INTERPRET=1')
        return 1
    cuda = torch.cuda.is_available() and os.environ.get('TRITON_INTERPRET') != '1'
    device, dtype = ('cuda', torch.bfloat16) if cuda else ('cpu', torch.float16)
    shapes = [(1, 16, 768, 768), (1, 16, 2304, 768), (1, 16, 3072, 768), (1, 16, 768, 3072),
              (1, 5, 768, 768), (1, 5, 2304, 768), (1, 5, 768, 3072),
              (2, 8, 768, 768), (3, 7, 160, 256), (1, 5, 256, 1536)]
    failed = 0
    for ops in OPS:
        print(f'{ops} ops on {device}, {dtype}:')
        failed += check(device, dtype, shapes, ops)
    print('all ok' if not failed else f'{failed} FAILED')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
