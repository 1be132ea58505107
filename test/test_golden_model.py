"""The model against the upstream golden data (../shared/golden/molmobot_tiny/README.md):
float32 on CPU, the stored uint8 images, ids, pooling indices, states and flow noise fed in;
each output within 1e-4 relative (||ours - ref|| / ||ref||)."""

import numpy as np
import pytest
import torch

from molmobot_policy.model.checkpoint import load_checkpoint

from _golden import GOLDEN, MISSING  # noqa: E402  (test/_golden.py: the data's location)

CASES = ['case1_2cam_360x640', 'case2_8cam_480x640']
RTOL = 1e-4

pytestmark = pytest.mark.skipif(not (GOLDEN / 'model.pt').is_file(),
                                reason=MISSING)


def rel_err(ours, ref) -> float:
    ours = np.asarray(torch.as_tensor(ours).detach().double())
    ref = np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


@pytest.fixture(scope='module')
def golden_model():
    torch.manual_seed(0)
    model, cfg = load_checkpoint(GOLDEN, device='cpu', dtype=torch.float32)
    return model, cfg


@pytest.fixture(scope='module', params=CASES)
def case(request):
    z = np.load(GOLDEN / f'{request.param}.npz')
    return {k: z[k] for k in z.files}


def inputs(case):
    return (torch.from_numpy(case['input_ids']), torch.from_numpy(case['images']),
            torch.from_numpy(case['token_pooling']))


@pytest.fixture(scope='module')
def hidden_states(golden_model, case):
    model, _ = golden_model
    with torch.no_grad():
        return model.llm_hidden_states(*inputs(case),
                                       position_ids=torch.from_numpy(case['position_ids']))


def test_vit_features_match_golden(golden_model, case):
    if 'vit_features' not in case:
        pytest.skip('this case stores no vit_features (golden README section 7)')
    model, _ = golden_model
    with torch.no_grad():
        feats = model.vision_backbone.encode_image(torch.from_numpy(case['images']))
    assert rel_err(feats, case['vit_features']) < RTOL


def test_image_features_match_golden(golden_model, case):
    model, _ = golden_model
    with torch.no_grad():
        feats = model.vision_backbone(torch.from_numpy(case['images']),
                                      torch.from_numpy(case['token_pooling']))
    assert rel_err(feats[0], case['image_features']) < RTOL


def test_llm_input_embeddings_match_golden(golden_model, case):
    model, _ = golden_model
    with torch.no_grad():
        x = model.embed_inputs(*inputs(case))
    assert rel_err(x, case['llm_input_embeddings']) < RTOL


def test_llm_attention_mask_equals_golden(golden_model, case):
    model, _ = golden_model
    allowed = model.attention_allowed(torch.from_numpy(case['input_ids']))
    np.testing.assert_array_equal(allowed.numpy(), case['llm_attention_mask'])


def test_every_llm_layer_hidden_state_matches_golden(hidden_states, case):
    ref = case['llm_layer_hidden_states']
    assert hidden_states.shape == ref.shape
    errors = [rel_err(hidden_states[i], ref[i]) for i in range(ref.shape[0])]
    assert max(errors) < RTOL, errors


def test_every_llm_layer_matches_golden_through_the_tile_classified_mask(golden_model, case):
    """The served flash path's mask object (`llm_attention: flash`): per-token kinds, tile
    classes and the op's CPU schedule of them, in place of the additive mask."""
    from molmobot_policy.runtime.serving import image_tokens_mask
    model, _ = golden_model
    with torch.no_grad():
        hidden = model.llm_hidden_states(*inputs(case),
                                         position_ids=torch.from_numpy(case['position_ids']),
                                         llm_mask=image_tokens_mask(model))
    ref = case['llm_layer_hidden_states']
    errors = [rel_err(hidden[i], ref[i]) for i in range(ref.shape[0])]
    assert max(errors) < RTOL, errors


def test_velocity_step0_matches_golden(golden_model, case, hidden_states):
    model, _ = golden_model
    ae = model.action_expert
    with torch.no_grad():
        ctx = ae.prepare_context(model.select_ae_layers(hidden_states),
                                 torch.from_numpy(case['ae_encoder_attention_mask']),
                                 torch.from_numpy(case['states']))
        v = ae.velocity(torch.from_numpy(case['flow_noise']), torch.zeros(1), ctx)
    assert rel_err(v, case['velocity_step0']) < RTOL


def test_actions_normalized_match_golden(golden_model, case):
    model, _ = golden_model
    with torch.no_grad():
        actions = model.generate_actions(*inputs(case), torch.from_numpy(case['states']),
                                         noise=torch.from_numpy(case['flow_noise']),
                                         position_ids=torch.from_numpy(case['position_ids']),
                                         num_steps=int(case['flow_num_steps']))
    assert actions.dtype == torch.float32
    assert rel_err(actions, case['actions_normalized']) < RTOL


def test_actions_unnormalized_match_golden_with_config_stats(golden_model, case):
    """State normalized and actions unnormalized with the config's quantile stats, by the
    golden README section 5 formulas."""
    model, cfg = golden_model
    s01, s99 = (np.asarray(v, np.float32) for v in (cfg.norm_stats.state_q01,
                                                     cfg.norm_stats.state_q99))
    a01, a99 = (np.asarray(v, np.float32) for v in (cfg.norm_stats.action_q01,
                                                     cfg.norm_stats.action_q99))
    states = 2 * (case['state_raw'] - s01) / np.maximum(s99 - s01, 1e-6) - 1
    np.testing.assert_allclose(states, case['states'][0, 0], rtol=0, atol=1e-6)
    with torch.no_grad():
        actions = model.generate_actions(*inputs(case), torch.from_numpy(states)[None, None],
                                         noise=torch.from_numpy(case['flow_noise']))
    unnormalized = (actions[0].numpy() + 1) * (a99 - a01) / 2 + a01
    assert rel_err(unnormalized, case['actions_unnormalized']) < RTOL
