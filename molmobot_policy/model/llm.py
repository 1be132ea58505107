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


def cudnn_attention_serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether cuDNN's fused attention with its log-sum-exp can run `causal_attention_with_lse`
    (its `fused` argument): a CUDA device, bf16 / fp16, a head dim of at most 128 and a
    multiple of 8, cuDNN and its SDPA backend enabled. Decided once, outside compiled code."""
    return (torch.device(device).type == 'cuda' and dtype in (torch.bfloat16, torch.float16)
            and head_dim <= 128 and head_dim % 8 == 0 and torch.backends.cudnn.is_available()
            and torch.backends.cuda.cudnn_sdp_enabled())


def causal_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention (query i sees key j <= i) and its log-sum-exp.

    q (B, Hq, L, D); k, v (B, Hkv, L, D), Hq a multiple of Hkv (query head h reads K/V head
    h // (Hq / Hkv), as SDPA's `enable_gqa`). Returns out (B, Hq, L, D) in q's dtype and
    lse float32 (B, Hq, L): the natural log of each row's softmax denominator over the
    scores q.k / sqrt(D). fused (where `cudnn_attention_serves`): cuDNN's fused kernel
    (`aten._scaled_dot_product_cudnn_attention`, which groups the heads itself); else
    float32 math.
    """
    if fused:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False)[:2]
        return out, lse.float().reshape(q.shape[:3])
    group = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.float() @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    length = q.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float('-inf'))
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse[..., None]) @ vf).to(q.dtype), lse


def attention_with_later_image_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    image_rows: torch.Tensor, fused: bool = False
                                    ) -> torch.Tensor:
    """Attention under the served mask "key j <= query i, or both are image tokens" as two
    causal attentions merged by their log-sum-exp, without an (L, L) mask.

    The mask is the union of two disjoint sets: the causal one, and for an image query the
    image keys after it. Taken last first, the image tokens make the second set causal too:
    the image token r-th from the end sees the image keys fewer than r from the end, i.e.
    queries rev[1:] against keys rev[:-1] under a square causal mask (rev = image_rows
    reversed; the last image token has no later image key). Rows that are not image tokens
    keep the causal result; image rows get (e^l1 o1 + e^l2 o2) / (e^l1 + e^l2).

    q (B, Hq, L, D); k, v (B, Hkv, L, D) (grouped heads and `fused` as
    `causal_attention_with_lse`);
    image_rows int64 (B, M), M >= 2: the image tokens' positions, increasing. Padding must
    come after every real token (right padding): the causal part lets a padding row see the
    padding keys before it, which no real row can. Returns (B, Hq, L, D) in q's dtype.
    Equals masked attention within the kernels' rounding (docs/decisions/llm-masked-attention.md).
    """
    b, hq, _, d = q.shape
    rev = image_rows.flip(1)
    rows, keys = rev[:, 1:], rev[:, :-1]
    m = rows.shape[1]

    def take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return t.gather(2, index[:, None, :, None].expand(b, t.shape[1], m, d))

    out, lse = causal_attention_with_lse(q, k, v, fused)
    later, later_lse = causal_attention_with_lse(take(q, rows), take(k, keys), take(v, keys),
                                                 fused)
    own_lse = lse.gather(2, rows[:, None, :].expand(b, hq, m))
    top = torch.maximum(own_lse, later_lse)
    w_own, w_later = torch.exp(own_lse - top), torch.exp(later_lse - top)
    merged = ((w_own[..., None] * take(out, rows).float() + w_later[..., None] * later.float())
              / (w_own + w_later)[..., None])
    return out.scatter(2, rows[:, None, :, None].expand(b, hq, m, d), merged.to(out.dtype))


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
        # cuDNN for the causal attentions of `image_rows` (set where `cudnn_attention_serves`)
        self.fused_causal_attention = False

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attn_bias: torch.Tensor | None,
                  image_rows: torch.Tensor | None = None) -> torch.Tensor:
        b, n = x.shape[:2]
        q, k, v = self.att_proj(x).split(self.split, dim=-1)
        q = self.q_norm(q.view(b, n, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(b, n, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # GQA: query head h reads KV head h // (n_heads / n_kv_heads). SDPA groups the heads
        # itself, faster than repeating K/V to n_heads first.
        if image_rows is not None:
            out = attention_with_later_image_keys(q, k, v, image_rows,
                                                  self.fused_causal_attention)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, enable_gqa=True)
        return self.attn_out(out.transpose(1, 2).reshape(b, n, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_bias: torch.Tensor | None,
                image_rows: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attn_norm(x), cos, sin, attn_bias, image_rows)
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
                attn_bias: torch.Tensor | None,
                image_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, L, d_model) input embeddings; position_ids int64 (B, L) in
        [0, max_sequence_length); attn_bias (B, 1, L, L) additive, x's dtype; or, instead
        (attn_bias None), image_rows int64 (B, M): the served mask "causal, or both image
        tokens" computed as `attention_with_later_image_keys` (right padding only).
        Returns (n_layers, B, L, d_model): the output of every block, before ln_f."""
        cos = self.rope_cos[position_ids].unsqueeze(1)
        sin = self.rope_sin[position_ids].unsqueeze(1)
        hidden = []
        for block in self.blocks:
            x = block(x, cos, sin, attn_bias, image_rows)
            hidden.append(x)
        return torch.stack(hidden)
