"""The fused DiT kernel (runtime/fused_dit.py) against the DiT blocks it replaces.

Skipped without CUDA and Triton (CPU CI); run on the H200 (benchmarks/RESULTS.md lists the
last run). The tiny model's action expert (48 wide, 4 heads of 12, MLP 192) exercises the
masked edges of every tile; the full-size shapes are checked by benchmarks/benchmark_fused_dit.py.
"""
from __future__ import annotations

import copy

import pytest
import torch

from molmobot_policy.model import checkpoint as ckpt
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.runtime import fused_dit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or fused_dit.triton is None,
                                reason='needs a CUDA device and Triton')


def setup(states_mode: str, padded: bool):
    """Tiny action expert in bf16 (perturbed so every gate and shift matters), a float32
    copy of the same weights, a context with or without padding, and the inputs of one step."""
    cfg = MolmoBotConfig.from_name('tiny')
    torch.manual_seed(0)
    model = ckpt.random_model(cfg, 0, torch.device('cuda'), torch.float32)
    ae = model.action_expert
    ae.states_mode = states_mode
    with torch.no_grad():
        for p in ae.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ae = ae.to(torch.bfloat16)
    ae32 = copy.deepcopy(ae).float()
    length = 45
    hidden = torch.randn(len(ae.blocks), 1, length, cfg.llm.d_model, device='cuda')
    mask = torch.ones(1, length, dtype=torch.bool, device='cuda')
    if padded:
        mask[:, 33:] = False
    states = torch.randn(1, 1, cfg.state_dim, device='cuda')
    x_t = torch.randn(1, cfg.action_horizon, cfg.action_dim, device='cuda')
    return ae, ae32, hidden, mask, states, x_t


def blocks_and_fused(ae, hidden, mask, states, x_t, t=0.3):
    """(x after the block loop, x after the fused kernel, fused kernel inputs) in bf16."""
    with torch.inference_mode():
        ctx = ae.prepare_context(hidden.to(ae.dtype), mask, states.to(ae.dtype))
        cond = ae.time_conditioning(torch.full((1,), t, device='cuda'))
        x = ae.embed_actions(x_t, ctx.state_tokens)
        ref = x
        for i, block in enumerate(ae.blocks):
            ref = block(ref, cond.blocks[i], ctx.keys[i], ctx.values[i], ctx.mask_bias,
                        ctx.out_bias[i])
        step = fused_dit.FusedDiTStep(ae)
        return ref, step(x, cond.blocks, ctx), (x, cond.blocks, ctx)


@pytest.mark.parametrize('states_mode', ['cross_attn', 'self_attn'])
@pytest.mark.parametrize('padded', [False, True])
def test_fused_step_matches_blocks_within_bf16_rounding(states_mode, padded):
    ae, ae32, hidden, mask, states, x_t = setup(states_mode, padded)
    ref, fused, _ = blocks_and_fused(ae, hidden, mask, states, x_t)
    ref32, _, _ = blocks_and_fused(ae32, hidden, mask, states, x_t)
    assert fused.shape == ref.shape and fused.dtype == torch.bfloat16
    scale = ref32.abs().max()
    err_fused = float((fused.float() - ref32).abs().max() / scale)
    err_blocks = float((ref.float() - ref32).abs().max() / scale)
    # the kernel keeps the residual stream in float32: no worse than the bf16 blocks
    assert err_fused <= max(2 * err_blocks, 1e-2), (err_fused, err_blocks)


def test_persistent_equals_phased_launches_bitwise():
    """The grid barrier orders the phases exactly as separate launches do."""
    ae, _, hidden, mask, states, x_t = setup('cross_attn', True)
    _, fused, (x, mod, ctx) = blocks_and_fused(ae, hidden, mask, states, x_t)
    with torch.inference_mode():
        phased = fused_dit.FusedDiTStep(ae, phased=True)(x, mod, ctx)
    assert torch.equal(fused, phased)


def test_graph_replays_are_bitwise_stable():
    ae, _, hidden, mask, states, x_t = setup('cross_attn', True)
    _, _, (x, mod, ctx) = blocks_and_fused(ae, hidden, mask, states, x_t)
    step = fused_dit.FusedDiTStep(ae)
    with torch.inference_mode():
        step(x, mod, ctx)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(x, mod, ctx)
        graph.replay()
        first = out.clone()
        for _ in range(5):
            graph.replay()
            assert torch.equal(out, first)


def test_weights_are_shared_with_the_blocks_not_copied():
    ae, *_ = setup('cross_attn', False)
    step = fused_dit.FusedDiTStep(ae)
    assert step.w.w1[1].data_ptr() == ae.blocks[1].mlp.fc1.weight.data_ptr()
    assert fused_dit.FusedDiTStep(ae).w is step.w      # stacking is idempotent


def test_bad_shapes_are_refused():
    ae, _, hidden, mask, states, x_t = setup('cross_attn', False)
    _, _, (x, mod, ctx) = blocks_and_fused(ae, hidden, mask, states, x_t)
    step = fused_dit.FusedDiTStep(ae)
    with pytest.raises(ValueError, match='x must be'):
        step(torch.cat([x, x]), mod, ctx)
    with pytest.raises(ValueError, match='mod'):
        step(x, mod[:2], ctx)
