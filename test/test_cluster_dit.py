"""The cluster DiT kernel's host side on the CPU (runtime/cluster_dit.py): the weights and the
cross-attention K/V in the mma fragment order the kernel reads, each CTA's stream holding the
rows and columns of its share, the reasons it does not serve, and a torch model of the
kernel's schedule (its split of the work over the CTAs, read from the packed streams) against
the float32 blocks. The kernel itself runs on the GPU (test_cluster_dit_gpu.py)."""
from __future__ import annotations

import dataclasses
import os
import types

import pytest
import torch

from molmobot_policy.model import action_expert as ae_mod
from molmobot_policy.model import checkpoint as ckpt
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.runtime import cluster_dit as cd
from molmobot_policy.runtime import fused_dit

from _mma_fragments import fragment  # noqa: E402  (test/_mma_fragments.py: the ISA's layout)

D, F, HD = cd.D, cd.F, cd.HD


def test_pack_b_puts_every_lanes_fragment_in_its_8_bytes():
    w = torch.randn(24, 48)
    packed = cd.pack_b(w)
    assert packed.shape == (3, 3, 32, 4)
    for n in range(3):
        for s in range(3):
            for lane in range(32):
                assert torch.equal(packed[n, s, lane], fragment(w, n, s, lane))


@pytest.fixture(scope='module')
def stacked():
    nb = 2
    g = torch.Generator().manual_seed(0)
    shapes = dict(wq1=(D, D), wkv1=(2 * D, D), wo1=(D, D), wq2=(D, D), wo2=(D, D), w1=(F, D),
                  w2=(D, F))
    w = types.SimpleNamespace(**{k: torch.randn(nb, *s, generator=g) for k, s in shapes.items()})
    return w, cd.pack_weights(w)


@pytest.mark.parametrize('h, r', [(0, 0), (3, 1), (7, 6)])
def test_each_ctas_stream_holds_its_share_of_the_block(stacked, h, r):
    """Slot by slot (cluster_dit.cu's item order): q|k|v n-tiles of head h (4 or 5 of 36),
    the self proj's columns of head h for output columns [96 r, 96 r + 96), cross q n-tiles
    (1 or 2 of 12), the cross proj likewise, fc1 rows of hidden units [384 h + 48 r, +48), fc2
    columns of the cluster's 384 hidden units for output columns [96 r, +96)."""
    w, wp = stacked
    b = 1
    slot = cd.SLOT_E
    stream = wp[b, h, r]
    assert stream.shape == (cd.WSLOTS * slot,)
    heads = torch.cat([w.wq1[b, h * HD:(h + 1) * HD], w.wkv1[b, h * HD:(h + 1) * HD],
                       w.wkv1[b, D + h * HD:D + (h + 1) * HD]])
    j0, nt = cd._split(36, r)
    assert nt in (4, 5)
    for i in range(5):
        got = stream[i * slot:(i + 1) * slot]
        if i < nt:
            assert torch.equal(got, cd.pack_b(heads[8 * (j0 + i):8 * (j0 + i + 1)]).reshape(-1))
        else:
            assert not got.any()                 # never copied: zero bytes in its item
    cols = slice(96 * r, 96 * (r + 1))
    o1 = cd.pack_b(w.wo1[b, cols, h * HD:(h + 1) * HD]).reshape(-1)
    assert torch.equal(stream[5 * slot:5 * slot + o1.numel()], o1)
    q0, nq = cd._split(12, r)
    for i in range(nq):
        expected = cd.pack_b(w.wq2[b, h * HD + 8 * (q0 + i):h * HD + 8 * (q0 + i + 1)])
        assert torch.equal(stream[(7 + i) * slot:(8 + i) * slot], expected.reshape(-1))
    o2 = cd.pack_b(w.wo2[b, cols, h * HD:(h + 1) * HD]).reshape(-1)
    assert torch.equal(stream[9 * slot:9 * slot + o2.numel()], o2)
    hid = slice(384 * h + 48 * r, 384 * h + 48 * (r + 1))
    assert torch.equal(stream[11 * slot:17 * slot], cd.pack_b(w.w1[b, hid]).reshape(-1))
    assert torch.equal(stream[17 * slot:23 * slot],
                       cd.pack_b(w.w2[b, cols, 384 * h:384 * (h + 1)]).reshape(-1))


def test_packed_context_keeps_each_ctas_keys_contiguous():
    """Keys: n-tiles of 8 keys (k-steps over the head dim); values: k-steps of 16 keys, each
    holding the 12 n-tiles of head dims; both from strided views as the engine serves them."""
    nb, h, s = 2, cd.H, 160
    kv = torch.randn(nb, 1, s, 2, h, HD)               # the served (.., S, 2, H, hd) GEMM output
    keys, values = kv[:, :, :, 0].transpose(2, 3), kv[:, :, :, 1].transpose(2, 3)
    kp, vp = cd.pack_context(keys, values)
    assert kp.shape == vp.shape == (nb, h, s * HD)
    k = kp[1, 5].view(s // 8, HD // 16, 32, 4)
    v = vp[1, 5].view(s // 16, HD // 8, 32, 4)
    vt = values[1, 0, 5].transpose(0, 1)                # B of P V: W[d, key]
    for lane in (0, 13, 31):
        assert torch.equal(k[7, 2, lane], fragment(keys[1, 0, 5], 7, 2, lane))
        assert torch.equal(v[4, 9, lane], fragment(vt, 9, 4, lane))


def test_the_kernel_does_not_serve_where_it_cannot_and_says_why():
    tiny = ckpt.random_model(MolmoBotConfig.from_name('tiny'), 0, torch.device('cpu'),
                             torch.float32).action_expert
    assert cd.unavailable_reason(tiny, torch.device('cpu'), torch.bfloat16) == \
        'needs a CUDA device, serving on cpu'


def test_auto_prefers_the_cluster_kernel_then_the_triton_kernel_saying_why(monkeypatch):
    """`fused_action_expert: auto` serves the cluster kernel where it can, else the Triton
    kernel with the cluster kernel's reason, else the compiled blocks with the Triton's."""
    from molmobot_policy.runtime import serving
    from molmobot_policy.runtime.config import EngineConfig
    tiny = ckpt.random_model(MolmoBotConfig.from_name('tiny'), 0, torch.device('cpu'),
                             torch.float32).action_expert
    config = EngineConfig(model='tiny', compile=True, buckets=(2048,))
    reasons = {'cluster': '', 'triton': ''}
    monkeypatch.setattr(cd, 'unavailable_reason', lambda *a, **k: reasons['cluster'])
    monkeypatch.setattr(fused_dit, 'unavailable_reason', lambda *a, **k: reasons['triton'])
    assert serving.fused_kernel_choice(config, tiny) == ('cluster', '')
    reasons['cluster'] = 'needs an sm_90 (Hopper) GPU, got compute capability 8.x'
    assert serving.fused_kernel_choice(config, tiny) == (
        'triton', 'cluster kernel not used: needs an sm_90 (Hopper) GPU, got compute '
                  'capability 8.x')
    reasons['triton'] = 'no triton'
    assert serving.fused_kernel_choice(config, tiny) == ('', 'no triton')
    config.fused_action_expert = 'triton'        # the Triton kernel required: not the cluster's
    reasons.update(cluster='', triton='')
    assert serving.fused_kernel_choice(config, tiny) == ('triton', '')
    # neither compiled nor graphed, on a CPU: the reason is the device, not the options
    assert serving.fused_kernel_choice(EngineConfig(model='tiny'), tiny) == (
        '', 'needs a CUDA device, serving on cpu')


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """cluster_dit's library state reset, its cache under tmp_path/cache, torch 'with CUDA'."""
    monkeypatch.setattr(cd, '_ext', None)
    monkeypatch.setattr(cd, '_ext_error', '')
    monkeypatch.setenv('MOLMOBOT_KERNEL_CACHE', str(tmp_path / 'cache'))
    monkeypatch.setattr(torch.version, 'cuda', '13.0')
    return tmp_path


def fake_nvcc(tmp_path, body: str) -> str:
    """An executable standing in for nvcc: records its arguments, then runs `body` (sh; the
    arguments end with `-o OUTPUT SOURCE`)."""
    path = tmp_path / 'nvcc'
    path.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\n{body}\n')
    path.chmod(0o755)
    return str(path)


@pytest.mark.skipif(cd.find_nvcc() is None, reason='needs nvcc on this machine')
def test_the_library_builds_with_nvcc_alone_and_reports_the_sizes_it_was_compiled_with(
        fresh_library):
    """The real source through the real nvcc (no torch headers, no GPU needed to build or
    load it): the C interface answers through ctypes with the sizes this module assumes, and
    names a CUDA error by its message."""
    path = cd.library_path()
    cd.build(path, cd.find_nvcc())
    lib = cd.Library(path)
    assert lib.constants()[:10] == [cd.D, cd.H, cd.HD, cd.F, cd.R, cd.MAX_TOKENS, cd.SLOT_E,
                                    cd.WSLOTS, cd.GROUPS_PER_SLOT, cd.MAX_KV_SLOTS]
    with pytest.raises(RuntimeError, match='the step launch failed: out of memory'):
        lib._check(2, 'the step launch')           # cudaErrorMemoryAllocation
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]


def test_nvcc_writes_beside_the_library_and_only_a_whole_one_is_renamed_into_place(
        fresh_library):
    nvcc = fake_nvcc(fresh_library, 'while [ $# -gt 2 ]; do shift; done; printf lib > "$1"')
    path = cd.library_path()
    cd.build(path, nvcc)
    args = (fresh_library / 'args').read_text().split()
    target = args[args.index('-o') + 1]
    assert target != path and target.startswith(path) and target.endswith('.tmp')
    assert open(path).read() == 'lib'
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]


def test_a_failed_build_says_why_and_leaves_nothing_behind(fresh_library, monkeypatch):
    nvcc = fake_nvcc(fresh_library, 'while [ $# -gt 2 ]; do shift; done; printf half > "$1"\n'
                     'echo "cluster_dit.cu(12): error: something is wrong" >&2; exit 2')
    monkeypatch.setattr(cd, 'find_nvcc', lambda: nvcc)
    assert cd.load_extension() is None
    assert cd._ext_error.startswith('the kernel library did not build or load: RuntimeError: '
                                    'nvcc exited with 2: cluster_dit.cu(12): error: something')
    assert os.listdir(os.path.dirname(cd.library_path())) == []


def test_an_edited_kernel_source_gets_its_own_library(fresh_library, monkeypatch):
    source = fresh_library / 'cluster_dit.cu'
    source.write_bytes(open(cd._SOURCE, 'rb').read())
    monkeypatch.setattr(cd, '_SOURCE', str(source))
    before = cd.library_path()
    source.write_bytes(source.read_bytes() + b'// edited\n')
    assert cd.library_path() != before
    assert os.path.dirname(cd.library_path()) == str(fresh_library / 'cache')


def test_a_cpu_torch_is_named_with_what_the_kernel_needs_and_nvcc_is_not_searched(
        fresh_library, monkeypatch):
    monkeypatch.setattr(torch.version, 'cuda', None)
    monkeypatch.setattr(cd, 'find_nvcc', lambda: pytest.fail('nvcc searched'))
    assert cd.load_extension() is None
    assert cd._ext_error.startswith(f'this torch ({torch.__version__}) is built without CUDA '
                                    '(the kernel needs a CUDA build of torch and a Hopper GPU)')


def test_without_nvcc_the_kernel_says_so_and_is_not_built(fresh_library, monkeypatch):
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, 'CUDA_HOME', None)
    monkeypatch.setenv('PATH', str(fresh_library))         # no nvcc there
    assert cd.find_nvcc() is None
    assert cd.load_extension() is None
    assert cd._ext_error.startswith('nvcc not found')
    assert not os.path.exists(fresh_library / 'cache')


# ------------------------------------------------------------------ a model of the schedule


def unpack_b(p: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_b`: (..., N / 8, K / 16, 32, 4) -> (..., N, K)."""
    *lead, nt, ks, _, _ = p.shape
    x = p.reshape(*lead, nt, ks, 8, 4, 2, 2)            # [nt, ks, g, t, half, e]
    nd = len(lead)
    x = x.permute(*range(nd), nd, nd + 2, nd + 1, nd + 4, nd + 3, nd + 5)
    return x.reshape(*lead, 8 * nt, 16 * ks)


def schedule_model(step, x, mod, ctx, tables):
    """One flow step as the kernel splits it (cluster_dit.cu's header): every weight and K/V
    operand read back from the packed streams of the CTA that uses it, each CTA's share of
    every GEMM, the LayerNorms through the u / v tables, the cross-attention as flash-decoding
    partials over each CTA's keys combined per head, the head sums in head order; float32 math
    with bf16 rounding where the kernel stores bf16. x (1, T, D) -> (1, T, D) float32."""
    w, wp = step.base.w, step.wp
    kp, vp = cd.pack_context(ctx.keys, ctx.values)
    nb, s = step.n_blocks, ctx.keys.shape[-2]
    se, R, H = cd.SLOT_E, cd.R, cd.H
    eps, scale = step.base.eps, step.base.sm_scale
    bf = lambda a: a.to(torch.bfloat16).float()          # noqa: E731
    mask = ctx.mask_bias.reshape(-1).float()
    x = x[0].float()
    t = x.shape[0]
    groups = s // 16

    def slots(b, h, r, first, count, nt, ks):
        stream = wp[b, h, r, first * se:(first + count) * se].float()
        return unpack_b(stream[:nt * ks * 128].reshape(nt, ks, 32, 4))

    def head_partial(a, b, h, first, ks):          # the head's partial, CTA r: columns 96 r..
        return torch.cat([a @ slots(b, h, r, first, 6, 12, ks).T for r in range(R)], dim=1)

    def layer_norm_inputs(x, j):                         # xm, mean, rstd of modulation row j
        mean = x.mean(-1, keepdim=True)
        var = ((x * x).mean(-1, keepdim=True) - mean * mean).clamp_min(0)
        return bf(x * (1 + mod[b, j, 0].float())), mean, 1 / torch.sqrt(var + eps)

    for b in range(nb):
        u, v = tables[0, b], tables[1, b]

        def normed(acc, n, bias, mean, rstd):
            return rstd * (acc - mean * u[n]) + v[n] + bias.float()

        def residual(partials, bias, gate):              # partials: H x (T, D), in head order
            par = (b + 1) & 1           # each float's lowest bit: its block's parity (the flag)
            flagged = [((p.contiguous().view(torch.int32) & ~1) | par).view(torch.float32)
                       for p in partials]
            total = flagged[0]
            for p in flagged[1:]:
                total = total + p
            return x + mod[b, gate, 0].float() * (total + bias.float())

        # self-attention: q|k|v n-tiles per CTA, attention per head, proj partials
        xm, mean, rstd = layer_norm_inputs(x, 1)
        parts = []
        for h in range(H):
            qkv = torch.zeros(t, 3 * HD)
            for r in range(R):
                j0, nt = cd._split(3 * HD // 8, r)
                wt = slots(b, h, r, 0, nt, nt, D // 16)
                for i in range(nt):
                    jj = j0 + i
                    part, col = jj // 12, (jj % 12) * 8
                    n = part * D + h * HD + col + torch.arange(8)
                    bias = (w.bq1[b] if part == 0 else w.bkv1[b, (part - 1) * D:])[
                        h * HD + col:h * HD + col + 8]
                    qkv[:, part * HD + col:part * HD + col + 8] = bf(normed(
                        xm @ wt[8 * i:8 * i + 8].T, n, bias, mean, rstd))
            q, k, vv = qkv[:, :HD], qkv[:, HD:2 * HD], qkv[:, 2 * HD:]
            o = bf(bf(torch.softmax(q @ k.T * scale, -1)) @ vv)
            parts.append(head_partial(o, b, h, 5, HD // 16))
        x = residual(parts, w.bo1[b], 2)
        # cross-attention: q n-tiles per CTA, each CTA's eighth of the keys, combined per head
        xm, mean, rstd = layer_norm_inputs(x, 4)
        parts = []
        for h in range(H):
            q = torch.zeros(t, HD)
            for r in range(R):
                q0, nq = cd._split(HD // 8, r)
                wt = slots(b, h, r, 7, nq, nq, D // 16)
                n = 3 * D + h * HD + 8 * q0 + torch.arange(8 * nq)
                bias = w.bq2[b, h * HD + 8 * q0:h * HD + 8 * (q0 + nq)]
                q[:, 8 * q0:8 * (q0 + nq)] = bf(normed(xm @ wt.T, n, bias, mean, rstd) * scale)
            keys = unpack_b(kp[b, h].float().reshape(s // 8, HD // 16, 32, 4))     # (S, HD)
            values = unpack_b(vp[b, h].float().reshape(s // 16, HD // 8, 32, 4)
                              .permute(1, 0, 2, 3)).T                            # (S, HD)
            ms, ls, os_ = [], [], []
            for r in range(R):
                g0, gr = cd._split(groups, r)
                keys_r = slice(16 * g0, 16 * (g0 + gr))
                scores = q @ keys[keys_r].T + mask[keys_r]
                m = scores.max(-1, keepdim=True).values
                e = torch.exp(scores - m)
                ms.append(m), ls.append(e.sum(-1, keepdim=True)), os_.append(bf(e) @ values[keys_r])
            top = torch.stack(ms).max(0).values
            wts = [torch.exp(m - top) for m in ms]
            o = bf(sum(wr * orr for wr, orr in zip(wts, os_))
                   / sum(wr * lr for wr, lr in zip(wts, ls)))
            parts.append(head_partial(o, b, h, 9, HD // 16))
        x = residual(parts, ctx.out_bias[b], 5)
        # MLP: 48 hidden units per CTA, fc2 partials over each head's 384
        xm, mean, rstd = layer_norm_inputs(x, 7)
        parts = []
        for h in range(H):
            a = torch.cat([bf(torch.nn.functional.gelu(normed(
                xm @ slots(b, h, r, 11, 6, 6, D // 16).T,
                4 * D + h * cd.FH + 48 * r + torch.arange(48),
                w.b1[b, h * cd.FH + 48 * r:h * cd.FH + 48 * (r + 1)], mean, rstd)))
                for r in range(R)], dim=1)
            parts.append(head_partial(a, b, h, 17, cd.FH // 16))
        x = residual(parts, w.b2[b], 8)
    return x[None]


def test_the_kernels_schedule_reproduces_the_float32_blocks():
    """The model of the schedule above (the packed streams, each CTA's share, the LayerNorm
    tables, the per-CTA key chunks and their combine) against the float32 blocks on the same
    bf16 weights: a wrong slot, share or chunk would put it far off (reading the cross
    proj's slots for the self proj: 0.76 of the largest value, against 2.8e-3)."""
    cfg = MolmoBotConfig.from_name('molmobot-4b-8cam')
    torch.manual_seed(0)
    ae = ae_mod.ActionExpert(dataclasses.replace(cfg.action_expert, num_layers=2),
                             cfg.llm.d_model, cfg.action_dim, cfg.action_horizon, 'cross_attn')
    with torch.no_grad():
        for p in ae.parameters():
            p.normal_(0.0, 0.02)
        for block in ae.blocks:
            block.adaLN_modulation[1].bias.add_(torch.randn(9 * D) * 0.3)
    ae = ae.to(torch.bfloat16).eval()
    ae32 = ae_mod.ActionExpert(dataclasses.replace(cfg.action_expert, num_layers=2),
                               cfg.llm.d_model, cfg.action_dim, cfg.action_horizon, 'cross_attn')
    ae32.load_state_dict({k: p.float() for k, p in ae.state_dict().items()})
    length = 150                                   # + 1 state token, padded to 160 keys
    hidden = torch.randn(2, 1, length, cfg.llm.d_model)
    mask = torch.ones(1, length, dtype=torch.bool)
    mask[:, -20:] = False
    states = torch.randn(1, cfg.n_obs_steps, cfg.state_dim)
    x_t = torch.randn(1, cfg.action_horizon, cfg.action_dim)
    with torch.inference_mode():
        step = cd.ClusterDiTStep.__new__(cd.ClusterDiTStep)   # its host side, no extension
        step.base = fused_dit.FusedDiTStep(ae)
        step.n_blocks = 2
        step.wp = cd.pack_weights(step.base.w)
        ctx = ae.prepare_context(hidden.to(torch.bfloat16), mask, states.to(torch.bfloat16))
        cond = ae.time_conditioning(torch.full((1,), 0.3))
        x = ae.embed_actions(x_t, ctx.state_tokens)
        got = schedule_model(step, x, cond.blocks, ctx, step.tables(cond.blocks))
        ctx32 = ae32.prepare_context(hidden, mask, states)
        cond32 = ae32.time_conditioning(torch.full((1,), 0.3))
        ref = x.float()
        for i, block in enumerate(ae32.blocks):
            ref = block(ref, cond32.blocks[i], ctx32.keys[i], ctx32.values[i],
                        ctx32.mask_bias, ctx32.out_bias[i])
    assert ctx.keys.shape[-2] == 160
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err < 5e-3, err
