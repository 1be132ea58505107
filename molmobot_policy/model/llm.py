"""The MolmoBot language model: Qwen3-style decoder blocks with OLMo parameter names.

Upstream: `olmo/nn/llm.py` (`OLMoSequentialBlock`); exact math in the golden README,
section 6 (../shared/golden/molmobot_tiny/README.md). RMSNorm and RoPE run in float32 whatever
the parameter dtype (upstream `rope_full_precision`); attention runs in the parameter dtype.
The outputs are the hidden states of every block (before `ln_f`): the action expert's
context. `ln_f` is kept for state-dict compatibility but never computed, nor the LM head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import LlmConfig


class RMSNorm(nn.Module):
    """weight * (x * rsqrt(mean(x^2) + eps)), normalization in float32, scale in x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(head_dim: int, max_positions: int, theta: float,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 (max_positions, head_dim) of NeoX-style RoPE:
    inv_freq = 1 / theta^(arange(0, hd, 2) / hd), angles cat([freqs, freqs])."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device,
                                            dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32),
                        inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, L, hd); cos/sin float32 (B, 1, L, hd). Computed in float32, returned in x's
    dtype."""
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


class Embedding(nn.Module):
    """Token embedding split in two tables, looked up as cat([embedding, new_embedding])
    without materializing the concatenation."""

    def __init__(self, num_embeddings: int, num_new_embeddings: int, dim: int):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding = nn.Parameter(torch.zeros(num_embeddings, dim))
        self.new_embedding = nn.Parameter(torch.zeros(num_new_embeddings, dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 (B, L) in [0, num_embeddings + num_new_embeddings) -> (B, L, dim)."""
        is_new = input_ids >= self.num_embeddings
        base = F.embedding(input_ids.clamp(max=self.num_embeddings - 1), self.embedding)
        new = F.embedding((input_ids - self.num_embeddings).clamp(min=0), self.new_embedding)
        return torch.where(is_new.unsqueeze(-1), new, base)


class OLMoSequentialBlock(nn.Module):
    """h = x + attn_out(Attn(attn_norm x)); out = h + ff_out(SwiGLU(ff_proj(ff_norm h)))."""

    def __init__(self, cfg: LlmConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.split = (q_dim, kv_dim, kv_dim)
        self.att_proj = nn.Linear(cfg.d_model, q_dim + 2 * kv_dim, bias=False)
        self.attn_out = nn.Linear(q_dim, cfg.d_model, bias=False)
        self.ff_proj = nn.Linear(cfg.d_model, 2 * cfg.mlp_hidden, bias=False)
        self.ff_out = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ff_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attn_bias: torch.Tensor) -> torch.Tensor:
        b, n = x.shape[:2]
        q, k, v = self.att_proj(x).split(self.split, dim=-1)
        q = self.q_norm(q.view(b, n, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(b, n, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(attn_bias, torch.Tensor):
            # GQA: query head h reads KV head h // (n_heads / n_kv_heads). SDPA groups the
            # heads itself, faster than repeating K/V to n_heads first.
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, enable_gqa=True)
            out = out.transpose(1, 2)
        else:   # a served mask object (`runtime.flash_attention.ImageTokensMask`) attends itself
            out = attn_bias(q, k, v)
        return self.attn_out(out.reshape(b, n, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_bias: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attn_norm(x), cos, sin, attn_bias)
        up, gate = self.ff_proj(self.ff_norm(h)).chunk(2, dim=-1)
        return h + self.ff_out(F.silu(gate) * up)


class Llm(nn.Module):
    """Decoder stack; `wte`, `blocks`, `ln_f` as upstream. RoPE tables are non-persistent
    float32 buffers (`rope_cos`, `rope_sin`, (max_sequence_length, head_dim)) built at
    construction; call `reset_buffers(device)` after loading onto a new device."""

    def __init__(self, cfg: LlmConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.additional_vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(OLMoSequentialBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_sequence_length, cfg.rope_theta)
        self.register_buffer('rope_cos', cos, persistent=False)
        self.register_buffer('rope_sin', sin, persistent=False)

    def reset_buffers(self, device: torch.device | str) -> None:
        """(Re)build the RoPE tables on `device` (e.g. after a meta-device build)."""
        self.rope_cos, self.rope_sin = rope_tables(
            self.cfg.head_dim, self.cfg.max_sequence_length, self.cfg.rope_theta, device)

    def _apply(self, fn, recurse=True):
        # `.to(dtype)`, `.half()` or `.to_empty()` would cast or blank the RoPE tables; they
        # are rebuilt in float32 on the buffers' new device instead.
        super()._apply(fn, recurse)
        self.reset_buffers(self.rope_cos.device)
        return self

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                attn_bias: torch.Tensor) -> torch.Tensor:
        """x (B, L, d_model) input embeddings; position_ids int64 (B, L) in
        [0, max_sequence_length); attn_bias (B, 1, L, L) additive, x's dtype, or a mask
        object called as mask(q (B, Hq, L, hd), k, v (B, Hkv, L, hd)) -> (B, L, Hq, hd) (the
        served form of the same mask, `runtime.flash_attention.ImageTokensMask`).
        Returns (n_layers, B, L, d_model): the output of every block, before ln_f."""
        cos = self.rope_cos[position_ids].unsqueeze(1)
        sin = self.rope_sin[position_ids].unsqueeze(1)
        hidden = []
        for block in self.blocks:
            x = block(x, cos, sin, attn_bias)
            hidden.append(x)
        return torch.stack(hidden)
