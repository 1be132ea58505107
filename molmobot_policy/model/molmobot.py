"""MolmoBot: vision backbone + LLM + action expert, assembled with upstream parameter names.

Upstream: `olmo/models/molmobot/molmobot.py`. State-dict keys are exactly upstream's
(`vision_backbone.*`, `transformer.*`, `action_expert.*`; golden README section 3), so an
upstream `model.pt` loads with `strict=True`. Forward paths hold no `.item()`, no host syncs
and no Python branches on tensor values, except `find_image_positions` (eager only): pass
`image_positions` to keep a compiled / CUDA-graphed call free of data-dependent shapes.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .action_expert import ActionExpert
from .config import MolmoBotConfig
from .llm import Llm
from .vision import MolmoVisionBackbone


class MolmoBot(nn.Module):
    """The policy model. `MolmoBot(cfg)` has PyTorch's default initialization; load a
    checkpoint (`checkpoint.load_checkpoint`) or draw weights (`checkpoint.random_model`,
    `checkpoint.init_random_`).

    Non-persistent buffers (not state-dict keys): `transformer.rope_cos/rope_sin` and
    `image_special_ids`; rebuild them with `reset_buffers(device)` after a meta-device build.
    """

    def __init__(self, cfg: MolmoBotConfig):
        super().__init__()
        self.config = self.cfg = cfg
        self.vision_backbone = MolmoVisionBackbone(cfg.vit, cfg.connector, cfg.llm)
        self.transformer = Llm(cfg.llm)
        self.action_expert = ActionExpert(cfg.action_expert, cfg.llm.d_model, cfg.action_dim,
                                          cfg.action_horizon, cfg.states_mode)
        self.register_buffer('image_special_ids', self._image_special_ids(), persistent=False)

    def _image_special_ids(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.tensor(self.cfg.tokens.image_special_ids, dtype=torch.int64, device=device)

    def reset_buffers(self, device: torch.device | str) -> None:
        """(Re)build every non-persistent buffer on `device` (RoPE tables, special ids)."""
        self.transformer.reset_buffers(device)
        self.image_special_ids = self._image_special_ids(device)

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.wte.embedding.dtype

    # -- LLM inputs ----------------------------------------------------------------------

    def find_image_positions(self, input_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Positions of the `<im_patch>` tokens, int64 (B, num_tokens), in sequence order.

        Eager only (data-dependent shape). Raises ValueError when a row does not hold exactly
        `num_tokens` `<im_patch>` tokens.
        """
        is_patch = input_ids == self.cfg.tokens.im_patch
        counts = is_patch.sum(dim=1)
        if bool((counts != num_tokens).any()):
            raise ValueError(f'input_ids must hold exactly {num_tokens} <im_patch> tokens '
                             f'(id {self.cfg.tokens.im_patch}) per row to match token_pooling, '
                             f'got {counts.tolist()}')
        return is_patch.nonzero()[:, 1].view(input_ids.shape[0], num_tokens)

    def attention_allowed(self, input_ids: torch.Tensor,
                          attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """bool (B, 1, L, L) [query, key] visibility: causal OR (both query and key are image
        special tokens) when cfg.bi_directional_attn; padded keys (attention_mask False)
        are never visible. Golden README section 6."""
        length = input_ids.shape[1]
        allowed = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        allowed = allowed[None]
        if self.cfg.bi_directional_attn:
            is_image = (input_ids.unsqueeze(-1) == self.image_special_ids).any(-1)
            allowed = allowed | (is_image[:, :, None] & is_image[:, None, :])
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, :]
        return allowed.unsqueeze(1)

    def embed_inputs(self, input_ids: torch.Tensor, images: torch.Tensor,
                     token_pooling: torch.Tensor,
                     image_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with the image features ADDED at the `<im_patch>` positions,
        (B, L, d_model) in the parameter dtype. Functional: a fresh tensor, inputs untouched."""
        x = self.transformer.wte(input_ids)
        feats = self.vision_backbone(images, token_pooling)
        b, t, d = feats.shape
        if image_positions is None:
            image_positions = self.find_image_positions(input_ids, t)
        elif image_positions.shape != (b, t):
            raise ValueError(f'image_positions must be int64 {(b, t)}, got '
                             f'{tuple(image_positions.shape)}')
        index = image_positions.unsqueeze(-1).expand(b, t, d)
        return x.scatter_add(1, index, feats.to(x.dtype))

    def llm_hidden_states(self, input_ids: torch.Tensor, images: torch.Tensor,
                          token_pooling: torch.Tensor, position_ids: torch.Tensor | None = None,
                          attention_mask: torch.Tensor | None = None,
                          image_positions: torch.Tensor | None = None,
                          llm_mask: Callable | None = None) -> torch.Tensor:
        """Output of every LLM block (before ln_f), (n_layers, B, L, d_model), param dtype.

        input_ids int64 (B, L); images uint8 (B, N, 729, 588); token_pooling int64
        (B, N*196, 4); position_ids int64 (B, L), default cumsum(attention_mask) - 1 clamped
        at 0 (arange(L) without a mask); attention_mask bool (B, L), False = padding;
        image_positions int64 (B, N*196), positions of the `<im_patch>` tokens (computed
        from input_ids when None, eager only); llm_mask: optional
        `llm_mask(input_ids, attention_mask) -> mask object` for the LLM blocks in place of the
        additive bias of `attention_allowed` (the served engine's form of the same mask,
        `Llm.forward`). Raises ValueError on malformed inputs.
        """
        if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            raise ValueError(f'input_ids must be int64 (B, L), got {input_ids.dtype} '
                             f'{tuple(input_ids.shape)}')
        if attention_mask is not None and (attention_mask.dtype != torch.bool
                                           or attention_mask.shape != input_ids.shape):
            raise ValueError(f'attention_mask must be bool {tuple(input_ids.shape)}, got '
                             f'{attention_mask.dtype} {tuple(attention_mask.shape)}')
        if position_ids is None:
            if attention_mask is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
                position_ids = position_ids.expand_as(input_ids)
            else:
                position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        x = self.embed_inputs(input_ids, images, token_pooling, image_positions)
        if llm_mask is not None:
            return self.transformer(x, position_ids, llm_mask(input_ids, attention_mask))
        allowed = self.attention_allowed(input_ids, attention_mask)
        bias = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device)
        bias = bias.masked_fill(~allowed, torch.finfo(x.dtype).min)
        return self.transformer(x, position_ids, bias)

    # -- actions -------------------------------------------------------------------------

    def select_ae_layers(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n_layers, B, L, d) -> (n_ae_blocks, B, L, d) by cfg.ae_layer_ids.

        Indexed with Python ints and stacked, not with a list: a list index becomes a host
        tensor copied to the device, which a CUDA graph capture refuses."""
        ids = self.cfg.ae_layer_ids
        if ids == tuple(range(hidden.shape[0])):
            return hidden
        return torch.stack([hidden[i] for i in ids])

    def generate_actions(self, input_ids: torch.Tensor, images: torch.Tensor,
                         token_pooling: torch.Tensor, states: torch.Tensor,
                         noise: torch.Tensor | None = None,
                         position_ids: torch.Tensor | None = None,
                         attention_mask: torch.Tensor | None = None,
                         image_positions: torch.Tensor | None = None,
                         num_steps: int | None = None,
                         generator: torch.Generator | None = None) -> torch.Tensor:
        """Action chunk in normalized action space, float32 (B, horizon, action_dim).

        states float (B, n_obs, state_dim), normalized. noise float32 (B, horizon,
        action_dim), drawn with torch.randn(generator=generator) when None. `euler_flow` over
        `num_steps or cfg.flow_steps` steps; the context (LLM hidden states, K/V of every
        cross-attention) is computed once. The plain reference the served engine is tested
        against. Other inputs as in `llm_hidden_states`. Raises ValueError on malformed inputs.
        """
        b = input_ids.shape[0]
        shape = (b, self.cfg.action_horizon, self.cfg.action_dim)
        if states.dim() != 3 or states.shape[0] != b or states.shape[2] != self.cfg.state_dim:
            raise ValueError(f'states must be (B={b}, n_obs, state_dim={self.cfg.state_dim}), '
                             f'got {tuple(states.shape)}')
        if noise is None:
            noise = torch.randn(shape, generator=generator, dtype=torch.float32,
                                device=input_ids.device)
        elif tuple(noise.shape) != shape:
            raise ValueError(f'noise must be float32 {shape}, got {tuple(noise.shape)}')
        steps = self.cfg.flow_steps if num_steps is None else int(num_steps)
        if steps < 1:
            raise ValueError(f'num_steps must be >= 1, got {steps}')
        hidden = self.llm_hidden_states(input_ids, images, token_pooling, position_ids,
                                        attention_mask, image_positions)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        ae = self.action_expert
        ctx = ae.prepare_context(self.select_ae_layers(hidden), attention_mask, states)

        def velocity(x: torch.Tensor, i: int) -> torch.Tensor:
            return ae.velocity(x, torch.full((b,), i / steps, dtype=torch.float32,
                                             device=x.device), ctx)
        return euler_flow(noise, velocity, steps)


def euler_flow(noise: torch.Tensor, velocity: Callable[[torch.Tensor, int], torch.Tensor],
               steps: int) -> torch.Tensor:
    """Upstream's flow-matching sampler: forward Euler from noise (t = 0) to data (t = 1),
    x_0 = noise; for i in range(steps): x = x + (1 / steps) * velocity(x, i), where step i is
    at flow time t = i / steps (molmobot_model.md section 6).

    noise float (B, horizon, action_dim); velocity(x float32 (B, horizon, action_dim), i) ->
    velocity of the same shape in any float dtype. Returns float32 (B, horizon, action_dim),
    normalized action space. `MolmoBot.generate_actions` and the engine's served query both
    run it, each with its own velocity function."""
    x = noise.float()
    dt = 1.0 / steps
    for i in range(steps):
        x = x + dt * velocity(x, i).float()
    return x
