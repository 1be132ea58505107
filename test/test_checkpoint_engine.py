"""A checkpoint served through the engine: the golden cases end to end (raw images, raw state,
instruction -> our preprocessing -> model -> unnormalized actions), the tokenizer the engine
picks, the normalization stats key and the checkpoint's image geometry. The golden checkpoint
ships no tokenizer.json: it is served with the built-in tiny tokenizer, chosen explicitly.
Golden data: ../shared/golden/molmobot_tiny/README.md (sections 5, 7 and 8)."""
from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from tokenizers import Tokenizer, models

from molmobot_policy.model.checkpoint import config_from_upstream, load_config, random_model
from molmobot_policy.model.config import TokenIds
from molmobot_policy.preprocess.tokenizer import TextTokenizer, resolve_tokenizer, tiny_tokenizer
from molmobot_policy.preprocess.transforms import RobotContract
from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine
from molmobot_policy.types import Observation

from _golden import GOLDEN, MISSING  # noqa: E402  (test/_golden.py: the data's location)

CASES = {'case1_2cam_360x640': 2, 'case2_8cam_480x640': 8}
ACTION_ATOL = 2e-5      # golden README section 8: own preprocessing, normalized actions
QWEN_VOCAB = 151936

pytestmark = pytest.mark.skipif(not (GOLDEN / 'model.pt').is_file(),
                                reason=MISSING)


@pytest.fixture(scope='module', params=list(CASES))
def case(request):
    z = np.load(GOLDEN / f'{request.param}.npz')
    return {'name': request.param, **{k: z[k] for k in z.files}}


@pytest.fixture(scope='module')
def golden_engine(case):
    return PolicyEngine(EngineConfig(checkpoint_path=str(GOLDEN), tokenizer='tiny', device='cpu',
                                     dtype='float32'), contract=contract(CASES[case['name']]))


def contract(cameras: int = 2, **gripper) -> RobotContract:
    """The golden robot: `cameras` cameras, 7 arm joints + the gripper."""
    return RobotContract.numbered(cameras, 8, **gripper)


def golden_observation(case) -> Observation:
    return Observation(images=tuple(case['images_raw']), state=case['state_raw'],
                       instruction=str(case['instruction']))


def golden_config() -> dict:
    return yaml.safe_load((GOLDEN / 'config.yaml').read_text())


def write_checkpoint(directory: Path, config: dict, state: dict | None = None) -> Path:
    """A checkpoint directory: config.yaml, and model.pt (the golden one when state is None)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / 'config.yaml').write_text(yaml.safe_dump(config))
    if state is None:
        shutil.copy(GOLDEN / 'model.pt', directory / 'model.pt')
    else:
        torch.save(state, directory / 'model.pt')
    return directory


def with_stats(config: dict, key: str, scale: float = 2.0, action_dims: int | None = None) -> dict:
    """The config with a second stats entry `key`: the golden stats scaled, in both the
    robot pre- and postprocessor; optionally the action stats cut to `action_dims`."""
    config = copy.deepcopy(config)
    for processor in ('robot_preprocessor', 'robot_postprocessor'):
        by_repo = config['model'][processor]['stats_by_repo']
        entry = copy.deepcopy(by_repo['synthmanip'])
        for stats in entry.values():
            for name, values in stats.items():
                stats[name] = [v * scale for v in values]
        if action_dims is not None:
            entry['action'] = {k: v[:action_dims] for k, v in entry['action'].items()}
        by_repo[key] = entry
    return config


@pytest.fixture(scope='module')
def qwen_checkpoint(tmp_path_factory) -> Path:
    """The golden architecture with Qwen3's vocabulary size (151936): the token ids of a
    released checkpoint, random weights, no tokenizer.json."""
    config = golden_config()
    config['model']['llm']['vocab_size'] = config['model']['llm']['embedding_size'] = QWEN_VOCAB
    model = random_model(config_from_upstream(config), seed=0)
    return write_checkpoint(tmp_path_factory.mktemp('qwen_ckpt'), config, model.state_dict())


def qwen_like_tokenizer_json(path: Path, bos: int = 151643) -> Path:
    """A word-level tokenizer.json with Qwen3's chat special ids (<|endoftext|> = bos)."""
    vocab = {'[UNK]': 0, 'pick': 1, 'up': 2, '<|endoftext|>': bos, '<|im_start|>': 151644,
             '<|im_end|>': 151645}
    Tokenizer(models.WordLevel(vocab, unk_token='[UNK]')).save(str(path))
    return path


# ------------------------------------------------------------------ golden, end to end
def test_engine_builds_the_golden_prompt_ids_with_the_tiny_tokenizer(golden_engine, case):
    text = golden_engine.text_inputs(str(case['instruction']))
    np.testing.assert_array_equal(text.input_ids, case['input_ids'][0])
    np.testing.assert_array_equal(text.token_pooling, case['token_pooling'][0])


def test_engine_normalizes_the_raw_state_like_upstream(golden_engine, case):
    normalized = golden_engine.preprocessor.transforms.normalize_state(case['state_raw'])
    np.testing.assert_allclose(normalized, case['states'][0, 0], rtol=0, atol=1e-6)


def test_engine_reproduces_golden_normalized_actions(golden_engine, case):
    chunk = golden_engine.predict(golden_observation(case), noise=case['flow_noise'][0])
    np.testing.assert_allclose(chunk.actions_normalized, case['actions_normalized'][0],
                               rtol=0, atol=ACTION_ATOL)


def test_engine_reproduces_golden_unnormalized_actions(golden_engine, case):
    chunk = golden_engine.predict(golden_observation(case), noise=case['flow_noise'][0])
    stats = golden_engine.model_config.norm_stats
    half_range = (np.asarray(stats.action_q99) - np.asarray(stats.action_q01)) / 2
    error = np.abs(chunk.actions - case['actions_unnormalized']) / half_range
    assert error.max() < ACTION_ATOL, error.max(axis=0)


# ------------------------------------------------------------------ tokenizer choice
def test_auto_tokenizer_refuses_a_tiny_vocabulary_checkpoint_without_tokenizer_json():
    """Another tokenizer of the tiny vocabulary size would tokenize every instruction
    differently with no sign of it: the checkpoint must bring its tokenizer.json, or the
    built-in one must be chosen explicitly."""
    with pytest.raises(FileNotFoundError) as error:
        PolicyEngine(EngineConfig(checkpoint_path=str(GOLDEN)))
    message = str(error.value)
    assert str(GOLDEN / 'tokenizer.json') in message and 'tokenizer_path' in message
    assert "'tiny'" in message


def test_explicit_tiny_tokenizer_serves_a_tiny_vocabulary_checkpoint():
    engine = PolicyEngine(EngineConfig(checkpoint_path=str(GOLDEN), tokenizer='tiny'))
    assert engine.tokenizer.source == 'tiny'


def test_engine_takes_a_tokenizer_object(case):
    engine = PolicyEngine(EngineConfig(checkpoint_path=str(GOLDEN)),
                          tokenizer=tiny_tokenizer(TokenIds.for_vocab(512, 320, 321, 322)),
                          contract=contract(CASES[case['name']]))
    text = engine.text_inputs(str(case['instruction']))
    np.testing.assert_array_equal(text.input_ids, case['input_ids'][0])


def test_a_tokenizer_object_with_other_special_ids_is_refused(qwen_checkpoint):
    with pytest.raises(ValueError, match=r'<\|endoftext\|> has id 320.*151643'):
        PolicyEngine(EngineConfig(checkpoint_path=str(qwen_checkpoint)),
                     tokenizer=tiny_tokenizer())


def test_tokenizer_json_beside_the_checkpoint_is_preferred(tmp_path):
    directory = write_checkpoint(tmp_path / 'ckpt', golden_config())
    tiny_tokenizer().save(directory / 'tokenizer.json')
    engine = PolicyEngine(EngineConfig(checkpoint_path=str(directory)))
    assert engine.tokenizer.source == str(directory / 'tokenizer.json')


def test_real_vocabulary_checkpoint_without_tokenizer_json_fails_naming_the_file(
        qwen_checkpoint):
    with pytest.raises(FileNotFoundError) as error:
        PolicyEngine(EngineConfig(checkpoint_path=str(qwen_checkpoint)))
    message = str(error.value)
    assert str(qwen_checkpoint / 'tokenizer.json') in message
    assert 'tokenizer_path' in message


def test_real_vocabulary_checkpoint_loads_the_tokenizer_path_it_is_given(qwen_checkpoint,
                                                                         tmp_path):
    path = qwen_like_tokenizer_json(tmp_path / 'tokenizer.json')
    engine = PolicyEngine(EngineConfig(checkpoint_path=str(qwen_checkpoint),
                                       tokenizer_path=str(path)))
    assert engine.tokenizer.source == str(path)
    assert engine.text_inputs('pick up').input_ids[0] == 151643   # BOS = <|endoftext|>


def test_tokenizer_special_ids_are_checked_against_the_checkpoint(qwen_checkpoint, tmp_path):
    path = qwen_like_tokenizer_json(tmp_path / 'tokenizer.json', bos=151000)
    with pytest.raises(ValueError, match='<\\|endoftext\\|>.*151000.*151643'):
        PolicyEngine(EngineConfig(checkpoint_path=str(qwen_checkpoint), tokenizer_path=str(path)))


def test_tiny_tokenizer_is_refused_for_a_real_vocabulary_checkpoint(qwen_checkpoint):
    with pytest.raises(ValueError, match='tokenizer=tiny'):
        PolicyEngine(EngineConfig(checkpoint_path=str(qwen_checkpoint), tokenizer='tiny'))


def test_file_tokenizer_mode_needs_a_tokenizer_json(tmp_path):
    directory = write_checkpoint(tmp_path / 'ckpt', golden_config())
    with pytest.raises(FileNotFoundError, match='tokenizer.json'):
        PolicyEngine(EngineConfig(checkpoint_path=str(directory), tokenizer='file'))


def test_random_weights_get_the_tiny_tokenizer_whatever_the_vocabulary():
    tokenizer = resolve_tokenizer('auto', TokenIds(), tokenizer_path='', checkpoint_path='')
    assert isinstance(tokenizer, TextTokenizer) and tokenizer.source == 'tiny'


def test_unknown_tokenizer_mode_is_rejected_by_name():
    with pytest.raises(ValueError, match="tokenizer must be one of.*'qwen'"):
        EngineConfig(tokenizer='qwen')


# ------------------------------------------------------------------ normalization stats key
def test_norm_stats_key_selects_that_datasets_statistics(tmp_path):
    directory = write_checkpoint(tmp_path / 'ckpt', with_stats(golden_config(), 'droid', 2.0))
    default = PolicyEngine(EngineConfig(checkpoint_path=str(directory), tokenizer='tiny'))
    chosen = PolicyEngine(EngineConfig(checkpoint_path=str(directory), tokenizer='tiny',
                                       norm_stats_key='droid'))
    chosen, default = chosen.preprocessor.transforms, default.preprocessor.transforms
    np.testing.assert_allclose(chosen.action_normalizer.q99, 2.0 * default.action_normalizer.q99,
                               rtol=1e-6)
    np.testing.assert_allclose(chosen.state_normalizer.q01, 2.0 * default.state_normalizer.q01,
                               rtol=1e-6)


def test_unknown_norm_stats_key_fails_listing_the_keys_there_are():
    with pytest.raises(ValueError, match="'droid'.*norm_stats_key.*\\['synthmanip'\\]"):
        PolicyEngine(EngineConfig(checkpoint_path=str(GOLDEN), norm_stats_key='droid'))


def test_norm_stats_key_with_the_wrong_action_width_fails_naming_key_and_width(tmp_path):
    config = with_stats(golden_config(), 'seven', action_dims=7)
    directory = write_checkpoint(tmp_path / 'ckpt', config)
    with pytest.raises(ValueError, match="action stats of 'seven' have 7 entries.*action_dim = 8"):
        PolicyEngine(EngineConfig(checkpoint_path=str(directory), norm_stats_key='seven'))


def test_norm_stats_key_needs_a_checkpoint():
    with pytest.raises(ValueError, match='norm_stats_key.*checkpoint_path'):
        EngineConfig(model='tiny', norm_stats_key='synthmanip')


# ------------------------------------------------------------------ gripper
def test_golden_gripper_on_its_0_to_255_scale_is_thresholded_at_128(golden_engine, case):
    gripper = contract(CASES[case['name']], gripper_index=7, gripper_threshold=128.0,
                       gripper_open=0.0, gripper_closed=1.0)
    engine = PolicyEngine(golden_engine.config, model=golden_engine.model, contract=gripper)
    chunk = engine.predict(golden_observation(case), noise=case['flow_noise'][0])
    expected = (case['actions_unnormalized'][:, 7] >= 128.0).astype(np.float32)
    np.testing.assert_array_equal(chunk.actions[:, 7], expected)
    np.testing.assert_allclose(chunk.actions[:, :7], case['actions_unnormalized'][:, :7],
                               atol=1e-3)


def test_actions_are_unnormalized_with_the_postprocessor_statistics(tmp_path):
    """Upstream unnormalizes with `robot_postprocessor`; its stats win over the
    preprocessor's when the two differ."""
    config = golden_config()
    post = config['model']['robot_postprocessor']['stats_by_repo']['synthmanip']['action']
    post['q99'] = [v + 1.0 for v in post['q99']]
    directory = write_checkpoint(tmp_path / 'ckpt', config)
    engine = PolicyEngine(EngineConfig(checkpoint_path=str(directory), tokenizer='tiny'))
    np.testing.assert_allclose(engine.preprocessor.transforms.action_normalizer.q99,
                               np.float32(post['q99']))


def test_load_config_reads_the_config_without_weights(tmp_path):
    (tmp_path / 'config.yaml').write_text((GOLDEN / 'config.yaml').read_text())
    cfg = load_config(tmp_path, norm_stats_key='synthmanip')
    assert (cfg.max_images, cfg.state_dim, cfg.action_dim) == (8, 8, 8)


# ------------------------------------------------------------------ image geometry
@pytest.fixture(scope='module')
def geometry_checkpoint(tmp_path_factory) -> Path:
    """The golden architecture with another ViT input size and pooling window: 224 x 224
    images (16 x 16 patches of 14) pooled in 3 x 2 windows; the project's random weights,
    saved in the upstream format (config.yaml + model.pt)."""
    config = golden_config()
    vit = config['model']['vision_backbone']['vit']
    vit['image_default_input_size'], vit['image_num_pos'] = [224, 224], 16 * 16
    image = config['model']['mm_preprocessor']['image']
    image['multi_image_pooling_h'], image['multi_image_pooling_w'] = 3, 2
    model = random_model(config_from_upstream(config), seed=0)
    return write_checkpoint(tmp_path_factory.mktemp('geometry_ckpt'), config, model.state_dict())


def test_checkpoint_image_size_and_pooling_reach_prompt_pooling_and_patches(geometry_checkpoint):
    """By the upstream rules (molmobot_model.md sections 1-3), by hand: 224 / 14 = 16 patches
    per side, the grid padded to 18 x 16 (multiples of 3 and 2, pad index -1), 6 x 8 = 48
    pooled tokens per image; token r * 8 + c pools rows 3r..3r+2 x columns 2c..2c+1,
    row-major, of the image's 256 patches (offset 256 per image)."""
    engine = PolicyEngine(EngineConfig(checkpoint_path=str(geometry_checkpoint), tokenizer='tiny'),
                          contract=contract(2))
    tokens = engine.model_config.tokens
    text = engine.text_inputs('pick up the red cube')
    ids = text.input_ids
    # BOS, "Image 1" (2 tiny tokens), <im_start> at 3, 48 x <im_patch>, <im_end>, "Image 2" ...
    np.testing.assert_array_equal(np.flatnonzero(ids == tokens.im_start), [3, 55])
    np.testing.assert_array_equal(text.image_positions,
                                  np.concatenate([np.arange(4, 52), np.arange(56, 104)]))
    assert (ids == tokens.im_patch).sum() == 2 * 48
    pooling = text.token_pooling
    assert pooling.shape == (2 * 48, 6)
    assert pooling[0].tolist() == [0, 1, 16, 17, 32, 33]
    assert pooling[7].tolist() == [14, 15, 30, 31, 46, 47]            # last column pair
    assert pooling[40].tolist() == [240, 241, -1, -1, -1, -1]         # row 15, then padding
    assert pooling[48 + 47].tolist() == [256 + 254, 256 + 255, -1, -1, -1, -1]
    rng = np.random.default_rng(0)
    observation = Observation(
        images=tuple(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8) for _ in range(2)),
        state=rng.uniform(-1, 1, 8).astype(np.float32), instruction='pick up the red cube')
    assert engine.preprocessor(observation).images.shape == (1, 2, 16 * 16, 14 * 14 * 3)
    engine.warmup()
    chunk = engine.predict(observation)
    assert chunk.actions.shape == (16, 8) and np.isfinite(chunk.actions).all()
