"""The score-modifier LLM attention (`llm_attention: score_mod`) on CUDA: the cuDNN graph at
the full-size shape against float32 attention under the boolean mask, CUDA-graph replays, the
start-up self-check, and an engine serving it against the float32 eager engine.

Skipped without CUDA or without the cuDNN frontend package (CPU CI); the CPU side of the same
rule is test_cudnn_attention.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.runtime import cudnn_attention
from molmobot_policy.runtime.cudnn_attention import RuleMask
from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine
from molmobot_policy.types import Observation

FULL = MolmoBotConfig.from_name('molmobot-4b-8cam')
REASON = (cudnn_attention.unavailable_reason(FULL, torch.device('cuda'), torch.bfloat16)
          if torch.cuda.is_available() else 'needs a CUDA device')
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON or 'runs')


VALID = 1639


def served_layout(length: int = 1664, valid: int = VALID):
    """The 8-camera prompt's token kinds: BOS, then per image a 3-token label, <im_start>,
    196 <im_patch>, <im_end>; chat text up to `valid`; padding to `length`."""
    tok = FULL.tokens
    ids = [tok.bos]
    for k in range(8):
        ids += [100 + k, 200, 300 + k, tok.im_start] + [tok.im_patch] * 196 + [tok.im_end]
    ids += list(range(1000, 1000 + valid - len(ids)))
    ids += [tok.bos] * (length - valid)
    mask = torch.zeros(1, length, dtype=torch.bool, device='cuda')
    mask[:, :valid] = True
    return torch.tensor([ids], device='cuda'), mask


@pytest.fixture(scope='module')
def full_shape():
    input_ids, valid = served_layout()
    image_ids = torch.tensor(FULL.tokens.image_special_ids, device='cuda')
    length = input_ids.shape[1]
    is_image = (input_ids.unsqueeze(-1) == image_ids).any(-1)
    allowed = (torch.ones(length, length, dtype=torch.bool, device='cuda').tril()[None]
               | (is_image[:, :, None] & is_image[:, None, :])) & valid[:, None, :]
    allowed = allowed[:, None]
    gen = torch.Generator(device='cuda').manual_seed(0)
    hq, hk, hd = FULL.llm.n_heads, FULL.llm.n_kv_heads, FULL.llm.head_dim
    q, k, v = (torch.randn(1, length, h, hd, device='cuda', generator=gen).mul(2)
               .bfloat16().transpose(1, 2) for h in (hq, hk, hk))
    group = hq // hk
    scores = q.float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2)
    scores = scores / math.sqrt(hd) + torch.where(allowed, 0.0, float('-inf'))
    ref = (torch.softmax(scores, -1) @ v.float().repeat_interleave(group, 1)).transpose(1, 2)
    bias = torch.zeros(allowed.shape, dtype=torch.bfloat16, device='cuda')
    bias = bias.masked_fill(~allowed, torch.finfo(torch.bfloat16).min)
    return q, k, v, ref, bias, RuleMask.build(input_ids, image_ids)


def test_op_matches_float32_masked_attention_as_closely_as_the_masked_sdpa(full_shape):
    q, k, v, ref, bias, mask = full_shape
    got = mask(q, k, v)
    assert got.shape == ref.shape and got.is_contiguous()
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    n = VALID     # the valid queries (padded ones are never read: cudnn_attention's docstring)
    got, masked, ref = got[:, :n].float(), masked.transpose(1, 2)[:, :n].float(), ref[:, :n]
    scale = ref.abs().max()
    err = ((got - ref).abs().max() / scale).item()
    masked_err = ((masked - ref).abs().max() / scale).item()
    assert err <= 1.5 * masked_err + 1e-4, (err, masked_err)


def test_op_replays_in_a_cuda_graph_bitwise(full_shape):
    q, k, v, _, _, mask = full_shape
    eager = mask(q, k, v)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mask(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mask(q, k, v)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_self_check_passes_for_the_full_size_model_in_bf16():
    assert cudnn_attention.self_check(FULL, torch.device('cuda'), torch.bfloat16) == ''


def test_score_mod_engine_matches_float32_as_closely_as_the_masked_engine():
    rng = np.random.default_rng(0)
    obs = Observation(images=tuple(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
                                   for _ in range(8)),
                      state=rng.uniform(-1, 1, 8).astype(np.float32),
                      instruction='pick up the red cube')
    noise = rng.standard_normal((16, 8)).astype(np.float32)
    reference = PolicyEngine(EngineConfig(model='tiny', device='cuda', dtype='float32'))
    ref = reference.predict(obs, noise=noise).actions_normalized   # float32, additive mask
    common = dict(model='tiny', device='cuda', dtype='bfloat16', compile=True,
                  cuda_graphs=True, buckets=(1664,), instruction='pick up the red cube')
    rule = PolicyEngine(EngineConfig(**common, llm_attention='score_mod'))
    rule.warmup()
    assert rule.mode['llm_attention'] == 'score_mod'
    masked = PolicyEngine(EngineConfig(**common), model=rule.model)
    masked.warmup()
    assert masked.mode['llm_attention'] == 'masked'
    err = np.abs(rule.predict(obs, noise=noise).actions_normalized - ref).max()
    masked_err = np.abs(masked.predict(obs, noise=noise).actions_normalized - ref).max()
    assert err <= 1.5 * masked_err + 1e-3, (err, masked_err)
