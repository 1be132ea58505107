"""A plain float32 re-derivation of the MolmoBot action expert (velocity field and Euler
flow), the tests' independent reference for both `states_mode`s.

Written from the upstream description (../shared/docs/molmobot_model.md sections 5-6, the
golden README section 6, and upstream's self_attn rule: the encoded state tokens are
prepended to the embedded actions FIRST, then `action_pos_embed[:, :n_obs + horizon]` is
added, so the states take positions 0..n_obs-1; only the action tokens reach the output).
Plain torch ops on the state-dict tensors; nothing from molmobot_policy.model is called.
Checked against the golden upstream outputs in cross_attn mode
(test_self_attn_reference.py).
"""
from __future__ import annotations

import math

import torch

PREFIX = 'action_expert.'


def _linear(sd: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    y = x @ sd[PREFIX + name + '.weight'].T
    bias = sd.get(PREFIX + name + '.bias')
    return y if bias is None else y + bias


def _layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """No affine parameters (every action-expert LayerNorm upstream)."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU."""
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2.0)))


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


def _attention(sd: dict, name: str, x: torch.Tensor, source: torch.Tensor, heads: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """q_proj, kv_proj (keys = first half), proj; softmax(q k^T / sqrt(hd) + bias) v."""
    b, n, d = x.shape
    s, hd = source.shape[1], d // heads
    q = _linear(sd, name + '.q_proj', x).view(b, n, heads, hd).transpose(1, 2)
    kv = _linear(sd, name + '.kv_proj', source).view(b, s, 2, heads, hd)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    scores = (q * hd ** -0.5) @ k.transpose(-1, -2)
    if bias is not None:
        scores = scores + bias
    out = torch.softmax(scores, dim=-1) @ v
    return _linear(sd, name + '.proj', out.transpose(1, 2).reshape(b, n, d))


def velocity(sd: dict, x_t: torch.Tensor, t: torch.Tensor, layers: list[torch.Tensor],
             encoder_mask: torch.Tensor, states: torch.Tensor, *, states_mode: str,
             heads: int) -> torch.Tensor:
    """The action expert's velocity v(x_t, t), float32 (B, H, A).

    sd: the model's state dict (upstream key names; float32 tensors); x_t (B, H, A); t (B,)
    in [0, 1]; layers: one LLM hidden state (B, L, d_llm) per action-expert block, in block
    order (already selected by the layer mode); encoder_mask bool (B, L), True = valid;
    states (B, n_obs, state_dim), normalized; heads: action-expert attention heads.
    """
    sd = {k: v.float() for k, v in sd.items() if k.startswith(PREFIX)}
    x_t, states = x_t.float(), states.float()
    hidden = sd[PREFIX + 'action_pos_embed'].shape[-1]
    n_blocks = len({k.split('.')[2] for k in sd if k.startswith(PREFIX + 'blocks.')})
    assert len(layers) == n_blocks, (len(layers), n_blocks)
    b, horizon, _ = x_t.shape
    n_obs = states.shape[1]

    # time: sinusoid(256) = [sin(t f), cos(t f)], f_k = exp(-k ln(1e4) / 127), no 1000 scale
    half = sd[PREFIX + 'time_embed.1.weight'].shape[1] // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / (half - 1))
    args = t.float()[:, None] * freqs[None]
    sinusoid = torch.cat([torch.sin(args), torch.cos(args)], dim=-1)
    c = _linear(sd, 'time_embed.3', _silu(_linear(sd, 'time_embed.1', sinusoid)))

    # one state token per observation step: LN_1e-6(state_encoder(states zero-padded))
    padded = torch.cat([states, states.new_zeros(b, n_obs, hidden - states.shape[-1])], -1)
    state_tokens = _layer_norm(_linear(sd, 'state_encoder', padded), 1e-6)

    pos = sd[PREFIX + 'action_pos_embed']
    tokens = _linear(sd, 'action_embed', x_t)
    if states_mode == 'self_attn':      # states first, then positions 0..n_obs + H - 1
        tokens = torch.cat([state_tokens, tokens], dim=1)
    x = tokens + pos[:, :tokens.shape[1]]

    visible = encoder_mask.float()
    if states_mode == 'cross_attn':     # the state tokens join every block's context
        visible = torch.cat([visible, visible.new_ones(b, n_obs)], dim=1)
    bias = ((1 - visible) * torch.finfo(torch.float32).min)[:, None, None, :]

    for i, layer in enumerate(layers):
        blk = f'blocks.{i}'
        context = _layer_norm(_linear(sd, 'context_proj', layer.float()), 1e-5)
        if states_mode == 'cross_attn':
            context = torch.cat([context, state_tokens], dim=1)
        sh1, sc1, g1, sh2, sc2, g2, sh3, sc3, g3 = _linear(
            sd, blk + '.adaLN_modulation.1', _silu(c)).chunk(9, dim=-1)
        h = _modulate(_layer_norm(x, 1e-6), sh1, sc1)
        x = x + g1[:, None] * _attention(sd, blk + '.attn1', h, h, heads)
        h = _modulate(_layer_norm(x, 1e-6), sh2, sc2)
        x = x + g2[:, None] * _attention(sd, blk + '.attn2', h, context, heads, bias)
        h = _modulate(_layer_norm(x, 1e-6), sh3, sc3)
        x = x + g3[:, None] * _linear(sd, blk + '.mlp.fc2',
                                      _gelu(_linear(sd, blk + '.mlp.fc1', h)))

    x = x[:, x.shape[1] - horizon:]     # the action tokens only (self_attn: states dropped)
    shift, scale = _linear(sd, 'final_layer.adaLN.1', _silu(c)).chunk(2, dim=-1)
    return _linear(sd, 'final_layer.linear', _modulate(_layer_norm(x, 1e-6), shift, scale))


def flow(sd: dict, noise: torch.Tensor, layers: list[torch.Tensor], encoder_mask: torch.Tensor,
         states: torch.Tensor, *, states_mode: str, heads: int, steps: int = 10) -> torch.Tensor:
    """Forward Euler from noise (t = 0) to data (t = 1): x += v(x, i / steps) / steps for
    i in 0..steps-1; float32 (B, H, A) in normalized action space."""
    x = noise.float()
    for i in range(steps):
        t = torch.full((x.shape[0],), i / steps, dtype=torch.float32)
        x = x + (1.0 / steps) * velocity(sd, x, t, layers, encoder_mask, states,
                                         states_mode=states_mode, heads=heads)
    return x
