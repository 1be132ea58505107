"""The score-modifier form of the LLM's masked attention (molmobot_policy/runtime/
cudnn_attention.py) on the CPU: `RuleMask`'s per-token tensors encode exactly the served mask
(`MolmoBot.attention_allowed`) over several layouts and the tiny model's real prompt, the op's
CPU path equals float32 attention under the boolean mask, the engine option's checks. The
cuDNN graph itself: test_cudnn_attention_gpu.py; upstream's golden hidden states through the
rule: test_golden_model.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.model.molmobot import MolmoBot
from molmobot_policy.preprocess.pipeline import Preprocessor
from molmobot_policy.preprocess.tokenizer import tiny_tokenizer
from molmobot_policy.runtime import cudnn_attention
from molmobot_policy.runtime.config import EngineConfig
from molmobot_policy.runtime.cudnn_attention import RuleMask
from molmobot_policy.runtime.serving import rule_mask

TINY = MolmoBotConfig.from_name('tiny')
TOK = TINY.tokens
IMAGE_IDS = torch.tensor(TOK.image_special_ids)


def layout(kinds: str):
    """ids from a string: 'i' image patch, 's' / 'e' image start / end, 't' text, 'p' padding."""
    ids = {'i': TOK.im_patch, 's': TOK.im_start, 'e': TOK.im_end, 't': 7, 'p': TOK.bos}
    input_ids = torch.tensor([[ids[c] for c in kinds]])
    valid = torch.tensor([[c != 'p' for c in kinds]])
    return input_ids, valid


def served_prompt(pad: int = 9):
    """The tiny model's real prompt (8 images, labels, chat text), right-padded by `pad`."""
    pre = Preprocessor(TINY, tiny_tokenizer(), None, buckets=(), overlong='error',
                       device=torch.device('cpu'))
    ids = pre.prompt.prompt_ids('put the red brick on the blue one')
    text = pre.prompt.pad(ids, len(ids) + pad)
    return (torch.from_numpy(np.array(text.input_ids))[None],
            torch.from_numpy(np.array(text.attention_mask))[None])


@pytest.fixture(scope='module')
def tiny_model():
    torch.manual_seed(0)
    return MolmoBot(TINY).eval()


LAYOUTS = ['tsiiiettsiietttpp', 'siiiiiie', 'ttttt', 'tsietsiiettpppp', 'siiettsiie']


def rule_of(input_ids, image_ids=IMAGE_IDS) -> torch.Tensor:
    mask = RuleMask.build(input_ids, image_ids)
    return cudnn_attention.visible(mask.query_offset, mask.key_image)


@pytest.mark.parametrize('kinds', LAYOUTS)
def test_rule_equals_the_served_mask_on_every_valid_query(tiny_model, kinds):
    input_ids, valid = layout(kinds)
    n = int(valid.sum())
    served = tiny_model.attention_allowed(input_ids, valid)
    assert torch.equal(rule_of(input_ids)[..., :n, :], served[..., :n, :])


def test_rule_equals_the_served_mask_on_the_tiny_models_prompt(tiny_model):
    input_ids, valid = served_prompt()
    n = int(valid.sum())
    assert n < input_ids.shape[1]      # padding is part of the check
    served = tiny_model.attention_allowed(input_ids, valid)
    assert torch.equal(rule_of(input_ids)[..., :n, :], served[..., :n, :])


def test_padded_queries_see_the_keys_before_them_and_no_valid_query_sees_padding():
    input_ids, valid = layout('tsiiettpp')
    rule = rule_of(input_ids)[0, 0]
    assert torch.equal(rule[7:], torch.ones(9, 9, dtype=torch.bool).tril()[7:])
    assert not rule[:7, 7:].any()


def test_without_image_ids_the_rule_is_causal():
    input_ids, _ = layout('tsiiettpp')
    assert torch.equal(rule_of(input_ids, None)[0, 0], torch.ones(9, 9, dtype=torch.bool).tril())


def test_op_cpu_path_equals_float32_attention_under_the_boolean_mask(tiny_model):
    input_ids, valid = layout('tsiiiettsiietttpp')
    length = input_ids.shape[1]
    allowed = tiny_model.attention_allowed(input_ids, valid)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, length, 16, generator=gen)
    k, v = torch.randn(2, 1, 2, length, 16, generator=gen)
    got = RuleMask.build(input_ids, IMAGE_IDS)(q, k, v)
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, float('-inf'))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    assert got.shape == (1, length, 4, 16) and got.is_contiguous()
    n = int(valid.sum())
    torch.testing.assert_close(got[:, :n], ref.transpose(1, 2)[:, :n], atol=1e-5, rtol=1e-5)


def test_tiny_llm_through_the_rule_equals_the_additive_mask(tiny_model):
    model = tiny_model
    input_ids, valid = served_prompt()
    x = torch.randn(1, input_ids.shape[1], TINY.llm.d_model)
    position_ids = (valid.long().cumsum(1) - 1).clamp(min=0)
    allowed = model.attention_allowed(input_ids, valid)
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        ref = model.transformer(x, position_ids, bias)
        got = model.transformer(x, position_ids, rule_mask(model)(input_ids, valid))
    n = int(valid.sum())
    torch.testing.assert_close(got[:, :, :n], ref[:, :, :n], atol=2e-5, rtol=2e-5)


def test_unavailable_reason_names_the_device_and_dtype():
    assert 'CUDA' in cudnn_attention.unavailable_reason(TINY, torch.device('cpu'),
                                                        torch.bfloat16)
    if torch.cuda.is_available():
        reason = cudnn_attention.unavailable_reason(TINY, torch.device('cuda'), torch.float32)
        assert 'bfloat16' in reason


def test_engine_config_refuses_an_unknown_mode_and_score_mod_off_cuda():
    with pytest.raises(ValueError, match='llm_attention must be one of'):
        EngineConfig(llm_attention='flex')
    with pytest.raises(ValueError, match='needs a CUDA device'):
        EngineConfig(llm_attention='score_mod', device='cpu')
    assert EngineConfig().llm_attention == 'masked'
