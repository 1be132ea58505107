"""fp8 (e4m3) weights for the LLM's Linear layers, with dynamic activation scaling.

`quantize_llm_fp8_(model, granularity)` swaps every LLM block's `att_proj`, `attn_out`,
`ff_proj` and `ff_out` for an `Fp8Linear`. Weights are quantized once; activations are
scaled per call from their absolute maximum (per tensor, or per row = per token), and the
product runs through `torch._scaled_mm` with fp32 scales and a bf16 result.

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
    """y = x W^T with W in e4m3 and x quantized on the fly; no bias (the LLM has none).

    Args:
        weight: (out_features, in_features) float tensor on a CUDA device; both sizes must
            be multiples of 16 (a `torch._scaled_mm` requirement).
        granularity: 'rowwise' (one scale per weight row and per activation row) or
            'tensor' (one scale each).

    forward: x (..., in_features) bf16 -> (..., out_features) bf16.
    """

    def __init__(self, weight: torch.Tensor, granularity: str = 'rowwise') -> None:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.granularity == 'rowwise':
            x_scale = _scale(x2.abs().amax(dim=1, keepdim=True))     # (M, 1)
        else:
            x_scale = _scale(x2.abs().amax())                         # ()
        y = torch._scaled_mm(_quantize(x2, x_scale), self.weight.t(), scale_a=x_scale,
                             scale_b=self.weight_scale, out_dtype=torch.bfloat16)
        return y.reshape(*shape[:-1], self.out_features)


LLM_LINEARS = ('att_proj', 'attn_out', 'ff_proj', 'ff_out')


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


def quantize_llm_fp8_(blocks: nn.ModuleList, granularity: str = 'rowwise') -> str:
    """Replaces the four Linears of every LLM block in `blocks` by `Fp8Linear`, in place.

    Tries `granularity` first, then falls back ('rowwise' -> 'tensor' -> bf16), logging why.

    Returns:
        the granularity in use: 'rowwise', 'tensor', or 'none' (nothing was quantized).
    """
    if not len(blocks):
        return 'none'
    device = next(blocks[0].parameters()).device
    order = [granularity] + [g for g in GRANULARITIES if g != granularity]
    for candidate in order:
        err = probe_fp8(device, candidate)
        if err is None:
            break
        log.warning('fp8 %s matmul unavailable on %s (%s); trying the next option',
                    candidate, device, err)
    else:
        log.warning('fp8 unavailable on %s; serving bf16 weights', device)
        return 'none'
    for block in blocks:
        for name in LLM_LINEARS:
            linear = getattr(block, name)
            if isinstance(linear, Fp8Linear):
                raise ValueError(f'{name} is already fp8; quantize a model once')
            setattr(block, name, Fp8Linear(linear.weight, candidate))
    return candidate
