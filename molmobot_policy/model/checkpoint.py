"""Upstream checkpoints: `config.yaml` -> `MolmoBotConfig`, strict `model.pt` / safetensors
loading on the meta device, and deterministic random weights.

An upstream checkpoint directory holds `config.yaml` (the full training config, the model
under `model:`) and `model.pt` (unsharded `torch.save` state dict, upstream key names), or
`*.safetensors` with the same keys. See ../shared/docs/molmobot_model.md ("On disk") and the
golden README (../shared/golden/molmobot_tiny/README.md), sections 2-4.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from .config import (ActionExpertConfig, ConnectorConfig, LlmConfig, MolmoBotConfig, NormStats,
                     TokenIds, VitConfig)
from .molmobot import MolmoBot

# bos (<|endoftext|>), <|im_start|>, <|im_end|> for the vocabularies we know:
# Qwen3 (upstream tokenizer) and the golden tiny tokenizer (golden README section 4).
KNOWN_CHAT_IDS = {151936: (151643, 151644, 151645), 512: (320, 321, 322)}

_MISSING = object()


def _get(section: dict, name: str, where: str, default: Any = _MISSING) -> Any:
    if name in section:
        return section[name]
    if default is _MISSING:
        raise ValueError(f'config field {where}.{name} is missing')
    return default


def _expect(section: dict, name: str, where: str, allowed: tuple, default: Any = _MISSING) -> Any:
    """The value of `section[name]`, which must be one of `allowed` (ValueError otherwise)."""
    value = _get(section, name, where, default)
    if value not in allowed:
        raise ValueError(f'unsupported config value {where}.{name} = {value!r}; '
                         f'supported: {list(allowed)}')
    return value


def _llm_config(llm: dict) -> LlmConfig:
    w = 'model.llm'
    _expect(llm, 'block_type', w, ('sequential',), 'sequential')
    _expect(llm, 'activation_type', w, ('swiglu',))
    _expect(llm, 'layer_norm_type', w, ('rms',))
    _expect(llm, 'layer_norm_with_affine', w, (True,), True)
    _expect(llm, 'rope', w, (True,))
    _expect(llm, 'rope_type', w, ('default', None), 'default')
    _expect(llm, 'qkv_bias', w, (False,), False)
    _expect(llm, 'include_bias', w, (False,), False)
    _expect(llm, 'clip_qkv', w, (None,), None)
    _expect(llm, 'norm_after', w, (False,), False)
    _expect(llm, 'full_attention_layers', w, (None,), None)
    _expect(llm, 'normalize_input_embeds', w, (False,), False)
    _expect(llm, 'weight_tying', w, (True,), True)
    _expect(llm, 'use_position_ids', w, (True,), True)
    qk_norm = _expect(llm, 'attention_layer_norm', w, (True, False), False)
    if qk_norm:
        _expect(llm, 'attention_layer_norm_type', w, ('qwen3',))
    d_model, n_heads = int(_get(llm, 'd_model', w)), int(_get(llm, 'n_heads', w))
    n_kv_heads = int(_get(llm, 'n_kv_heads', w, None) or n_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f'config field {w}.n_kv_heads = {n_kv_heads} must divide '
                         f'n_heads = {n_heads}')
    mlp_hidden_size = _get(llm, 'mlp_hidden_size', w, None)
    if mlp_hidden_size is None:
        mlp_hidden_size = int(_get(llm, 'mlp_ratio', w)) * d_model
    vocab = _get(llm, 'embedding_size', w, None) or _get(llm, 'vocab_size', w)
    return LlmConfig(
        d_model=d_model, n_layers=int(_get(llm, 'n_layers', w)), n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=int(_get(llm, 'head_dim', w, None) or d_model // n_heads),
        mlp_hidden=int(mlp_hidden_size) // 2, vocab_size=int(vocab),
        additional_vocab_size=int(_get(llm, 'additional_vocab_size', w, None) or 0),
        rope_theta=float(_get(llm, 'rope_theta', w)),
        norm_eps=float(_get(llm, 'layer_norm_eps', w)),
        max_sequence_length=int(_get(llm, 'max_sequence_length', w)), qk_norm=bool(qk_norm))


def _vit_config(vb: dict) -> VitConfig:
    w = 'model.vision_backbone.vit'
    vit = _get(vb, 'vit', 'model.vision_backbone')
    _expect(vit, 'image_model_type', w, ('siglip',))
    _expect(vit, 'image_mlp_activations', w, ('gelu_pytorch_tanh',))
    _expect(vit, 'normalize', w, ('siglip',), 'siglip')
    size = list(_get(vit, 'image_default_input_size', w))
    if len(size) != 2 or size[0] != size[1]:
        raise ValueError(f'unsupported config value {w}.image_default_input_size = {size}; '
                         'expected a square [S, S]')
    patch = int(_get(vit, 'image_patch_size', w))
    pos_patch = int(_get(vit, 'image_pos_patch_size', w, patch))
    if pos_patch != patch:
        raise ValueError(f'unsupported config value {w}.image_pos_patch_size = {pos_patch}; '
                         f'expected image_patch_size = {patch}')
    heads = int(_get(vit, 'image_num_heads', w))
    kv_heads = int(_get(vit, 'image_num_key_value_heads', w, heads))
    if kv_heads != heads:
        raise ValueError(f'unsupported config value {w}.image_num_key_value_heads = {kv_heads}; '
                         f'expected image_num_heads = {heads}')
    cfg = VitConfig(
        image_size=int(size[0]), patch_size=patch, emb_dim=int(_get(vit, 'image_emb_dim', w)),
        num_heads=heads, head_dim=int(_get(vit, 'image_head_dim', w)),
        mlp_dim=int(_get(vit, 'image_mlp_dim', w)),
        num_layers=int(_get(vit, 'image_num_layers', w)),
        norm_eps=float(_get(vit, 'image_norm_eps', w)),
        vit_layers=tuple(int(i) for i in _get(vb, 'vit_layers', 'model.vision_backbone')),
        skip_unused_layers=bool(_get(vb, 'skip_unused_layers', 'model.vision_backbone', True)))
    num_pos = int(_get(vit, 'image_num_pos', w, cfg.num_patches))
    if num_pos != cfg.num_patches:
        raise ValueError(f'unsupported config value {w}.image_num_pos = {num_pos}; expected '
                         f'{cfg.num_patches} (positional-embedding interpolation is not supported)')
    for i in cfg.vit_layers:
        if not -cfg.num_layers <= i < cfg.num_layers:
            raise ValueError(f'config field model.vision_backbone.vit_layers has {i}, outside '
                             f'a {cfg.num_layers}-layer ViT')
    return cfg


def _connector_config(vb: dict, image: dict, vit: VitConfig, llm: LlmConfig) -> ConnectorConfig:
    w = 'model.vision_backbone'
    _expect(vb, 'image_pooling_2d', w, ('attention_meanq',))
    _expect(vb, 'image_projector', w, ('mlp',))
    _expect(vb, 'use_deepstack', w, (False,), False)
    _expect(vb, 'image_padding_embed', w, (None,), None)
    _expect(vb, 'pool_size_embeds', w, (None,), None)
    _expect(vb, 'use_resize_bottleneck', w, (False,), False)
    wi = 'model.mm_preprocessor.image'
    return ConnectorConfig(
        pooling_h=int(_get(image, 'multi_image_pooling_h', wi)),
        pooling_w=int(_get(image, 'multi_image_pooling_w', wi)),
        pool_dim=vit.emb_dim, num_heads=vit.num_heads, projector_hidden=llm.mlp_hidden,
        pooling_attention_mask=bool(_expect(vb, 'pooling_attention_mask', w, (True, False))))


def _quantiles(stats: dict, key: str, where: str) -> tuple[list[float], list[float]]:
    """(q01, q99) float lists of one stats entry (e.g. 'observation.state' or 'action')."""
    entry = _get(stats, key, where)
    q01 = [float(v) for v in _get(entry, 'q01', f'{where}.{key}')]
    q99 = [float(v) for v in _get(entry, 'q99', f'{where}.{key}')]
    if len(q01) != len(q99):
        raise ValueError(f'config field {where}.{key}: q01 has {len(q01)} entries but q99 has '
                         f'{len(q99)}')
    return q01, q99


def _repo_stats(processor: dict, where: str, norm_stats_key: str | None,
                origin: str | None = None) -> tuple[str, dict]:
    """(key, stats_by_repo[key]) of a robot pre/postprocessor; key default: default_repo_id.
    origin: where the key came from, for the error (default: norm_stats_key if given)."""
    stats_by_repo = _get(processor, 'stats_by_repo', where)
    if not isinstance(stats_by_repo, dict):
        raise ValueError(f'config field {where}.stats_by_repo must be a mapping, got '
                         f'{stats_by_repo!r}')
    key = norm_stats_key or _get(processor, 'default_repo_id', where)
    if key not in stats_by_repo:
        origin = origin or ('norm_stats_key' if norm_stats_key else f'{where}.default_repo_id')
        raise ValueError(f'normalization stats key {key!r} ({origin}) is not in '
                         f'{where}.stats_by_repo; available keys: {sorted(stats_by_repo)}')
    return key, stats_by_repo[key]


def _norm_stats(model: dict, norm_stats_key: str | None = None) -> NormStats:
    """Quantile stats of `stats_by_repo[norm_stats_key or default_repo_id]`: the state from
    `robot_preprocessor` (state_keys concatenated), the action from `robot_postprocessor`
    (what upstream unnormalizes with), or from `robot_preprocessor` when the config has no
    postprocessor."""
    w = 'model.robot_preprocessor'
    pre = _get(model, 'robot_preprocessor', 'model')
    if not isinstance(pre, dict):
        raise ValueError(f'config field {w} must be a mapping, got {pre!r}')
    modes = {_expect(pre, 'state_norm_mode', w, ('quantiles',)),
             _expect(pre, 'action_norm_mode', w, ('quantiles',))}
    key, stats = _repo_stats(pre, w, norm_stats_key)
    state_q01, state_q99 = [], []
    for state_key in _get(pre, 'state_keys', w):
        q01, q99 = _quantiles(stats, state_key, f'{w}.stats_by_repo.{key}')
        state_q01 += q01
        state_q99 += q99
    post, wp = model.get('robot_postprocessor'), 'model.robot_postprocessor'
    if isinstance(post, dict):
        _expect(post, 'action_norm_mode', wp, ('quantiles',), 'quantiles')
        _, post_stats = _repo_stats(post, wp, key, 'norm_stats_key' if norm_stats_key
                                    else f'{w}.default_repo_id')
        action_q01, action_q99 = _quantiles(post_stats, _get(post, 'action_key', wp),
                                            f'{wp}.stats_by_repo.{key}')
    else:
        action_q01, action_q99 = _quantiles(stats, _get(pre, 'action_key', w),
                                            f'{w}.stats_by_repo.{key}')
    return NormStats(state_q01=state_q01, state_q99=state_q99, action_q01=action_q01,
                     action_q99=action_q99, mode=modes.pop())


def config_from_upstream(cfg_dict: dict, *, bos: int | None = None,
                         chat_im_start: int | None = None, chat_im_end: int | None = None,
                         name: str = 'upstream',
                         norm_stats_key: str | None = None) -> MolmoBotConfig:
    """`MolmoBotConfig` from an upstream `config.yaml`, given as a dict (the whole file, or
    its `model:` section).

    Reads every field that changes the math (sizes, heads, eps, rope_theta, ViT layers,
    pooling, attention mask mode, action expert, flow steps, normalization stats of
    `stats_by_repo[norm_stats_key]`, default key `robot_preprocessor.default_repo_id`;
    state_dim = length of the state stats).
    bos / chat_im_start / chat_im_end: token ids, default from KNOWN_CHAT_IDS by vocab size.
    norm_stats_key: the dataset whose statistics to use (e.g. 'synthmanip'); None or '' =
        the checkpoint's default_repo_id.

    Raises:
        ValueError: a missing field, or an unknown / unsupported value (named with its value);
            a norm_stats_key the config has no stats for (the message lists the keys it has);
            action stats whose length differs from model.action_dim.
    """
    model = cfg_dict.get('model', cfg_dict) if isinstance(cfg_dict, dict) else None
    if not isinstance(model, dict) or 'llm' not in model:
        raise ValueError('cfg_dict must be the upstream config (with a model: section holding '
                         'llm, vision_backbone, action_expert)')
    _expect(model, 'model_name', 'model', ('molmobot',), 'molmobot')
    llm = _llm_config(_get(model, 'llm', 'model'))
    vb = _get(model, 'vision_backbone', 'model')
    vit = _vit_config(vb)
    image = _get(_get(model, 'mm_preprocessor', 'model'), 'image', 'model.mm_preprocessor')
    wi = 'model.mm_preprocessor.image'
    _expect(image, 'crop_mode', wi, ('resize',))
    _expect(image, 'max_multi_image_crops', wi, (1,), 1)
    _expect(image, 'use_single_crop_col_tokens', wi, (False,), False)
    connector = _connector_config(vb, image, vit, llm)

    w = 'model.action_expert'
    ae = _get(model, 'action_expert', 'model')
    action_dim = int(_get(model, 'action_dim', 'model'))
    ae_action_dim = int(_get(ae, 'action_dim', w, action_dim))
    if ae_action_dim != action_dim:
        raise ValueError(f'config field {w}.action_dim = {ae_action_dim} differs from '
                         f'model.action_dim = {action_dim}')
    ae_cfg = ActionExpertConfig(
        hidden_size=int(_get(ae, 'hidden_size', w)), num_layers=int(_get(ae, 'num_layers', w)),
        num_heads=int(_get(ae, 'num_heads', w)), mlp_ratio=float(_get(ae, 'mlp_ratio', w)),
        timestep_embed_dim=int(_get(ae, 'timestep_embed_dim', w)),
        max_horizon=int(_get(ae, 'max_horizon', w)),
        context_layer_norm=bool(_get(ae, 'context_layer_norm', w, True)))
    if ae_cfg.hidden_size % ae_cfg.num_heads:
        raise ValueError(f'config field {w}.num_heads = {ae_cfg.num_heads} must divide '
                         f'hidden_size = {ae_cfg.hidden_size}')

    bidir = _expect(model, 'bi_directional_attn', 'model', ('image_tokens', None, False), None)
    stats = _norm_stats(model, norm_stats_key)
    key = norm_stats_key or model['robot_preprocessor']['default_repo_id']
    if len(stats.state_q01) > ae_cfg.hidden_size:
        raise ValueError(f'state_dim {len(stats.state_q01)} (from the state stats of {key!r}) '
                         f'exceeds {w}.hidden_size = {ae_cfg.hidden_size}')
    if len(stats.action_q01) != action_dim:
        raise ValueError(f'action stats of {key!r} have {len(stats.action_q01)} entries, '
                         f'model.action_dim = {action_dim}')

    ids = [bos, chat_im_start, chat_im_end]
    if None in ids:
        if llm.vocab_size not in KNOWN_CHAT_IDS:
            raise ValueError(f'unknown vocabulary size {llm.vocab_size}: pass bos, '
                             'chat_im_start and chat_im_end')
        ids = [given if given is not None else known
               for given, known in zip(ids, KNOWN_CHAT_IDS[llm.vocab_size])]
    return MolmoBotConfig(
        vit=vit, connector=connector, llm=llm, action_expert=ae_cfg,
        tokens=TokenIds.for_vocab(llm.vocab_size, *ids),
        max_images=int(_get(image, 'max_images', wi)),
        bi_directional_attn=bidir == 'image_tokens',
        action_dim=action_dim, action_horizon=int(_get(model, 'action_horizon', 'model')),
        state_dim=len(stats.state_q01), n_obs_steps=int(_get(model, 'n_obs_steps', 'model', 1)),
        states_mode=_expect(model, 'states_mode', 'model', ('cross_attn', 'self_attn')),
        action_expert_layer_mode=_expect(model, 'action_expert_layer_mode', 'model',
                                         ('per_layer', 'even')),
        flow_steps=int(_get(model, 'flow_matching_num_steps', 'model')),
        norm_stats=stats, name=name)


def _read_weight_file(f: Path) -> dict[str, torch.Tensor]:
    """One weight file's tensors: safetensors, or torch.save's zip format (memory-mapped) or
    legacy format (read whole). Raises ValueError naming the file when it cannot be parsed
    (corrupt or truncated), the reader's message after ours; a missing or unreadable file
    (permissions) and MemoryError propagate unchanged."""
    if f.suffix == '.safetensors':
        from safetensors.torch import load_file   # outside the try: not a file problem
    try:
        if f.suffix == '.safetensors':
            return load_file(str(f), device='cpu')
        with open(f, 'rb') as stream:
            zipped = stream.read(4) == b'PK\x03\x04'
        return torch.load(f, map_location='cpu', mmap=zipped, weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError, MemoryError):
        raise
    except Exception as error:   # noqa: BLE001 - torch / safetensors raise many kinds
        raise ValueError(f'checkpoint weight file {f} could not be read: it looks corrupt or '
                         f'truncated (re-download it). {type(error).__name__}: {error}'
                         ) from error


def _read_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(_read_weight_file(f))
    return state


def _config_file(path: Path) -> Path:
    """config.yaml of a checkpoint directory, or of the directory holding a weight file."""
    if not path.exists():
        raise FileNotFoundError(f'checkpoint path {path} does not exist (checkpoint_path: a '
                                'directory with config.yaml and model.pt or *.safetensors, or '
                                'one of those weight files)')
    directory = path if path.is_dir() else path.parent
    config = directory / 'config.yaml'
    if not config.is_file():
        raise FileNotFoundError(f'checkpoint {path}: no config.yaml in {directory}')
    return config


def _checkpoint_files(path: Path) -> tuple[Path, list[Path]]:
    """(config.yaml, weight files: `provenance.weight_files`) of a checkpoint directory or
    weight file."""
    from .provenance import weight_files
    return _config_file(path), weight_files(path)


def load_config(path: str | Path, norm_stats_key: str | None = None,
                **token_ids: int) -> MolmoBotConfig:
    """The `MolmoBotConfig` of a checkpoint (directory or weight file) from its config.yaml
    alone, without reading any weights: cheap, for checking a robot's configuration before
    the (possibly 10 GB) load. Arguments as `config_from_upstream`.

    Raises:
        FileNotFoundError: no config.yaml.
        ValueError: as `config_from_upstream`.
    """
    config_file = _config_file(Path(path))
    return config_from_upstream(yaml.safe_load(config_file.read_text()),
                                name=config_file.parent.name, norm_stats_key=norm_stats_key,
                                **token_ids)


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor],
                     strict: bool = True) -> None:
    """Compare checkpoint keys/shapes with the model's.

    Raises:
        ValueError: ONE error listing every missing key, every unexpected key (only when
            strict) and every shape mismatch. Missing keys are always an error.
    """
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected)) if strict else []
    mismatched = sorted(f'{k}: checkpoint {tuple(state[k].shape)}, model '
                        f'{tuple(expected[k].shape)}'
                        for k in set(expected) & set(state) if state[k].shape != expected[k].shape)
    if missing or unexpected or mismatched:
        parts = [f'{title} ({len(keys)}): ' + ', '.join(keys)
                 for title, keys in (('missing keys', missing), ('unexpected keys', unexpected),
                                     ('shape mismatches', mismatched)) if keys]
        raise ValueError('checkpoint does not match the model built from its config.yaml; '
                         + '; '.join(parts))


def load_checkpoint(path: str | Path, device: torch.device | str = 'cpu',
                    dtype: torch.dtype = torch.float32, strict: bool = True,
                    norm_stats_key: str | None = None,
                    **token_ids: int) -> tuple[MolmoBot, MolmoBotConfig]:
    """Load an upstream checkpoint (directory with config.yaml + model.pt or *.safetensors,
    or the weight file itself) as (MolmoBot in eval mode, its config).

    The model is built on the meta device, so each parameter is materialized once: the
    checkpoint tensors (model.pt is memory-mapped) are assigned, then cast to `dtype` and
    moved to `device`; RoPE tables are rebuilt there. norm_stats_key: the dataset whose
    normalization stats to use (None: the checkpoint's default_repo_id). token_ids: bos /
    chat_im_start / chat_im_end overrides for `config_from_upstream`.

    Raises:
        FileNotFoundError: no config.yaml or no weights.
        ValueError: unsupported config value, unknown norm_stats_key, a directory holding
            both model.pt and *.safetensors, a weight file that
            cannot be parsed (corrupt or truncated: the message names it), or mismatched
            keys/shapes (one error listing all; unexpected keys are tolerated when
            strict=False).
    """
    config_file, weight_files = _checkpoint_files(Path(path))
    cfg = config_from_upstream(yaml.safe_load(config_file.read_text()),
                               name=config_file.parent.name, norm_stats_key=norm_stats_key,
                               **token_ids)
    with torch.device('meta'):
        model = MolmoBot(cfg)
    state = _read_state_dict(weight_files)
    check_state_dict(model, state, strict)
    model.load_state_dict(state, strict=False, assign=True)
    model.reset_buffers(device)   # buffers leave meta first, so that .to() can move the rest
    model.to(device=device, dtype=dtype)
    return model.eval(), cfg


def _init_spec(name: str, param: torch.Tensor) -> tuple[float, float]:
    """(mean, std) of a weight under the golden README's section 2 step 2 scheme."""
    if name.endswith(('wte.embedding', 'wte.new_embedding')):
        return 0.0, 1.0
    if name.endswith(('positional_embedding', 'action_pos_embed')):
        return 0.0, 0.5
    if name.endswith('.bias'):
        return 0.0, 0.1
    if param.dim() == 1:                   # norm scales
        return 1.0, 0.1
    return 0.0, param.shape[-1] ** -0.5    # matrices: N(0, 1 / fan_in)


@torch.no_grad()
def init_random_(model: MolmoBot, seed: int, device: torch.device | str | None = None) -> MolmoBot:
    """Deterministic random weights in place, drawn on the model's device (or `device` when
    the model is on meta: it is then materialized there, in its current dtype).

    Scheme of the golden README, section 2 step 2 (every branch matters): matrices
    N(0, 1/fan_in), token embeddings N(0, 1), positional embeddings N(0, 0.25), norm scales
    1 + N(0, 0.01), biases N(0, 0.01). Draws are float32 from a torch.Generator seeded with
    `seed`, in `named_parameters()` order, then cast to each parameter's dtype, so the same
    seed gives the same weights on a device in every dtype. Returns the model.
    """
    current = next(model.parameters()).device
    if current.type == 'meta':
        if device is None:
            raise ValueError('init_random_: the model is on the meta device; pass device=')
        model.to_empty(device=device)
        model.reset_buffers(device)   # the special ids (RoPE tables are rebuilt by to_empty)
        current = torch.device(device)
    generator = torch.Generator(device=current).manual_seed(seed)
    for name, param in model.named_parameters():
        mean, std = _init_spec(name, param)
        draw = torch.randn(param.shape, generator=generator, device=current, dtype=torch.float32)
        param.copy_(draw.mul_(std).add_(mean))
    return model


def random_model(cfg: MolmoBotConfig, seed: int = 0, device: torch.device | str = 'cpu',
                 dtype: torch.dtype = torch.float32) -> MolmoBot:
    """A MolmoBot with `init_random_` weights, built on meta and materialized once on
    `device` in `dtype` (eval mode)."""
    with torch.device('meta'):
        model = MolmoBot(cfg).to(dtype=dtype)
    return init_random_(model, seed, device).eval()
