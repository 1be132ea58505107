"""Upstream checkpoints: config.yaml mapping, strict loading with one error for every key
problem, safetensors, meta-device build, dtype casting."""
import copy
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from molmobot_policy.model import checkpoint
from molmobot_policy.model.checkpoint import (config_from_upstream, init_random_,
                                              load_checkpoint, random_model)
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.model.molmobot import MolmoBot

from _golden import GOLDEN, MISSING  # noqa: E402  (test/_golden.py: the data's location)

pytestmark = pytest.mark.skipif(not (GOLDEN / 'model.pt').is_file(),
                                reason=MISSING)


@pytest.fixture(scope='module')
def upstream_config() -> dict:
    return yaml.safe_load((GOLDEN / 'config.yaml').read_text())


@pytest.fixture(scope='module')
def golden_state() -> dict:
    return torch.load(GOLDEN / 'model.pt', weights_only=True)


def write_checkpoint(directory: Path, state: dict, config: dict | None = None,
                     fmt: str = 'pt') -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if config is None:
        shutil.copy(GOLDEN / 'config.yaml', directory / 'config.yaml')
    else:
        (directory / 'config.yaml').write_text(yaml.safe_dump(config))
    if fmt == 'pt':
        torch.save(state, directory / 'model.pt')
    else:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, directory / 'model.safetensors')
    return directory


def test_state_dict_keys_are_exactly_the_upstream_keys(golden_state):
    model = MolmoBot(MolmoBotConfig.from_name('tiny'))
    assert set(model.state_dict()) == set(golden_state)
    model.load_state_dict(golden_state, strict=True)


def test_upstream_config_maps_onto_the_tiny_preset(upstream_config):
    cfg = config_from_upstream(upstream_config)
    expected = dataclasses.asdict(MolmoBotConfig.from_name('tiny'))
    got = dataclasses.asdict(cfg)
    assert {k: v for k, v in got.items() if k != 'name'} == \
        {k: v for k, v in expected.items() if k != 'name'}


def test_model_section_alone_is_accepted(upstream_config):
    assert config_from_upstream(upstream_config['model']) == config_from_upstream(upstream_config)


def test_token_ids_follow_the_vocab_and_can_be_overridden(upstream_config):
    cfg = config_from_upstream(upstream_config, bos=7)
    assert (cfg.tokens.bos, cfg.tokens.chat_im_start, cfg.tokens.chat_im_end) == (7, 321, 322)
    assert cfg.tokens.im_patch == 514


def test_unknown_vocab_without_token_ids_raises(upstream_config):
    changed = copy.deepcopy(upstream_config)
    changed['model']['llm']['vocab_size'] = changed['model']['llm']['embedding_size'] = 1000
    with pytest.raises(ValueError, match='unknown vocabulary size 1000'):
        config_from_upstream(changed)


@pytest.mark.parametrize('path,value', [
    (('vision_backbone', 'image_pooling_2d'), 'attention'),
    (('vision_backbone', 'image_projector'), 'linear'),
    (('llm', 'activation_type'), 'gelu'),
    (('states_mode',), 'film'),
    (('bi_directional_attn',), 'all_tokens'),
    (('robot_preprocessor', 'action_norm_mode'), 'mean_std'),
])
def test_unsupported_config_value_raises_naming_field_and_value(upstream_config, path, value):
    changed = copy.deepcopy(upstream_config)
    section = changed['model']
    for key in path[:-1]:
        section = section[key]
    section[path[-1]] = value
    with pytest.raises(ValueError, match=rf'{path[-1]} = {value!r}'):
        config_from_upstream(changed)


def test_missing_config_field_raises(upstream_config):
    changed = copy.deepcopy(upstream_config)
    del changed['model']['action_expert']['hidden_size']
    with pytest.raises(ValueError, match='model.action_expert.hidden_size is missing'):
        config_from_upstream(changed)


@pytest.mark.parametrize('n_llm, expected', [
    (4, (0, 2, 3)),      # 1.5 -> 2 (half-up and half-to-even agree)
    (6, (0, 2, 5)),      # 2.5 -> 2: Python's round (half to even), not 3
])
def test_even_layer_mode_reads_the_action_expert_depth(upstream_config, n_llm, expected):
    changed = copy.deepcopy(upstream_config)
    changed['model']['action_expert_layer_mode'] = 'even'
    changed['model']['action_expert']['num_layers'] = 3
    changed['model']['llm']['n_layers'] = n_llm
    assert config_from_upstream(changed).ae_layer_ids == expected


def test_self_attn_with_max_horizon_below_horizon_plus_states_is_refused(upstream_config):
    """self_attn puts the state token before the 16 actions: 17 position embeddings."""
    changed = copy.deepcopy(upstream_config)
    changed['model']['states_mode'] = 'self_attn'
    changed['model']['action_expert']['max_horizon'] = 16
    with pytest.raises(ValueError, match=r"states_mode 'self_attn' puts n_obs_steps = 1 state "
                                         r'.*action_horizon = 16 .*max_horizon >= 17.*got 16'):
        config_from_upstream(changed)
    changed['model']['action_expert']['max_horizon'] = 17
    assert config_from_upstream(changed).states_mode == 'self_attn'


def test_missing_action_stats_key_blames_default_repo_id_not_norm_stats_key(upstream_config):
    """The default key is in the state stats but not in the postprocessor's (action) stats;
    norm_stats_key was not given, so the error names where the key came from."""
    changed = copy.deepcopy(upstream_config)
    post = changed['model']['robot_postprocessor']['stats_by_repo']
    post['other'] = post.pop('synthmanip')
    with pytest.raises(ValueError) as info:
        config_from_upstream(changed)
    message = str(info.value)
    assert "'synthmanip' (model.robot_preprocessor.default_repo_id)" in message
    assert 'model.robot_postprocessor.stats_by_repo' in message and "['other']" in message
    assert 'norm_stats_key' not in message


def test_missing_action_stats_key_blames_norm_stats_key_when_given(upstream_config):
    changed = copy.deepcopy(upstream_config)
    pre = changed['model']['robot_preprocessor']['stats_by_repo']
    pre['droid'] = pre['synthmanip']
    with pytest.raises(ValueError, match=r"'droid' \(norm_stats_key\) is not in "
                                         r'model.robot_postprocessor.stats_by_repo'):
        config_from_upstream(changed, norm_stats_key='droid')


def test_load_checkpoint_gives_the_golden_weights(golden_state):
    model, cfg = load_checkpoint(GOLDEN)
    assert cfg.llm.d_model == 64
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, golden_state[name]), name


def test_load_checkpoint_builds_the_model_on_the_meta_device(monkeypatch):
    built_on = []

    class Recording(MolmoBot):
        def __init__(self, cfg):
            super().__init__(cfg)
            built_on.append({p.device.type for p in self.parameters()})

    monkeypatch.setattr(checkpoint, 'MolmoBot', Recording)
    model, _ = load_checkpoint(GOLDEN)
    assert built_on == [{'meta'}]
    assert {p.device.type for p in model.parameters()} == {'cpu'}


def test_load_checkpoint_casts_to_dtype_and_keeps_rope_in_float32():
    model, _ = load_checkpoint(GOLDEN, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.transformer.rope_cos.dtype == torch.float32
    reference, _ = load_checkpoint(GOLDEN)
    assert torch.equal(model.transformer.rope_sin, reference.transformer.rope_sin)


def test_key_problems_are_reported_in_one_error(tmp_path, golden_state):
    state = dict(golden_state)
    del state['transformer.ln_f.weight']
    state['action_expert.extra.weight'] = torch.zeros(3)
    state['action_expert.action_embed.bias'] = torch.zeros(7)
    write_checkpoint(tmp_path / 'bad', state)
    with pytest.raises(ValueError) as info:
        load_checkpoint(tmp_path / 'bad')
    message = str(info.value)
    assert 'missing keys (1): transformer.ln_f.weight' in message
    assert 'unexpected keys (1): action_expert.extra.weight' in message
    assert 'action_expert.action_embed.bias: checkpoint (7,), model (48,)' in message


def test_unexpected_keys_are_tolerated_when_not_strict(tmp_path, golden_state):
    state = dict(golden_state, **{'transformer.ff_out.weight': torch.zeros(640, 64)})
    write_checkpoint(tmp_path / 'extra', state)
    with pytest.raises(ValueError, match='unexpected keys'):
        load_checkpoint(tmp_path / 'extra')
    model, _ = load_checkpoint(tmp_path / 'extra', strict=False)
    assert 'transformer.ff_out.weight' not in model.state_dict()


def test_safetensors_round_trip(tmp_path, golden_state):
    write_checkpoint(tmp_path / 'st', golden_state, fmt='safetensors')
    model, _ = load_checkpoint(tmp_path / 'st')
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, golden_state[name]), name


def test_a_directory_with_both_weight_formats_is_refused_by_the_loader(tmp_path, golden_state):
    write_checkpoint(tmp_path / 'both', golden_state, fmt='safetensors')
    torch.save(golden_state, tmp_path / 'both' / 'model.pt')
    with pytest.raises(ValueError, match='holds both model.pt and'):
        load_checkpoint(tmp_path / 'both')


def truncated(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


@pytest.mark.parametrize('fmt, damage', [
    ('pt', 'truncated'), ('pt', 'garbage'), ('pt', 'empty'),
    ('safetensors', 'truncated'), ('safetensors', 'garbage')])
def test_corrupt_weight_file_error_names_the_file_and_says_re_download(tmp_path, golden_state,
                                                                       fmt, damage):
    directory = write_checkpoint(tmp_path / 'ckpt', golden_state, fmt=fmt)
    weights = directory / ('model.pt' if fmt == 'pt' else 'model.safetensors')
    if damage == 'truncated':
        truncated(weights)
    else:
        weights.write_bytes(b'not a checkpoint ' * 8 if damage == 'garbage' else b'')
    with pytest.raises(ValueError) as info:
        load_checkpoint(directory)
    message = str(info.value)
    assert message.startswith(f'checkpoint weight file {weights} could not be read: it looks '
                              'corrupt or truncated (re-download it). ')
    cause = info.value.__cause__        # the reader's own words follow ours
    assert cause is not None and message.endswith(f'{type(cause).__name__}: {cause}')
    assert 'please torch.save your checkpoint' not in message


def test_legacy_torch_save_format_still_loads(tmp_path, golden_state):
    """A (non-zip) legacy torch.save file cannot be memory-mapped; it is read whole."""
    directory = tmp_path / 'legacy'
    write_checkpoint(directory, {})
    torch.save(golden_state, directory / 'model.pt', _use_new_zipfile_serialization=False)
    model, _ = load_checkpoint(directory)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, golden_state[name]), name


def test_missing_config_yaml_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match='config.yaml'):
        load_checkpoint(tmp_path)


def test_init_random_materializes_a_meta_model_on_the_device():
    cfg = MolmoBotConfig.from_name('tiny')
    with torch.device('meta'):
        model = MolmoBot(cfg)
    init_random_(model, seed=0, device='cpu')
    reference = random_model(cfg, seed=0)
    assert model.transformer.rope_cos.device.type == 'cpu'
    assert torch.equal(model.transformer.rope_cos, reference.transformer.rope_cos)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_init_random_gives_the_same_weights_in_bfloat16():
    cfg = MolmoBotConfig.from_name('tiny')
    fp32, bf16 = random_model(cfg, seed=1), random_model(cfg, seed=1, dtype=torch.bfloat16)
    for (name, p), q in zip(fp32.named_parameters(), bf16.parameters()):
        assert torch.equal(p.to(torch.bfloat16), q), name
