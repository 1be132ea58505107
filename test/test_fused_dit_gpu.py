"""The fused DiT kernel (runtime/fused_dit.py) against the DiT blocks it replaces.

Skipped without CUDA and Triton (CPU CI); run on the H200 (docs/PERFORMANCE.md, "GPU
tests", lists the last run). The tiny model's action expert (48 wide, 4 heads of 12, MLP 192) exercises the
masked edges of every tile; the full-size shapes are checked by benchmarks/benchmark_fused_dit.py.
At the end, a `states_mode: self_attn` model served end to end in bf16 (compiled, CUDA graphs)
through the kernel and through the compiled blocks, against the fp32 CPU reference.
"""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from molmobot_policy.model import checkpoint as ckpt
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.preprocess.transforms import RobotContract
from molmobot_policy.runtime import fused_dit
from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine
from molmobot_policy.types import Observation

import _dit_reference as ref  # noqa: E402  (test/_dit_reference.py: the plain fp32 re-derivation)

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


# -- states_mode self_attn end to end: the serving engine in bf16 against the fp32 reference

TINY = MolmoBotConfig.from_name('tiny')
# the shape of the failed upstream comparison: 6 LLM layers, 3 action-expert blocks fed by
# layers 0, 2, 5 (`action_expert_layer_mode: even`), the state token first in the self-attention
SELF_ATTN = TINY.replace(states_mode='self_attn', action_expert_layer_mode='even',
                         llm=dataclasses.replace(TINY.llm, n_layers=6),
                         action_expert=dataclasses.replace(TINY.action_expert, num_layers=3))
INSTRUCTION = 'pick up the red cube'


@pytest.fixture(scope='module')
def self_attn_models():
    """(the fp32 CPU model, the same weights in bf16 on CUDA)."""
    model32 = ckpt.random_model(SELF_ATTN, seed=0)
    return model32, copy.deepcopy(model32).to(device='cuda', dtype=torch.bfloat16)


def self_attn_query(seed: int = 0) -> tuple[Observation, np.ndarray]:
    """Two 378x378 frames (the 378x378 resize is then the identity), a state, the noise."""
    rng = np.random.default_rng(seed)
    images = tuple(rng.integers(0, 256, (378, 378, 3), dtype=np.uint8) for _ in range(2))
    state = rng.uniform(-1, 1, SELF_ATTN.state_dim).astype(np.float32)
    noise = rng.standard_normal((SELF_ATTN.action_horizon, SELF_ATTN.action_dim))
    return Observation(images=images, state=state, instruction=INSTRUCTION), \
        noise.astype(np.float32)


def fp32_reference_actions(model32, engine: PolicyEngine, obs: Observation,
                           noise: np.ndarray) -> np.ndarray:
    """`MolmoBot.generate_actions` in fp32 on the CPU on the same query: the engine's prompt
    without its bucket padding, the frames patchified as the golden README section 5 says,
    the state quantile-normalized (section 5), the same noise. Checked on the way against
    the plain re-derivation of the action expert (test/_dit_reference.py) on its LLM layers
    0, 2, 5, so that this reference is upstream's math, not only our fp32 path."""
    text = engine.text_inputs(obs.instruction)
    n = text.length
    patches = np.stack([im.reshape(27, 14, 27, 14, 3).transpose(0, 2, 1, 3, 4).reshape(729, 588)
                        for im in obs.images])
    stats = SELF_ATTN.norm_stats
    q01, q99 = (np.asarray(v, np.float32) for v in (stats.state_q01, stats.state_q99))
    states = torch.from_numpy(2 * (obs.state - q01) / np.maximum(q99 - q01, 1e-6) - 1)[None, None]
    inputs = (torch.tensor(text.input_ids[:n])[None], torch.from_numpy(patches)[None],
              torch.tensor(text.token_pooling)[None])
    where = dict(position_ids=torch.tensor(text.position_ids[:n])[None],
                 image_positions=torch.tensor(text.image_positions)[None])
    noise_t = torch.from_numpy(noise)[None]
    with torch.no_grad():
        actions = model32.generate_actions(*inputs, states, noise=noise_t, **where)
        hidden = model32.llm_hidden_states(*inputs, **where)
    derived = ref.flow(model32.state_dict(), noise_t, [hidden[i] for i in (0, 2, 5)],
                       torch.ones(1, n, dtype=torch.bool), states, states_mode='self_attn',
                       heads=SELF_ATTN.action_expert.num_heads)
    torch.testing.assert_close(actions, derived, rtol=0, atol=1e-4)
    return actions[0].numpy()


@pytest.mark.parametrize('fused', ['on', 'off'])
def test_self_attn_engine_in_bf16_matches_the_fp32_reference(self_attn_models, fused):
    """Compiled + CUDA-graphed bf16 serving, through the fused kernel ('on') or the compiled
    blocks ('off'), against the fp32 CPU reference path (which test_self_attn_reference.py
    checks against a re-derivation of upstream's math)."""
    model32, model_bf = self_attn_models
    torch._dynamo.reset()
    engine = PolicyEngine(EngineConfig(model='tiny', device='cuda', dtype='bfloat16',
                                       compile=True, cuda_graphs=True, buckets=(512,),
                                       instruction=INSTRUCTION, fused_action_expert=fused),
                          model=model_bf,
                          contract=RobotContract.numbered(2, SELF_ATTN.state_dim))
    engine.warmup()
    assert engine.mode['fused_action_expert'] == ('triton' if fused == 'on'
                                                  else 'off (as configured)')
    obs, noise = self_attn_query()
    got = engine.predict(obs, noise=noise).actions_normalized
    expected = fp32_reference_actions(model32, engine, obs, noise)
    assert got.shape == expected.shape
    # bf16 rounding through 6 LLM layers, 3 blocks x 10 flow steps (test_engine_gpu.py's bound)
    err = float(np.abs(got - expected).max())
    assert err < 0.05 * max(1.0, float(np.abs(expected).max())), err
