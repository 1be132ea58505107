"""The LLM's tile-classified masked attention on the GPU (runtime/flash_attention.py): the
FlashAttention-4 kernel against float32 attention under the mask at the served shape, bitwise
stable on graph replay, and the engine's `llm_attention: flash` against upstream's golden
hidden states and the served additive mask.

Skipped without a Hopper / Blackwell GPU and the flash-attn-4 package; run with the GPU tests
(docs/PERFORMANCE.md, "GPU tests", lists the last run).
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.runtime import flash_attention as fa

sys.path.insert(0, os.path.dirname(__file__))
from _prompt_layouts import served_kinds  # noqa: E402  (test/_prompt_layouts.py)


def _reason() -> str:
    if not torch.cuda.is_available():
        return 'needs a CUDA device'
    return fa.unavailable_reason(MolmoBotConfig.from_name('tiny'), torch.device('cuda'),
                                 torch.bfloat16)


pytestmark = pytest.mark.skipif(bool(_reason()), reason=_reason() or 'runs')


def run_op(q, k, v, kinds):
    t = fa.tile_classes(kinds)
    return fa.image_tokens_attention(q, k, v, fa.key_limits(kinds), t.partial_count,
                                     t.partial_index, t.full_count, t.full_index,
                                     1.0 / math.sqrt(q.shape[-1]))


@pytest.mark.parametrize('length', [1664, 1856])
def test_kernel_matches_float32_masked_attention_at_the_served_shape(length):
    kinds = served_kinds(length).cuda()
    g = torch.Generator(device='cuda').manual_seed(length)
    q, k, v = (torch.randn(1, length, h, 128, device='cuda', dtype=torch.bfloat16, generator=g)
               for h in (32, 8, 8))
    out = run_op(q, k, v, kinds)
    ref = fa.reference(q, k, v, kinds, 1.0 / math.sqrt(128))
    rows = kinds[0] != fa.KIND_PAD
    got, want = out.float()[0][rows], ref[0][rows]
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < 1e-2      # bf16 lands near 3e-3


def test_kernel_is_bitwise_stable_on_graph_replay():
    kinds = served_kinds(1664).cuda()
    q, k, v = (torch.randn(1, 1664, h, 128, device='cuda', dtype=torch.bfloat16)
               for h in (32, 8, 8))
    run_op(q, k, v, kinds)        # compile outside the capture
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_op(q, k, v, kinds)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = run_op(q, k, v, kinds)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert torch.equal(first, out)


def test_self_check_passes_for_the_tiny_and_full_head_layouts():
    tiny = MolmoBotConfig.from_name('tiny')
    assert fa.self_check(tiny, torch.device('cuda'), torch.bfloat16) == ''
    full = MolmoBotConfig.from_name('molmobot-4b-8cam')    # 32 / 8 heads of 128
    assert fa.self_check(full, torch.device('cuda'), torch.bfloat16) == ''


def test_engine_flash_attention_matches_the_additive_mask_within_bf16_noise():
    from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine
    from molmobot_policy.types import Observation
    rng = np.random.default_rng(0)
    obs = Observation(images=tuple(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
                                   for _ in range(8)),
                      state=rng.uniform(-1, 1, 8).astype(np.float32),
                      instruction='pick up the red cube')
    noise = rng.standard_normal((16, 8)).astype(np.float32)
    config = dict(model='tiny', device='cuda', dtype='bfloat16', compile=True,
                  cuda_graphs=True, buckets=(1664,), instruction='pick up the red cube')
    torch._dynamo.reset()
    flash = PolicyEngine(EngineConfig(llm_attention='auto', **config))   # the default
    flash.warmup()
    assert flash.mode['llm_attention'] == 'flash'     # auto serves the kernel where it can
    masked = PolicyEngine(EngineConfig(llm_attention='masked', **config), model=flash.model)
    masked.warmup()
    a = flash.predict(obs, noise=noise).actions_normalized
    b = masked.predict(obs, noise=noise).actions_normalized
    assert np.abs(a - b).max() < 0.05     # bf16 rounding through 4 blocks x 10 steps


def test_golden_hidden_states_through_the_kernel_are_as_close_as_the_masked_path():
    from _golden import GOLDEN
    if not (GOLDEN / 'model.pt').is_file():
        pytest.skip('golden data missing')
    from molmobot_policy.model.checkpoint import load_checkpoint
    from molmobot_policy.runtime.serving import image_tokens_mask
    model, _ = load_checkpoint(GOLDEN, device='cuda', dtype=torch.bfloat16)
    case = np.load(GOLDEN / 'case2_8cam_480x640.npz')
    args = (torch.from_numpy(case['input_ids']).cuda(), torch.from_numpy(case['images']).cuda(),
            torch.from_numpy(case['token_pooling']).cuda())
    position_ids = torch.from_numpy(case['position_ids']).cuda()
    ref = torch.from_numpy(case['llm_layer_hidden_states']).double()
    with torch.no_grad():
        flash = model.llm_hidden_states(*args, position_ids=position_ids,
                                        llm_mask=image_tokens_mask(model)).double().cpu()
        masked = model.llm_hidden_states(*args, position_ids=position_ids).double().cpu()
    err_flash = max(float((flash[i] - ref[i]).norm() / ref[i].norm()) for i in range(len(ref)))
    err_masked = max(float((masked[i] - ref[i]).norm() / ref[i].norm()) for i in range(len(ref)))
    assert err_flash < 2e-2, err_flash
    assert err_flash < 1.5 * err_masked + 1e-3, (err_flash, err_masked)
