"""Vision side of MolmoBot: SigLIP ViT, 2x2 attention-mean-query pooling, SwiGLU projector.

Module and parameter names follow upstream `olmo/nn/image_vit.py` and
`olmo/nn/vision_backbone.py` (`image_vit`, `image_pooling_2d`, `image_projector`), so an
upstream state dict loads one to one. The math is the golden README's section 6
(../shared/golden/molmobot_tiny/README.md): ViT and pooling attention run in float32
whatever the parameter dtype (upstream `float32_attention`), images are normalized inside
the model as x / 255 * 2 - 1 (upstream `normalize_on_gpu`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConnectorConfig, LlmConfig, VitConfig
from .stacking import is_stack_of, stack_parameters_


def fp32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA with q, k, v cast to float32; the result is cast back to q's dtype.

    q: (..., H, Tq, hd), k/v: (..., H, Tk, hd); attn_mask bool, True = may attend.
    """
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask)
    return out.to(q.dtype)


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query over a few keys as float32 products and sums.

    q: (..., H, 1, hd), k/v: (..., H, Tk, hd); attn_mask bool broadcastable to (..., H, 1, Tk),
    True = may attend. Returns (..., H, 1, hd) in q's dtype. For the connector's 2x2 pooling
    windows (1 query, 4 keys, 1568 windows x 16 heads for 8 images): SDPA ran it as one fused
    kernel of 0.31 ms on an H200, these few elementwise kernels read the same 15 MB once.
    """
    scores = (q.float() * k.float()).sum(-1, keepdim=True).transpose(-1, -2)  # (.., H, 1, Tk)
    scores = scores * q.shape[-1] ** -0.5
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float('-inf'))
    probs = torch.softmax(scores, dim=-1)
    return (probs.transpose(-1, -2) * v.float()).sum(-2, keepdim=True).to(q.dtype)


class ViTMultiHeadDotProductAttention(nn.Module):
    """Multi-head attention with biased wq/wk/wv/wo.

    `float32_attention` (upstream's flag, default True): q, k, v are cast to float32 before
    SDPA. With bf16 weights, q/k/v carry bf16 precision either way and the fused bf16
    kernels accumulate q k^T, the softmax and p v in float32 too; the difference is the
    rounding of the probabilities to bf16 before p v. The runtime turns the flag off for
    bf16 serving (about 2.6x faster ViT on an H200: 34.6 -> 13.5 ms for 8 images,
    benchmarks/RESULTS.md).
    """

    float32_attention = True
    qkv_stack: tuple[torch.Tensor, torch.Tensor] | None = None   # set by `stack_qkv_`

    def __init__(self, dim: int, n_heads: int, head_dim: int, in_dim: int | None = None):
        super().__init__()
        in_dim = dim if in_dim is None else in_dim
        self.n_heads, self.head_dim = n_heads, head_dim
        self.wq = nn.Linear(in_dim, n_heads * head_dim)
        self.wk = nn.Linear(in_dim, n_heads * head_dim)
        self.wv = nn.Linear(in_dim, n_heads * head_dim)
        self.wo = nn.Linear(n_heads * head_dim, dim)

    def stack_qkv_(self) -> None:
        """Re-points wq / wk / wv (weights and biases) to slices of one (3, H * hd, in_dim)
        weight and one (3, H * hd) bias (`stacking.stack_parameters_`): in place and
        idempotent; values, state-dict keys and `load_state_dict` unchanged, no second copy.
        Self-attention (x_q is x_kv) then projects q, k and v with one GEMM of N = 3 H hd:
        for the so400m ViT over 8 images 10.21 instead of 10.38 ms on an H200
        (benchmarks/benchmark_vit_variants.py, RESULTS.md). Moving the module (`.to`) stacks
        the moved parameters again; the compiled forward trusts the stack, so replacing a
        parameter's tensor (`p.data = ...`) after compiling is not supported."""
        if not self.qkv_stacked():
            linears = (self.wq, self.wk, self.wv)
            self.qkv_stack = (stack_parameters_([m.weight for m in linears]),
                              stack_parameters_([m.bias for m in linears]))

    def qkv_stacked(self) -> bool:
        """True while wq / wk / wv are the slices of `qkv_stack` (a deep copy, or a parameter
        given a new tensor, ends it; eager calls then run three GEMMs, `stack_qkv_` restacks)."""
        stack, linears = self.qkv_stack, (self.wq, self.wk, self.wv)
        return stack is not None and is_stack_of(stack[0], [m.weight for m in linears]) \
            and is_stack_of(stack[1], [m.bias for m in linears])

    def _apply(self, fn, recurse=True):
        # `.to` / `.half` / `.cuda` give each parameter its own new tensor: stack those again
        restack = self.qkv_stack is not None
        self.qkv_stack = None
        module = super()._apply(fn, recurse)
        if restack:
            self.stack_qkv_()
        return module

    def forward(self, x_q: torch.Tensor, x_kv: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x_q (B, Tq, in_dim), x_kv (B, Tk, in_dim), attn_mask bool broadcastable to
        (B, H, Tq, Tk) -> (B, Tq, dim)."""
        b, tq, tk = x_q.shape[0], x_q.shape[1], x_kv.shape[1]
        # compiled code trusts the stack (`stack_qkv_` is called before compiling)
        if self.qkv_stack is not None and x_q is x_kv and (
                torch.compiler.is_compiling() or self.qkv_stacked()):
            weight, bias = self.qkv_stack
            qkv = F.linear(x_q, weight.flatten(0, 1), bias.flatten())
            q, k, v = qkv.view(b, tq, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        else:
            q = self.wq(x_q).view(b, tq, self.n_heads, self.head_dim).transpose(1, 2)
            k = self.wk(x_kv).view(b, tk, self.n_heads, self.head_dim).transpose(1, 2)
            v = self.wv(x_kv).view(b, tk, self.n_heads, self.head_dim).transpose(1, 2)
        if tq == 1 and tk <= 16:    # the pooling windows
            out = single_query_attention(q, k, v, attn_mask)
        elif self.float32_attention:
            out = fp32_attention(q, k, v, attn_mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.wo(out.transpose(1, 2).reshape(b, tq, self.n_heads * self.head_dim))


class ViTMLP(nn.Module):
    """w2(gelu_tanh(w1 x)), both with bias.

    On CUDA, w1 + bias + GELU run as one cuBLASLt GEMM with its GELU epilogue
    (`torch._addmm_activation`), which computes the tanh approximation (checked against
    F.gelu(approximate='tanh') on an H200: max |diff| 5e-6 in float32, against 4.7e-4 for the
    erf form). That saves the separate GELU pass over the (N, 4304) activations and leaves
    w2's input contiguous, so w2 keeps its bias epilogue too (1.5 ms of 12.6 for 8 images,
    benchmarks/RESULTS.md). On CPU `_addmm_activation` computes the erf form, so the CPU path
    stays F.gelu.
    """

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            shape = x.shape
            h = torch._addmm_activation(self.w1.bias, x.reshape(-1, shape[-1]),
                                        self.w1.weight.t(), use_gelu=True)
            return self.w2(h.view(*shape[:-1], h.shape[-1]))
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
