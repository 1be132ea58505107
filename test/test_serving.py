"""The serving-time changes (runtime/serving.py) against the model's own forwards, which compute
upstream's math: the ViT's stacked q|k|v, the pooling windows' attention, the action expert's
bias-free batched K/V with the folded output bias, the precomputed flow conditioning, the fused
kernel's weight preparation; all on the CPU (the CUDA-only GELU epilogue: test_vision_gpu.py)."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from molmobot_policy.model.checkpoint import random_model
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.model.molmobot import euler_flow
from molmobot_policy.runtime.config import EngineConfig
from molmobot_policy.runtime.serving import (PoolingWindowAttention, ServedActionExpert,
                                             ServedViTAttention, prepare_for_serving,
                                             single_query_attention)

TINY = MolmoBotConfig.from_name('tiny')
STEPS = TINY.flow_steps


def make_inputs(batch: int = 2, seed: int = 0):
    """input_ids (B, L) of two images and a short instruction, uint8 images, token_pooling,
    normalized states (B, 1, state_dim): inputs for the tiny model (golden README section 4)."""
    tok, per_image = TINY.tokens, TINY.tokens_per_image
    ids = [tok.bos]
    for k in range(2):
        ids += [259, 267 + k, tok.im_start] + [tok.im_patch] * per_image + [tok.im_end]
    ids += [tok.chat_im_start, 313, 198, 280, 25, 260, 261, 262, tok.chat_im_end]
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch, 2, 729, 588), generator=g, dtype=torch.uint8)
    rows = torch.arange(14).repeat_interleave(14)
    cols = torch.arange(14).repeat(14)
    window = [(2 * rows + i) * 27 + 2 * cols + j for i in (0, 1) for j in (0, 1)]
    valid = [(2 * rows + i < 27) & (2 * cols + j < 27) for i in (0, 1) for j in (0, 1)]
    pool = torch.where(torch.stack(valid, 1), torch.stack(window, 1), -1)
    pool = torch.cat([torch.where(pool >= 0, pool + 729 * k, -1) for k in range(2)])
    states = torch.rand(batch, 1, TINY.state_dim, generator=g) * 2 - 1
    return (torch.tensor([ids] * batch), images, pool[None].expand(batch, -1, -1), states)


@pytest.fixture(scope='module')
def models():
    """(reference, prepared) per states mode: the same random weights, float32 on the CPU."""
    out = {}
    for mode in ('cross_attn', 'self_attn'):
        reference = random_model(TINY.replace(states_mode=mode), seed=3)
        prepared = copy.deepcopy(reference)
        prepare_for_serving(prepared, EngineConfig(model='tiny'), STEPS)
        out[mode] = reference, prepared
    return out


def upstream_contexts(ae, hidden, state_tokens):
    """Every block's cross-attention context (B, S, hidden), block by block as upstream."""
    out = []
    for hidden_i in hidden.unbind(0):
        ctx = ae.context_norm(ae.context_proj(hidden_i))
        if ae.states_mode == 'cross_attn':
            ctx = torch.cat([ctx, state_tokens], dim=1)
        out.append(F.pad(ctx, (0, 0, 0, -ctx.shape[1] % 16)))
    return out


# ---------------------------------------------------------------- vision
def test_single_query_attention_equals_sdpa_with_the_window_mask():
    """The pooling windows' attention (1 query, 4 keys, padded keys masked) written as
    products and sums equals SDPA."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(30, 4, n, 12, generator=g) for n in (1, 4, 4))
    mask = torch.rand(30, 1, 1, 4, generator=g) > 0.4
    mask[..., 2] = True                                  # every window keeps one key
    out = single_query_attention(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert not mask.all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def _linear_calls(fn) -> tuple[torch.Tensor, int]:
    """(fn()'s result, the F.linear calls it made)."""
    calls = []
    real = F.linear

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    F.linear = counting
    try:
        out = fn()
    finally:
        F.linear = real
    return out, len(calls)


def test_served_vit_projects_qkv_with_one_gemm_over_the_weights_stacked_in_place(models):
    reference, prepared = models['cross_attn']
    vit, served_vit = reference.vision_backbone.image_vit, prepared.vision_backbone.image_vit
    patches = torch.rand(2, 729, TINY.vit.patch_dim) * 2 - 1
    with torch.no_grad():
        expected, calls = _linear_calls(lambda: vit(patches)[-1])
        out, served_calls = _linear_calls(lambda: served_vit(patches)[-1])
    blocks = served_vit.transformer.resblocks
    assert all(isinstance(b.attention, ServedViTAttention) for b in blocks)
    assert calls - served_calls == 2 * len(blocks)       # one q|k|v GEMM instead of three
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    a = blocks[0].attention
    for i, linear in enumerate((a.wq, a.wk, a.wv)):      # the parameters are views of it
        assert linear.weight.data_ptr() == a.qkv_weight[i].data_ptr()
        assert linear.bias.data_ptr() == a.qkv_bias[i].data_ptr()
    assert prepared.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(prepared.state_dict()[k], v)
               for k, v in reference.state_dict().items())


def test_served_pooling_window_attention_equals_the_models_pooling(models):
    reference, prepared = models['cross_attn']
    ids, images, pool, _ = make_inputs()
    assert isinstance(prepared.vision_backbone.image_pooling_2d, PoolingWindowAttention)
    with torch.no_grad():
        torch.testing.assert_close(prepared.vision_backbone(images, pool),
                                   reference.vision_backbone(images, pool),
                                   rtol=1e-5, atol=1e-5)


def test_prepare_for_serving_is_idempotent_and_sets_the_vit_attention_precision(models):
    _, prepared = models['cross_attn']
    blocks = prepared.vision_backbone.image_vit.transformer.resblocks
    served = [b.attention for b in blocks]
    assert not any(a.float32_attention for a in served)      # EngineConfig default
    prepare_for_serving(prepared, EngineConfig(model='tiny', vit_fp32_attention=True), STEPS)
    assert [b.attention for b in blocks] == served            # not wrapped again
    assert all(a.float32_attention for a in served)
    prepare_for_serving(prepared, EngineConfig(model='tiny'), STEPS)
    assert not any(a.float32_attention for a in served)


# ---------------------------------------------------------------- action expert
@pytest.fixture(scope='module')
def contexts(models):
    """Per mode: the reference model, hidden states, a padded mask, states and both contexts."""
    out = {}
    for mode, (reference, prepared) in models.items():
        ids, images, pool, states = make_inputs()
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[1, -5:] = False
        with torch.no_grad():
            hidden = reference.select_ae_layers(reference.llm_hidden_states(ids, images, pool))
            served = ServedActionExpert(prepared.action_expert, STEPS)
            ctx = served.context(hidden, mask, states)
            ref_ctx = reference.action_expert.prepare_context(hidden, mask, states)
        out[mode] = reference, hidden, mask, states, served, ctx, ref_ctx
    return out


@pytest.mark.parametrize('mode', ['cross_attn', 'self_attn'])
def test_bias_free_key_values_with_the_folded_bias_give_upstreams_cross_attention(contexts,
                                                                                  mode):
    """The served K/V leave out kv_proj's bias and fold the value bias into the output bias:
    each block's cross-attention output equals upstream's attention over biased K/V (kv_proj
    with its bias, proj with its own bias), padding masked."""
    reference, hidden, mask, states, served, ctx, _ = contexts[mode]
    ae = reference.action_expert
    x = torch.randn(hidden.shape[1], TINY.action_horizon, TINY.action_expert.hidden_size)
    d = TINY.action_expert.hidden_size
    with torch.no_grad():
        rows = upstream_contexts(ae, hidden, ctx.state_tokens)
        for i, block in enumerate(ae.blocks):
            assert block.attn2.kv_proj.bias[:d].abs().min() > 0   # biases that would matter
            assert block.attn2.kv_proj.bias[d:].abs().min() > 0
            upstream = block.attn2(x, rows[i], ctx.mask_bias)
            cached = block.attn2.attend(x, ctx.keys[i], ctx.values[i], ctx.mask_bias,
                                        ctx.out_bias[i])
            torch.testing.assert_close(cached, upstream, rtol=1e-5, atol=1e-6)
            without_fold = block.attn2.attend(x, ctx.keys[i], ctx.values[i], ctx.mask_bias)
            assert not torch.allclose(without_fold, upstream, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize('mode', ['cross_attn', 'self_attn'])
def test_served_keys_are_the_upstream_keys_without_the_bias(contexts, mode):
    reference, hidden, _, _, _, ctx, ref_ctx = contexts[mode]
    heads, d = TINY.action_expert.num_heads, TINY.action_expert.hidden_size
    n_ctx = hidden.shape[2] + (1 if mode == 'cross_attn' else 0)
    assert ctx.keys.shape == (len(reference.action_expert.blocks), 2, heads,
                              -(-n_ctx // 16) * 16, d // heads)
    assert ctx.keys.stride() == ctx.values.stride() and ctx.keys.stride(-1) == 1
    for i, block in enumerate(reference.action_expert.blocks):
        b_k = block.attn2.kv_proj.bias[:d].view(heads, 1, d // heads)
        b_v = block.attn2.kv_proj.bias[d:].view(heads, 1, d // heads)
        torch.testing.assert_close(ctx.keys[i] + b_k, ref_ctx.keys[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ctx.values[i] + b_v, ref_ctx.values[i], rtol=1e-5,
                                   atol=1e-5)
    torch.testing.assert_close(ctx.mask_bias, ref_ctx.mask_bias)


@pytest.mark.parametrize('mode', ['cross_attn', 'self_attn'])
def test_served_flow_equals_the_reference_generate_actions(models, mode):
    """The served context and velocity (precomputed conditioning per flow step) through
    `euler_flow` against the model's `generate_actions`, float32, a padded prompt."""
    reference, prepared = models[mode]
    ids, images, pool, states = make_inputs(batch=1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, -3:] = False
    noise = torch.randn(1, TINY.action_horizon, TINY.action_dim,
                        generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference.generate_actions(ids, images, pool, states, noise=noise,
                                              attention_mask=mask)
        hidden = prepared.select_ae_layers(prepared.llm_hidden_states(ids, images, pool,
                                                                      attention_mask=mask))
        served = ServedActionExpert(prepared.action_expert, STEPS)
        ctx = served.context(hidden, mask, states)
        out = euler_flow(noise, lambda x, i: served.velocity(x, i, ctx), STEPS)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_stacked_kv_weight_keeps_weights_keys_and_loads_through(models):
    reference, prepared = models['cross_attn']
    model = copy.deepcopy(reference)
    ae = model.action_expert
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = ServedActionExpert(ae, STEPS)
    stacked = ae.served_kv_weight
    ServedActionExpert(ae, STEPS)                                # a second engine: same stack
    assert ae.served_kv_weight is stacked
    for i, block in enumerate(ae.blocks):                        # the parameters are views of it
        assert block.attn2.kv_proj.weight.data_ptr() == stacked[i].data_ptr()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k])
                                                 for k in before)
    rows = torch.randn(len(ae.blocks), 1, 32, TINY.action_expert.hidden_size)
    with torch.no_grad():
        keys = first.key_values(rows)[0]
        model.load_state_dict(random_model(TINY, seed=5).state_dict())
        assert not torch.equal(first.key_values(rows)[0], keys)   # new weights, same stack
    assert ae.served_kv_weight is stacked


def test_fused_kernel_weights_are_prepared_with_per_flow_time_tables(models):
    """The CPU part of the fused path: the blocks' weights stacked in place (shared, not
    copied) and one table set per flow step, those of `FusedDiTStep.tables`."""
    from molmobot_policy.runtime import fused_dit
    ae = copy.deepcopy(models['cross_attn'][0]).action_expert
    served = ServedActionExpert(ae, STEPS, kernel='triton')
    assert len(served.fused_steps) == STEPS
    step = served.fused_steps[3].func
    assert step.w.w1[1].data_ptr() == ae.blocks[1].mlp.fc1.weight.data_ptr()
    with torch.no_grad():
        expected = fused_dit.FusedDiTStep(ae).tables(served.conditioning[3].blocks)
    torch.testing.assert_close(served.fused_steps[3].keywords['tables'], expected)


FUSED_CHECK = r'''
import json, torch
from molmobot_policy.model import checkpoint as ckpt
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.runtime.serving import ServedActionExpert
cfg = MolmoBotConfig.from_name('tiny')
ae = ckpt.random_model(cfg, 0, torch.device('cpu'), torch.float16).action_expert
hidden = torch.randn(len(ae.blocks), 1, 40, cfg.llm.d_model, dtype=torch.float16)
mask = torch.ones(1, 40, dtype=torch.bool)
states = torch.randn(1, 1, cfg.state_dim, dtype=torch.float16)
x = torch.randn(1, cfg.action_horizon, cfg.action_dim)
with torch.inference_mode():
    out = {}
    for fused in (False, True):
        served = ServedActionExpert(ae, 2, kernel='triton' if fused else '')
        if fused:      # one launch per phase: the interpreter has no concurrent programs
            for s in served.fused_steps:
                s.func.phased = True
        ctx = served.context(hidden, mask, states)
        out[fused] = served.velocity(x, 1, ctx).float()
scale = out[False].abs().max()
print(json.dumps({'error': float((out[True] - out[False]).abs().max() / scale)}))
'''


def test_served_velocity_through_the_fused_kernel_agrees_with_the_blocks():
    """The served context's strided K/V and folded bias through the fused kernel (Triton's
    interpreter, float16) against the blocks: the same velocity within fp16 rounding."""
    pytest.importorskip('triton')
    if torch.cuda.is_available():
        pytest.skip('CPU CI check: with CUDA the kernel itself runs (test_fused_dit_gpu.py), and '
                    "the GPU image's Triton interpreter rejects numpy-array scalars")
    env = dict(os.environ, TRITON_INTERPRET='1')
    run = subprocess.run([sys.executable, '-c', FUSED_CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])['error'] < 2e-2


def test_gelu_epilogue_mlp_wires_bias_weights_and_shapes():
    """`GeluEpilogueMLP` serves CUDA only (there the epilogue is the tanh GELU:
    test_vision_gpu.py); on the CPU `_addmm_activation` computes the erf form, which checks the
    bias, the transposed weight and the reshapes against F.gelu's erf form."""
    from molmobot_policy.model.vision import ViTMLP
    from molmobot_policy.runtime.serving import GeluEpilogueMLP
    torch.manual_seed(0)
    mlp = ViTMLP(24, 40)
    x = torch.randn(2, 5, 24)
    with torch.no_grad():
        out = GeluEpilogueMLP(mlp)(x)
        erf = mlp.w2(F.gelu(mlp.w1(x), approximate='none'))
    assert out.shape == (2, 5, 24)
    torch.testing.assert_close(out, erf, rtol=1e-5, atol=1e-5)


def _flow_reason_of(ae):
    """`ClusterDiTStep.flow_reason` of an expert without building the kernel (which needs a
    Hopper GPU): the method reads only the expert and its action_dim."""
    from molmobot_policy.runtime import cluster_dit
    step = object.__new__(cluster_dit.ClusterDiTStep)
    step.ae, step.action_dim = ae, ae.action_embed.in_features
    return step


def test_the_whole_step_kernel_takes_one_cross_attn_query_and_names_what_it_does_not(models):
    step = _flow_reason_of(models['cross_attn'][1].action_expert)
    horizon = TINY.action_horizon
    assert step.flow_reason(horizon, 1680) == ''
    assert 'batch of 2' in step.flow_reason(horizon, 1680, batch=2)
    assert 'horizon 17' in step.flow_reason(17, 1680)
    assert 'context of 1681 keys' in step.flow_reason(horizon, 1681)
    assert 'context of 112 keys' in step.flow_reason(horizon, 112)
    self_attn = _flow_reason_of(models['self_attn'][1].action_expert)
    assert "states_mode 'self_attn'" in self_attn.flow_reason(horizon, 1680)


def test_served_flow_runs_a_batch_through_the_separate_steps_where_the_kernel_runs_one(models):
    """`ServedActionExpert.flow` with a whole-step kernel that would take a single query of
    this context: a batch of two goes through `euler_flow` with the served velocity (the
    kernel is not called), and each query's actions equal that query's flow alone."""
    _, prepared = models['cross_attn']
    ids, images, pool, states = make_inputs(batch=2)
    noise = torch.randn(2, TINY.action_horizon, TINY.action_dim,
                        generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        mask = torch.ones_like(ids, dtype=torch.bool)
        hidden = prepared.select_ae_layers(prepared.llm_hidden_states(ids, images, pool,
                                                                      attention_mask=mask))
        served = ServedActionExpert(prepared.action_expert, STEPS)
        ctx = served.context(hidden, mask, states)
        kernel = _flow_reason_of(prepared.action_expert)
        kernel.flow_step = lambda *a, **k: pytest.fail('the one-query kernel was called')
        # the premise: one query of this context is what the kernel takes
        assert kernel.flow_reason(TINY.action_horizon, ctx.keys.shape[-2]) == ''
        served.step_kernel = kernel
        out = served.flow(noise, ctx)

        def query(i):
            return dataclasses.replace(
                ctx, keys=ctx.keys[:, i:i + 1], values=ctx.values[:, i:i + 1],
                mask_bias=ctx.mask_bias[i:i + 1], state_tokens=ctx.state_tokens[i:i + 1])
        alone = [euler_flow(noise[i:i + 1], lambda x, s, c=query(i): served.velocity(x, s, c),
                            STEPS) for i in range(2)]
    assert out.shape == noise.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, torch.cat(alone), rtol=1e-5, atol=1e-5)
