"""Preprocessing against the upstream golden data (../shared/golden/molmobot_tiny, README
sections 4, 5 and 8): images, token ids, pooling indices, state and action (un)normalization,
through the objects the engine serves with (`Preprocessor`, `PromptFitter`, `RobotTransforms`).
"""

import numpy as np
import pytest

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.preprocess.images import pooling_indices, resize_and_patchify
from molmobot_policy.preprocess.pipeline import Preprocessor
from molmobot_policy.preprocess.prompt import PromptFitter, image_token_positions
from molmobot_policy.preprocess.tokenizer import tiny_tokenizer
from molmobot_policy.preprocess.transforms import RobotContract, RobotTransforms
from molmobot_policy.types import Observation

from _golden import GOLDEN, MISSING  # noqa: E402  (test/_golden.py: the data's location)

CASES = ['case1_2cam_360x640', 'case2_8cam_480x640']
TINY = MolmoBotConfig.from_name('tiny')

pytestmark = pytest.mark.skipif(not GOLDEN.is_dir(), reason=MISSING)


@pytest.fixture(scope='module', params=CASES)
def case(request):
    with np.load(GOLDEN / f'{request.param}.npz') as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope='module')
def tok():
    return tiny_tokenizer(TINY.tokens)


def test_images_match_upstream_except_flagged_rounding_ties(case):
    patches = resize_and_patchify(case['images_raw'])
    expected = case['images'][0]
    assert patches.shape == expected.shape
    diff = patches.astype(np.int16) - expected.astype(np.int16)
    assert np.abs(diff).max() <= 1
    assert not np.any((diff != 0) & ~case['images_rounding_ambiguous'][0])


def test_token_pooling_matches_upstream_exactly(case, tok):
    n_images = case['images_raw'].shape[0]
    np.testing.assert_array_equal(pooling_indices(n_images), case['token_pooling'][0])
    served = PromptFitter(tok, TINY, n_images).token_pooling    # from the config's geometry
    np.testing.assert_array_equal(served, case['token_pooling'][0])


def test_tiny_tokenizer_vocab_matches_the_golden_token_strings(case, tok):
    for token_id, string in zip(case['input_ids'][0], case['input_token_strings']):
        assert tok.id_to_token(int(token_id)) == str(string)


def test_prompt_ids_match_upstream_exactly(case, tok):
    text = PromptFitter(tok, TINY, case['images_raw'].shape[0]).text_inputs(
        str(case['instruction']))
    np.testing.assert_array_equal(text.input_ids, case['input_ids'][0])
    np.testing.assert_array_equal(text.position_ids, case['position_ids'][0])
    assert text.attention_mask.all() and text.bucket == 0


def test_image_positions_select_the_rows_where_image_features_are_added(case):
    ids = case['input_ids'][0]
    positions = image_token_positions(ids, TINY.tokens)
    assert positions.shape == (case['token_pooling'].shape[1],)
    # README section 4: <im_start> at 3 + 200 k, its 196 patches right after it.
    starts = 3 + 200 * np.arange(case['images_raw'].shape[0])
    expected = (starts[:, None] + 1 + np.arange(196)[None]).reshape(-1)
    np.testing.assert_array_equal(positions, expected)


def transforms(case) -> RobotTransforms:
    return RobotTransforms(RobotContract.numbered(case['images_raw'].shape[0], 8), TINY)


def test_state_normalization_matches_upstream(case):
    normalized = transforms(case).normalize_state(case['state_raw'])
    np.testing.assert_allclose(normalized, case['state_normalized'][0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(normalized, case['states'][0, 0], rtol=0, atol=1e-6)


def test_action_unnormalization_matches_upstream(case):
    actions = transforms(case).postprocess(case['actions_normalized'][0])
    scale = (np.float32(TINY.norm_stats.action_q99) - np.float32(TINY.norm_stats.action_q01)) / 2
    # README section 8: scale the float tolerance by (q99 - q01) / 2 per dimension.
    assert np.all(np.abs(actions - case['actions_unnormalized']) <= 1e-6 * scale)


def test_preprocessor_reproduces_every_model_input(case, tok):
    n_images = case['images_raw'].shape[0]
    preprocessor = Preprocessor(TINY, tok, RobotContract.numbered(n_images, 8))
    inputs = preprocessor(Observation(images=tuple(case['images_raw']), state=case['state_raw'],
                                      instruction=str(case['instruction'])))
    np.testing.assert_array_equal(inputs.input_ids.numpy(), case['input_ids'])
    np.testing.assert_array_equal(inputs.position_ids.numpy(), case['position_ids'])
    np.testing.assert_array_equal(inputs.token_pooling.numpy(), case['token_pooling'])
    positions = image_token_positions(case['input_ids'][0], TINY.tokens)
    np.testing.assert_array_equal(inputs.image_positions.numpy()[0], positions)
    diff = inputs.images.numpy().astype(np.int16) - case['images'].astype(np.int16)
    assert diff.shape == case['images'].shape
    assert not np.any((diff != 0) & ~case['images_rounding_ambiguous'])
    np.testing.assert_allclose(inputs.states.numpy(), case['states'], rtol=0, atol=1e-6)
