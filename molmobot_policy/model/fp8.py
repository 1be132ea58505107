"""fp8 (e4m3) weights for the LLM's (and optionally the ViT's) Linears, with dynamic
activation scaling.

`quantize_llm_fp8_(blocks, granularity)` swaps every LLM block's `att_proj`, `attn_out`,
`ff_proj` and `ff_out` for an `Fp8Linear`; `quantize_vit_fp8_(resblocks, granularity)` does
the same for every ViT block's `attention.{wq,wk,wv,wo}` and `feed_forward.{w1,w2}` (their
biases stay bf16). Weights are quantized once; activations are scaled per call from their
absolute maximum (per tensor, or per row = per token), and the product runs through
`torch._scaled_mm` with fp32 scales and a bf16 result.

Scaling: q = clamp(x / s, -448, 448) in float8_e4m3fn with s = amax / 448 (448 is the
largest finite e4m3fn value, OCP FP8 spec). amax is clamped to >= 1e-12 so all-zero rows
(prompt padding) quantize to zeros and give finite outputs.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger('molmobot_policy.fp8')

E4M3_MAX = 448.0
GRANULARITIES = ('rowwise', 'tensor')
_MIN_AMAX = 1e-12


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=_MIN_AMAX) / E4M3_MAX


def _quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in e4m3 and x quantized on the fly.

    Args:
        weight: (out_features, in_features) float tensor on a CUDA device; both sizes must
            be multiples of 16 (a `torch._scaled_mm` requirement).
        granularity: 'rowwise' (one scale per weight row and per activation row) or
            'tensor' (one scale each).
        bias: optional (out_features,) tensor, kept in its dtype and added to the bf16
            product (under compile the add fuses into the consumer of y).

    forward: x (..., in_features) bf16 -> (..., out_features) bf16.
    """

    def __init__(self, weight: torch.Tensor, granularity: str = 'rowwise',
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if granularity not in GRANULARITIES:
            raise ValueError(f'granularity must be one of {GRANULARITIES}, got {granularity!r}')
        out_features, in_features = weight.shape
        if out_features % 16 or in_features % 16:
            raise ValueError(f'fp8 Linear needs sizes divisible by 16, got {tuple(weight.shape)}')
        self.granularity = granularity
        self.in_features, self.out_features = in_features, out_features
        w = weight.detach()
        if granularity == 'rowwise':
            w_scale = _scale(w.abs().amax(dim=1, keepdim=True))      # (out, 1)
        else:
            w_scale = _scale(w.abs().amax())                          # ()
        self.register_buffer('weight', _quantize(w, w_scale))         # (out, in) e4m3
        # _scaled_mm wants scale_b shaped like the (in, out) operand's columns: (1, out)
        self.register_buffer('weight_scale', w_scale.reshape(1, -1) if granularity == 'rowwise'
                             else w_scale)
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f'fp8 Linear bias must be ({out_features},), got {tuple(bias.shape)}')
        self.register_buffer('bias', None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.granularity == 'rowwise':
            x_scale = _scale(x2.abs().amax(dim=1, keepdim=True))     # (M, 1)
        else:
            x_scale = _scale(x2.abs().amax())                         # ()
        y = torch._scaled_mm(_quantize(x2, x_scale), self.weight.t(), scale_a=x_scale,
                             scale_b=self.weight_scale, out_dtype=torch.bfloat16)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


LLM_LINEARS = ('att_proj', 'attn_out', 'ff_proj', 'ff_out')
VIT_LINEARS = ('attention.wq', 'attention.wk', 'attention.wv', 'attention.wo',
               'feed_forward.w1', 'feed_forward.w2')


def probe_fp8(device: torch.device | str, granularity: str) -> str | None:
    """Returns None if `granularity` fp8 matmuls run on `device`, else the error text."""
    try:
        w = torch.randn(32, 32, device=device, dtype=torch.bfloat16)
        x = torch.randn(16, 32, device=device, dtype=torch.bfloat16)
        y = Fp8Linear(w, granularity)(x)
        if not torch.isfinite(y).all():
            return 'non-finite output'
        return None
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        return f'{type(err).__name__}: {err}'


def fp8_granularity(blocks: nn.ModuleList, names: tuple[str, ...] = LLM_LINEARS) -> str:
    """The granularity of the `names` Linears of `blocks[0]`: 'rowwise', 'tensor', or 'none'
    (not quantized, or no blocks)."""
    if not len(blocks):
        return 'none'
    linear = blocks[0].get_submodule(names[0])
    return linear.granularity if isinstance(linear, Fp8Linear) else 'none'


def _usable_granularity(device: torch.device, granularity: str) -> str:
    """`granularity` if it runs on `device`, else the next that does ('rowwise' -> 'tensor'),
    logging why; 'none' when fp8 matmuls do not run there at all."""
    order = [granularity] + [g for g in GRANULARITIES if g != granularity]
    for candidate in order:
        err = probe_fp8(device, candidate)
        if err is None:
            return candidate
        log.warning('fp8 %s matmul unavailable on %s (%s); trying the next option',
                    candidate, device, err)
    log.warning('fp8 unavailable on %s; serving bf16 weights', device)
    return 'none'


def _quantize_blocks_(blocks: nn.ModuleList, names: tuple[str, ...], granularity: str) -> str:
    if not len(blocks):
        return 'none'
    if granularity not in GRANULARITIES:
        raise ValueError(f'granularity must be one of {GRANULARITIES}, got {granularity!r}')
    for block in blocks:
        for name in names:
            if isinstance(block.get_submodule(name), Fp8Linear):
                raise ValueError(f'{name} is already fp8; quantize a model once')
    candidate = _usable_granularity(next(blocks[0].parameters()).device, granularity)
    if candidate == 'none':
        return 'none'
    for block in blocks:
        for name in names:
            parent_name, _, attr = name.rpartition('.')
            parent = block.get_submodule(parent_name) if parent_name else block
            linear = getattr(parent, attr)
            setattr(parent, attr, Fp8Linear(linear.weight, candidate, linear.bias))
    return candidate


def quantize_llm_fp8_(blocks: nn.ModuleList, granularity: str = 'rowwise') -> str:
    """Replaces the four Linears of every LLM block in `blocks` by `Fp8Linear`, in place.

    Tries `granularity` first, then falls back ('rowwise' -> 'tensor' -> bf16), logging why.

    Returns:
        the granularity in use: 'rowwise', 'tensor', or 'none' (nothing was quantized).

    Raises:
        ValueError: a Linear is already fp8 (quantize a model once), or an unknown granularity.
    """
    return _quantize_blocks_(blocks, LLM_LINEARS, granularity)


def quantize_vit_fp8_(resblocks: nn.ModuleList, granularity: str = 'rowwise') -> str:
    """Replaces the six Linears of every ViT block in `resblocks` (`attention.wq/wk/wv/wo`,
    `feed_forward.w1/w2`; biases kept) by `Fp8Linear`, in place. The patch embedding (588
    inputs, not a multiple of 16) and the connector stay in the serving dtype.

    Fallbacks, return value and errors as `quantize_llm_fp8_`.
    """
    return _quantize_blocks_(resblocks, VIT_LINEARS, granularity)
