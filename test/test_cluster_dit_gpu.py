"""The cluster DiT kernel (runtime/cluster_dit.py) against the float32 DiT blocks and the
Triton kernel it replaces.

Skipped without an sm_90 GPU (CPU CI tests its packing: test_cluster_dit.py); run on the H200
(docs/PERFORMANCE.md, "GPU tests", lists the last run). The kernel is compiled for the
full-size expert's widths (768, 8 heads of 96, MLP 3072), so these tests build that expert
with 6 blocks (the block count is a loop bound), random N(0, 0.02) weights perturbed so that
every gate and shift matters, and a context as the engine pads it (one state token, the
last prompt tokens masked as bucket padding).
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from molmobot_policy.model import action_expert as ae_mod
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.runtime import cluster_dit, fused_dit
from molmobot_policy.runtime.serving import ServedActionExpert

from _mma_fragments import fragment  # noqa: E402  (test/_mma_fragments.py: the ISA's layout)

BLOCKS = 6
CFG = MolmoBotConfig.from_name('molmobot-4b-8cam')


def _reason() -> str:
    if not torch.cuda.is_available():
        return 'needs a CUDA device'
    if torch.cuda.get_device_capability()[0] != 9:
        return 'needs an sm_90 GPU'
    return ''


pytestmark = pytest.mark.skipif(bool(_reason()), reason=_reason() or 'runs')


@pytest.fixture(scope='module')
def experts():
    """(bf16 expert, its float32 copy); skips where the kernel cannot serve (and says why)."""
    torch.manual_seed(0)
    ae = ae_mod.ActionExpert(dataclasses.replace(CFG.action_expert, num_layers=BLOCKS),
                             CFG.llm.d_model, CFG.action_dim, CFG.action_horizon,
                             'cross_attn')
    with torch.no_grad():
        for p in ae.parameters():
            p.normal_(0.0, 0.02)
        for block in ae.blocks:          # AdaLN modulation large enough that gates matter
            block.adaLN_modulation[1].bias.add_(torch.randn_like(
                block.adaLN_modulation[1].bias) * 0.3)
    ae = ae.to('cuda', torch.bfloat16).eval()
    reason = cluster_dit.unavailable_reason(ae, torch.device('cuda'), torch.bfloat16, 1680)
    if reason:
        pytest.skip(f'cluster kernel unavailable: {reason}')
    return ae, copy.deepcopy(ae).float()


def inputs(ae, length: int, t: float = 0.3, seed: int = 1):
    """One flow step's inputs for a context of `length` LLM tokens (the last 25 padding)."""
    g = torch.Generator(device='cuda').manual_seed(seed)
    hidden = torch.randn(BLOCKS, 1, length, CFG.llm.d_model, device='cuda', generator=g)
    mask = torch.ones(1, length, dtype=torch.bool, device='cuda')
    mask[:, -25:] = False
    states = torch.randn(1, CFG.n_obs_steps, CFG.state_dim, device='cuda', generator=g)
    x_t = torch.randn(1, CFG.action_horizon, CFG.action_dim, device='cuda', generator=g)
    with torch.inference_mode():
        ctx = ae.prepare_context(hidden.to(ae.dtype), mask, states.to(ae.dtype))
        cond = ae.time_conditioning(torch.full((1,), t, device='cuda'))
        x = ae.embed_actions(x_t, ctx.state_tokens)
    return x, cond.blocks, ctx, (hidden, mask, states, x_t, t)


def blocks32(ae32, raw):
    """The float32 blocks on the same inputs (the reference)."""
    hidden, mask, states, x_t, t = raw
    with torch.inference_mode():
        ctx = ae32.prepare_context(hidden, mask, states)
        cond = ae32.time_conditioning(torch.full((1,), t, device='cuda'))
        x = ae32.embed_actions(x_t, ctx.state_tokens)
        for i, block in enumerate(ae32.blocks):
            x = block(x, cond.blocks[i], ctx.keys[i], ctx.values[i], ctx.mask_bias,
                      ctx.out_bias[i])
    return x


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize('length', [1664, 1856])
def test_one_flow_step_matches_the_float32_blocks_as_closely_as_the_triton_kernel(experts,
                                                                                  length):
    ae, ae32 = experts
    x, mod, ctx, raw = inputs(ae, length)
    with torch.inference_mode():
        got = cluster_dit.ClusterDiTStep(ae)(x, mod, ctx)
        triton = fused_dit.FusedDiTStep(ae)(x, mod, ctx)
    ref = blocks32(ae32, raw)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    err, err_triton = rel(got, ref), rel(triton, ref)
    assert err <= max(1.25 * err_triton, 5e-3), (err, err_triton)
    assert rel(got, triton) <= 2 * max(err, err_triton), (rel(got, triton), err, err_triton)


def test_replays_give_the_same_bits_and_context_lengths_do_not_mix(experts):
    """A-B-A: the 1664- and 1856-token buckets in turn; A's output bitwise equal each time,
    also as a CUDA graph replay."""
    ae, _ = experts
    step = cluster_dit.ClusterDiTStep(ae)
    a, b = inputs(ae, 1664, seed=2), inputs(ae, 1856, seed=3)
    with torch.inference_mode():
        first = step(*a[:3])
        other = step(*b[:3])
        again = step(*a[:3])
        assert torch.equal(first, again)
        assert not torch.equal(first, other)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(*a[:3])
        for _ in range(3):
            graph.replay()
            assert torch.equal(out, first)


def test_more_than_16_tokens_run_through_the_triton_kernel(experts):
    """The self_attn mode's 17 tokens (a state token before the actions): the Triton
    kernel's output, bitwise."""
    ae, _ = experts
    x, mod, ctx, _ = inputs(ae, 1664)
    x17 = torch.cat([ctx.state_tokens.to(x.dtype), x], dim=1)
    with torch.inference_mode():
        got = cluster_dit.ClusterDiTStep(ae)(x17, mod, ctx)
        expected = fused_dit.FusedDiTStep(ae)(x17, mod, ctx)
    assert torch.equal(got, expected)


def test_served_velocity_through_the_cluster_kernel_matches_the_blocks(experts):
    """The engine's path: the served context's strided K/V without their bias (folded into
    out_bias), repacked per query, through the kernel, against the bf16 blocks."""
    ae, _ = experts
    _, _, _, (hidden, mask, states, x_t, _) = inputs(ae, 1664, seed=4)
    with torch.inference_mode():
        out = {}
        for kernel in ('', 'cluster'):
            served = ServedActionExpert(ae, 10, kernel)
            ctx = served.context(hidden.to(ae.dtype), mask, states.to(ae.dtype))
            out[kernel] = served.velocity(x_t, 3, ctx).float()
    assert isinstance(served.fused_steps[3].func, cluster_dit.ClusterDiTStep)
    err = float((out['cluster'] - out['']).abs().max() / out[''].abs().max())
    assert err < 2e-2, err          # bf16 rounding of the blocks through 6 blocks


@pytest.mark.parametrize('length', [1664, 1856])
def test_the_pack_kernel_puts_the_served_kv_in_fragment_order(experts, length):
    """The library's one-pass repack of the served, strided K/V: every lane's fragments
    where the PTX layout puts them (spot checks), and the same bytes as torch's permute form."""
    nb, s = BLOCKS, length
    kv = torch.randn(nb, 1, s, 2, cluster_dit.H, cluster_dit.HD, device='cuda').bfloat16()
    keys, values = kv[:, :, :, 0].transpose(2, 3), kv[:, :, :, 1].transpose(2, 3)
    ext = cluster_dit.load_extension()
    assert cluster_dit._packable(keys, values)
    kp, vp = cluster_dit.pack_context(keys, values, ext)
    k = kp.view(nb, cluster_dit.H, s // 8, cluster_dit.HD // 16, 32, 4)
    v = vp.view(nb, cluster_dit.H, s // 16, cluster_dit.HD // 8, 32, 4)
    for b, h, n, st, lane in [(0, 0, 0, 0, 0), (5, 7, s // 8 - 1, 5, 31), (3, 2, 101, 3, 13)]:
        assert torch.equal(k[b, h, n, st, lane], fragment(keys[b, 0, h], n, st, lane))
        vt = values[b, 0, h].transpose(0, 1)            # B of P V: W[dim, key]
        assert torch.equal(v[b, h, n // 2, st, lane], fragment(vt, st, n // 2, lane))
    ref_k, ref_v = cluster_dit.pack_context(keys, values)
    assert torch.equal(kp, ref_k) and torch.equal(vp, ref_v)


@pytest.mark.parametrize('length', [1664, 1856])
def test_a_whole_euler_step_in_the_kernel_matches_float32_as_closely_as_the_separate_step(
        experts, length):
    """`flow_step`: the action embedding, the blocks, the final layer and x + dt * velocity in
    one launch, against the float32 expert's Euler step; its velocity as close to float32's as
    the velocity of the separate path (embedding, kernel, final layer, update as torch ops)."""
    ae, ae32 = experts
    _, _, ctx, (hidden, mask, states, x_t, t) = inputs(ae, length, t=0.6, seed=5)
    dt = 0.1
    step = cluster_dit.ClusterDiTStep(ae)
    assert step.flow_reason(x_t.shape[1], length) == ''
    with torch.inference_mode():
        cond = ae.time_conditioning(torch.full((1,), t, device='cuda'))
        got = step.flow_step(x_t, cond.blocks, cond.final, ctx, dt)
        separate = x_t + dt * ae.velocity_from_conditioning(x_t, cond, ctx, step).float()
        ctx32 = ae32.prepare_context(hidden, mask, states)
        cond32 = ae32.time_conditioning(torch.full((1,), t, device='cuda'))
        ref = x_t + dt * ae32.velocity_from_conditioning(x_t, cond32, ctx32)
    assert got.shape == x_t.shape and got.dtype == torch.float32
    v, v_sep, v_ref = (got - x_t) / dt, (separate - x_t) / dt, (ref - x_t) / dt
    err, err_sep = rel(v, v_ref), rel(v_sep, v_ref)
    assert err <= max(1.25 * err_sep, 5e-3), (err, err_sep)
    assert rel(v, v_sep) <= 2 * max(err, err_sep), (rel(v, v_sep), err, err_sep)


def test_the_served_flow_runs_whole_steps_in_the_kernel_and_replays_bitwise(experts,
                                                                            monkeypatch):
    """`ServedActionExpert.flow` with the cluster kernel: 10 `flow_step` launches, the actions
    within bf16 noise of the blocks' Euler flow, and the same bits on CUDA graph replay."""
    ae, _ = experts
    _, _, _, (hidden, mask, states, _, _) = inputs(ae, 1664, seed=6)
    noise = torch.randn(1, CFG.action_horizon, CFG.action_dim, device='cuda',
                        generator=torch.Generator(device='cuda').manual_seed(7))
    calls = []
    real = cluster_dit.ClusterDiTStep.flow_step
    monkeypatch.setattr(cluster_dit.ClusterDiTStep, 'flow_step',
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    with torch.inference_mode():
        out = {}
        for kernel in ('', 'cluster'):
            served = ServedActionExpert(ae, 10, kernel)
            ctx = served.context(hidden.to(ae.dtype), mask, states.to(ae.dtype))
            out[kernel] = served.flow(noise, ctx)
        assert len(calls) == 10
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = served.flow(noise, ctx)
        for _ in range(2):
            graph.replay()
            assert torch.equal(replayed, out['cluster'])
    err = float((out['cluster'] - out['']).abs().max() / out[''].abs().max())
    assert err < 2e-2, err          # bf16 rounding of the blocks through 6 blocks x 10 steps
