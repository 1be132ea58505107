"""The mma.m16n8k16 B-operand fragment layout (PTX ISA, "Matrix fragments for mma.m16n8k16"),
written from the ISA, the tests' reference for the cluster kernel's packed weights and K/V."""
from __future__ import annotations

import torch


def fragment(w: torch.Tensor, n: int, s: int, lane: int) -> torch.Tensor:
    """Lane `lane`'s B registers of n-tile n, k-step s of mma.m16n8k16 (row.col): b0 =
    W[8n + g, 16s + 2t + (0, 1)], b1 = the same + 8, with g = lane // 4, t = lane % 4."""
    g, t = lane // 4, lane % 4
    row, k = 8 * n + g, 16 * s + 2 * t
    return torch.stack([w[row, k], w[row, k + 1], w[row, k + 8], w[row, k + 9]])
