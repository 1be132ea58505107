"""MolmoBot on the tiny preset with random weights: shapes, determinism, the action-expert
K/V cache (bitwise equal to the reference path), masks and input validation."""
import dataclasses

import pytest
import torch

from molmobot_policy.model.checkpoint import random_model
from molmobot_policy.model.config import ActionExpertConfig, MolmoBotConfig

TINY = MolmoBotConfig.from_name('tiny')
TOK = TINY.tokens
N_IMAGES = 2
PER_IMAGE = TINY.tokens_per_image          # 196


def pooling(n_images: int) -> torch.Tensor:
    """Golden README section 5: 2x2 windows over the 27x27 grid padded by -1."""
    rows = []
    for k in range(n_images):
        for r in range(14):
            for c in range(14):
                window = []
                for y, x in ((2 * r, 2 * c), (2 * r, 2 * c + 1), (2 * r + 1, 2 * c),
                             (2 * r + 1, 2 * c + 1)):
                    window.append(y * 27 + x + k * 729 if y < 27 and x < 27 else -1)
                rows.append(window)
    return torch.tensor(rows, dtype=torch.int64)


def prompt_ids(n_images: int, text: list[int]) -> list[int]:
    ids = [TOK.bos]
    for k in range(n_images):
        ids += [259, 267 + k, TOK.im_start] + [TOK.im_patch] * PER_IMAGE + [TOK.im_end]
    return ids + [TOK.chat_im_start, 313, 198, 280, 25] + text + [TOK.chat_im_end]


def make_inputs(batch: int = 2, pad: bool = False, seed: int = 0):
    """input_ids (B, L), images uint8, token_pooling, states, attention_mask (B, L) or None.
    With pad=True row 1 has a 5-token shorter instruction, right-padded."""
    g = torch.Generator().manual_seed(seed)
    long_ids = prompt_ids(N_IMAGES, [260, 261, 262, 263, 264, 265, 266])
    ids = [long_ids] * batch
    mask = None
    if pad:
        short = prompt_ids(N_IMAGES, [270, 271])
        ids = [long_ids, short + [TOK.bos] * (len(long_ids) - len(short))]
        mask = torch.tensor([[True] * len(long_ids),
                             [True] * len(short) + [False] * (len(long_ids) - len(short))])
    images = torch.randint(0, 256, (batch, N_IMAGES, 729, 588), generator=g, dtype=torch.uint8)
    states = torch.rand(batch, 1, TINY.state_dim, generator=g) * 2 - 1
    return (torch.tensor(ids), images, pooling(N_IMAGES)[None].expand(batch, -1, -1), states,
            mask)


@pytest.fixture(scope='module')
def model():
    return random_model(TINY, seed=0)


@pytest.fixture(scope='module')
def hidden(model):
    ids, images, pool, _, _ = make_inputs()
    with torch.no_grad():
        return model.llm_hidden_states(ids, images, pool)


def test_vision_backbone_gives_one_d_model_feature_per_im_patch_token(model):
    _, images, pool, _, _ = make_inputs()
    with torch.no_grad():
        feats = model.vision_backbone(images, pool)
    assert feats.shape == (2, N_IMAGES * PER_IMAGE, TINY.llm.d_model)
    assert torch.isfinite(feats).all()


def test_llm_hidden_states_are_every_block_output(hidden):
    ids, _, _, _, _ = make_inputs()
    assert hidden.shape == (TINY.llm.n_layers, 2, ids.shape[1], TINY.llm.d_model)
    assert torch.isfinite(hidden).all()


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_generate_actions_returns_finite_float32_chunk(dtype):
    model = random_model(TINY, seed=1, dtype=dtype)
    ids, images, pool, states, _ = make_inputs()
    with torch.no_grad():
        actions = model.generate_actions(ids, images, pool, states,
                                         generator=torch.Generator().manual_seed(0))
    assert actions.shape == (2, TINY.action_horizon, TINY.action_dim)
    assert actions.dtype == torch.float32
    assert torch.isfinite(actions).all()


def test_generate_actions_is_deterministic_under_a_fixed_seed(model):
    ids, images, pool, states, _ = make_inputs()
    with torch.no_grad():
        runs = [model.generate_actions(ids, images, pool, states,
                                       generator=torch.Generator().manual_seed(seed))
                for seed in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_random_init_is_deterministic_per_seed():
    a, b, c = (random_model(TINY, seed=s) for s in (3, 3, 4))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name


def test_inputs_are_not_mutated(model):
    ids, images, pool, states, _ = make_inputs()
    copies = [t.clone() for t in (ids, images, pool, states)]
    with torch.no_grad():
        model.generate_actions(ids, images, pool, states, num_steps=2)
    for before, after in zip(copies, (ids, images, pool, states)):
        assert torch.equal(before, after)


def test_precomputed_image_positions_give_the_same_hidden_states(model, hidden):
    ids, images, pool, _, _ = make_inputs()
    positions = (ids[0] == TOK.im_patch).nonzero()[:, 0].expand(2, -1)
    with torch.no_grad():
        out = model.llm_hidden_states(ids, images, pool, image_positions=positions)
    assert torch.equal(out, hidden)


def test_image_features_are_added_at_im_patch_positions_only(model):
    ids, images, pool, _, _ = make_inputs(batch=1)
    with torch.no_grad():
        x = model.embed_inputs(ids, images, pool)
        plain = model.transformer.wte(ids)
    is_patch = ids == TOK.im_patch
    assert torch.equal(x[~is_patch], plain[~is_patch])
    assert not torch.equal(x[is_patch], plain[is_patch])


def test_ln_f_is_not_on_the_action_path():
    model = random_model(TINY, seed=2)
    ids, images, pool, states, _ = make_inputs()
    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(float('nan'))
        actions = model.generate_actions(ids, images, pool, states, num_steps=2)
    assert torch.isfinite(actions).all()


def test_image_tokens_attend_across_images_and_text_stays_causal(model):
    ids, _, _, _, _ = make_inputs(batch=1)
    allowed = model.attention_allowed(ids)[0, 0]
    first_patch = int((ids[0] == TOK.im_patch).nonzero()[0])
    last_patch = int((ids[0] == TOK.im_patch).nonzero()[-1])
    image_k_text = first_patch + PER_IMAGE + 1     # "Image 2" after the first <im_end>
    assert allowed[first_patch, last_patch]          # image token sees a later image's token
    assert not allowed[first_patch, image_k_text]    # but not the later "Image 2" text
    assert not allowed[image_k_text, image_k_text + 1]
    assert allowed[-1].all()                         # last text token sees everything


def test_padded_keys_are_masked_and_positions_follow_the_mask(model):
    ids, images, pool, _, mask = make_inputs(pad=True)
    length = int(mask[1].sum())
    with torch.no_grad():
        padded = model.llm_hidden_states(ids, images, pool, attention_mask=mask)
        alone = model.llm_hidden_states(ids[1:, :length], images[1:], pool[1:])
    assert not model.attention_allowed(ids, mask)[1, 0, :, length:].any()
    torch.testing.assert_close(padded[:, 1, :length], alone[:, 0], rtol=1e-5, atol=1e-5)


def cached_and_uncached(model, pad: bool, steps: int):
    """Euler loop through prepare_context + velocity, and through the reference forward."""
    ids, images, pool, states, mask = make_inputs(pad=pad)
    ae = model.action_expert
    enc_mask = mask if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    noise = torch.randn(2, TINY.action_horizon, TINY.action_dim,
                        generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = model.select_ae_layers(
            model.llm_hidden_states(ids, images, pool, attention_mask=mask))
        ctx = ae.prepare_context(hidden, enc_mask, states)
        x_cached, x_ref = noise.clone(), noise.clone()
        for i in range(steps):
            t = torch.full((2,), (i + 0.5) / steps)
            x_cached = x_cached + ae.velocity(x_cached, t, ctx).float() / steps
            x_ref = x_ref + ae(x_ref, t, hidden, enc_mask, states).float() / steps
    return x_cached, x_ref


CACHE_CASES = [(dtype, mode, pad) for dtype in (torch.float32, torch.bfloat16)
               for mode in ('cross_attn', 'self_attn') for pad in (False, True)]


@pytest.fixture(scope='module')
def models_by_dtype_and_mode():
    return {(dtype, mode): random_model(TINY.replace(states_mode=mode), seed=3, dtype=dtype)
            for dtype in (torch.float32, torch.bfloat16) for mode in ('cross_attn', 'self_attn')}


@pytest.mark.parametrize('dtype,mode,pad', CACHE_CASES)
@pytest.mark.parametrize('steps', [1, 10])
def test_cached_action_expert_equals_uncached_bitwise(models_by_dtype_and_mode, dtype, mode,
                                                      pad, steps):
    x_cached, x_ref = cached_and_uncached(models_by_dtype_and_mode[dtype, mode], pad, steps)
    assert torch.isfinite(x_ref).all()
    assert torch.equal(x_cached, x_ref)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_precomputed_time_conditioning_equals_per_step_bitwise(models_by_dtype_and_mode, dtype):
    model = models_by_dtype_and_mode[dtype, 'cross_attn']
    ae = model.action_expert
    ids, images, pool, states, _ = make_inputs()
    steps = TINY.flow_steps
    with torch.no_grad():
        hidden = model.llm_hidden_states(ids, images, pool)
        ctx = ae.prepare_context(hidden, torch.ones_like(ids, dtype=torch.bool), states)
        conds = [ae.time_conditioning(torch.full((2,), i / steps)) for i in range(steps)]
        x_pre = x_step = torch.randn(2, TINY.action_horizon, TINY.action_dim)
        for i in range(steps):
            x_pre = x_pre + ae.velocity_from_conditioning(x_pre, conds[i], ctx).float() / steps
            t = torch.full((2,), i / steps)
            x_step = x_step + ae.velocity(x_step, t, ctx).float() / steps
    assert torch.equal(x_pre, x_step)


def test_time_conditioning_depends_on_t(model):
    ae = model.action_expert
    with torch.no_grad():
        a, b = ae.time_conditioning(torch.zeros(1)), ae.time_conditioning(torch.full((1,), .5))
    assert a.blocks.shape == (TINY.action_expert.num_layers, 9, 1,
                              TINY.action_expert.hidden_size)
    assert a.final.shape == (2, 1, TINY.action_expert.hidden_size)
    assert not torch.equal(a.blocks, b.blocks)


def test_even_layer_mode_feeds_the_selected_llm_layers():
    cfg = TINY.replace(action_expert_layer_mode='even',
                       action_expert=ActionExpertConfig(hidden_size=48, num_layers=3,
                                                        num_heads=4))
    assert cfg.ae_layer_ids == (0, 2, 3)
    model = random_model(cfg, seed=0)
    ids, images, pool, states, _ = make_inputs()
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim)
    with torch.no_grad():
        actions = model.generate_actions(ids, images, pool, states, noise=noise, num_steps=1)
        hidden = model.llm_hidden_states(ids, images, pool)[[0, 2, 3]]
        v = model.action_expert(noise, torch.zeros(2), hidden,
                                torch.ones_like(ids, dtype=torch.bool), states)
    assert torch.equal(actions, noise + v)


@pytest.mark.parametrize('n_llm, n_ae, expected', [
    (4, 3, (0, 2, 3)),          # 1.5 -> 2: half-up and half-to-even agree
    (6, 3, (0, 2, 5)),          # 2.5 -> 2 (half to even), not 3
    (10, 3, (0, 4, 9)),         # 4.5 -> 4, not 5
    (6, 5, (0, 1, 2, 4, 5)),    # 2.5 -> 2, 3.75 -> 4
    (2, 3, (0, 0, 1)),          # 0.5 -> 0, not 1
    (1, 3, (0, 0, 0)),          # one LLM layer feeds every block
    (6, 1, (5,)),               # one block reads the last layer
])
def test_even_layer_mode_rounds_like_pythons_round(n_llm, n_ae, expected):
    """Upstream `_select_layer_states`: round(i * (n_llm - 1) / (n_ae - 1)) with Python's
    round, half to even (../shared/docs/molmobot_model.md: 3 blocks over 6 layers ->
    [0, 2, 5])."""
    cfg = TINY.replace(action_expert_layer_mode='even',
                       llm=dataclasses.replace(TINY.llm, n_layers=n_llm),
                       action_expert=dataclasses.replace(TINY.action_expert, num_layers=n_ae))
    assert cfg.ae_layer_ids == expected


@pytest.mark.parametrize('n_obs, max_horizon, ok', [(1, 16, False), (1, 17, True),
                                                    (2, 17, False), (2, 18, True)])
def test_self_attn_config_needs_a_position_embedding_per_state_and_action_token(
        n_obs, max_horizon, ok):
    def build():
        return TINY.replace(states_mode='self_attn', n_obs_steps=n_obs,
                            action_expert=dataclasses.replace(TINY.action_expert,
                                                              max_horizon=max_horizon))
    if ok:
        assert build().action_expert.max_horizon == max_horizon
    else:
        with pytest.raises(ValueError, match=rf'max_horizon >= {16 + n_obs} .*got '
                                             rf'{max_horizon}'):
            build()


def test_cross_attn_config_needs_position_embeddings_for_the_actions_only():
    cfg = TINY.replace(n_obs_steps=2,
                       action_expert=dataclasses.replace(TINY.action_expert, max_horizon=16))
    assert cfg.action_expert.max_horizon == cfg.action_horizon == 16


def test_non_uint8_images_raise_value_error(model):
    ids, images, pool, states, _ = make_inputs()
    with pytest.raises(ValueError, match='images must be uint8'):
        model.llm_hidden_states(ids, images.float(), pool)


def test_im_patch_count_mismatch_raises_value_error(model):
    ids, images, pool, states, _ = make_inputs()
    with pytest.raises(ValueError, match='<im_patch>'):
        model.llm_hidden_states(ids[:, :-200], images, pool)


def test_wrong_state_shape_raises_value_error(model):
    ids, images, pool, states, _ = make_inputs()
    with pytest.raises(ValueError, match='states must be'):
        model.generate_actions(ids, images, pool, states[..., :5])


def test_wrong_noise_shape_raises_value_error(model):
    ids, images, pool, states, _ = make_inputs()
    with pytest.raises(ValueError, match='noise must be'):
        model.generate_actions(ids, images, pool, states, noise=torch.zeros(2, 3, 8))


def test_unknown_preset_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown model preset 'tiny2'; expected one of .*'tiny'"):
        MolmoBotConfig.from_name('tiny2')
