"""One persistent Triton kernel per flow step for the action expert's DiT blocks (CUDA only).

Why: the 10-step x 36-block flow loop is bound by kernel latency, not by arithmetic or memory.
Each block-step reads ~22 MB (16.5 MB of weights, 5.2 MB of cross-attention K/V), a few us at
HBM speed, but the compiled block runs it as ~25 kernels, each paying a launch. Here one
launch runs every block of one flow step with all SMs: the 16 action tokens stay in a small
float32 scratch (in L2), each phase of a block (below) is split over the whole grid, and the
phases are separated by a grid-wide barrier (an atomic counter) instead of a kernel boundary.

A prologue (phase 9, once per step) takes the input tokens into the float32 residual stream
(x, xm and the row statistics below); the last block's fc2 phase writes the output tokens:
a flow step is two launches (the barrier counter's fill, the kernel).
Phases of one block (B = 1, T <= 32 tokens; `DiTBlock.forward` is the reference):
  0. self q|k|v = (LN1(x) * (1 + scale1) + shift1) @ [Wq; Wkv]^T + b       (3D columns)
  1. self-attention, one head per program: softmax(q k^T / sqrt(hd)) v -> o
  2. x += gate1 * (o @ Wo^T + bo)
  3. q2 = (LN2(x) * (1 + scale2) + shift2) @ Wq2^T + bq2, times 1/sqrt(hd)
  4. cross-attention partials per (head, 128-key chunk): row max, sum, P V (flash-decoding)
  5. combine the chunks per (head, row) into o
  6. x += gate2 * (o @ Wo2^T + bo2), bo2 = the context's `out_bias` (the value bias folded in;
     the cached K/V carry no bias: `ActionExpert.context_key_values`)
  7. a = GELU((LN3(x) * (1 + scale3) + shift3) @ W1^T + b1)                 (exact erf GELU)
  8. x += gate3 * (a @ W2^T + b2), the K = 3072 reduction split in two halves per output tile;
     the later half to finish adds the two (a + b == b + a: the same bits either way)
The LayerNorms cost no pass over x: every residual update (2, 6, 8) also writes its tile's row
sums and sums of squares and xm = x * (1 + scale) for the next LayerNorm-fed GEMM, which then
runs as a plain pipelined GEMM on xm and applies the normalization in its epilogue:
rstd * (xm @ W^T - mean * W(1 + scale)) + W shift, with W(1 + scale) and W shift computed once
per flow time (`FusedDiTStep.tables`, like the engine's precomputed AdaLN conditioning).
Every GEMM tile loads its epilogue's operands (row statistics, u / v, bias; the residual's x,
gate and next scale) before its K loop, so their L2 round trips overlap the weight loads.
The residual stream stays float32 inside the kernel (the reference rounds it to the
parameter dtype after every op); matmuls take parameter-dtype operands with float32
accumulation, as cuBLAS does. Agreement with float32 is
closer than the bf16 blocks' (tested on the GPU).

Safety of the grid barrier: the grid is exactly one program per SM, launched alone on the
stream, so every program is resident (the barrier would hang otherwise). Where that cannot be
guaranteed (e.g. MPS with an SM limit) set the engine's `fused_action_expert: off`.

`phased=True` launches each phase as its own kernel (no barrier): slower, but it runs in
Triton's CPU interpreter (TRITON_INTERPRET=1) and isolates a barrier fault from a math fault;
on the GPU it gives the same bits as the persistent launch (tested).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from molmobot_policy.runtime.stacking import is_stack_of, stack_parameters_

try:   # triton ships with CUDA builds of torch; CPU builds run the torch path
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - exercised on CPU-only installs
    triton = None
    tl = None

N_PHASES = 9
ROWS = 16              # token rows per tile (tl.dot needs >= 16); T <= ROWS * 2 supported
KEY_CHUNK = 128        # cross-attention keys per program in phase 4
TILE_N = 16            # output columns per program for D-wide outputs (phases 2, 3, 6, 8)
TILE_N_WIDE = 32       # output columns per program for the q|k|v and fc1 GEMMs (phases 0, 7)
TILE_K = 256           # reduction chunk of the GEMMs (a pipelined loop)
TILE_K_ADALN = 256     # reduction chunk of the LayerNorm-fed GEMMs (phases 0, 3, 7)
COUNTER_STRIDE = 32    # int32s between two synchronization counters (one 128-byte line each)


def unavailable_reason(ae, device: torch.device, dtype: torch.dtype, batch: int = 1) -> str:
    """'' when the fused kernel can serve this action expert, else why not (for a log line).

    ae: `ActionExpert`; device, dtype: serving device and parameter dtype; batch: queries per
    call (the engine serves 1).
    """
    if device.type != 'cuda':
        return f'needs a CUDA device, serving on {device}'
    if triton is None:
        return 'triton is not installed'
    if dtype not in (torch.bfloat16, torch.float16):
        return f'needs bfloat16 or float16 weights, got {dtype}'
    if batch != 1:
        return f'serves one query at a time, got batch {batch}'
    cfg = ae.cfg
    if cfg.hidden_size % cfg.num_heads:
        return f'hidden_size {cfg.hidden_size} is not a multiple of num_heads {cfg.num_heads}'
    tokens = ae.horizon + (1 if ae.states_mode == 'self_attn' else 0)
    if tokens > 2 * ROWS:
        return f'{tokens} action tokens; the kernel handles at most {2 * ROWS}'
    return ''


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class StackedBlockWeights:
    """Every DiT block's weights as one (n_blocks, ...) tensor per kind, parameter dtype.

    The blocks' own parameters are re-pointed to views of these (no second copy), so the torch
    path and the kernel read the same memory. Shapes: wq1, wo1, wq2, wo2 (NB, D, D); wkv1
    (NB, 2D, D); w1 (NB, F, D); w2 (NB, D, F); biases (NB, N).
    """

    wq1: torch.Tensor
    bq1: torch.Tensor
    wkv1: torch.Tensor
    bkv1: torch.Tensor
    wo1: torch.Tensor
    bo1: torch.Tensor
    wq2: torch.Tensor
    bq2: torch.Tensor
    wo2: torch.Tensor
    bo2: torch.Tensor
    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor

    @classmethod
    def from_blocks_(cls, blocks) -> 'StackedBlockWeights':
        """Stacks the blocks' Linear weights and re-points each block to its slice (in place).
        Idempotent: a second call on the same blocks returns the same stacked tensors."""
        params = {prefix + name: [getattr(get(b), kind) for b in blocks]
                  for name, get in _LINEARS.items() for prefix, kind in _KINDS}
        cached = getattr(blocks, '_molmobot_stacked', None)
        if cached is not None and all(is_stack_of(getattr(cached, field), ps)
                                      for field, ps in params.items()):
            return cached
        fields = {field: stack_parameters_(ps) for field, ps in params.items()}
        stacked = cls(**fields)
        blocks._molmobot_stacked = stacked
        return stacked


_LINEARS = {'q1': lambda b: b.attn1.q_proj, 'kv1': lambda b: b.attn1.kv_proj,
            'o1': lambda b: b.attn1.proj, 'q2': lambda b: b.attn2.q_proj,
            'o2': lambda b: b.attn2.proj, '1': lambda b: b.mlp.fc1, '2': lambda b: b.mlp.fc2}
_KINDS = (('w', 'weight'), ('b', 'bias'))


if triton is not None:
    _CS = tl.constexpr(COUNTER_STRIDE)

    @triton.jit
    def _arrive(counter_ptr, cond):
        """Adds this program's arrival to a counter (a release add, after every thread of
        the program has finished its stores) when `cond`."""
        tl.debug_barrier()
        if cond:
            tl.atomic_add(counter_ptr, 1, sem='release', scope='gpu')

    @triton.jit
    def _wait(counter_ptr, target, cond):
        """When `cond`: spins until the counter reaches `target` (acquire reads: what the
        arrivals' programs stored before arriving is visible after). Loads issued before
        the call stay in flight while it spins."""
        if cond:
            seen = tl.atomic_add(counter_ptr, 0, sem='acquire', scope='gpu')
            while seen < target:
                seen = tl.atomic_add(counter_ptr, 0, sem='acquire', scope='gpu')
        tl.debug_barrier()

    @triton.jit
    def _load_row_stats(st_ptr, D: tl.constexpr, BN: tl.constexpr, NTP: tl.constexpr,
                        BT: tl.constexpr):
        """The per-tile row sums and sums of squares that the last residual update wrote
        (st: (2, NTP, BT) float32; tiles past ceil(D / BN) read as zero), as two (NTP, BT)
        tiles; loaded before a GEMM's K loop so that their L2 round trip overlaps it
        (`_row_stats` reduces them)."""
        tiles = tl.arange(0, NTP)
        offs = tiles[:, None] * BT + tl.arange(0, BT)[None, :]
        used = (tiles < (D + BN - 1) // BN)[:, None]
        return (tl.load(st_ptr + offs, mask=used, other=0.0, cache_modifier='.cg'),
                tl.load(st_ptr + NTP * BT + offs, mask=used, other=0.0, cache_modifier='.cg'))

    @triton.jit
    def _row_stats(sums, sums_sq, eps, D: tl.constexpr):
        """Mean and 1/std of the rows of x from `_load_row_stats`' tiles: one L2 round instead
        of a pass over x. Summed in a fixed order (bitwise reproducible); variance as
        E[x^2] - mean^2 in float32 (the residual stream's |mean| / std is small)."""
        total = tl.sum(sums, axis=0)
        total_sq = tl.sum(sums_sq, axis=0)
        mean = total / D
        var = tl.maximum(total_sq / D - mean * mean, 0.0)
        return mean, 1.0 / tl.sqrt(var + eps)

    @triton.jit
    def _linear(a_ptr, w_ptr, n0, n_rows, T, K: tl.constexpr, BT: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, LD: tl.constexpr = 0):
        """a (T, K) @ W[n0:n0+BN]^T -> float32 (BT, BN); a in scratch, W (n_rows, K); rows of
        both LD apart (0: K); the K loop software-pipelined STAGES deep."""
        ld: tl.constexpr = K if LD == 0 else LD
        rows = tl.arange(0, BT)
        ks = tl.arange(0, BK)
        ns = n0 + tl.arange(0, BN)
        acc = tl.zeros((BT, BN), tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            kk = k + ks
            km = kk < K
            a = tl.load(a_ptr + rows[:, None] * ld + kk[None, :],
                        mask=(rows[:, None] < T) & km[None, :], other=0.0, cache_modifier='.cg')
            w = tl.load(w_ptr + ns[:, None] * ld + kk[None, :],
                        mask=(ns[:, None] < n_rows) & km[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
        return acc

    @triton.jit
    def _gated_residual(x_ptr, st_ptr, xm_ptr, out_ptr, last, acc, x, b, g, nsc, n0, T,
                        D: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                        NTP: tl.constexpr):
        """x[:, n0:n0+BN] += gate * (acc + bias), float32 in place, with x, bias, gate and
        next_scale from `_residual_operands` (then `_store_residual`)."""
        rows = tl.arange(0, BT)
        ns = n0 + tl.arange(0, BN)
        m = (rows[:, None] < T) & (ns < D)[None, :]
        x = tl.where(m, x + g[None, :] * (acc + b[None, :]), 0.0)
        _store_residual(x_ptr, st_ptr, xm_ptr, out_ptr, last, x, nsc, n0, T, D, BT, BN, NTP)

    @triton.jit
    def _store_residual(x_ptr, st_ptr, xm_ptr, out_ptr, last, x, nsc, n0, T, D: tl.constexpr,
                        BT: tl.constexpr, BN: tl.constexpr, NTP: tl.constexpr):
        """Stores the new float32 x tile (BT, BN) (rows >= T zero) at columns n0:n0+BN, the
        tile's row sums and sums of squares to st[:, n0 // BN] (see `_row_stats`) and
        xm = x * (1 + next_scale) for the next LayerNorm-fed GEMM (see `_adaln_linear`);
        `last` (the last block's final update): x in the parameter dtype to out (T, D) too."""
        rows = tl.arange(0, BT)
        ns = n0 + tl.arange(0, BN)
        m = (rows[:, None] < T) & (ns < D)[None, :]
        tl.store(x_ptr + rows[:, None] * D + ns[None, :], x, mask=m)
        tl.store(xm_ptr + rows[:, None] * D + ns[None, :],
                 (x * (1.0 + nsc[None, :])).to(xm_ptr.dtype.element_ty), mask=m)
        if last:
            tl.store(out_ptr + rows[:, None] * D + ns[None, :],
                     x.to(out_ptr.dtype.element_ty), mask=m)
        tile = n0 // BN
        tl.store(st_ptr + tile * BT + rows, tl.sum(x, axis=1))
        tl.store(st_ptr + (NTP + tile) * BT + rows, tl.sum(x * x, axis=1))

    @triton.jit
    def _load_w(w_ptr, n0, n_rows, k0, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                LD: tl.constexpr, valid):
        """W[n0:n0+BN, k0:k0+BK] (rows LD apart, 0: K), zeros outside (n_rows, K) or when
        not `valid`."""
        ld: tl.constexpr = K if LD == 0 else LD
        ns = n0 + tl.arange(0, BN)
        kk = k0 + tl.arange(0, BK)
        return tl.load(w_ptr + ns[:, None] * ld + kk[None, :],
                       mask=valid & (ns[:, None] < n_rows) & (kk[None, :] < K), other=0.0)

    @triton.jit
    def _load_w3(w_ptr, n0, n_rows, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 LD: tl.constexpr, valid):
        """The first three BK-wide chunks of W's rows n0:n0+BN (the prefetched part of a
        tile's weights: `_linear_pre`)."""
        return (_load_w(w_ptr, n0, n_rows, 0, K, BN, BK, LD, valid),
                _load_w(w_ptr, n0, n_rows, BK, K, BN, BK, LD, valid),
                _load_w(w_ptr, n0, n_rows, 2 * BK, K, BN, BK, LD, valid))

    @triton.jit
    def _linear_pre(a_ptr, w_ptr, w0, w1, w2, n0, n_rows, T, K: tl.constexpr,
                    BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                    LD: tl.constexpr = 0):
        """a (T, K) @ W[n0:n0+BN]^T -> float32 (BT, BN) with W's first three K chunks given
        (w0..w2 from `_load_w3`, loaded before the wait for a); the rest of K, if any, as a
        pipelined loop. a in scratch; rows of a and W LD apart (0: K)."""
        ld: tl.constexpr = K if LD == 0 else LD
        rows = tl.arange(0, BT)
        ks = tl.arange(0, BK)
        rm = rows[:, None] < T
        a0 = tl.load(a_ptr + rows[:, None] * ld + ks[None, :], mask=rm & (ks[None, :] < K),
                     other=0.0, cache_modifier='.cg')
        a1 = tl.load(a_ptr + rows[:, None] * ld + BK + ks[None, :],
                     mask=rm & (BK + ks[None, :] < K), other=0.0, cache_modifier='.cg')
        a2 = tl.load(a_ptr + rows[:, None] * ld + 2 * BK + ks[None, :],
                     mask=rm & (2 * BK + ks[None, :] < K), other=0.0, cache_modifier='.cg')
        acc = tl.dot(a0, tl.trans(w0))
        acc = tl.dot(a1, tl.trans(w1), acc)
        acc = tl.dot(a2, tl.trans(w2), acc)
        ns = n0 + tl.arange(0, BN)
        for k in tl.range(3 * BK, K, BK, num_stages=STAGES):
            kk = k + ks
            km = kk < K
            a = tl.load(a_ptr + rows[:, None] * ld + kk[None, :], mask=rm & km[None, :],
                        other=0.0, cache_modifier='.cg')
            w = tl.load(w_ptr + ns[:, None] * ld + kk[None, :],
                        mask=(ns[:, None] < n_rows) & km[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
        return acc

    @triton.jit
    def _adaln_pre(u_ptr, v_ptr, w_ptr, bias_ptr, n0, n_rows, D: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, valid):
        """The constant operands of one LayerNorm-fed GEMM tile (see `_adaln_finish`): u, v
        (float32), bias and W's first three K chunks; they depend on no activation, so they
        are loaded before the wait for the phase's input."""
        ns = n0 + tl.arange(0, BN)
        nm = (ns < n_rows) & valid
        u = tl.load(u_ptr + ns, mask=nm, other=0.0)
        v = tl.load(v_ptr + ns, mask=nm, other=0.0)
        b = tl.load(bias_ptr + ns, mask=nm, other=0.0).to(tl.float32)
        w0, w1, w2 = _load_w3(w_ptr, n0, n_rows, D, BN, BK, 0, valid)
        return u, v, b, w0, w1, w2

    @triton.jit
    def _adaln_finish(xm_ptr, st_ptr, w_ptr, u, v, b, w0, w1, w2, n0, n_rows, T, eps,
                      D: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      NTP: tl.constexpr, STAGES: tl.constexpr, BNS: tl.constexpr):
        """(LN(x) * (1 + scale) + shift) @ W[n0:n0+BN]^T + bias -> float32 (BT, BN), computed
        as rstd * (xm @ W^T - mean * u) + v + bias with xm = x * (1 + scale) (parameter dtype,
        written by the residual update before), u = W (1 + scale), v = W shift (per flow step,
        from `FusedDiTStep.tables`): the normalization moves to the epilogue, so the K loop is
        a plain GEMM. W (n_rows, D); the constants from `_adaln_pre`; BNS: the residual
        updates' tile width (the row statistics' tiling)."""
        sums, sums_sq = _load_row_stats(st_ptr, D, BNS, NTP, BT)
        acc = _linear_pre(xm_ptr, w_ptr, w0, w1, w2, n0, n_rows, T, D, BT, BN, BK, STAGES)
        mean, rstd = _row_stats(sums, sums_sq, eps, D)
        return rstd[:, None] * (acc - mean[:, None] * u[None, :]) + v[None, :] + b[None, :]

    @triton.jit
    def _residual_pre(w_ptr, bias_ptr, gate_ptr, next_scale_ptr, n0, K: tl.constexpr,
                      D: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LD: tl.constexpr,
                      valid):
        """The constant operands of one gated-residual GEMM tile (columns n0:n0+BN): bias,
        gate, the next LayerNorm's scale (float32) and W's first three K chunks."""
        ns = n0 + tl.arange(0, BN)
        nm = (ns < D) & valid
        b = tl.load(bias_ptr + ns, mask=nm, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + ns, mask=nm, other=0.0).to(tl.float32)
        nsc = tl.load(next_scale_ptr + ns, mask=nm, other=0.0).to(tl.float32)
        w0, w1, w2 = _load_w3(w_ptr, n0, D, K, BN, BK, LD, valid)
        return b, g, nsc, w0, w1, w2

    @triton.jit
    def _load_x_tile(x_ptr, n0, T, D: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr):
        """x[:, n0:n0+BN] (float32 residual stream; rows >= T and columns >= D read 0)."""
        rows = tl.arange(0, BT)
        ns = n0 + tl.arange(0, BN)
        return tl.load(x_ptr + rows[:, None] * D + ns[None, :],
                       mask=(rows[:, None] < T) & (ns < D)[None, :], other=0.0,
                       cache_modifier='.cg')

    @triton.jit
    def _proj_tile(a_ptr, w_ptr, x_ptr, st_ptr, xm_ptr, out_ptr, last, b, g, nsc, w0, w1, w2,
                   n0, T, K: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, NTP: tl.constexpr, STAGES: tl.constexpr):
        """x[:, n0:n0+BN] += gate * (a @ W^T + bias); a (T, K) scratch, W (D, K), the
        constants from `_residual_pre`."""
        x = _load_x_tile(x_ptr, n0, T, D, BT, BN)
        acc = _linear_pre(a_ptr, w_ptr, w0, w1, w2, n0, D, T, K, BT, BN, BK, STAGES)
        _gated_residual(x_ptr, st_ptr, xm_ptr, out_ptr, last, acc, x, b, g, nsc, n0, T, D,
                        BT, BN, NTP)

    @triton.jit
    def _proj_residual(a_ptr, w_ptr, x_ptr, st_ptr, xm_ptr, out_ptr, last, next_scale_ptr,
                       bias_ptr, gate_ptr, pid, n_progs, T, wait_ptr, target, do_wait,
                       K: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, NTP: tl.constexpr, STAGES: tl.constexpr,
                       PF: tl.constexpr):
        """x += gate * (a @ W^T + bias) over this program's output tiles (a (T, K) scratch,
        W (D, K)): the first tile's constants loaded before the wait (PF = 1), the others
        after it."""
        n_tiles = (D + BN - 1) // BN
        if PF == 0:
            _wait(wait_ptr, target, do_wait)
        b, g, nsc, w0, w1, w2 = _residual_pre(w_ptr, bias_ptr, gate_ptr, next_scale_ptr,
                                              pid * BN, K, D, BN, BK, 0, pid < n_tiles)
        if PF == 1:
            _wait(wait_ptr, target, do_wait)
        if pid < n_tiles:
            _proj_tile(a_ptr, w_ptr, x_ptr, st_ptr, xm_ptr, out_ptr, last, b, g, nsc, w0, w1,
                       w2, pid * BN, T, K, D, BT, BN, BK, NTP, STAGES)
        for t in range(pid + n_progs, n_tiles, n_progs):
            b, g, nsc, w0, w1, w2 = _residual_pre(w_ptr, bias_ptr, gate_ptr, next_scale_ptr,
                                                  t * BN, K, D, BN, BK, 0, True)
            _proj_tile(a_ptr, w_ptr, x_ptr, st_ptr, xm_ptr, out_ptr, last, b, g, nsc, w0, w1,
                       w2, t * BN, T, K, D, BT, BN, BK, NTP, STAGES)

    @triton.jit
    def _self_attention_head(hh, qkv_ptr, o2_ptr, T, sm_scale, D: tl.constexpr,
                             HD: tl.constexpr, HDP: tl.constexpr, BT: tl.constexpr):
        """Head hh of the self-attention: softmax(q k^T sm_scale) v from the q|k|v scratch
        (BT, 3D) into o (BT, D); every token sees every token."""
        dtype = o2_ptr.dtype.element_ty
        rows = tl.arange(0, BT)
        ds = tl.arange(0, HDP)
        keys = tl.arange(0, BT)
        qm = (rows[:, None] < T) & (ds[None, :] < HD)
        base = qkv_ptr + rows[:, None] * (3 * D) + hh * HD + ds[None, :]
        q = tl.load(base, mask=qm, other=0.0, cache_modifier='.cg')
        k = tl.load(base + D, mask=qm, other=0.0, cache_modifier='.cg')
        v = tl.load(base + 2 * D, mask=qm, other=0.0, cache_modifier='.cg')
        s = tl.dot(q, tl.trans(k)) * sm_scale
        s = tl.where(keys[None, :] < T, s, float('-inf'))
        e = tl.exp(s - tl.max(s, axis=1)[:, None])
        prob = (e / tl.sum(e, axis=1)[:, None]).to(dtype)
        o = tl.dot(prob, v).to(dtype)
        tl.store(o2_ptr + rows[:, None] * D + hh * HD + ds[None, :], o, mask=qm)

    @triton.jit
    def _qkv_pre(t, q_tiles, blk, wq1, bq1, wkv1, bkv1, u_ptr, uv_half, D: tl.constexpr,
                 BNW: tl.constexpr, BKA: tl.constexpr, valid):
        """Tile t of the self-attention q | k | v GEMM (q tiles first, then k | v): its weight
        base, first output row, row count, column in the q|k|v scratch, and the constants of
        `_adaln_pre`."""
        is_kv = t >= q_tiles
        n0 = tl.where(is_kv, t - q_tiles, t) * BNW
        n_rows = tl.where(is_kv, 2 * D, D)
        col0 = tl.where(is_kv, D, 0) + n0
        if is_kv:
            w = wkv1 + blk * 2 * D * D
            bias = bkv1 + blk * 2 * D
            uu = u_ptr + D
        else:
            w = wq1 + blk * D * D
            bias = bq1 + blk * D
            uu = u_ptr + 0
        u, v, b, w0, w1, w2 = _adaln_pre(uu, uu + uv_half, w, bias, n0, n_rows, D, BNW, BKA,
                                         valid)
        return w, n0, n_rows, col0, u, v, b, w0, w1, w2

    @triton.jit
    def _kv_pre(item, blk, k2_ptr, bias_ptr, S, NC, ksb, ksh, kss, HD: tl.constexpr,
                HDP: tl.constexpr, BS: tl.constexpr, valid):
        """The cached keys and the mask bias of one (head, key chunk) item of the
        cross-attention (they depend on no activation: loaded before the wait for q)."""
        h = item // NC
        c = item % NC
        ds = tl.arange(0, HDP)
        ss = c * BS + tl.arange(0, BS)
        km = valid & (ss[:, None] < S) & (ds[None, :] < HD)
        kt = tl.load(k2_ptr + blk * ksb + h * ksh + ss[:, None] * kss + ds[None, :], mask=km,
                     other=0.0)
        bias = tl.load(bias_ptr + ss, mask=valid & (ss < S), other=0.0).to(tl.float32)
        return kt, bias

    @triton.jit
    def _cross_partial(item, blk, kt, bias, q2_ptr, v2_ptr, po_ptr, pm_ptr, pl_ptr, T, S, NC,
                       ksb, ksh, kss, D: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
                       BT: tl.constexpr, BS: tl.constexpr, NCP: tl.constexpr):
        """One (head, 128-key chunk) item of the cross-attention: row max, sum and P V
        (flash-decoding partials), from the keys and bias of `_kv_pre`."""
        dtype = q2_ptr.dtype.element_ty
        h = item // NC
        c = item % NC
        rows = tl.arange(0, BT)
        ds = tl.arange(0, HDP)
        ss = c * BS + tl.arange(0, BS)
        qm = (rows[:, None] < T) & (ds[None, :] < HD)
        q = tl.load(q2_ptr + rows[:, None] * D + h * HD + ds[None, :], mask=qm, other=0.0,
                    cache_modifier='.cg')
        km = (ss[:, None] < S) & (ds[None, :] < HD)
        vt = tl.load(v2_ptr + blk * ksb + h * ksh + ss[:, None] * kss + ds[None, :], mask=km,
                     other=0.0)
        s = tl.dot(q, tl.trans(kt)) + bias[None, :]
        s = tl.where(ss[None, :] < S, s, float('-inf'))
        mx = tl.max(s, axis=1)
        e = tl.exp(s - mx[:, None])
        lsum = tl.sum(e, axis=1)
        o = tl.dot(e.to(dtype), vt)
        slot = (h * NCP + c) * BT
        tl.store(pm_ptr + slot + rows, mx)
        tl.store(pl_ptr + slot + rows, lsum)
        tl.store(po_ptr + (slot + rows[:, None]) * HDP + ds[None, :], o)

    @triton.jit
    def _fc2_half(item, blk, w2, b2, mod, next_mod, act_ptr, x_ptr, st_ptr, xm_ptr, out_ptr,
                  po_ptr, tiles_ptr, last, b, g, nsc, w0, w1, w2c, T, D: tl.constexpr,
                  F: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  NTP: tl.constexpr, S2: tl.constexpr):
        """One half of the fc2 K reduction for one output tile (item = 2 tile + half); the
        later of the two halves adds both and updates x (a + b == b + a: the same bits
        whichever is later). b, g, nsc, w0..w2c from `_residual_pre`."""
        half: tl.constexpr = F // 2
        t = item // 2
        kh = item % 2
        n0 = t * BN
        rows = tl.arange(0, BT)
        cols = tl.arange(0, BN)
        x = _load_x_tile(x_ptr, n0, T, D, BT, BN)
        acc = _linear_pre(act_ptr + kh * half, w2 + blk * D * F + kh * half, w0, w1, w2c, n0,
                          D, T, half, BT, BN, BK, S2, F)
        part = po_ptr + rows[:, None] * D + n0 + cols[None, :]   # (2, BT, D)
        pm = (n0 + cols[None, :] < D) & (rows[:, None] < BT)
        tl.store(part + kh * BT * D, acc, mask=pm)
        tl.debug_barrier()
        old = tl.atomic_add(tiles_ptr + t, 1, sem='acq_rel', scope='gpu')
        if old % 2 == 1:
            other = tl.load(part + (1 - kh) * BT * D, mask=pm, other=0.0, cache_modifier='.cg')
            _gated_residual(x_ptr, st_ptr, xm_ptr, out_ptr, last, acc + other, x, b, g, nsc,
                            n0, T, D, BT, BN, NTP)

    @triton.jit
    def _n_items(p: tl.constexpr, T, NC, D: tl.constexpr, H: tl.constexpr, F: tl.constexpr,
                 BN: tl.constexpr, BNW: tl.constexpr, KS2: tl.constexpr):
        """The number of work items of phase p (tiles, heads, (head, chunk) pairs, ...)."""
        n = (D + BN - 1) // BN                       # 2, 3, 6, 9 (the prologue), 8 (KS2 = 1)
        if p == 0:
            n = (D + BNW - 1) // BNW + (2 * D + BNW - 1) // BNW
        if p == 1:
            n = H
        if p == 4:
            n = H * NC
        if p == 5:
            n = H * T
        if p == 7:
            n = (F + BNW - 1) // BNW
        if p == 8 and KS2 == 2:
            n = 2 * ((D + BN - 1) // BN)
        return n

    @triton.jit
    def _phase(p: tl.constexpr, blk, pid, n_progs, x_ptr, xin_ptr, out_ptr, mod_ptr,
               wq1, bq1, wkv1, bkv1, wo1, bo1, wq2, bq2, wo2, bo2, w1, b1, w2, b2,
               k2_ptr, v2_ptr, bias_ptr, qkv_ptr, q2_ptr, po_ptr, pm_ptr, pl_ptr, o2_ptr,
               act_ptr, st_ptr, xm_ptr, uv_ptr, tiles_ptr, uv_half, n_blocks, T, S, NC, eps,
               sm_scale, ksb, ksh, kss, wait_ptr, target, do_wait,
               D: tl.constexpr, H: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
               F: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, NCP: tl.constexpr,
               BN: tl.constexpr, BNW: tl.constexpr, BK: tl.constexpr, BKA: tl.constexpr,
               NTP: tl.constexpr, S2: tl.constexpr, KS2: tl.constexpr, PF: tl.constexpr):
        """Phase p of block `blk` (see the module docstring), work split over the grid: this
        program's first item's constant operands (weights, biases, cached keys) are loaded,
        then it waits (`_wait(wait_ptr, target, do_wait)`) for the phase's input, then
        computes (PF = 0: waits first). p = 9: the step's prologue (x_in (T, D) in the
        parameter dtype to the float32 x, its row statistics and xm = x * (1 + scale1) of
        block 0; no wait)."""
        dtype = wq1.dtype.element_ty
        mod = mod_ptr + blk * 9 * D      # shift1 scale1 gate1 shift2 scale2 gate2 shift3 ...
        uw = 4 * D + F                   # u / v of one block: self q|k|v, cross q, fc1
        u = uv_ptr + blk * uw
        next_mod = mod_ptr + tl.minimum(blk + 1, n_blocks - 1) * 9 * D
        rows = tl.arange(0, BT)
        if p == 9:      # prologue: the input tokens into the float32 residual stream
            for t in range(pid, (D + BN - 1) // BN, n_progs):
                n0 = t * BN
                ns = n0 + tl.arange(0, BN)
                nm = ns < D
                x = tl.load(xin_ptr + rows[:, None] * D + ns[None, :],
                            mask=(rows[:, None] < T) & nm[None, :], other=0.0).to(tl.float32)
                nsc = tl.load(mod + D + ns, mask=nm, other=0.0).to(tl.float32)
                _store_residual(x_ptr, st_ptr, xm_ptr, out_ptr, 0, x, nsc, n0, T, D, BT, BN,
                                NTP)
        elif p == 0:    # self-attention q | k | v for every head
            q_tiles = (D + BNW - 1) // BNW
            n_tiles = q_tiles + (2 * D + BNW - 1) // BNW
            ns = tl.arange(0, BNW)
            if PF == 0:
                _wait(wait_ptr, target, do_wait)
            wb, n0, n_rows, col0, uu, vv, b, w0, w1_, w2_ = _qkv_pre(
                pid, q_tiles, blk, wq1, bq1, wkv1, bkv1, u, uv_half, D, BNW, BKA, pid < n_tiles)
            if PF == 1:
                _wait(wait_ptr, target, do_wait)
            for t in range(pid, n_tiles, n_progs):
                if t != pid:
                    wb, n0, n_rows, col0, uu, vv, b, w0, w1_, w2_ = _qkv_pre(
                        t, q_tiles, blk, wq1, bq1, wkv1, bkv1, u, uv_half, D, BNW, BKA, True)
                acc = _adaln_finish(xm_ptr, st_ptr, wb, uu, vv, b, w0, w1_, w2_, n0, n_rows, T,
                                    eps, D, BT, BNW, BKA, NTP, S2, BN)
                tl.store(qkv_ptr + rows[:, None] * (3 * D) + col0 + ns[None, :], acc.to(dtype),
                         mask=(rows[:, None] < T) & (ns[None, :] < n_rows - n0))
        elif p == 1:    # self-attention, one head per program -> o (BT, D)
            _wait(wait_ptr, target, do_wait)
            for hh in range(pid, H, n_progs):
                _self_attention_head(hh, qkv_ptr, o2_ptr, T, sm_scale, D, HD, HDP, BT)
        elif p == 2:    # self-attention proj + gated residual
            _proj_residual(o2_ptr, wo1 + blk * D * D, x_ptr, st_ptr, xm_ptr, out_ptr, 0,
                           mod + 4 * D, bo1 + blk * D, mod + 2 * D, pid, n_progs, T, wait_ptr,
                           target, do_wait, D, D, BT, BN, BK, NTP, S2, PF)
        elif p == 3:    # cross-attention queries, pre-scaled
            n_tiles = (D + BN - 1) // BN
            if PF == 0:
                _wait(wait_ptr, target, do_wait)
            uu, vv, b, w0, w1_, w2_ = _adaln_pre(u + 3 * D, u + uv_half + 3 * D,
                                                 wq2 + blk * D * D, bq2 + blk * D, pid * BN, D,
                                                 D, BN, BKA, pid < n_tiles)
            if PF == 1:
                _wait(wait_ptr, target, do_wait)
            for t in range(pid, n_tiles, n_progs):
                if t != pid:
                    uu, vv, b, w0, w1_, w2_ = _adaln_pre(u + 3 * D, u + uv_half + 3 * D,
                                                         wq2 + blk * D * D, bq2 + blk * D,
                                                         t * BN, D, D, BN, BKA, True)
                n0 = t * BN
                ns = n0 + tl.arange(0, BN)
                acc = _adaln_finish(xm_ptr, st_ptr, wq2 + blk * D * D, uu, vv, b, w0, w1_, w2_,
                                    n0, D, T, eps, D, BT, BN, BKA, NTP, S2, BN)
                tl.store(q2_ptr + rows[:, None] * D + ns[None, :], (acc * sm_scale).to(dtype),
                         mask=(rows[:, None] < T) & (ns[None, :] < D))
        elif p == 4:    # cross-attention partials, one (head, key chunk) per program
            if PF == 0:
                _wait(wait_ptr, target, do_wait)
            kt, kb = _kv_pre(pid, blk, k2_ptr, bias_ptr, S, NC, ksb, ksh, kss, HD, HDP, BS,
                             pid < H * NC)
            if PF == 1:
                _wait(wait_ptr, target, do_wait)
            for item in range(pid, H * NC, n_progs):
                if item != pid:
                    kt, kb = _kv_pre(item, blk, k2_ptr, bias_ptr, S, NC, ksb, ksh, kss, HD, HDP,
                                     BS, True)
                _cross_partial(item, blk, kt, kb, q2_ptr, v2_ptr, po_ptr, pm_ptr, pl_ptr, T, S,
                               NC, ksb, ksh, kss, D, HD, HDP, BT, BS, NCP)
        elif p == 5:    # combine the key chunks, one (head, row) per program
            _wait(wait_ptr, target, do_wait)
            ds = tl.arange(0, HDP)
            cs = tl.arange(0, NCP)
            for item in range(pid, H * T, n_progs):
                h = item // T
                r = item % T
                slots = (h * NCP + cs) * BT + r
                cm = cs < NC
                mx = tl.load(pm_ptr + slots, mask=cm, other=float('-inf'), cache_modifier='.cg')
                lsum = tl.load(pl_ptr + slots, mask=cm, other=0.0, cache_modifier='.cg')
                o = tl.load(po_ptr + slots[:, None] * HDP + ds[None, :], mask=cm[:, None],
                            other=0.0, cache_modifier='.cg')
                wgt = tl.where(cm, tl.exp(mx - tl.max(mx, axis=0)), 0.0)
                out = tl.sum(o * wgt[:, None], axis=0) / tl.sum(lsum * wgt, axis=0)
                tl.store(o2_ptr + r * D + h * HD + ds, out.to(dtype), mask=ds < HD)
        elif p == 6:    # cross-attention proj + gated residual
            _proj_residual(o2_ptr, wo2 + blk * D * D, x_ptr, st_ptr, xm_ptr, out_ptr, 0,
                           mod + 7 * D, bo2 + blk * D, mod + 5 * D, pid, n_progs, T, wait_ptr,
                           target, do_wait, D, D, BT, BN, BK, NTP, S2, PF)
        elif p == 7:    # MLP fc1 + exact GELU
            n_tiles = (F + BNW - 1) // BNW
            if PF == 0:
                _wait(wait_ptr, target, do_wait)
            uu, vv, b, w0, w1_, w2_ = _adaln_pre(u + 4 * D, u + uv_half + 4 * D, w1 + blk * F * D,
                                                 b1 + blk * F, pid * BNW, F, D, BNW, BKA,
                                                 pid < n_tiles)
            if PF == 1:
                _wait(wait_ptr, target, do_wait)
            for t in range(pid, n_tiles, n_progs):
                if t != pid:
                    uu, vv, b, w0, w1_, w2_ = _adaln_pre(u + 4 * D, u + uv_half + 4 * D,
                                                         w1 + blk * F * D, b1 + blk * F,
                                                         t * BNW, F, D, BNW, BKA, True)
                n0 = t * BNW
                ns = n0 + tl.arange(0, BNW)
                y = _adaln_finish(xm_ptr, st_ptr, w1 + blk * F * D, uu, vv, b, w0, w1_, w2_, n0,
                                  F, T, eps, D, BT, BNW, BKA, NTP, S2, BN)
                y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
                tl.store(act_ptr + rows[:, None] * F + ns[None, :], y.to(dtype),
                         mask=(rows[:, None] < T) & (ns[None, :] < F))
        else:           # MLP fc2 + gated residual
            if KS2 == 1:
                _proj_residual(act_ptr, w2 + blk * D * F, x_ptr, st_ptr, xm_ptr, out_ptr,
                               blk == n_blocks - 1, next_mod + D, b2 + blk * D, mod + 8 * D,
                               pid, n_progs, T, wait_ptr, target, do_wait, F, D, BT, BN, BK,
                               NTP, S2, PF)
            else:       # K split in two halves (`_fc2_half`)
                half: tl.constexpr = F // 2
                items = 2 * ((D + BN - 1) // BN)
                if PF == 0:
                    _wait(wait_ptr, target, do_wait)
                b, g, nsc, w0, w1_, w2_ = _residual_pre(
                    w2 + blk * D * F + (pid % 2) * half, b2 + blk * D, mod + 8 * D, next_mod + D,
                    (pid // 2) * BN, half, D, BN, BK, F, pid < items)
                if PF == 1:
                    _wait(wait_ptr, target, do_wait)
                for item in range(pid, items, n_progs):
                    if item != pid:
                        b, g, nsc, w0, w1_, w2_ = _residual_pre(
                            w2 + blk * D * F + (item % 2) * half, b2 + blk * D, mod + 8 * D,
                            next_mod + D, (item // 2) * BN, half, D, BN, BK, F, True)
                    _fc2_half(item, blk, w2, b2, mod, next_mod, act_ptr, x_ptr, st_ptr, xm_ptr,
                              out_ptr, po_ptr, tiles_ptr, blk == n_blocks - 1, b, g, nsc, w0,
                              w1_, w2_, T, D, F, BT, BN, BK, NTP, S2)

    @triton.jit
    def _dit_step_kernel(x_ptr, xin_ptr, out_ptr, mod_ptr,
                         wq1, bq1, wkv1, bkv1, wo1, bo1, wq2, bq2, wo2, bo2, w1, b1, w2, b2,
                         k2_ptr, v2_ptr, bias_ptr, qkv_ptr, q2_ptr, po_ptr, pm_ptr, pl_ptr,
                         o2_ptr, act_ptr, st_ptr, xm_ptr, uv_ptr, sync_ptr, uv_half,
                         n_blocks, blk_only, T, S, NC, eps, sm_scale, ksb, ksh, kss,
                         D: tl.constexpr, H: tl.constexpr, HD: tl.constexpr,
                         HDP: tl.constexpr, F: tl.constexpr, BT: tl.constexpr,
                         BS: tl.constexpr, NCP: tl.constexpr, BN: tl.constexpr,
                         BNW: tl.constexpr, BK: tl.constexpr, BKA: tl.constexpr,
                         NTP: tl.constexpr, S2: tl.constexpr, SYNC: tl.constexpr,
                         PF: tl.constexpr, SKIP: tl.constexpr, KS2: tl.constexpr,
                         PHASE: tl.constexpr):
        """PHASE = -1: the prologue (phase 9), then every phase of every block (persistent);
        PHASE = p >= 0: only phase p of block `blk_only` (one launch per phase, no waits).
        Synchronization (sync: int32, zero at launch; counters COUNTER_STRIDE apart): SYNC = 0,
        a grid barrier after every phase (every program arrives at counter 0 and waits for
        all); SYNC = 1, one counter per phase that only the phase's workers arrive at, and a
        phase's workers wait only for the phase before it (which, transitively, waited for
        all earlier ones). After the counters: one per fc2 output tile (KS2 = 2). SKIP = 1
        runs the synchronization alone (benchmarks). x_in: the step's input tokens; out: its
        output (both (T, D), parameter dtype), written by the last block's fc2 phase."""
        pid = tl.program_id(0)
        n_progs = tl.num_programs(0)
        tiles_ptr = sync_ptr + 10 * _CS
        if PHASE >= 0:
            _phase(PHASE, blk_only, pid, n_progs, x_ptr, xin_ptr, out_ptr, mod_ptr, wq1, bq1,
                   wkv1, bkv1, wo1, bo1, wq2, bq2, wo2, bo2, w1, b1, w2, b2, k2_ptr, v2_ptr,
                   bias_ptr, qkv_ptr, q2_ptr, po_ptr, pm_ptr, pl_ptr, o2_ptr, act_ptr, st_ptr,
                   xm_ptr, uv_ptr, tiles_ptr, uv_half, n_blocks, T, S, NC, eps, sm_scale,
                   ksb, ksh, kss, sync_ptr, 0, False, D, H, HD, HDP, F, BT, BS, NCP, BN, BNW,
                   BK, BKA, NTP, S2, KS2, PF)
        else:
            if SKIP == 0:
                _phase(9, 0, pid, n_progs, x_ptr, xin_ptr, out_ptr, mod_ptr, wq1, bq1,
                       wkv1, bkv1, wo1, bo1, wq2, bq2, wo2, bo2, w1, b1, w2, b2, k2_ptr, v2_ptr,
                       bias_ptr, qkv_ptr, q2_ptr, po_ptr, pm_ptr, pl_ptr, o2_ptr, act_ptr,
                       st_ptr, xm_ptr, uv_ptr, tiles_ptr, uv_half, n_blocks, T, S, NC, eps,
                       sm_scale, ksb, ksh, kss, sync_ptr, 0, False, D, H, HD, HDP, F, BT, BS,
                       NCP, BN, BNW, BK, BKA, NTP, S2, KS2, PF)
            n9 = _n_items(9, T, NC, D, H, F, BN, BNW, KS2)
            if SYNC == 0:
                _arrive(sync_ptr, True)
            else:
                _arrive(sync_ptr + 9 * _CS, pid < n9)
            for blk in range(n_blocks):
                for p in tl.static_range(9):
                    items = _n_items(p, T, NC, D, H, F, BN, BNW, KS2)
                    if SYNC == 0:
                        wait_ptr = sync_ptr
                        arrive_ptr = sync_ptr
                        target = (1 + blk * 9 + p) * n_progs
                        works = pid >= 0
                    else:
                        works = pid < items
                        arrive_ptr = sync_ptr + p * _CS
                        if p == 0:      # the prologue before block 0, else the last fc2
                            n8 = _n_items(8, T, NC, D, H, F, BN, BNW, KS2)
                            wait_ptr = sync_ptr + tl.where(blk == 0, 9, 8) * _CS
                            target = tl.where(blk == 0, tl.minimum(n9, n_progs),
                                              blk * tl.minimum(n8, n_progs))
                        else:
                            prev = _n_items(p - 1, T, NC, D, H, F, BN, BNW, KS2)
                            wait_ptr = sync_ptr + (p - 1) * _CS
                            target = (blk + 1) * tl.minimum(prev, n_progs)
                    if SKIP == 0:
                        _phase(p, blk, pid, n_progs, x_ptr, xin_ptr, out_ptr, mod_ptr, wq1,
                               bq1, wkv1, bkv1, wo1, bo1, wq2, bq2, wo2, bo2, w1, b1, w2, b2,
                               k2_ptr, v2_ptr, bias_ptr, qkv_ptr, q2_ptr, po_ptr, pm_ptr,
                               pl_ptr, o2_ptr, act_ptr, st_ptr, xm_ptr, uv_ptr, tiles_ptr,
                               uv_half, n_blocks, T, S, NC, eps, sm_scale, ksb, ksh, kss,
                               wait_ptr, target, works, D, H, HD, HDP, F, BT, BS, NCP, BN, BNW,
                               BK, BKA, NTP, S2, KS2, PF)
                    else:
                        _wait(wait_ptr, target, works)
                    _arrive(arrive_ptr, works)

class FusedDiTStep:
    """Runs every DiT block of one flow step as one persistent kernel launch (after a fill
    that zeroes its barrier counter: two launches per step).

    Args:
        ae: the `ActionExpert` (its blocks' weights are stacked and re-pointed, in place; the
        engine does this at load time, `runtime.serving.ServedActionExpert`).
        phased: one launch per phase instead of grid barriers (interpreter / debugging).
        tiles: overrides of the tile sizes (BN, BNW, BK, BKA, BS, S2), num_warps, num_stages,
            SYNC (0: a grid barrier after every phase; 1: per-phase counters, `_dit_step_kernel`),
            PF (1: each phase's constant operands loaded before its wait; 0: after), SKIP (1:
            barriers only), KS2 (1 or 2: fc2 split-K) (benchmarks).
        phases: with `phased`, run only these phases (benchmarks time them one by one).

    Call: `(x, mod, ctx, tables=None) -> x` with x (1, T, D) in the parameter dtype (the action
    tokens after `embed_actions`), mod (n_blocks, 9, 1, D) one flow step's block modulation,
    ctx an `ActionExpertContext`, tables = `self.tables(mod)` (computed per call if None:
    precompute them once per flow time, as the engine does); returns (1, T, D) in the
    parameter dtype, equal to running the blocks within bf16 rounding. Allocates its scratch
    per call (static memory inside a CUDA graph capture; never read before the kernel writes
    it, tested with NaN-filled scratch). Raises ValueError on other shapes.
    """

    def __init__(self, ae, phased: bool = False, tiles: dict | None = None,
                 phases: tuple[int, ...] = tuple(range(N_PHASES))) -> None:
        cfg = ae.cfg
        self.tiles = dict(BN=TILE_N, BNW=TILE_N_WIDE, BK=TILE_K, BKA=TILE_K_ADALN,
                          BS=KEY_CHUNK, S2=4, SYNC=1, PF=1, SKIP=0, KS2=2, num_warps=4,
                          num_stages=4)
        self.tiles.update(tiles or {})
        self.d, self.h = cfg.hidden_size, cfg.num_heads
        self.hd = self.d // self.h
        self.f = cfg.mlp_hidden
        self.n_blocks = len(ae.blocks)
        self.w = StackedBlockWeights.from_blocks_(ae.blocks)
        self.phased, self.phases = phased, tuple(phases)
        self.sm_scale = self.hd ** -0.5
        self.eps = ae.blocks[0].norm1.eps

    def tables(self, mod: torch.Tensor) -> torch.Tensor:
        """Per-flow-time constants of the LayerNorm-fed GEMMs (see `_adaln_linear`):
        mod (n_blocks, 9, 1, D) -> float32 (2, n_blocks, 4D + F): u = W (1 + scale) and
        v = W shift for the self-attention q|k|v (3D), the cross-attention q (D) and fc1 (F)."""
        m = mod[:, :, 0].float()
        w = self.w
        parts = ((w.wq1, 0), (w.wkv1, 0), (w.wq2, 3), (w.w1, 6))     # (weights, shift index)
        u = torch.cat([torch.matmul(wt.float(), 1.0 + m[:, i + 1, :, None])[..., 0]
                       for wt, i in parts], dim=1)
        v = torch.cat([torch.matmul(wt.float(), m[:, i, :, None])[..., 0] for wt, i in parts],
                      dim=1)
        return torch.stack([u, v]).contiguous()

    def __call__(self, x: torch.Tensor, mod: torch.Tensor, ctx,
                 tables: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        if b != 1 or d != self.d or t > 2 * ROWS:
            raise ValueError(f'x must be (1, T <= {2 * ROWS}, {self.d}), got {tuple(x.shape)}')
        nb, h, hd = self.n_blocks, self.h, self.hd
        keys, values = ctx.keys, ctx.values
        s = keys.shape[-2]
        if keys.shape != (nb, 1, h, s, hd) or mod.shape != (nb, 9, 1, d):
            raise ValueError(f'keys must be ({nb}, 1, {h}, S, {hd}) and mod ({nb}, 9, 1, {d}); '
                             f'got {tuple(keys.shape)} and {tuple(mod.shape)}')
        if values.shape != keys.shape or values.stride() != keys.stride() \
                or keys.stride(-1) != 1:
            raise ValueError(f'keys and values must have one shape and one set of strides, '
                             f'the last dim contiguous; got {tuple(keys.shape)} '
                             f'{keys.stride()} and {tuple(values.shape)} {values.stride()}')
        out_bias = ctx.out_bias
        if out_bias.shape != (nb, d) or out_bias.dtype != x.dtype:
            raise ValueError(f'ctx.out_bias must be ({nb}, {d}) {x.dtype}, got '
                             f'{tuple(out_bias.shape)} {out_bias.dtype}')
        if tables is None:
            tables = self.tables(mod)
        dev, dtype = x.device, x.dtype
        bt = ROWS if t <= ROWS else 2 * ROWS
        hdp = max(16, _next_pow2(hd))
        tiles = dict(self.tiles)
        if self.f % 2:
            tiles['KS2'] = 1          # the split-K fc2 halves the hidden width
        nc = math.ceil(s / tiles['BS'])
        ncp = max(16, _next_pow2(nc))
        # x, xm and the row statistics are written by the kernel's prologue (phase 9), the
        # output by its last fc2 phase: two launches per step (the sync fill, the kernel)
        xs = torch.empty((bt, d), device=dev, dtype=torch.float32)
        xm = torch.empty((bt, d), device=dev, dtype=dtype)
        ntp = _next_pow2(-(-d // tiles['BN']))
        stats = torch.empty((2, ntp, bt), device=dev, dtype=torch.float32)
        out = torch.empty((1, t, d), device=dev, dtype=dtype)
        scratch = dict(
            qkv=torch.empty((bt, 3 * d), device=dev, dtype=dtype),
            q2=torch.empty((bt, d), device=dev, dtype=dtype),
            po=torch.empty((h, ncp, bt, hdp), device=dev, dtype=torch.float32),
            pm=torch.empty((h, ncp, bt), device=dev, dtype=torch.float32),
            pl=torch.empty((h, ncp, bt), device=dev, dtype=torch.float32),
            o2=torch.empty((bt, d), device=dev, dtype=dtype),
            act=torch.empty((bt, self.f), device=dev, dtype=dtype))
        n_progs = torch.cuda.get_device_properties(dev).multi_processor_count \
            if dev.type == 'cuda' else 1
        sync = torch.zeros(10 * COUNTER_STRIDE + ntp, device=dev, dtype=torch.int32)
        w = self.w
        args = (xs, x.contiguous(), out, mod.contiguous(), w.wq1, w.bq1, w.wkv1, w.bkv1, w.wo1,
                w.bo1, w.wq2, w.bq2, w.wo2, out_bias.contiguous(), w.w1, w.b1, w.w2, w.b2, keys,
                values, ctx.mask_bias.reshape(-1), *scratch.values(), stats, xm, tables, sync,
                tables.shape[1] * tables.shape[2])
        tiles['BK'] = min(tiles['BK'], _next_pow2(d))
        tiles['BKA'] = min(tiles['BKA'], _next_pow2(d))
        meta = dict(D=d, H=h, HD=hd, HDP=hdp, F=self.f, BT=bt, NCP=ncp, NTP=ntp, **tiles)
        kv_strides = (keys.stride(0), keys.stride(2), keys.stride(3))    # block, head, key
        if self.phased:
            bnw = tiles['BNW']
            wide = -(-d // bnw) + -(-2 * d // bnw)
            grid = (max(wide, -(-self.f // bnw), -(-d // tiles['BN']), h * nc, h * t),)
            _dit_step_kernel[grid](*args, nb, 0, t, s, nc, self.eps, self.sm_scale, *kv_strides,
                                   PHASE=9, **meta)
            for blk in range(nb):
                for p in self.phases:
                    _dit_step_kernel[grid](*args, nb, blk, t, s, nc, self.eps, self.sm_scale,
                                           *kv_strides, PHASE=p, **meta)
        else:
            grid = (n_progs,)
            _dit_step_kernel[grid](*args, nb, 0, t, s, nc, self.eps, self.sm_scale, *kv_strides,
                                   PHASE=-1, **meta)
        return out
