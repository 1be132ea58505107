"""The action expert in both states modes against a plain float32 re-derivation written from
the upstream description (test/_dit_reference.py), and that re-derivation against upstream's
own golden outputs (cross_attn, the mode of the golden data).

self_attn (upstream `olmo/nn/action_expert.py`): the state tokens are prepended to the
embedded actions and then `action_pos_embed[:, :n_obs + horizon]` is added, so the states
take positions 0..n_obs-1; the final layer's output keeps the action tokens only.
"""
import dataclasses

import numpy as np
import pytest
import torch

from molmobot_policy.model.checkpoint import random_model
from molmobot_policy.model.config import MolmoBotConfig

import _dit_reference as ref
from _golden import GOLDEN, MISSING  # noqa: E402  (test/_golden.py: the data's location)

TINY = MolmoBotConfig.from_name('tiny')
HEADS = TINY.action_expert.num_heads
# the checkpoint shape of the failed upstream comparison: 6 LLM layers, 3 action-expert
# blocks fed (upstream's round(), half to even) by LLM layers 0, 2 and 5
SELF_ATTN = TINY.replace(states_mode='self_attn', action_expert_layer_mode='even',
                         llm=dataclasses.replace(TINY.llm, n_layers=6),
                         action_expert=dataclasses.replace(TINY.action_expert, num_layers=3))
EVEN_LAYERS = [0, 2, 5]
ATOL = 1e-5


def prompt_ids(n_images: int, text: list[int]) -> list[int]:
    tok = TINY.tokens
    ids = [tok.bos]
    for k in range(n_images):
        ids += [259, 267 + k, tok.im_start] + [tok.im_patch] * TINY.tokens_per_image
        ids += [tok.im_end]
    return ids + [tok.chat_im_start, 313, 198, 280, 25] + text + [tok.chat_im_end]


def pooling(n_images: int) -> torch.Tensor:
    """Golden README section 5: 2x2 windows over the 27x27 grid, padded with -1."""
    rows = []
    for k in range(n_images):
        for r in range(14):
            for c in range(14):
                rows.append([y * 27 + x + k * 729 if y < 27 and x < 27 else -1
                             for y, x in ((2 * r, 2 * c), (2 * r, 2 * c + 1),
                                          (2 * r + 1, 2 * c), (2 * r + 1, 2 * c + 1))])
    return torch.tensor(rows, dtype=torch.int64)


def batch(seed: int = 0, n_obs: int = 1):
    """Two queries, the second with a 5-token shorter instruction right-padded (so the
    cross-attention mask matters): ids, images, token_pooling, mask, states, noise."""
    g = torch.Generator().manual_seed(seed)
    long = prompt_ids(2, [260, 261, 262, 263, 264, 265, 266])
    short = prompt_ids(2, [270, 271])
    ids = torch.tensor([long, short + [TINY.tokens.bos] * (len(long) - len(short))])
    mask = torch.tensor([[True] * len(long),
                         [True] * len(short) + [False] * (len(long) - len(short))])
    images = torch.randint(0, 256, (2, 2, 729, 588), generator=g, dtype=torch.uint8)
    states = torch.rand(2, n_obs, TINY.state_dim, generator=g) * 2 - 1
    noise = torch.randn(2, TINY.action_horizon, TINY.action_dim, generator=g)
    return ids, images, pooling(2)[None].expand(2, -1, -1), mask, states, noise


@pytest.fixture(scope='module')
def self_attn_model():
    return random_model(SELF_ATTN, seed=3)


@pytest.fixture(scope='module')
def self_attn_inputs(self_attn_model):
    ids, images, pool, mask, states, noise = batch()
    with torch.no_grad():
        hidden = self_attn_model.llm_hidden_states(ids, images, pool, attention_mask=mask)
    return ids, images, pool, mask, states, noise, [hidden[i] for i in EVEN_LAYERS]


# -- the re-derivation against upstream's golden outputs (cross_attn) ------------------------

@pytest.fixture(scope='module')
def golden():
    if not (GOLDEN / 'model.pt').is_file():
        pytest.skip(MISSING)
    z = np.load(GOLDEN / 'case1_2cam_360x640.npz')
    case = {k: torch.from_numpy(z[k]) for k in ('llm_layer_hidden_states', 'flow_noise',
                                                 'ae_encoder_attention_mask', 'states',
                                                 'velocity_step0', 'actions_normalized')}
    return torch.load(GOLDEN / 'model.pt', weights_only=True), case


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_re_derivation_reproduces_golden_velocity_step0_in_cross_attn_mode(golden):
    sd, case = golden
    v = ref.velocity(sd, case['flow_noise'], torch.zeros(1),
                     list(case['llm_layer_hidden_states']), case['ae_encoder_attention_mask'],
                     case['states'], states_mode='cross_attn', heads=HEADS)
    assert rel_err(v, case['velocity_step0']) < 1e-5


def test_re_derivation_reproduces_golden_actions_in_cross_attn_mode(golden):
    sd, case = golden
    actions = ref.flow(sd, case['flow_noise'], list(case['llm_layer_hidden_states']),
                       case['ae_encoder_attention_mask'], case['states'],
                       states_mode='cross_attn', heads=HEADS)
    assert rel_err(actions, case['actions_normalized']) < 1e-5


# -- our model against the re-derivation -----------------------------------------------------

def test_even_mode_self_attn_config_selects_layers_0_2_5():
    assert list(SELF_ATTN.ae_layer_ids) == EVEN_LAYERS


@pytest.mark.parametrize('t', [0.0, 0.3])
def test_self_attn_velocity_matches_the_re_derivation(self_attn_model, self_attn_inputs, t):
    ids, images, pool, mask, states, noise, layers = self_attn_inputs
    ae = self_attn_model.action_expert
    times = torch.full((2,), t)
    with torch.no_grad():
        ctx = ae.prepare_context(torch.stack(layers), mask, states)
        ours = ae.velocity(noise, times, ctx)
    expected = ref.velocity(self_attn_model.state_dict(), noise, times, layers, mask, states,
                            states_mode='self_attn', heads=HEADS)
    torch.testing.assert_close(ours, expected, rtol=0, atol=ATOL)


def test_self_attn_generate_actions_matches_the_re_derived_flow(self_attn_model,
                                                                self_attn_inputs):
    """The whole fp32 reference path (LLM, layer selection 0/2/5, K/V cache, 10 Euler
    steps) against the re-derived flow on the same LLM layers."""
    ids, images, pool, mask, states, noise, layers = self_attn_inputs
    with torch.no_grad():
        actions = self_attn_model.generate_actions(ids, images, pool, states, noise=noise,
                                                   attention_mask=mask)
    expected = ref.flow(self_attn_model.state_dict(), noise, layers, mask, states,
                        states_mode='self_attn', heads=HEADS)
    assert actions.dtype == torch.float32
    torch.testing.assert_close(actions, expected, rtol=0, atol=ATOL)


def test_self_attn_with_two_state_tokens_matches_the_re_derivation(self_attn_model,
                                                                   self_attn_inputs):
    """n_obs = 2: the states take positions 0 and 1, the actions 2..H+1, and both state
    tokens are dropped before the final layer."""
    _, _, _, mask, _, noise, layers = self_attn_inputs
    states = batch(seed=1, n_obs=2)[4]
    ae = self_attn_model.action_expert
    with torch.no_grad():
        ours = ae(noise, torch.full((2,), 0.5), torch.stack(layers), mask, states)
    expected = ref.velocity(self_attn_model.state_dict(), noise, torch.full((2,), 0.5), layers,
                            mask, states, states_mode='self_attn', heads=HEADS)
    assert ours.shape == noise.shape
    torch.testing.assert_close(ours, expected, rtol=0, atol=ATOL)


def test_cross_attn_velocity_of_the_same_model_matches_the_re_derivation(self_attn_model,
                                                                         self_attn_inputs):
    """The same weights read in cross_attn mode (the state token in every block's context,
    positions 0..H-1 for the actions)."""
    _, _, _, mask, states, noise, layers = self_attn_inputs
    ae = self_attn_model.action_expert
    ae.states_mode = 'cross_attn'
    try:
        with torch.no_grad():
            ours = ae(noise, torch.full((2,), 0.7), torch.stack(layers), mask, states)
    finally:
        ae.states_mode = 'self_attn'
    expected = ref.velocity(self_attn_model.state_dict(), noise, torch.full((2,), 0.7), layers,
                            mask, states, states_mode='cross_attn', heads=HEADS)
    torch.testing.assert_close(ours, expected, rtol=0, atol=ATOL)


def test_too_many_self_attention_tokens_are_refused_with_the_numbers():
    ae = random_model(SELF_ATTN, seed=0).action_expert
    h = SELF_ATTN.action_expert.max_horizon
    x_t = torch.zeros(1, h, SELF_ATTN.action_dim)
    with pytest.raises(ValueError, match=rf'{h + 1} action-expert tokens \({h} actions \+ 1 '
                                         rf'state tokens\) exceed max_horizon = {h}'):
        ae.embed_actions(x_t, torch.zeros(1, 1, SELF_ATTN.action_expert.hidden_size))
