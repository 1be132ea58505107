"""MolmoBot model configuration: one dataclass per part, named presets, derived sizes.

Field names follow the upstream MolmoBot `config.yaml` (under `model:`), so that a released
checkpoint's file maps onto these one to one (see `checkpoint.config_from_upstream`).
Sizes of the real model: ../shared/docs/molmobot_model.md; of the tiny one:
../shared/golden/molmobot_tiny/README.md, section 3.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class VitConfig:
    """SigLIP-style ViT. Upstream: `model.vision_backbone.vit`."""

    image_size: int = 378            # square input side, pixels
    patch_size: int = 14
    emb_dim: int = 1152
    num_heads: int = 16
    head_dim: int = 72
    mlp_dim: int = 4304
    num_layers: int = 27             # depth of the pretrained ViT
    norm_eps: float = 1e-6
    vit_layers: tuple[int, ...] = (-3, -9)   # block outputs concatenated, in this order
    skip_unused_layers: bool = True  # build only the blocks up to the deepest one used

    @property
    def grid(self) -> int:
        """Patches per side (27 for 378/14)."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    @property
    def patch_dim(self) -> int:
        """Flattened patch length, (row, col, channel) order: 14*14*3 = 588."""
        return self.patch_size * self.patch_size * 3

    @property
    def layer_indices(self) -> tuple[int, ...]:
        """`vit_layers` as non-negative block indices, same order."""
        return tuple(i if i >= 0 else self.num_layers + i for i in self.vit_layers)

    @property
    def num_built_layers(self) -> int:
        """Blocks actually built: up to the deepest one used (`skip_unused_layers`), else all."""
        if not self.skip_unused_layers:
            return self.num_layers
        return max(self.layer_indices) + 1


@dataclass
class ConnectorConfig:
    """2x2 attention-mean-query pooling + SwiGLU projector. Upstream: `vision_backbone`."""

    pooling_h: int = 2
    pooling_w: int = 2
    pool_dim: int = 1152             # wq/wk/wv output width (= ViT emb_dim upstream)
    num_heads: int = 16              # pooling attention heads (head_dim = pool_dim / heads)
    projector_hidden: int = 9728     # w1/w3 output width
    pooling_attention_mask: bool = True


@dataclass
class LlmConfig:
    """Qwen3-style decoder with OLMo parameter names. Upstream: `model.llm`."""

    d_model: int = 2560
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    mlp_hidden: int = 9728           # SwiGLU hidden; ff_proj is d_model -> 2*mlp_hidden
    vocab_size: int = 151936         # rows of wte.embedding (upstream embedding_size)
    additional_vocab_size: int = 128  # rows of wte.new_embedding
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    max_sequence_length: int = 8192  # RoPE table length
    qk_norm: bool = True             # qwen3 per-head q/k RMSNorm


@dataclass
class ActionExpertConfig:
    """DiT-style flow-matching head. Upstream: `model.action_expert`."""

    hidden_size: int = 768           # DiT width (768 = 8 heads x 96)
    num_layers: int = 36             # one block per LLM layer in `per_layer` mode
    num_heads: int = 8
    mlp_ratio: float = 4.0           # MLP hidden = mlp_ratio * hidden_size (exact GELU)
    timestep_embed_dim: int = 256    # sinusoidal time embedding width
    max_horizon: int = 32            # rows of action_pos_embed
    context_layer_norm: bool = True  # context_norm: LayerNorm eps 1e-5, no affine

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


@dataclass
class TokenIds:
    """Special-token ids. Image specials sit right after the base vocab (new_embedding)."""

    bos: int = 151643                # <|endoftext|>, used as BOS
    chat_im_start: int = 151644      # <|im_start|>
    chat_im_end: int = 151645        # <|im_end|>
    im_start: int = 151936
    im_end: int = 151937
    im_patch: int = 151938
    im_col: int = 151939
    low_res_im_start: int = 151940
    image: int = 151941
    im_low: int = 151942
    frame_start: int = 151943
    frame_end: int = 151944

    @classmethod
    def for_vocab(cls, vocab_size: int, bos: int, chat_im_start: int, chat_im_end: int) -> TokenIds:
        """Image specials at vocab_size + 0..8, in upstream order."""
        return cls(bos=bos, chat_im_start=chat_im_start, chat_im_end=chat_im_end,
                   im_start=vocab_size, im_end=vocab_size + 1, im_patch=vocab_size + 2,
                   im_col=vocab_size + 3, low_res_im_start=vocab_size + 4,
                   image=vocab_size + 5, im_low=vocab_size + 6, frame_start=vocab_size + 7,
                   frame_end=vocab_size + 8)

    @property
    def image_special_ids(self) -> tuple[int, ...]:
        """Ids that attend bidirectionally under `bi_directional_attn: image_tokens`."""
        return (self.im_patch, self.im_col, self.im_start, self.low_res_im_start,
                self.frame_start, self.im_end, self.frame_end, self.im_low)


@dataclass
class NormStats:
    """Quantile statistics (upstream `robot_preprocessor.stats_by_repo[repo]`), float lists."""

    state_q01: list[float]
    state_q99: list[float]
    action_q01: list[float]
    action_q99: list[float]
    mode: str = 'quantiles'

    @classmethod
    def identity(cls, state_dim: int, action_dim: int) -> NormStats:
        """q01 = -1, q99 = 1 everywhere: normalization leaves values as they are (random-weight
        presets, which have no training data)."""
        return cls(state_q01=[-1.0] * state_dim, state_q99=[1.0] * state_dim,
                   action_q01=[-1.0] * action_dim, action_q99=[1.0] * action_dim)


@dataclass
class MolmoBotConfig:
    """The whole policy model. `MolmoBotConfig.from_name('tiny')` for a preset."""

    vit: VitConfig = field(default_factory=VitConfig)
    connector: ConnectorConfig = field(default_factory=ConnectorConfig)
    llm: LlmConfig = field(default_factory=LlmConfig)
    action_expert: ActionExpertConfig = field(default_factory=ActionExpertConfig)
    tokens: TokenIds = field(default_factory=TokenIds)
    max_images: int = 8
    bi_directional_attn: bool = True      # upstream `bi_directional_attn: image_tokens`
    action_dim: int = 8
    action_horizon: int = 16
    state_dim: int = 8
    n_obs_steps: int = 1
    states_mode: str = 'cross_attn'       # or 'self_attn'
    action_expert_layer_mode: str = 'per_layer'   # or 'even'
    flow_steps: int = 10
    norm_stats: NormStats | None = None
    name: str = 'custom'

    def __post_init__(self) -> None:
        if self.states_mode not in ('cross_attn', 'self_attn'):
            raise ValueError("states_mode must be 'cross_attn' or 'self_attn', got "
                             f'{self.states_mode!r}')
        if self.action_expert_layer_mode not in ('per_layer', 'even'):
            raise ValueError("action_expert_layer_mode must be 'per_layer' or 'even', "
                             f'got {self.action_expert_layer_mode!r}')
        if self.action_horizon > self.action_expert.max_horizon:
            raise ValueError(f'action_horizon {self.action_horizon} exceeds '
                             f'action_expert.max_horizon {self.action_expert.max_horizon}')
        tokens = self.action_horizon + self.n_obs_steps
        if self.states_mode == 'self_attn' and tokens > self.action_expert.max_horizon:
            # upstream prepends the state tokens to the actions, then adds
            # action_pos_embed[:, :n_obs + horizon]
            raise ValueError(f"states_mode 'self_attn' puts n_obs_steps = {self.n_obs_steps} "
                             f'state token(s) before the action_horizon = '
                             f'{self.action_horizon} action tokens, which needs '
                             f'action_expert.max_horizon >= {tokens} (one position embedding '
                             f'per token), got {self.action_expert.max_horizon}')

    @property
    def tokens_per_image(self) -> int:
        """Pooled tokens per image: ceil(27/2)^2 = 196."""
        g = self.vit.grid
        ph, pw = self.connector.pooling_h, self.connector.pooling_w
        return ((g + ph - 1) // ph) * ((g + pw - 1) // pw)

    @property
    def ae_layer_ids(self) -> tuple[int, ...]:
        """LLM block whose output feeds each action-expert block."""
        n_ae, n_llm = self.action_expert.num_layers, self.llm.n_layers
        if self.action_expert_layer_mode == 'per_layer':
            if n_ae != n_llm:
                raise ValueError(f'per_layer mode needs action_expert.num_layers ({n_ae}) == '
                                 f'llm.n_layers ({n_llm})')
            return tuple(range(n_llm))
        if n_ae == 1:
            return (n_llm - 1,)
        # upstream: round(i * (n_llm - 1) / (n_ae - 1)), Python (banker's) rounding
        return tuple(round(i * (n_llm - 1) / (n_ae - 1)) for i in range(n_ae))

    def replace(self, **changes) -> MolmoBotConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_name(cls, name: str) -> MolmoBotConfig:
        """A preset by name: 'tiny', 'molmobot-droid', 'molmobot-4b-8cam'. Raises ValueError
        on another name."""
        if name not in PRESETS:
            raise ValueError(f'unknown model preset {name!r}; expected one of {sorted(PRESETS)}')
        return PRESETS[name]()


def _tiny() -> MolmoBotConfig:
    """The golden tiny architecture (../shared/golden/molmobot_tiny/README.md, section 3)."""
    return MolmoBotConfig(
        name='tiny',
        vit=VitConfig(emb_dim=48, num_heads=4, head_dim=12, mlp_dim=96, num_layers=4,
                      vit_layers=(-2, -4)),
        connector=ConnectorConfig(pool_dim=48, num_heads=4, projector_hidden=128),
        llm=LlmConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=24,
                      mlp_hidden=128, vocab_size=512, additional_vocab_size=128),
        action_expert=ActionExpertConfig(hidden_size=48, num_layers=4, num_heads=4),
        tokens=TokenIds.for_vocab(512, bos=320, chat_im_start=321, chat_im_end=322),
        max_images=8, action_dim=8, action_horizon=16, state_dim=8,
        norm_stats=NormStats(
            state_q01=[-2.60, -1.55, -2.65, -2.95, -2.70, 0.25, -2.70, 0.00],
            state_q99=[2.55, 1.60, 2.70, -0.25, 2.65, 3.45, 2.75, 0.80],
            action_q01=[-2.65, -1.60, -2.70, -3.00, -2.75, 0.20, -2.75, 0.0],
            action_q99=[2.60, 1.65, 2.75, -0.20, 2.70, 3.50, 2.80, 255.0]),
    )


def _molmobot_droid() -> MolmoBotConfig:
    """MolmoBot-DROID shape: Molmo2-4B base, 2 cameras, 7 joints + gripper, chunk 16 x 8;
    identity normalization statistics (a checkpoint brings its own)."""
    return MolmoBotConfig(name='molmobot-droid', max_images=2, action_dim=8,
                          action_horizon=16, state_dim=8, norm_stats=NormStats.identity(8, 8))


def _molmobot_4b_8cam() -> MolmoBotConfig:
    """The benchmark contract: full-size model, 8 cameras, 14-D state and action, horizon 16;
    identity normalization statistics."""
    return MolmoBotConfig(name='molmobot-4b-8cam', max_images=8, action_dim=14,
                          action_horizon=16, state_dim=14,
                          norm_stats=NormStats.identity(14, 14))


PRESETS = {
    'tiny': _tiny,
    'molmobot-droid': _molmobot_droid,
    'molmobot-4b-8cam': _molmobot_4b_8cam,
}
