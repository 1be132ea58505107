"""fp8 (e4m3) Linears on the CPU (torch's `_scaled_mm` runs there too): the biased Linear the
ViT needs, and which modules `quantize_vit_fp8_` swaps. GPU checks: test_engine_gpu.py."""
import pytest
import torch
from torch import nn

from molmobot_policy.model.checkpoint import random_model
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.model.fp8 import (VIT_LINEARS, Fp8Linear, fp8_granularity, probe_fp8,
                                       quantize_vit_fp8_)
from molmobot_policy.runtime.engine import EngineConfig

from test_model import N_IMAGES, make_inputs

pytestmark = pytest.mark.skipif(probe_fp8('cpu', 'rowwise') is not None,
                                reason='this torch build has no CPU fp8 matmul')


@pytest.mark.parametrize('granularity', ['rowwise', 'tensor'])
def test_fp8_linear_adds_its_bias_and_stays_close_to_bf16(granularity):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 128, generator=g) / 128 ** 0.5).bfloat16()
    b = torch.randn(64, generator=g).bfloat16()
    x = torch.randn(32, 128, generator=g).bfloat16()
    x[5] = 0                                          # a padding row
    ref = x.float() @ w.float().t() + b.float()
    out = Fp8Linear(w, granularity, bias=b)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (32, 64)
    assert torch.equal(out[5], b)                     # zero row: exactly the bias
    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.06


def test_fp8_linear_refuses_a_bias_of_the_wrong_size():
    with pytest.raises(ValueError, match='bias'):
        Fp8Linear(torch.randn(32, 32), bias=torch.zeros(16))


@pytest.fixture()
def bf16_model():
    return random_model(MolmoBotConfig.from_name('tiny'), seed=0).to(torch.bfloat16)


def test_quantize_vit_swaps_the_six_linears_of_every_block_only(bf16_model):
    vision = bf16_model.vision_backbone
    blocks = vision.image_vit.transformer.resblocks
    biases = [[blk.get_submodule(n).bias.clone() for n in VIT_LINEARS] for blk in blocks]
    assert quantize_vit_fp8_(blocks, 'rowwise') == 'rowwise'
    for blk, before in zip(blocks, biases):
        for name, bias in zip(VIT_LINEARS, before):
            linear = blk.get_submodule(name)
            assert isinstance(linear, Fp8Linear) and linear.granularity == 'rowwise', name
            assert torch.equal(linear.bias, bias), name
    assert fp8_granularity(blocks, VIT_LINEARS) == 'rowwise'
    assert type(vision.image_vit.patch_embedding) is nn.Linear       # 588 inputs: not fp8
    assert type(vision.image_projector.w1) is nn.Linear               # connector untouched
    assert fp8_granularity(bf16_model.transformer.blocks) == 'none'   # the LLM untouched


def test_fp8_vit_features_stay_close_to_bf16(bf16_model):
    _, images, pool, _, _ = make_inputs(batch=1)
    vision = bf16_model.vision_backbone
    with torch.no_grad():
        ref = vision(images, pool).float()
        quantize_vit_fp8_(vision.image_vit.transformer.resblocks, 'rowwise')
        out = vision(images, pool).float()
    assert out.shape == ref.shape == (1, N_IMAGES * 196, bf16_model.config.llm.d_model)
    assert torch.isfinite(out).all()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.1, rel           # changed (fp8 is in use), but only by rounding


def test_quantizing_the_vit_twice_is_refused(bf16_model):
    blocks = bf16_model.vision_backbone.image_vit.transformer.resblocks
    quantize_vit_fp8_(blocks, 'tensor')
    with pytest.raises(ValueError, match='already fp8'):
        quantize_vit_fp8_(blocks, 'tensor')


def test_quantize_vit_needs_an_fp8_quantize_mode():
    with pytest.raises(ValueError, match='quantize_vit'):
        EngineConfig(quantize_vit=True)
