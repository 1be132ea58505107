"""Vision side of MolmoBot: SigLIP ViT, 2x2 attention-mean-query pooling, SwiGLU projector.

Module and parameter names follow upstream `olmo/nn/image_vit.py` and
`olmo/nn/vision_backbone.py` (`image_vit`, `image_pooling_2d`, `image_projector`), so an
upstream state dict loads one to one. The math is the golden README's section 6
(../shared/golden/molmobot_tiny/README.md): ViT and pooling attention run in float32
whatever the parameter dtype (upstream `float32_attention`), images are normalized inside
the model as x / 255 * 2 - 1 (upstream `normalize_on_gpu`). The runtime swaps in its served
forms of the attention and the MLP at load time (`runtime.serving.prepare_for_serving`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConnectorConfig, LlmConfig, VitConfig


class ViTMultiHeadDotProductAttention(nn.Module):
    """Multi-head attention with biased wq/wk/wv/wo; q, k and v are cast to float32 before
    attention (upstream `float32_attention: true`), the result back to the parameter dtype."""

    def __init__(self, dim: int, n_heads: int, head_dim: int, in_dim: int | None = None):
        super().__init__()
        in_dim = dim if in_dim is None else in_dim
        self.n_heads, self.head_dim = n_heads, head_dim
        self.wq = nn.Linear(in_dim, n_heads * head_dim)
        self.wk = nn.Linear(in_dim, n_heads * head_dim)
        self.wv = nn.Linear(in_dim, n_heads * head_dim)
        self.wo = nn.Linear(n_heads * head_dim, dim)

    def forward(self, x_q: torch.Tensor, x_kv: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x_q (B, Tq, in_dim), x_kv (B, Tk, in_dim), attn_mask bool broadcastable to
        (B, H, Tq, Tk), True = may attend -> (B, Tq, dim)."""
        b, tq, tk = x_q.shape[0], x_q.shape[1], x_kv.shape[1]
        q = self.wq(x_q).view(b, tq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x_kv).view(b, tk, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x_kv).view(b, tk, self.n_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                             attn_mask=attn_mask).to(x_q.dtype)
        return self.wo(out.transpose(1, 2).reshape(b, tq, self.n_heads * self.head_dim))


class ViTMLP(nn.Module):
    """w2(gelu_tanh(w1 x)), both with bias."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate='tanh'))


class ResidualAttentionBlock(nn.Module):
    """Pre-LN ViT block: x += attention(LN x); x += feed_forward(LN x)."""

    def __init__(self, cfg: VitConfig):
        super().__init__()
        self.attention = ViTMultiHeadDotProductAttention(cfg.emb_dim, cfg.num_heads, cfg.head_dim)
        self.feed_forward = ViTMLP(cfg.emb_dim, cfg.mlp_dim)
        self.attention_norm = nn.LayerNorm(cfg.emb_dim, eps=cfg.norm_eps)
        self.ffn_norm = nn.LayerNorm(cfg.emb_dim, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        x = x + self.attention(h, h)
        return x + self.feed_forward(self.ffn_norm(x))


class BlockCollection(nn.Module):
    def __init__(self, cfg: VitConfig):
        super().__init__()
        self.resblocks = nn.ModuleList(
            ResidualAttentionBlock(cfg) for _ in range(cfg.num_built_layers))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Returns the output of every built block, in order."""
        outputs = []
        for block in self.resblocks:
            x = block(x)
            outputs.append(x)
        return outputs


class SiglipVisionTransformer(nn.Module):
    """SigLIP ViT without CLS token, pre-LN or post-LN; only `num_built_layers` blocks."""

    def __init__(self, cfg: VitConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = nn.Linear(cfg.patch_dim, cfg.emb_dim)
        self.positional_embedding = nn.Parameter(torch.zeros(cfg.num_patches, cfg.emb_dim))
        self.transformer = BlockCollection(cfg)

    def forward(self, patches: torch.Tensor) -> list[torch.Tensor]:
        """patches (B, 729, 588) normalized to [-1, 1] in the parameter dtype -> list of
        (B, 729, emb_dim), one per built block."""
        x = self.patch_embedding(patches) + self.positional_embedding[None]
        return self.transformer(x)


class ImageProjectorMLP(nn.Module):
    """w2(silu(w1 x) * w3 x), no biases (upstream `image_projector: mlp`)."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int):
        super().__init__()
        self.w1 = nn.Linear(in_dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, out_dim, bias=False)
        self.w3 = nn.Linear(in_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MolmoVisionBackbone(nn.Module):
    """uint8 patches + pooling indices -> one d_model feature per `<im_patch>` token."""

    def __init__(self, vit: VitConfig, connector: ConnectorConfig, llm: LlmConfig):
        super().__init__()
        self.vit_cfg, self.connector_cfg = vit, connector
        pool_in = vit.emb_dim * len(vit.vit_layers)
        self.image_vit = SiglipVisionTransformer(vit)
        self.image_pooling_2d = ViTMultiHeadDotProductAttention(
            connector.pool_dim, connector.num_heads, connector.pool_dim // connector.num_heads,
            in_dim=pool_in)
        self.image_projector = ImageProjectorMLP(connector.pool_dim, connector.projector_hidden,
                                                 llm.d_model)

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """images uint8 (B, N, 729, 588) -> ViT features (B, N, 729, emb_dim * len(vit_layers)),
        the selected block outputs concatenated in `vit_layers` order, parameter dtype.

        Pixels are normalized here in float32: x / 255 * 2 - 1 (upstream `normalize_on_gpu`).
        """
        b, n, p, d = images.shape
        x = images.reshape(b * n, p, d).float() / 255.0
        x = (x * 2 - 1).to(self.image_vit.patch_embedding.weight.dtype)
        hidden = self.image_vit(x)
        feats = torch.cat([hidden[i] for i in self.vit_cfg.layer_indices], dim=-1)
        return feats.view(b, n, p, -1)

    def forward(self, images: torch.Tensor, token_pooling: torch.Tensor) -> torch.Tensor:
        """images uint8 (B, N, 729, 588); token_pooling int64 (B, T, 4) with T = N * 196,
        indices into the example's flattened (N * 729) patch list, -1 = padding.

        Returns (B, T, d_model) in the parameter dtype. A token whose indices are all -1
        gets a zero feature. Pooling query = mean of the valid patches of the window
        (`attention_meanq`), keys/values = the window's patches, padded ones masked.
        """
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f'images must be uint8 (B, N, 729, 588), got {images.dtype} '
                             f'{tuple(images.shape)}')
        if token_pooling.dim() != 3 or token_pooling.shape[0] != images.shape[0]:
            raise ValueError(f'token_pooling must be int64 (B, T, pool), got '
                             f'{tuple(token_pooling.shape)} for images {tuple(images.shape)}')
        feats = self.encode_image(images)
        b, t, pool = token_pooling.shape
        feats = feats.reshape(b, -1, feats.shape[-1])
        valid = token_pooling >= 0                                    # (B, T, pool)
        batch_idx = torch.arange(b, device=feats.device).view(b, 1, 1)
        to_pool = feats[batch_idx, token_pooling.clamp(min=0)]          # (B, T, pool, D)
        to_pool = to_pool * valid.unsqueeze(-1).to(to_pool.dtype)
        n_valid = valid.sum(-1, keepdim=True)                          # (B, T, 1)
        query = to_pool.sum(-2) / n_valid.clamp(min=1).to(to_pool.dtype)
        token_valid = n_valid > 0
        # A fully padded window attends to its (zero) entries so SDPA never sees an empty row.
        key_mask = (valid | ~token_valid).reshape(b * t, 1, 1, pool)
        pooled = self.image_pooling_2d(query.reshape(b * t, 1, -1),
                                       to_pool.reshape(b * t, pool, -1), key_mask)
        out = self.image_projector(pooled.reshape(b, t, -1))
        return out * token_valid.to(out.dtype)
