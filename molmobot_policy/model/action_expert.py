"""The MolmoBot action expert: a DiT-style flow-matching head (AdaLN-Zero blocks).

Upstream: `olmo/nn/action_expert.py`; exact math in the golden README, section 6
(../shared/golden/molmobot_tiny/README.md). Block i cross-attends to LLM block
`ae_layer_ids[i]` projected by one shared `context_proj` and normalized (LayerNorm, no affine,
eps 1e-5), plus the state tokens in `states_mode: cross_attn`.

Everything about the cross-attention context is the same for every flow step (molmobot_model.md
section 6), so it is computed once per query: `prepare_context(...)` (the context rows, every
block's cross-attention K/V, the mask bias, the state tokens: the per-query K/V cache), then per
flow step `velocity(x_t, t, ctx)` = `velocity_from_conditioning(x_t, time_conditioning(t), ctx)`.
`forward(x_t, t, hidden, encoder_mask, states)` computes all of it per call, as upstream does.
The runtime serves the same math with its own K/V projection (`runtime.serving`), which it
passes to `prepare_context`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ActionExpertConfig

NORM_EPS = 1e-6          # every AE LayerNorm except the context norm (upstream)
CONTEXT_ALIGN = 16       # cross-attention context padded to a multiple of this many tokens
CONTEXT_NORM_EPS = 1e-5  # context_norm is a default nn.LayerNorm upstream


@dataclass
class ActionExpertContext:
    """Per-query cache, identical for every flow step.

    keys, values: (n_blocks, B, H, S, head_dim) cross-attention K/V of every block, S = L
        context tokens (+ n_obs state tokens in cross_attn mode) rounded up to a multiple of
        CONTEXT_ALIGN (the extra rows masked); any strides with the last dim contiguous, the
        same for keys and values.
    mask_bias: (B, 1, 1, S) additive cross-attention mask, 0 or finfo(dtype).min.
    state_tokens: (B, n_obs, hidden) encoded states (used by self_attn mode).
    out_bias: (n_blocks, hidden) the cross-attention output-projection bias that goes with these
        keys and values: each block's attn2.proj.bias for upstream's K/V (`cross_key_values`).
    All in the parameter dtype.
    """

    keys: torch.Tensor
    values: torch.Tensor
    mask_bias: torch.Tensor
    state_tokens: torch.Tensor
    out_bias: torch.Tensor


@dataclass
class TimeConditioning:
    """AdaLN modulation for one flow time t, as produced by `time_conditioning(t)`.

    blocks: (n_blocks, 9, B, hidden): shift/scale/gate for self-attn, cross-attn, MLP.
    final: (2, B, hidden): shift, scale of the final layer. Parameter dtype.
    """

    blocks: torch.Tensor
    final: torch.Tensor


class SinusoidalPosEmb(nn.Module):
    """t (B,) float -> float32 (B, dim): [sin(t f), cos(t f)], f_k = exp(-k ln(1e4) / (dim/2 - 1)).
    t is NOT scaled by 1000 (upstream)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        k = torch.arange(half, device=t.device, dtype=torch.float32)
        freqs = torch.exp(k * (-math.log(10000.0) / (half - 1)))
        args = t.float()[:, None] * freqs[None]
        return torch.cat([args.sin(), args.cos()], dim=-1)


class Attention(nn.Module):
    """q_proj, fused kv_proj (keys = first half), proj; softmax(q k^T / sqrt(hd) + bias) v."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, dim)
        self.kv_proj = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def key_values(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """context (B, S, dim) -> k, v (B, H, S, head_dim)."""
        b, s = context.shape[:2]
        kv = self.kv_proj(context).view(b, s, 2, self.n_heads, self.head_dim)
        return kv[:, :, 0].transpose(1, 2).contiguous(), kv[:, :, 1].transpose(1, 2).contiguous()

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               bias: torch.Tensor | None = None,
               out_bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, dim) queries; k, v (B, H, S, head_dim); bias (B, 1, 1, S) -> (B, T, dim).

        out_bias (dim,): the output projection's bias for these k, v
        (`ActionExpertContext.out_bias`); None = proj.bias.

        Written out (two batched matmuls and a float32 softmax) rather than through SDPA:
        with 16 queries the fused attention kernels are launch-bound, and the compiled
        matmul + softmax + matmul is faster."""
        b, n = x.shape[:2]
        q = self.q_proj(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        q = q * self.head_dim ** -0.5
        scores = torch.matmul(q, k.transpose(-1, -2)).float()
        if bias is not None:
            scores = scores + bias
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)
        return F.linear(out.transpose(1, 2).reshape(b, n, -1), self.proj.weight,
                        self.proj.bias if out_bias is None else out_bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(x, *self.key_values(context), bias)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (B, T, D), shift/scale (B, D) -> x * (1 + scale) + shift."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTBlock(nn.Module):
    """AdaLN-Zero block: self-attn, cross-attn, MLP, each gated; conditioned on c only."""

    def __init__(self, cfg: ActionExpertConfig):
        super().__init__()
        h = cfg.hidden_size
        self.norm1 = nn.LayerNorm(h, eps=NORM_EPS, elementwise_affine=False)
        self.attn1 = Attention(h, cfg.num_heads)
        self.norm2 = nn.LayerNorm(h, eps=NORM_EPS, elementwise_affine=False)
        self.attn2 = Attention(h, cfg.num_heads)
        self.norm3 = nn.LayerNorm(h, eps=NORM_EPS, elementwise_affine=False)
        self.mlp = Mlp(h, cfg.mlp_hidden)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(h, 9 * h))

    def modulation(self, c: torch.Tensor) -> torch.Tensor:
        """c (B, hidden) -> (9, B, hidden)."""
        return torch.stack(self.adaLN_modulation(c).chunk(9, dim=-1))

    def forward(self, x: torch.Tensor, mod: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                bias: torch.Tensor, out_bias: torch.Tensor) -> torch.Tensor:
        """x (B, T, hidden); mod (9, B, hidden); k, v (B, H, S, hd) cross-attention K/V;
        bias (B, 1, 1, S); out_bias (hidden,) the cross-attention output bias that goes with
        k, v (`ActionExpertContext.out_bias[i]`)."""
        sh1, sc1, g1, sh2, sc2, g2, sh3, sc3, g3 = mod.unbind(0)
        h = modulate(self.norm1(x), sh1, sc1)
        x = x + g1.unsqueeze(1) * self.attn1(h, h)
        x = x + g2.unsqueeze(1) * self.attn2.attend(modulate(self.norm2(x), sh2, sc2), k, v, bias,
                                                    out_bias)
        return x + g3.unsqueeze(1) * self.mlp(modulate(self.norm3(x), sh3, sc3))


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, action_dim: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, eps=NORM_EPS, elementwise_affine=False)
        self.linear = nn.Linear(hidden, action_dim)
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def modulation(self, c: torch.Tensor) -> torch.Tensor:
        """c (B, hidden) -> (2, B, hidden): shift, scale."""
        return torch.stack(self.adaLN(c).chunk(2, dim=-1))

    def forward(self, x: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        return self.linear(modulate(self.norm_final(x), mod[0], mod[1]))


class ActionExpert(nn.Module):
    """Flow-matching velocity field v(x_t, t | LLM hidden states, robot state).

    Args:
        cfg: the action-expert sizes.
        llm_dim: width of the LLM hidden states (context_proj input).
        action_dim, horizon: action chunk shape (horizon <= cfg.max_horizon).
        states_mode: 'cross_attn' (state tokens appended to every block's context, always
            visible) or 'self_attn' (state tokens prepended to the action tokens).
    """

    def __init__(self, cfg: ActionExpertConfig, llm_dim: int, action_dim: int, horizon: int,
                 states_mode: str = 'cross_attn'):
        super().__init__()
        h = cfg.hidden_size
        self.cfg, self.horizon, self.states_mode = cfg, horizon, states_mode
        self.action_embed = nn.Linear(action_dim, h)
        self.action_pos_embed = nn.Parameter(torch.zeros(1, cfg.max_horizon, h))
        self.time_embed = nn.Sequential(SinusoidalPosEmb(cfg.timestep_embed_dim),
                                        nn.Linear(cfg.timestep_embed_dim, h), nn.SiLU(),
                                        nn.Linear(h, h))
        self.context_proj = nn.Linear(llm_dim, h, bias=False)
        self.context_norm = (nn.LayerNorm(h, eps=CONTEXT_NORM_EPS, elementwise_affine=False)
                             if cfg.context_layer_norm else nn.Identity())
        self.state_encoder = nn.Linear(h, h)
        self.state_norm = nn.LayerNorm(h, eps=NORM_EPS, elementwise_affine=False)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.num_layers))
        self.final_layer = FinalLayer(h, action_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.action_embed.weight.dtype

    # -- per-query pieces (the K/V cache) ------------------------------------------------

    def encode_states(self, states: torch.Tensor) -> torch.Tensor:
        """states float (B, n_obs, state_dim), normalized -> (B, n_obs, hidden):
        state_norm(state_encoder(states zero-padded to hidden))."""
        h = self.cfg.hidden_size
        if states.dim() != 3 or states.shape[-1] > h:
            raise ValueError(f'states must be (B, n_obs, state_dim <= {h}), got '
                             f'{tuple(states.shape)}')
        padded = F.pad(states.to(self.dtype), (0, h - states.shape[-1]))
        return self.state_norm(self.state_encoder(padded))

    def context_rows(self, hidden: torch.Tensor, state_tokens: torch.Tensor) -> torch.Tensor:
        """hidden (n_blocks, B, L, llm_dim), state_tokens (B, n_obs, hidden) -> every block's
        cross-attention context (n_blocks, B, S, hidden), parameter dtype:
        context_norm(context_proj(hidden[i])) (+ the state tokens in cross_attn mode), then zero
        rows up to S, a multiple of CONTEXT_ALIGN (aligned K/V rows keep the cross-attention
        matmuls on vectorized kernels; `cross_mask_bias` masks the extra rows, which get
        exactly zero probability). One GEMM projects every layer (context_proj is shared)."""
        n = hidden.shape[0]
        ctx = self.context_norm(self.context_proj(hidden.to(self.dtype)))
        if self.states_mode == 'cross_attn':
            ctx = torch.cat([ctx, state_tokens.unsqueeze(0).expand(n, -1, -1, -1)], dim=2)
        return F.pad(ctx, (0, 0, 0, -ctx.shape[2] % CONTEXT_ALIGN))

    def cross_key_values(self, rows: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Upstream's cross-attention K/V of every block, block by block.

        rows (n_blocks, B, S, hidden) from `context_rows` -> keys, values (n_blocks, B, H, S,
        head_dim) from each block's attn2.kv_proj (with its bias), and out_bias (n_blocks,
        hidden) = each block's attn2.proj.bias (`ActionExpertContext`)."""
        keys, values = zip(*(block.attn2.key_values(ctx)
                             for block, ctx in zip(self.blocks, rows.unbind(0))))
        out_bias = torch.stack([block.attn2.proj.bias for block in self.blocks])
        return torch.stack(keys), torch.stack(values), out_bias

    def cross_mask_bias(self, encoder_mask: torch.Tensor, n_obs: int) -> torch.Tensor:
        """encoder_mask bool (B, L), True = valid -> additive (B, 1, 1, S): (1 - m) * finfo.min,
        state tokens always visible in cross_attn mode, alignment rows never (S as in
        `context_key_values`)."""
        m = encoder_mask
        if self.states_mode == 'cross_attn':
            m = torch.cat([m, m.new_ones(m.shape[0], n_obs)], dim=1)
        m = F.pad(m, (0, -m.shape[1] % CONTEXT_ALIGN), value=False).to(self.dtype)
        return ((1 - m) * torch.finfo(self.dtype).min)[:, None, None, :]

    def _check_context_inputs(self, hidden: torch.Tensor, encoder_mask: torch.Tensor) -> None:
        n = len(self.blocks)
        if hidden.dim() != 4 or hidden.shape[0] != n:
            raise ValueError(f'hidden must be ({n}, B, L, d_model) (one LLM layer per block), '
                             f'got {tuple(hidden.shape)}')
        if encoder_mask.dtype != torch.bool or encoder_mask.shape != hidden.shape[1:3]:
            raise ValueError(f'encoder_mask must be bool {tuple(hidden.shape[1:3])}, got '
                             f'{encoder_mask.dtype} {tuple(encoder_mask.shape)}')

    def prepare_context(self, hidden: torch.Tensor, encoder_mask: torch.Tensor,
                        states: torch.Tensor, key_values=None) -> ActionExpertContext:
        """Everything that does not depend on x_t or t, computed once per query.

        hidden: (n_blocks, B, L, llm_dim), LLM outputs already selected by ae_layer_ids.
        encoder_mask: bool (B, L), False = padding. states: (B, n_obs, state_dim) normalized.
        key_values: `rows -> (keys, values, out_bias)` as `cross_key_values` (the default);
            the runtime passes its served projection (`runtime.serving.ServedActionExpert`).
        Raises ValueError on mismatched shapes.
        """
        self._check_context_inputs(hidden, encoder_mask)
        state_tokens = self.encode_states(states)
        rows = self.context_rows(hidden, state_tokens)
        keys, values, out_bias = (key_values or self.cross_key_values)(rows)
        return ActionExpertContext(keys, values,
                                   self.cross_mask_bias(encoder_mask, states.shape[1]),
                                   state_tokens, out_bias)

    # -- per-step pieces -----------------------------------------------------------------

    def embed_time(self, t: torch.Tensor) -> torch.Tensor:
        """t float (B,) -> c (B, hidden): Linear(SiLU(Linear(sinusoid(t)))), param dtype."""
        sinusoid = self.time_embed[0](t).to(self.dtype)
        return self.time_embed[1:](sinusoid)

    def time_conditioning(self, t: torch.Tensor) -> TimeConditioning:
        """t float (B,) in [0, 1] -> every block's (and the final layer's) AdaLN modulation."""
        c = self.embed_time(t)
        return TimeConditioning(torch.stack([block.modulation(c) for block in self.blocks]),
                                self.final_layer.modulation(c))

    def embed_actions(self, x_t: torch.Tensor, state_tokens: torch.Tensor) -> torch.Tensor:
        """x_t (B, H, A), state_tokens (B, n_obs, hidden) -> the self-attention tokens
        (B, T, hidden), parameter dtype: action_embed(x_t), in self_attn mode after the
        state tokens (T = n_obs + H, else T = H), plus action_pos_embed[:, :T]. So in
        self_attn mode the state tokens take positions 0..n_obs-1 and the actions
        n_obs..n_obs+H-1 (upstream: the states prepended first, then the position embedding
        added). Raises ValueError when T exceeds max_horizon (the position table's length)."""
        x = self.action_embed(x_t.to(self.dtype))
        if self.states_mode == 'self_attn':
            x = torch.cat([state_tokens, x], dim=1)
        if x.shape[1] > self.cfg.max_horizon:
            raise ValueError(f'{x.shape[1]} action-expert tokens ({x_t.shape[1]} actions'
                             + (f' + {state_tokens.shape[1]} state tokens'
                                if self.states_mode == 'self_attn' else '')
                             + f') exceed max_horizon = {self.cfg.max_horizon}')
        return x + self.action_pos_embed[:, :x.shape[1]]

    def velocity_from_conditioning(self, x_t: torch.Tensor, cond: TimeConditioning,
                                   ctx: ActionExpertContext, blocks_fn=None) -> torch.Tensor:
        """x_t (B, H, A) -> velocity (B, H, A) in the parameter dtype.

        blocks_fn: optional replacement for the loop over the blocks, called as
            `blocks_fn(x, cond.blocks, ctx) -> x` with x (B, T, hidden) (the runtime's fused
            kernel, `molmobot_policy.runtime.fused_dit.FusedDiTStep`); None runs the blocks."""
        x = self.embed_actions(x_t, ctx.state_tokens)
        if blocks_fn is not None:
            x = blocks_fn(x, cond.blocks, ctx)
        else:
            for i, block in enumerate(self.blocks):
                x = block(x, cond.blocks[i], ctx.keys[i], ctx.values[i], ctx.mask_bias,
                          ctx.out_bias[i])
        x = x[:, x.shape[1] - x_t.shape[1]:]
        return self.final_layer(x, cond.final)

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor,
                 ctx: ActionExpertContext) -> torch.Tensor:
        """x_t (B, H, A), t float (B,) -> velocity (B, H, A) in the parameter dtype."""
        return self.velocity_from_conditioning(x_t, self.time_conditioning(t), ctx)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, hidden: torch.Tensor,
                encoder_mask: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """Velocity with the context computed for this call, as upstream. Shapes as in
        `prepare_context` and `velocity`."""
        return self.velocity(x_t, t, self.prepare_context(hidden, encoder_mask, states))
