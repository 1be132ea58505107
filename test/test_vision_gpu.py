"""The ViT MLP as served on CUDA (`runtime.serving.GeluEpilogueMLP`: w1 + bias + GELU as one
cuBLASLt GEMM with its GELU epilogue) computes the tanh-approximated GELU that SigLIP uses, not
the erf form.

Skipped without CUDA (CPU CI); run on the H200 (docs/PERFORMANCE.md, "GPU tests", lists the last run)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from molmobot_policy.model.vision import ViTMLP
from molmobot_policy.runtime.serving import GeluEpilogueMLP

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')


def reference(mlp: GeluEpilogueMLP, x: torch.Tensor, approximate: str) -> torch.Tensor:
    """float64 on the CPU: w2(gelu(w1 x))."""
    w1, b1, w2, b2 = (t.detach().double().cpu() for t in (mlp.w1.weight, mlp.w1.bias,
                                                           mlp.w2.weight, mlp.w2.bias))
    h = F.gelu(F.linear(x.double().cpu(), w1, b1), approximate=approximate)
    return F.linear(h, w2, b2)


def test_gelu_epilogue_is_the_tanh_gelu_in_float32():
    torch.manual_seed(0)
    mlp = GeluEpilogueMLP(ViTMLP(64, 256).cuda())
    x = torch.randn(3, 50, 64, device='cuda') * 3       # pre-activations spread over [-6, 6]
    with torch.no_grad():
        out = mlp(x).double().cpu()
        tanh, erf = reference(mlp, x, 'tanh'), reference(mlp, x, 'none')
    assert out.shape == (3, 50, 64)
    assert (out - tanh).abs().max() < 5e-5
    assert (tanh - erf).abs().max() > 2e-4         # the two forms differ by 5e-4 here
    assert (out - erf).abs().max() > 2e-4


def test_gelu_epilogue_in_bfloat16_matches_the_reference_within_rounding():
    torch.manual_seed(1)
    mlp = GeluEpilogueMLP(ViTMLP(1152, 4304).cuda().to(torch.bfloat16))
    x = torch.randn(2, 729, 1152, device='cuda', dtype=torch.bfloat16)
    with torch.no_grad():
        out = mlp(x).double().cpu()
        ref = reference(mlp, x, 'tanh')
    assert (out - ref).abs().max() / ref.abs().max() < 2e-2
