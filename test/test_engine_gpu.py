"""PolicyEngine on CUDA (tiny model): compile + CUDA graphs + buckets + fp8.

Skipped without CUDA (CPU CI); run on the H200 (docs/PERFORMANCE.md, "GPU tests", lists the last run).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from molmobot_policy.model.fp8 import Fp8Linear, probe_fp8, quantize_llm_fp8_
from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine
from molmobot_policy.types import Observation

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')

INSTRUCTION = 'pick up the red cube'
BUCKETS = (1664, 2048)


def observation(seed: int = 0, instruction: str = INSTRUCTION) -> Observation:
    rng = np.random.default_rng(seed)
    images = tuple(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8) for _ in range(8))
    return Observation(images=images, state=rng.uniform(-1, 1, 8).astype(np.float32),
                       instruction=instruction)


def noise(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((16, 8)).astype(np.float32)


@pytest.fixture(scope='module')
def graphed() -> PolicyEngine:
    torch._dynamo.reset()
    e = PolicyEngine(EngineConfig(model='tiny', device='cuda', dtype='bfloat16', compile=True,
                                  cuda_graphs=True, buckets=BUCKETS, instruction=INSTRUCTION))
    e.warmup()
    return e


def test_default_engine_runs_the_fused_action_expert_kernel(graphed):
    # the tiny expert is narrower than the cluster kernel's compiled widths: the Triton kernel
    assert graphed.mode['fused_action_expert'].startswith(
        'triton (cluster kernel not used: compiled for hidden 768')


def test_fused_action_expert_matches_the_blocks_within_bf16_noise(graphed):
    blocks = PolicyEngine(EngineConfig(model='tiny', device='cuda', dtype='bfloat16',
                                       compile=True, cuda_graphs=True, buckets=BUCKETS[:1],
                                       instruction=INSTRUCTION, fused_action_expert='off'),
                          model=graphed.model)
    blocks.warmup()
    assert blocks.mode['fused_action_expert'] == 'off (as configured)'
    a = graphed.predict(observation(), noise=noise()).actions_normalized
    b = blocks.predict(observation(), noise=noise()).actions_normalized
    assert np.abs(a - b).max() < 0.05     # bf16 rounding through 4 blocks x 10 steps


def test_every_bucket_is_captured_at_warmup(graphed):
    assert sorted(graphed._runners) == list(BUCKETS)
    assert all(r.graph is not None for r in graphed._runners.values())


def test_no_recompile_across_instruction_lengths_after_warmup(graphed):
    from torch._dynamo.utils import counters
    before = dict(counters['stats'])
    for words in range(1, 201, 9):
        instruction = ' '.join(['move'] * words)
        try:
            graphed.predict(observation(instruction=instruction))
        except ValueError as err:           # longer than the largest bucket: rejected
            assert 'too long' in str(err)
    assert dict(counters['stats']) == before


def test_replay_is_bitwise_stable(graphed):
    obs = observation()
    a = graphed.predict(obs, noise=noise()).actions_normalized
    b = graphed.predict(obs, noise=noise()).actions_normalized
    assert np.array_equal(a, b)


def test_interleaved_buckets_leave_earlier_results_intact(graphed):
    short, long = INSTRUCTION, ' '.join(['reach'] * 60)
    assert graphed.text_inputs(short).bucket != graphed.text_inputs(long).bucket
    a1 = graphed.predict(observation(instruction=short), noise=noise())
    a1_copy = a1.actions_normalized.copy()
    graphed.predict(observation(instruction=long), noise=noise(1))
    a2 = graphed.predict(observation(instruction=short), noise=noise())
    assert np.array_equal(a1.actions_normalized, a1_copy)
    assert np.array_equal(a2.actions_normalized, a1_copy)


def test_graphed_compiled_padded_matches_eager_unpadded_within_bf16_noise(graphed):
    eager = PolicyEngine(EngineConfig(model='tiny', device='cuda', dtype='bfloat16'),
                         model=PolicyEngine(EngineConfig(model='tiny', device='cuda',
                                                         dtype='bfloat16')).model)
    obs = observation()
    a = graphed.predict(obs, noise=noise()).actions_normalized
    b = eager.predict(obs, noise=noise()).actions_normalized
    assert np.abs(a - b).max() < 0.05 * max(1.0, np.abs(b).max())


def test_kv_cache_equals_recomputed_context_bitwise_in_bf16_on_cuda():
    cached = PolicyEngine(EngineConfig(model='tiny', device='cuda', dtype='bfloat16'))
    uncached = PolicyEngine(EngineConfig(model='tiny', device='cuda', dtype='bfloat16',
                                         kv_cache=False), model=cached.model)
    obs = observation()
    assert np.array_equal(cached.predict(obs, noise=noise()).actions_normalized,
                          uncached.predict(obs, noise=noise()).actions_normalized)


@pytest.mark.parametrize('granularity', ['rowwise', 'tensor'])
def test_fp8_linear_is_close_to_bf16_and_finite_on_zero_rows(granularity):
    if probe_fp8('cuda', granularity) is not None:
        pytest.skip(f'fp8 {granularity} not supported here')
    w = torch.randn(256, 512, device='cuda', dtype=torch.bfloat16) / 512 ** 0.5
    x = torch.randn(64, 512, device='cuda', dtype=torch.bfloat16)
    x[10] = 0                                  # a padding row
    ref = x.float() @ w.float().t()
    out = Fp8Linear(w, granularity)(x).float()
    assert torch.isfinite(out).all()
    assert torch.equal(out[10], torch.zeros_like(out[10]))
    assert ((out - ref).norm() / ref.norm()).item() < 0.06


def test_fp8_engine_actions_stay_close_to_bf16():
    base = PolicyEngine(EngineConfig(model='tiny', device='cuda', dtype='bfloat16'))
    ref = base.predict(observation(), noise=noise()).actions_normalized
    fp8 = PolicyEngine(EngineConfig(model='tiny', device='cuda', dtype='bfloat16', quantize='fp8'))
    assert fp8.mode['fp8'] in ('rowwise', 'tensor')
    out = fp8.predict(observation(), noise=noise()).actions_normalized
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() / 2.0 < 0.05     # within 5 % of the [-1, 1] range (tiny model)


def test_quantizing_twice_is_refused():
    e = PolicyEngine(EngineConfig(model='tiny', device='cuda', dtype='bfloat16', quantize='fp8'))
    with pytest.raises(ValueError, match='already fp8'):
        quantize_llm_fp8_(e.model.transformer.blocks)


@pytest.mark.parametrize('limit,kernel', [(0, 'triton_red_'), (4096, 'triton_per_')])
def test_wide_row_reductions_compile_a_1152_wide_layer_norm_in_one_pass(limit, kernel):
    from torch._inductor.utils import run_and_get_code
    from molmobot_policy.runtime.compile import wide_row_reductions
    torch._dynamo.reset()
    norm = torch.nn.LayerNorm(1152, device='cuda', dtype=torch.bfloat16)
    x = torch.randn(4096, 1152, device='cuda', dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: norm(t) * 2.0, dynamic=False)
    with torch._inductor.config.patch(fx_graph_cache=False):
        out, code = run_and_get_code(wide_row_reductions(compiled, limit), x)
    assert kernel in '\n'.join(code)
    torch.testing.assert_close(out, norm(x) * 2.0, rtol=2e-2, atol=2e-2)
