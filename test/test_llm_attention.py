"""The image-run form of the LLM's masked attention (molmobot_policy/runtime/llm_attention.py)
on the CPU: the extra head dimensions encode exactly the served mask's image rows, the
non-image rows are the ones the Triton kernel rewrites, the kernel (through Triton's
interpreter, in a fresh process) equals float32 attention under the boolean mask, and the tiny
model's LLM through the mask equals its LLM through the additive mask. Upstream's golden
hidden states through it: test_golden_model.py. On the GPU: test_llm_attention_gpu.py."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from molmobot_policy.model import checkpoint as ckpt
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.model.molmobot import attention_allowed
from molmobot_policy.preprocess.pipeline import Preprocessor
from molmobot_policy.preprocess.tokenizer import tiny_tokenizer
from molmobot_policy.runtime import llm_attention
from molmobot_policy.runtime.config import EngineConfig
from molmobot_policy.runtime.llm_attention import HIDDEN, ImageRunMask, extra_dims

TOK = MolmoBotConfig.from_name('tiny').tokens
IMAGE_IDS = torch.tensor(TOK.image_special_ids)


def served_prompt(pad: int = 9):
    """The tiny model's real prompt (8 images, labels, chat text), right-padded by `pad`."""
    cfg = MolmoBotConfig.from_name('tiny')
    pre = Preprocessor(cfg, tiny_tokenizer(), None, buckets=(), overlong='error',
                       device=torch.device('cpu'))
    ids = pre.prompt.prompt_ids('put the red brick on the blue one')
    text = pre.prompt.pad(ids, len(ids) + pad)
    return (torch.from_numpy(np.array(text.input_ids))[None],
            torch.from_numpy(np.array(text.attention_mask))[None], len(text.image_positions))


def layout(kinds: str):
    """ids from a string: 'i' image patch, 's' / 'e' image start / end, 't' text, 'p' padding."""
    ids = {'i': TOK.im_patch, 's': TOK.im_start, 'e': TOK.im_end, 't': 7, 'p': TOK.bos}
    input_ids = torch.tensor([[ids[c] for c in kinds]])
    valid = torch.tensor([[c != 'p' for c in kinds]])
    return input_ids, valid, kinds.count('i')


LAYOUTS = {
    'served prompt': served_prompt(),
    'no padding': served_prompt(0),
    'image first, runs touching text on both sides': layout('iiitsiiiettiitpp'),
    'one-token runs and gaps': layout('titititttip'),
    'text only after one run': layout('tttsiiieppp'),
}


@pytest.mark.parametrize('name', LAYOUTS)
def test_extra_dims_reproduce_the_served_mask_on_image_rows(name):
    input_ids, valid, n_patch = LAYOUTS[name]
    mask = ImageRunMask.build(input_ids, valid, IMAGE_IDS, n_patch, 8, torch.float32)
    allowed = attention_allowed(input_ids, IMAGE_IDS, valid)[0, 0]
    is_image = torch.isin(input_ids[0], IMAGE_IDS)
    extra = mask.q_extra[0, :, 0] @ mask.k_extra[0, :, 0].T        # (L, L) added to q . k
    rows = is_image.nonzero()[:, 0]
    assert len(rows)
    # visible pairs get exactly 0 added, hidden ones -HIDDEN (exp underflows to 0)
    torch.testing.assert_close(extra[rows], torch.where(allowed[rows], 0.0, -HIDDEN),
                               rtol=0, atol=0)
    assert (mask.q_extra[0, ~is_image] == 0).all()     # other rows: rewritten by the kernel


@pytest.mark.parametrize('name', LAYOUTS)
def test_rows_list_exactly_the_non_image_rows_in_order(name):
    input_ids, valid, n_patch = LAYOUTS[name]
    mask = ImageRunMask.build(input_ids, valid, IMAGE_IDS, n_patch, 8, torch.float32)
    expected = (~torch.isin(input_ids[0], IMAGE_IDS)).nonzero()[:, 0]
    n = int(mask.n_rows[0])
    assert n == len(expected) <= mask.rows.shape[1] == input_ids.shape[1] - n_patch
    assert mask.rows[0, :n].tolist() == expected.tolist()
    assert mask.key_valid.dtype == torch.int8 and mask.key_valid.tolist() == valid.int().tolist()


def test_extra_dims_are_a_multiple_of_8_for_cudnn():
    assert [extra_dims(n) for n in (1, 8, 9, 16)] == [8, 8, 16, 16]


def test_hidden_weight_underflows_to_exactly_zero_at_the_served_scale():
    # the largest plausible real score (|q . k| / sqrt(128) ~ 100) next to a hidden one
    s = torch.tensor([100.0, 100.0 - HIDDEN / math.sqrt(128)])
    assert torch.softmax(s, 0)[1].item() == 0.0


def reference_rows(q, k, v, rows, n_rows, valid):
    """float32 attention of q's `rows` under the boolean mask (the served rule; non-image rows
    are causal over valid keys), (R, Hq, D)."""
    group = q.shape[1] // k.shape[1]
    length = q.shape[2]
    is_row = torch.zeros(length, dtype=torch.bool)
    is_row[rows[0, :n_rows]] = True
    allowed = torch.ones(length, length, dtype=torch.bool).tril() & valid[0].bool()[None, :]
    scores = q[0].float() @ k[0].float().repeat_interleave(group, 0).transpose(1, 2)
    scores = scores / math.sqrt(v.shape[-1]) + torch.where(allowed, 0.0, float('-inf'))
    out = torch.softmax(scores, -1) @ v[0].float().repeat_interleave(group, 0)
    return out.transpose(0, 1)[rows[0, :n_rows]]


def test_text_rows_reference_is_masked_attention():
    torch.manual_seed(0)
    input_ids, valid, n_patch = LAYOUTS['image first, runs touching text on both sides']
    mask = ImageRunMask.build(input_ids, valid, IMAGE_IDS, n_patch, 8, torch.float32)
    q, k, v = torch.randn(1, 4, 16, 32), torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32)
    n = int(mask.n_rows[0])
    got = llm_attention.text_rows_reference(q, k, v, mask.rows, mask.n_rows, mask.key_valid,
                                            1 / math.sqrt(32))
    torch.testing.assert_close(got[0, :n], reference_rows(q, k, v, mask.rows, n, valid))
    assert (got[0, n:] == 0).all()


KERNEL_CHECK = r'''
import json, math, sys
import torch
from molmobot_policy.runtime import llm_attention as la
torch.manual_seed(0)
b, hq, hk, d, e = 1, 4, 2, int(sys.argv[1]), 8
kinds = sys.argv[2]
la.KEY_SPLITS, la.BLOCK_KEYS, la.BLOCK_ROWS = (int(x) for x in sys.argv[4].split(','))
length = len(kinds)
is_image = torch.tensor([[c == 'i' for c in kinds]])
valid = torch.tensor([[c != 'p' for c in kinds]])
order = torch.argsort(is_image.to(torch.uint8), dim=1, stable=True)
rows = order[:, :int(sys.argv[3])].contiguous()
n_rows = (~is_image).sum(1).to(torch.int32)
# q / k with extra dims the kernel must skip, (B, L, H, D + E) memory as served
q = torch.randn(b, length, hq, d + e).half().transpose(1, 2)
k = torch.randn(b, length, hk, d + e).half().transpose(1, 2)
v = torch.randn(b, length, hk, d).half().transpose(1, 2)
out = torch.full((b, length, hq, d), 7.0).half().transpose(1, 2)
la.text_rows_attention(out, q, k, v, rows, n_rows, valid.to(torch.int8), 1 / math.sqrt(d))
group = hq // hk
allowed = torch.ones(length, length, dtype=torch.bool).tril() & valid[0][None, :]
scores = q[0, :, :, :d].float() @ k[0, :, :, :d].float().repeat_interleave(group, 0).mT
scores = scores / math.sqrt(d) + torch.where(allowed, 0.0, float('-inf'))
ref = (torch.softmax(scores, -1) @ v[0].float().repeat_interleave(group, 0)).transpose(0, 1)
got = out[0].transpose(0, 1).float()
text = ~is_image[0]
print(json.dumps({'err': float((got[text] - ref[text]).abs().max() / ref[text].abs().max()),
                  'image_rows_untouched': bool((got[is_image[0]] == 7.0).all())}))
'''


LONG = 't' * 3 + 'i' * 70 + 't' * 2 + 'i' * 50 + 't' * 60 + 'p' * 15


@pytest.mark.parametrize('d, kinds, bound, tiles', [
    (128, LONG, 80, '1,64,64'),          # one program per row block, > 1 block
    (128, LONG, 80, '4,16,32'),          # keys in 4 chunks of 64, partials merged; the
                                         # chunks past a row block's last row stay empty
    (64, LONG, 80, '2,32,16'),           # 2 chunks of 128
    (32, 'tiiittiiiitp', 7, '1,64,64'),  # the row bound above the non-image count
])
def test_text_row_kernel_matches_masked_attention_in_the_interpreter(d, kinds, bound, tiles):
    pytest.importorskip('triton')
    env = dict(os.environ, TRITON_INTERPRET='1')
    out = subprocess.run([sys.executable, '-c', KERNEL_CHECK, str(d), kinds, str(bound), tiles],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r['image_rows_untouched'], r
    assert r['err'] < 2e-3, r          # float16 operands (the interpreter has no bfloat16)


@pytest.fixture(scope='module')
def tiny():
    cfg = MolmoBotConfig.from_name('tiny')
    return ckpt.random_model(cfg, 0, 'cpu', torch.float32)


def test_llm_through_the_image_run_mask_equals_the_additive_mask(tiny):
    from molmobot_policy.runtime.serving import image_run_mask
    cfg = tiny.config
    pre = Preprocessor(cfg, tiny_tokenizer(), None, buckets=(), overlong='error',
                       device=torch.device('cpu'))
    rng = np.random.default_rng(0)
    frames = tuple(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
                   for _ in pre.contract.camera_names)
    ids = pre.prompt.prompt_ids('pick up the red brick')
    text = pre.prompt.pad(ids, len(ids) + 11)
    inp = pre.inputs(text, frames, np.zeros(len(pre.contract.joint_names), np.float32)).tensors()
    args = (inp['input_ids'], inp['images'], inp['token_pooling'])
    kwargs = dict(position_ids=inp['position_ids'], attention_mask=inp['attention_mask'],
                  image_positions=inp['image_positions'])
    with torch.no_grad():
        ref = tiny.llm_hidden_states(*args, **kwargs)
        got = tiny.llm_hidden_states(*args, **kwargs, llm_mask=image_run_mask(tiny))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_self_check_passes_on_the_cpu_and_fails_when_the_mask_is_wrong(tiny, monkeypatch):
    cfg = tiny.config
    assert llm_attention.self_check(cfg, torch.device('cpu'), torch.float32) == ''
    monkeypatch.setattr(llm_attention, 'HIDDEN', 0.0)      # image rows would see every key
    assert 'self-check: max error' in llm_attention.self_check(cfg, torch.device('cpu'),
                                                               torch.float32)


def test_engine_config_checks_llm_attention():
    assert EngineConfig().llm_attention == 'masked'
    with pytest.raises(ValueError, match='llm_attention must be one of'):
        EngineConfig(llm_attention='fast')
    with pytest.raises(ValueError, match='llm_attention=image_runs needs a CUDA device'):
        EngineConfig(llm_attention='image_runs')


def test_unavailable_reasons_name_the_model_property():
    cfg = MolmoBotConfig.from_name('tiny')
    cuda = torch.device('cuda')
    cfg.bi_directional_attn = False
    assert 'causally' in llm_attention.unavailable_reason(cfg, cuda, torch.bfloat16)
    cfg.bi_directional_attn = True
    assert 'bfloat16' in llm_attention.unavailable_reason(cfg, cuda, torch.float32)
    assert 'CUDA' in llm_attention.unavailable_reason(cfg, torch.device('cpu'), torch.bfloat16)
