"""Small shared pieces of the model's math."""
from __future__ import annotations

import torch
from torch import nn


def residual_linear(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x): x (..., in_features), residual (..., out_features), same dtype.

    On CUDA, for a plain `nn.Linear`, one GEMM that takes the residual (plus the bias) as its
    C operand, `torch.addmm(residual + bias, x, W^T)` (beta = 1): the sum is accumulated in
    float32 and rounded once, and no separate elementwise pass re-reads the output. At a
    block's end (the output leaves the compiled block) Inductor keeps it one GEMM; the
    `residual + bias` it fuses into the kernel that produced the residual. Elsewhere (CPU, or
    another module such as `Fp8Linear`): residual + linear(x), as upstream.
    """
    if x.is_cuda and type(linear) is nn.Linear:
        shape = residual.shape
        c = residual if linear.bias is None else residual + linear.bias
        out = torch.addmm(c.reshape(-1, shape[-1]), x.reshape(-1, x.shape[-1]),
                          linear.weight.t())
        return out.view(shape)
    return residual + linear(x)
