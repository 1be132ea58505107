"""Same-shape parameters kept as slices of one stacked tensor (no second copy).

Used where one GEMM over the stacked weights replaces several at serving time (the action
expert's per-block cross-attention K/V projections, the fused DiT kernel's weights).
"""
from __future__ import annotations

import torch
from torch import nn


def stack_parameters_(params: list[nn.Parameter]) -> torch.Tensor:
    """Copies same-shape parameters into one (len(params), ...) tensor and re-points each to
    its slice, in place: values, state-dict keys and `load_state_dict` (it writes through the
    views) are unchanged; there is no second copy. Returns the stacked tensor."""
    with torch.no_grad():
        stacked = torch.stack([p.detach() for p in params]).contiguous()
        for i, p in enumerate(params):
            p.data = stacked[i]
    return stacked


def is_stack_of(stacked: torch.Tensor | None, params: list[nn.Parameter]) -> bool:
    """True while every parameter is still its slice of `stacked` (`stack_parameters_`);
    moving or replacing a parameter (`.to`, `p.data = ...`) ends it."""
    return stacked is not None and len(params) == stacked.shape[0] and all(
        p.data_ptr() == stacked[i].data_ptr() for i, p in enumerate(params))
