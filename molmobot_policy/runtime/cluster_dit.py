"""One flow step of the action expert's DiT blocks as one kernel of thread-block clusters
(CUDA C++, Hopper; the source is `cluster_dit.cu` beside this file).

Why: the Triton kernel (`runtime.fused_dit`) splits every block into 9 phases over the whole
grid, and each phase boundary is a grid barrier plus a chain of round trips through L2
(~3.9 us); 9 of them per block-step bound the loop far above its weight traffic
(docs/decisions/fused-dit-kernel.md). Here a block-step has 3 exchanges through global memory
and the rest inside clusters, through distributed shared memory (a cluster barrier costs
~0.25 us against the grid's ~1.1 us plus its round trips; `benchmarks/probe_phase_latency.py`).
Inside a cluster no barrier is left in a block-step: a CTA sends its share of every
broadcast to its peers by bulk copies (the LayerNorm inputs) or `st.async` stores (the
q|k|v, cross q and fc1 outputs, the cross-attention's partials and combined dims), which count
their bytes on the receiver's mbarrier, and the receiver waits for the bytes it needs, not
for every CTA of the cluster to arrive:

- one cluster of 8 CTAs per attention head (8 x 8 = 64 CTAs, one per SM). Every cluster keeps
  its own copy of the float32 residual stream, split by columns over its CTAs; all clusters
  compute the same bits (same inputs, same order of every sum).
- the small parts are recomputed, not exchanged: every cluster forms its LayerNorm inputs
  from its copy of x (row statistics shared inside the cluster), every CTA of a cluster runs
  its head's 16-token self-attention; the cross-attention runs over the head's keys split in
  eighths, its flash-decoding partials combined inside the cluster (each CTA owns 12 of the
  head's 96 dims and sends them, combined, to every peer).
- the three sums over heads (self-attention proj, cross-attention proj, fc2 over each
  cluster's 384 hidden units) go through global memory: CTA (h, r) writes its head's partial
  of output columns [96 r, 96 (r + 1)), and reads the 8 partials of its own columns (from the
  CTAs (*, r), not the whole grid), summed in head order. A partial is its own signal: each
  float carries the parity of its block in its lowest mantissa bit (a relative change of at
  most 2^-23, far below bf16's 2^-8), and the reader polls the values until they carry this
  block's parity, so no counter, fence or block barrier stands between a partial's store
  and its use (the partials are zeroed at launch; the idea of a flag inside the data is
  NCCL's LL protocol, which pairs each 4-byte word with a 4-byte flag instead). It polls in
  rounds, reloading every late value before it looks at any again: one L2 round trip per
  round, where polling a value at a time costs one per late head.
- weights (repacked once at load time into each CTA's stream, in mma fragment order) and the
  cached cross-attention K/V (repacked once per query by one kernel of the library that
  reads each 16-key tile once, `pack_context`) stream into a ring of
  11 shared-memory slots of 12 KB by bulk asynchronous copies (TMA), issued a ring ahead of
  their use: weights never depend on activations. Each warp of a GEMM (and of the scores)
  waits for the slots of its own n-tiles only, and starts as they land. Each block's small
  epilogue operands (scales, gates, biases, the LayerNorm tables of its columns) are copied a
  block ahead.

- a whole Euler step (`ClusterDiTStep.flow_step`, what `ServedActionExpert.flow` serves): the
  kernel also embeds the action tokens from x_t before the blocks, and after them cluster 0
  runs the final layer (its LayerNorm through the same broadcast, the 16 x action_dim x 768
  product on its CTA 0) and the update x_t + dt * velocity in float32, so a flow step is one
  launch with no small kernels around it.

The math is the Triton kernel's (`runtime.fused_dit` module docstring): float32 residual,
LayerNorms applied in the GEMM epilogues through the per-flow-time tables u = W (1 + scale),
v = W shift (`FusedDiTStep.tables`), bf16 GEMM operands with float32 accumulation, exact erf
GELU. No float atomics: a replay gives the same bits.

Served by default where it can serve (`fused_action_expert: auto`, else the Triton kernel
with a log line saying why; `cluster` requires it; docs/decisions/cluster-dit-kernel.md).
Limits (`unavailable_reason` names the one that fails): the model's sizes compiled into the
kernel (hidden 768, 8 heads, MLP 3072), at most 16 action tokens (`states_mode: cross_attn`
at horizon 16), bf16, an sm_90 GPU with room for 8 resident clusters of 8 (the grid waits on
itself: all 64 CTAs must be resident), and nvcc to build the kernel library (built and
tested with CUDA 13.0; the library links nvcc's CUDA runtime statically, so its version need
not match torch's, only the driver must support it): a plain shared library with a
C interface, no torch headers, called through ctypes (`Library`); built on first use in
~10-20 s and cached per source digest under `build_directory()` (`library_path()`;
`python -m molmobot_policy.runtime.cluster_dit` builds it ahead). A context outside
128..2048 keys in multiples of 16 runs through the Triton kernel at call time.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import math
import os
import shutil
import subprocess
import sys
import threading

import torch

log = logging.getLogger(__name__)

D, H, HD, F, R = 768, 8, 96, 3072, 8       # the sizes compiled into cluster_dit.cu
CW, FH = D // R, F // H                     # residual columns per CTA, hidden units per head
MAX_TOKENS = 16
SLOT_E = 6144                               # bf16 elements of one 12 KB ring slot
WSLOTS = 23                                 # weight slots per (block, head, rank)
GROUPS_PER_SLOT = 4                         # 16-key groups of K (or V) per slot
MAX_KV_SLOTS = 4
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'cluster_dit.cu')
_EXT_NAME = 'molmobot_cluster_dit'          # a benchmark renames another copy's (its baseline)
_ext = None
_ext_error = ''


def pack_b(w: torch.Tensor) -> torch.Tensor:
    """(..., N, K) -> (..., N / 8, K / 16, 32, 4): the B operand of mma.m16n8k16 (row.col) in
    fragment order, so that lane l of a warp reads its two registers as 8 contiguous bytes.
    Lane l = 4 g + t holds W[8 n + g, 16 s + 2 t + e] (e = 0, 1: register b0) and
    W[8 n + g, 16 s + 8 + 2 t + e] (b1) of n-tile n and k-step s (PTX ISA, "Matrix fragments
    for mma.m16n8k16"). N a multiple of 8, K of 16."""
    *lead, n, k = w.shape
    x = w.reshape(*lead, n // 8, 8, k // 16, 2, 4, 2)        # [nt, g, ks, half, t, e]
    nd = len(lead)
    x = x.permute(*range(nd), nd, nd + 2, nd + 1, nd + 4, nd + 3, nd + 5)
    return x.reshape(*lead, n // 8, k // 16, 32, 4)


def _split(n: int, r: int) -> tuple[int, int]:
    """CTA r's share [start, start + count) of n items over R ranks (as the kernel splits)."""
    start = r * n // R
    return start, (r + 1) * n // R - start


def pack_weights(w) -> torch.Tensor:
    """`fused_dit.StackedBlockWeights` -> (n_blocks, H, R, WSLOTS * SLOT_E) bf16: each CTA's
    weight stream of one block, in the order the kernel consumes it (slots of SLOT_E):
    q|k|v (5 slots: its 4 or 5 of the head's 36 n-tiles), self proj (2; 1.5 used), cross q
    (2: 1 or 2 of the head's 12 n-tiles), cross proj (2), fc1 (6), fc2 (6)."""
    nb = w.wq1.shape[0]
    out = torch.zeros(nb, H, R, WSLOTS, SLOT_E, dtype=w.wq1.dtype, device=w.wq1.device)
    qkv = pack_b(torch.cat([w.wq1.view(nb, H, HD, D), w.wkv1[:, :D].reshape(nb, H, HD, D),
                            w.wkv1[:, D:].reshape(nb, H, HD, D)], dim=2))
    qkv = qkv.reshape(nb, H, 3 * HD // 8, SLOT_E)             # one n-tile per slot
    q2 = pack_b(w.wq2.view(nb, H, HD, D)).reshape(nb, H, HD // 8, SLOT_E)
    for r in range(R):
        j0, nt = _split(3 * HD // 8, r)
        out[:, :, r, 0:nt] = qkv[:, :, j0:j0 + nt]
        q0, nq = _split(HD // 8, r)
        out[:, :, r, 7:7 + nq] = q2[:, :, q0:q0 + nq]
    flat = out.view(nb, H, R, WSLOTS * SLOT_E)

    def proj(wo):            # (nb, D out, D in): rows r*96 + n, columns h*96 + k
        return pack_b(wo.view(nb, R, CW, H, HD).permute(0, 3, 1, 2, 4)).reshape(nb, H, R, -1)

    o1, o2 = proj(w.wo1), proj(w.wo2)                          # 9216 elements each
    flat[..., 5 * SLOT_E:5 * SLOT_E + o1.shape[-1]] = o1
    flat[..., 9 * SLOT_E:9 * SLOT_E + o2.shape[-1]] = o2
    flat[..., 11 * SLOT_E:17 * SLOT_E] = pack_b(w.w1.view(nb, H, R, FH // R, D)).reshape(
        nb, H, R, -1)
    flat[..., 17 * SLOT_E:23 * SLOT_E] = pack_b(
        w.w2.view(nb, R, CW, H, FH).permute(0, 3, 1, 2, 4)).reshape(nb, H, R, -1)
    return flat


def pack_context(keys: torch.Tensor, values: torch.Tensor, ext=None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached cross-attention K/V (n_blocks, 1, H, S, HD) (any strides) -> (n_blocks, H,
    S * HD) each, in the kernel's fragment order: keys as the B operand of q K^T (n-tiles of 8
    keys, k-steps over the head dim), values as the B operand of P V, k-step (16 keys) major so
    that each CTA's eighth of the keys is one contiguous range. With `ext` (the loaded
    library) and bf16 CUDA tensors whose head dim is contiguous, one kernel reads each tile
    once and writes both outputs (`pack_context_kernel` in cluster_dit.cu); else torch's
    permute copies (a few passes over the 2 x 92 MB of the full-size model)."""
    nb, _, h, s, hd = keys.shape
    if ext is not None and _packable(keys, values):
        kp = torch.empty((nb, h, s * hd), device=keys.device, dtype=keys.dtype)
        vp = torch.empty_like(kp)
        ext.pack_context(keys, values, kp, vp)
        return kp, vp
    kp = pack_b(keys[:, 0]).reshape(nb, h, s * hd)
    vp = pack_b(values[:, 0].transpose(-1, -2))                # (nb, h, hd/8, s/16, 32, 4)
    vp = vp.permute(0, 1, 3, 2, 4, 5).reshape(nb, h, s * hd)
    return kp, vp


def _packable(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the library's pack kernel takes these K/V: bf16 on CUDA, (nb, 1, H, S, HD),
    S % 16 == 0, the same strides, the head dim contiguous, rows 16-byte aligned."""
    st = keys.stride()
    return (keys.is_cuda and keys.dtype == values.dtype == torch.bfloat16
            and keys.shape == values.shape and keys.shape[1] == 1 and keys.shape[2] == H
            and keys.shape[4] == HD and keys.shape[3] % 16 == 0 and st == values.stride()
            and st[4] == 1 and st[0] % 8 == 0 and st[2] % 8 == 0 and st[3] % 8 == 0
            and keys.data_ptr() % 16 == 0 and values.data_ptr() % 16 == 0)


NVCC_FLAGS = ('-O3', '-std=c++17', '-gencode=arch=compute_90a,code=sm_90a', '-shared',
              '-Xcompiler', '-fPIC')         # the CUDA runtime is linked statically (nvcc's default)
BUILD_TIMEOUT_S = 600.0


def build_directory() -> str:
    """Where the built kernel library is cached: MOLMOBOT_KERNEL_CACHE, else
    $XDG_CACHE_HOME/molmobot_policy (default ~/.cache/molmobot_policy)."""
    root = os.environ.get('MOLMOBOT_KERNEL_CACHE')
    if root:
        return root
    cache = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return os.path.join(cache, 'molmobot_policy')


def library_path() -> str:
    """The library built from this source with these flags: one file per source digest, so
    an edited kernel is rebuilt and never mixed up with an older build."""
    digest = hashlib.sha256()
    with open(_SOURCE, 'rb') as f:
        digest.update(f.read())
    digest.update(' '.join(NVCC_FLAGS).encode())
    return os.path.join(build_directory(), f'{_EXT_NAME}-{digest.hexdigest()[:16]}.so')


def find_nvcc() -> str | None:
    """nvcc's path: under torch's CUDA_HOME (`torch.utils.cpp_extension`: CUDA_HOME or
    CUDA_PATH, else nvcc on the PATH, else /usr/local/cuda), else on the PATH; None if none."""
    from torch.utils import cpp_extension
    if cpp_extension.CUDA_HOME:
        nvcc = os.path.join(cpp_extension.CUDA_HOME, 'bin', 'nvcc')
        if os.access(nvcc, os.X_OK):
            return nvcc
    return shutil.which('nvcc')


def build(path: str, nvcc: str) -> None:
    """Compiles cluster_dit.cu into the shared library `path` (~10-20 s). nvcc writes a file
    of its own beside `path`, renamed into place when complete: a reader sees a whole library
    or none, and builds racing in several processes each finish with a whole library (no
    lock to go stale). Raises RuntimeError with the end of nvcc's output when it fails."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f'{path}.{os.getpid()}.{threading.get_ident()}.tmp'
    try:
        done = subprocess.run([nvcc, *NVCC_FLAGS, '-o', tmp, _SOURCE], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f'nvcc exited with {done.returncode}: '
                               f'{(done.stderr or done.stdout).strip()[-300:]}')
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@dataclasses.dataclass
class FlowArgs:
    """What the kernel needs to run a whole flow step (`ClusterDiTStep.flow_step`): x_t in and
    out (T, A) float32; action_embed's weight (D, A) and bias (D), the position embedding's
    first T rows (T, D); the final linear's weight (A, D) and bias (A), the final layer's
    modulation (2, D) (shift, scale) and its LayerNorm table (2, A) float32 (u = W (1 +
    scale), v = W shift); dt = 1 / flow steps."""
    xt_in: torch.Tensor
    xt_out: torch.Tensor
    w_emb: torch.Tensor
    b_emb: torch.Tensor
    pos: torch.Tensor
    w_fin: torch.Tensor
    b_fin: torch.Tensor
    mod_fin: torch.Tensor
    tab_fin: torch.Tensor
    dt: float


class Library:
    """The kernel library through ctypes (the C functions at the end of cluster_dit.cu). The
    C side trusts its arguments; these methods check them first (ValueError naming the
    tensor), and raise RuntimeError with CUDA's message where a call fails."""

    def __init__(self, path: str) -> None:
        c = ctypes
        lib = c.CDLL(path)
        lib.cdit_error_string.argtypes, lib.cdit_error_string.restype = [c.c_int], c.c_char_p
        lib.cdit_constants.argtypes = [c.POINTER(c.c_longlong), c.c_int]
        lib.cdit_max_active_clusters.argtypes = [c.c_int, c.POINTER(c.c_int)]
        lib.cdit_step.argtypes = [c.c_int, c.c_void_p, c.POINTER(c.c_void_p),
                                  c.POINTER(c.c_longlong), c.POINTER(c.c_float)]
        lib.cdit_pack_context.argtypes = [c.c_int, c.c_void_p] + [c.c_void_p] * 4 + [
            c.c_longlong] * 3 + [c.c_int] * 2
        for name in ('cdit_constants', 'cdit_max_active_clusters', 'cdit_step',
                     'cdit_pack_context'):
            getattr(lib, name).restype = c.c_int
        self.lib = lib

    def _check(self, error: int, what: str) -> None:
        if error:
            message = self.lib.cdit_error_string(error).decode(errors='replace')
            raise RuntimeError(f'cluster DiT kernel: {what} failed: {message} ({error})')

    def constants(self) -> list[int]:
        """D, H, HD, F, R, MR, SLOT_E, WSLOTS, GROUPS_PER_SLOT, MAX_KV_SLOTS, SMEM_BYTES as
        compiled."""
        out = (ctypes.c_longlong * 11)()
        self._check(self.lib.cdit_constants(out, 11), 'constants')
        return list(out)

    def max_active_clusters(self, device: torch.device) -> int:
        """Clusters of the kernel resident at once on `device` (H are needed)."""
        n = ctypes.c_int(0)
        self._check(self.lib.cdit_max_active_clusters(_index(device), ctypes.byref(n)),
                    'the occupancy query')
        return n.value

    def step(self, x_in, out, mod, tables, wp, bq1, bkv1, bo1, bq2, bo2, b1, b2, kp, vp,
             mask_bias, part, trace, T: int, S: int, nb: int, nkv: int, prefetch: int,
             mode: int, eps: float, sm_scale: float, flow: FlowArgs | None = None) -> None:
        """One launch of the kernel (after zeroing `part`) on the current stream of out's
        device; the tensors as `cdit::Params` in cluster_dit.cu describes them. With `flow`
        the whole flow step (x_in unused: the tokens come from flow.xt_in)."""
        named = dict(out=out, mod=mod, wp=wp, bq1=bq1, bkv1=bkv1, bo1=bo1, bq2=bq2,
                     bo2=bo2, b1=b1, b2=b2, kp=kp, vp=vp, mask_bias=mask_bias)
        dev = out.device
        if flow is None:
            named['x_in'] = x_in
        else:
            named.update(w_emb=flow.w_emb, b_emb=flow.b_emb, pos=flow.pos, w_fin=flow.w_fin,
                         b_fin=flow.b_fin, mod_fin=flow.mod_fin)
            for name in ('xt_in', 'xt_out', 'tab_fin'):
                _require(getattr(flow, name), name, torch.float32, dev)
            a = flow.w_fin.shape[0]
            if not (1 <= a <= 16 and flow.xt_in.numel() == flow.xt_out.numel() == T * a
                    and flow.w_emb.numel() == D * a and flow.pos.numel() == T * D
                    and flow.mod_fin.numel() == 2 * D and flow.tab_fin.numel() == 2 * a):
                raise ValueError(f'flow step tensors do not fit T={T}, action_dim={a}: '
                                 f'xt {tuple(flow.xt_in.shape)}, pos {tuple(flow.pos.shape)}')
        for name, t in named.items():
            _require(t, name, torch.bfloat16, dev)
        _require(tables, 'tables', torch.float32, dev)
        _require(part, 'part', torch.float32, dev)
        if part.numel() != 3 * H * MAX_TOKENS * D:
            raise ValueError(f'part must be (3, {H}, {MAX_TOKENS}, {D}), got {tuple(part.shape)}')
        if trace is not None:
            _require(trace, 'trace', torch.int64, dev)
        if not (1 <= T <= MAX_TOKENS and S % 16 == 0 and 1 <= nkv <= MAX_KV_SLOTS):
            raise ValueError(f'T={T}, S={S} or nkv={nkv} out of range')
        ptrs = [t.data_ptr() for t in (
            out, mod, tables, wp, bq1, bkv1, bo1, bq2, bo2, b1, b2, kp, vp, mask_bias, part)]
        ptrs = [None if flow is not None else x_in.data_ptr()] + ptrs + [
            trace.data_ptr() if trace is not None else None]
        if flow is None:
            ptrs += [None] * 9
            a, dt = 0, 0.0
        else:
            ptrs += [t.data_ptr() for t in (flow.xt_in, flow.xt_out, flow.w_emb, flow.b_emb,
                                            flow.pos, flow.w_fin, flow.b_fin, flow.mod_fin,
                                            flow.tab_fin)]
            a, dt = flow.w_fin.shape[0], flow.dt
        ptrs = (ctypes.c_void_p * 26)(*ptrs)
        ints = (ctypes.c_longlong * 7)(T, S, nb, nkv, prefetch, mode, a)
        floats = (ctypes.c_float * 3)(eps, sm_scale, dt)
        self._check(self.lib.cdit_step(_index(dev), _stream(dev), ptrs, ints, floats),
                    'the step launch')

    def pack_context(self, keys, values, kp, vp) -> None:
        """keys / values (nb, 1, H, S, HD) as `_packable` takes them -> kp, vp (nb, H, S * HD)
        contiguous, on the current stream."""
        if not _packable(keys, values):
            raise ValueError('keys / values: bf16 CUDA (nb, 1, H, S, HD), S % 16 == 0, the '
                             'same strides, the head dim contiguous, the others multiples of 8')
        nb, s = keys.shape[0], keys.shape[3]
        for name, t in (('kp', kp), ('vp', vp)):
            _require(t, name, torch.bfloat16, keys.device)
            if t.numel() != nb * H * s * HD:
                raise ValueError(f'{name} must be ({nb}, {H}, {s * HD}), got {tuple(t.shape)}')
        st = keys.stride()
        self._check(self.lib.cdit_pack_context(
            _index(keys.device), _stream(keys.device), keys.data_ptr(), values.data_ptr(),
            kp.data_ptr(), vp.data_ptr(), st[0], st[2], st[3], nb, s), 'the K/V repack')


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _require(t: torch.Tensor, name: str, dtype: torch.dtype, device: torch.device) -> None:
    if not (t.device == device and t.dtype == dtype and t.is_contiguous()):
        raise ValueError(f'{name} must be a contiguous {dtype} tensor on {device}, got '
                         f'{t.dtype} on {t.device}' + ('' if t.is_contiguous()
                                                        else ' (not contiguous)'))


def load_extension() -> Library | None:
    """The kernel library (built with nvcc on first use, ~10-20 s, then loaded from
    `library_path()`), or None with the reason in `_ext_error` (logged once)."""
    global _ext, _ext_error
    if _ext is not None or _ext_error:
        return _ext
    nvcc = None
    if torch.version.cuda is None:
        _ext_error = (f'this torch ({torch.__version__}) is built without CUDA (the kernel '
                      'needs a CUDA build of torch and a Hopper GPU)')
    elif (nvcc := find_nvcc()) is None:
        _ext_error = 'nvcc not found (no CUDA toolkit: set CUDA_HOME or put nvcc on the PATH)'
    if _ext_error:
        log.warning('cluster DiT kernel: %s', _ext_error)
        return None
    path = library_path()
    try:
        if not os.path.exists(path):
            log.info('cluster DiT kernel: building %s with %s (~10-20 s, once)', path, nvcc)
            build(path, nvcc)
        lib = Library(path)
        compiled = lib.constants()
        expected = [D, H, HD, F, R, MAX_TOKENS, SLOT_E, WSLOTS, GROUPS_PER_SLOT, MAX_KV_SLOTS]
        if compiled[:10] != expected:
            raise RuntimeError(f'{path} holds sizes {compiled[:10]}, this module {expected}')
        _ext = lib
    except Exception as exc:  # noqa: BLE001 - any build failure means: serve the fallback
        _ext_error = f'the kernel library did not build or load: {type(exc).__name__}: {exc}'
        log.warning('cluster DiT kernel: %s', _ext_error)
    return _ext


def unavailable_reason(ae, device: torch.device, dtype: torch.dtype, context: int | None = None
                       ) -> str:
    """'' when the cluster kernel can serve this action expert, else why not (for a log line).
    context: the cross-attention key count S, when known (other counts run through the Triton
    kernel at call time)."""
    if device.type != 'cuda':
        return f'needs a CUDA device, serving on {device}'
    major, _ = torch.cuda.get_device_capability(device)
    if major != 9:
        return f'needs an sm_90 (Hopper) GPU, got compute capability {major}.x'
    if dtype != torch.bfloat16:
        return f'needs bfloat16 weights, got {dtype}'
    cfg = ae.cfg
    if (cfg.hidden_size, cfg.num_heads, cfg.mlp_hidden) != (D, H, F):
        return (f'compiled for hidden {D}, {H} heads, MLP {F}; the model has '
                f'{cfg.hidden_size}, {cfg.num_heads}, {cfg.mlp_hidden}')
    tokens = ae.horizon + (1 if ae.states_mode == 'self_attn' else 0)
    if tokens > MAX_TOKENS:
        return f'{tokens} action tokens; the kernel handles at most {MAX_TOKENS}'
    if context is not None and not (128 <= context <= 2048 and context % 16 == 0):
        return f'context of {context} keys; the kernel handles 128 to 2048 in multiples of 16'
    from molmobot_policy.runtime import fused_dit
    triton = fused_dit.unavailable_reason(ae, device, dtype)
    if triton:                              # its fallback for other shapes
        return f'the Triton kernel (its fallback) cannot serve: {triton}'
    ext = load_extension()
    if ext is None:
        return _ext_error
    resident = ext.max_active_clusters(device)
    if resident < H:
        return f'{resident} clusters of {R} fit on this GPU at once, {H} are needed'
    return ''


class ClusterDiTStep:
    """Runs every DiT block of one flow step as one launch of the cluster kernel (after a
    memset of its head partials).

    Args:
        ae: the `ActionExpert`; its blocks' weights are stacked in place
            (`fused_dit.StackedBlockWeights`) and repacked into a second copy (~0.65 GB for
            the 36 x 768 expert) in the kernel's stream order.
        prefetch: also prefetch into L2 the stream item this many slots ahead of each one
            issued (0: off).
        mode: benchmarks only (wrong outputs): bit 0 streams nothing, bit 1 skips the waits
            of the exchanges through global memory.

    Call: `(x, mod, ctx, tables=None) -> x` as `fused_dit.FusedDiTStep` (x (1, T <= 16, 768)
    bf16, mod (n_blocks, 9, 1, 768), ctx an `ActionExpertContext`, tables from `tables(mod)`);
    the K/V are repacked on the first call with a new ctx (`pack_context`; the flow steps of
    one query share it). More than 16 tokens, or a context outside 128..2048 keys in
    multiples of 16, run through the Triton kernel (`fused_dit.FusedDiTStep`, same tables).
    Raises ValueError on other shapes, RuntimeError where the kernel library is unavailable.
    """

    def __init__(self, ae, prefetch: int = 0, mode: int = 0) -> None:
        from molmobot_policy.runtime import fused_dit
        self.ae = ae
        self.action_dim = ae.action_embed.in_features
        self.base = fused_dit.FusedDiTStep(ae)          # stacked weights and the tables
        self.n_blocks = self.base.n_blocks
        self.prefetch, self.mode = int(prefetch), int(mode)
        self.trace = None       # set to an int64 (64, n_blocks, 24) tensor: clock64 stamps
        self.ext = load_extension()
        if self.ext is None:
            raise RuntimeError(f'cluster DiT kernel unavailable: {_ext_error}')
        with torch.no_grad():
            self.wp = pack_weights(self.base.w)
        self._ctx = None
        self._packed = None

    def tables(self, mod: torch.Tensor) -> torch.Tensor:
        return self.base.tables(mod)

    def packed_context(self, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        if ctx is not self._ctx:
            self._packed = pack_context(ctx.keys, ctx.values, self.ext)
            self._ctx = ctx
        return self._packed

    def __call__(self, x: torch.Tensor, mod: torch.Tensor, ctx,
                 tables: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        s = ctx.keys.shape[-2]
        if tables is None:
            tables = self.tables(mod)
        if t > MAX_TOKENS or not (128 <= s <= 2048 and s % 16 == 0):
            return self.base(x, mod, ctx, tables)      # the Triton kernel serves these shapes
        if b != 1 or d != D or x.dtype != torch.bfloat16:
            raise ValueError(f'x must be (1, T, {D}) bfloat16, got {tuple(x.shape)} {x.dtype}')
        out = torch.empty((1, t, D), device=x.device, dtype=x.dtype)
        self._launch(x.contiguous(), out, t, mod, ctx, tables, None)
        return out

    def flow_reason(self, horizon: int, context: int, batch: int = 1) -> str:
        """'' when `flow_step` serves `batch` queries of this action horizon and context length
        (keys), else why not: the whole step runs one query (batch 1) and needs `states_mode:
        cross_attn` (the tokens are the actions alone), horizon and action_dim <= 16 and a
        context the kernel takes."""
        ae = self.ae
        if batch != 1:
            return f'a batch of {batch} queries (the flow step runs one)'
        if ae.states_mode != 'cross_attn':
            return f"states_mode {ae.states_mode!r} (the flow step needs 'cross_attn')"
        if horizon > MAX_TOKENS or self.action_dim > 16:
            return f'horizon {horizon} / action_dim {self.action_dim}: at most 16 each'
        if not (128 <= context <= 2048 and context % 16 == 0):
            return f'context of {context} keys; the kernel handles 128 to 2048 in multiples of 16'
        return ''

    def final_tables(self, final_mod: torch.Tensor) -> torch.Tensor:
        """The final layer's modulation (2, 1, D) (shift, scale) -> its LayerNorm table (2, A)
        float32: u = W (1 + scale), v = W shift (as `tables` for the blocks)."""
        w = self.ae.final_layer.linear.weight.float()
        m = final_mod.reshape(2, D).float()
        return torch.stack([w @ (1.0 + m[1]), w @ m[0]]).contiguous()

    def flow_step(self, xt: torch.Tensor, mod: torch.Tensor, final_mod: torch.Tensor, ctx,
                  dt: float, tables: torch.Tensor | None = None,
                  final_tables: torch.Tensor | None = None) -> torch.Tensor:
        """One Euler step of the flow in one launch, on xt's CUDA device and current stream: xt
        (1, horizon, A) float32 -> xt + dt * velocity (same shape, float32), the velocity of
        `ActionExpert.velocity_from_conditioning` (the action embedding, every block, the final
        layer) as `euler_flow` adds it. mod (n_blocks, 9, 1, D) and final_mod (2, 1, D): the
        flow time's modulation, bf16 (`ActionExpert.time_conditioning`); ctx: the served
        context (bf16 K/V, `ServedActionExpert.context`); tables: `tables(mod)` (2, n_blocks,
        4 D + F) float32 and final_tables: `final_tables(final_mod)` (2, A) float32, computed
        here when None. The sums run in the kernel's order and the final layer's LayerNorm
        goes through its table, so the result is within bf16 rounding of the separate path,
        not bit-equal. Raises ValueError where `flow_reason` names a reason or a tensor has
        another shape, dtype or device; RuntimeError if the launch fails (CUDA's message)."""
        b, t, a = xt.shape
        if b != 1 or xt.dtype != torch.float32 or a != self.action_dim:
            raise ValueError(f'xt must be (1, T, {self.action_dim}) float32, got '
                             f'{tuple(xt.shape)} {xt.dtype}')
        reason = self.flow_reason(t, ctx.keys.shape[-2], b)
        if reason:
            raise ValueError(f'the whole-step kernel cannot take this query: {reason}')
        if tuple(final_mod.shape) != (2, 1, D):
            raise ValueError(f'final_mod must be (2, 1, {D}), got {tuple(final_mod.shape)}')
        if tables is None:
            tables = self.tables(mod)
        if final_tables is None:
            final_tables = self.final_tables(final_mod)
        ae = self.ae
        xt_out = torch.empty_like(xt)
        out = torch.empty((1, t, D), device=xt.device, dtype=torch.bfloat16)
        flow = FlowArgs(xt.contiguous(), xt_out, ae.action_embed.weight, ae.action_embed.bias,
                        ae.action_pos_embed[0, :t], ae.final_layer.linear.weight,
                        ae.final_layer.linear.bias, final_mod.reshape(2, D), final_tables,
                        float(dt))
        self._launch(None, out, t, mod, ctx, tables, flow)
        return xt_out

    def _launch(self, x, out, t: int, mod, ctx, tables, flow: FlowArgs | None) -> None:
        nb = self.n_blocks
        keys = ctx.keys
        s = keys.shape[-2]
        if keys.shape != (nb, 1, H, s, HD) or mod.shape != (nb, 9, 1, D) \
                or ctx.values.shape != keys.shape:
            raise ValueError(f'keys / values must be ({nb}, 1, {H}, S, {HD}) and mod '
                             f'({nb}, 9, 1, {D}); got {tuple(keys.shape)}, '
                             f'{tuple(ctx.values.shape)} and {tuple(mod.shape)}')
        mask = ctx.mask_bias.reshape(-1)
        if mask.numel() != s:
            raise ValueError(f'ctx.mask_bias must hold one value per key ({s}), got '
                             f'{tuple(ctx.mask_bias.shape)}')
        kp, vp = self.packed_context(ctx)
        groups = math.ceil(s // 16 / R)
        nkv = math.ceil(groups / GROUPS_PER_SLOT)
        part = torch.empty((3, H, 16, D), device=out.device, dtype=torch.float32)
        w = self.base.w
        self.ext.step(x, out, mod.contiguous(), tables, self.wp, w.bq1, w.bkv1,
                      w.bo1, w.bq2, ctx.out_bias.contiguous(), w.b1, w.b2, kp, vp,
                      mask.contiguous(), part, self.trace, t, s, nb, nkv,
                      self.prefetch, self.mode, self.base.eps, self.base.sm_scale, flow)


def main() -> int:
    """`python -m molmobot_policy.runtime.cluster_dit`: builds the kernel now (or finds it
    built) and says where, or why it cannot; exit status 0 or 1. For a set-up step, so that
    the node's first configure does not spend the build (~10-20 s)."""
    import argparse
    argparse.ArgumentParser(prog='python -m molmobot_policy.runtime.cluster_dit',
                            description=main.__doc__.split(':', 1)[1].strip()).parse_args()
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    if load_extension() is None:            # (the reason is logged)
        return 1
    print(f'cluster DiT kernel ready: {library_path()}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
