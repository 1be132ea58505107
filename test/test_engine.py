"""PolicyEngine on the CPU with the tiny model: the serving contract, padding, caching, compile."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from molmobot_policy.preprocess.transforms import RobotContract
from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine
from molmobot_policy.types import Observation

INSTRUCTION = 'pick up the red cube'


def observation(cameras: int = 8, size=(48, 64), seed: int = 0, instruction: str = INSTRUCTION,
                joints: int = 8) -> Observation:
    rng = np.random.default_rng(seed)
    images = tuple(rng.integers(0, 256, (*size, 3), dtype=np.uint8) for _ in range(cameras))
    state = rng.uniform(-1, 1, joints).astype(np.float32)
    return Observation(images=images, state=state, instruction=instruction, stamp=1.5, seq=3)


def noise(engine: PolicyEngine, seed: int = 0) -> np.ndarray:
    cfg = engine.model_config
    rng = np.random.default_rng(seed)
    return rng.standard_normal((cfg.action_horizon, cfg.action_dim)).astype(np.float32)


@pytest.fixture(scope='module')
def engine() -> PolicyEngine:
    return PolicyEngine(EngineConfig(model='tiny', seed=0))


def test_predict_returns_a_chunk_in_robot_units(engine):
    chunk = engine.predict(observation())
    cfg = engine.model_config
    assert chunk.actions.shape == (cfg.action_horizon, cfg.action_dim)
    assert chunk.actions.dtype == np.float32
    assert np.isfinite(chunk.actions).all()
    q01 = np.asarray(cfg.norm_stats.action_q01, np.float32)
    q99 = np.asarray(cfg.norm_stats.action_q99, np.float32)
    expected = (chunk.actions_normalized + 1) * (q99 - q01) / 2 + q01
    np.testing.assert_allclose(chunk.actions, expected, rtol=1e-6, atol=1e-5)
    assert chunk.observation_stamp == 1.5 and chunk.observation_seq == 3
    assert chunk.inference_ms > 0


def test_same_noise_gives_identical_actions(engine):
    obs = observation()
    a = engine.predict(obs, noise=noise(engine)).actions
    b = engine.predict(obs, noise=noise(engine)).actions
    assert np.array_equal(a, b)


def test_seeded_engines_draw_the_same_noise_sequence():
    obs = observation()
    first = [PolicyEngine(EngineConfig(model='tiny', seed=5)).predict(obs).actions
             for _ in range(2)]
    assert np.array_equal(first[0], first[1])


def test_images_change_the_actions(engine):
    a = engine.predict(observation(seed=0), noise=noise(engine)).actions_normalized
    obs = observation(seed=0)
    flipped = tuple(img[::-1].copy() for img in obs.images)
    b = engine.predict(Observation(images=flipped, state=obs.state, instruction=INSTRUCTION),
                       noise=noise(engine)).actions_normalized
    assert np.abs(a - b).max() > 1e-4


def test_wrong_camera_count_is_rejected(engine):
    with pytest.raises(ValueError, match='observation has 7 images, the robot contract has 8'):
        engine.predict(observation(cameras=7))


def test_non_uint8_image_is_rejected_naming_its_camera(engine):
    obs = observation()
    images = list(obs.images)
    images[2] = images[2].astype(np.float32)
    with pytest.raises(ValueError, match="image of camera 'camera_2'.*uint8"):
        engine.predict(Observation(images=tuple(images), state=obs.state, instruction=INSTRUCTION))


def test_state_of_another_joint_count_is_rejected(engine):
    with pytest.raises(ValueError, match=r'state must have shape \(8,\)'):
        engine.predict(observation(joints=7))


def test_fewer_joints_than_the_state_width_are_zero_padded(engine):
    """A contract of 7 joints on the 8-wide tiny state: the 8th state dimension is zero in
    normalized space, as if that joint sat at its (q01 + q99) / 2."""
    joints = PolicyEngine(EngineConfig(model='tiny'), model=engine.model,
                          contract=RobotContract.numbered(8, 7))
    obs = observation(joints=7)
    stats = engine.model_config.norm_stats
    middle = (np.float32(stats.state_q01[7]) + np.float32(stats.state_q99[7])) / 2
    full = Observation(images=obs.images, state=np.append(obs.state, middle),
                       instruction=INSTRUCTION)
    np.testing.assert_allclose(joints.predict(obs, noise=noise(engine)).actions_normalized,
                               engine.predict(full, noise=noise(engine)).actions_normalized,
                               atol=1e-5)


def test_non_finite_state_is_rejected(engine):
    obs = observation()
    state = obs.state.copy()
    state[1] = np.nan
    with pytest.raises(ValueError, match='non-finite'):
        engine.predict(Observation(images=obs.images, state=state, instruction=INSTRUCTION))


def test_empty_instruction_is_rejected(engine):
    with pytest.raises(ValueError, match='instruction'):
        engine.predict(observation(instruction='  '))


def test_more_cameras_than_the_checkpoint_allows_is_refused():
    with pytest.raises(ValueError, match='9 cameras.*max_images=8'):
        PolicyEngine(EngineConfig(model='tiny'), contract=RobotContract.numbered(9, 8))


def test_kv_cache_and_recomputed_context_give_identical_actions():
    obs = observation()
    cached = PolicyEngine(EngineConfig(model='tiny', kv_cache=True))
    uncached = PolicyEngine(EngineConfig(model='tiny', kv_cache=False), model=cached.model)
    n = noise(cached)
    assert np.array_equal(cached.predict(obs, noise=n).actions_normalized,
                          uncached.predict(obs, noise=n).actions_normalized)


def test_padded_prompt_matches_unpadded_within_float_noise(engine):
    padded = PolicyEngine(EngineConfig(model='tiny', buckets=(2048,)), model=engine.model)
    obs = observation()
    n = noise(engine)
    text = padded.text_inputs(INSTRUCTION)
    assert text.bucket == 2048 and text.input_ids.shape == (2048,)
    assert int(text.attention_mask.sum()) == text.length < 2048
    a = engine.predict(obs, noise=n).actions_normalized
    b = padded.predict(obs, noise=n).actions_normalized
    np.testing.assert_allclose(b, a, atol=2e-5)


def test_prompt_goes_to_the_smallest_bucket_that_fits(engine):
    base = engine.text_inputs(INSTRUCTION).length
    e = PolicyEngine(EngineConfig(model='tiny', buckets=(base - 1, base + 10, base + 100)),
                     model=engine.model)
    assert e.text_inputs(INSTRUCTION).bucket == base + 10


def test_overlong_instruction_is_rejected_by_default(engine):
    base = engine.text_inputs(INSTRUCTION).length
    e = PolicyEngine(EngineConfig(model='tiny', buckets=(base + 8,)), model=engine.model)
    with pytest.raises(ValueError, match='too long'):
        e.text_inputs(INSTRUCTION + ' and then put it into the blue bowl on the left')


def test_overlong_error_counts_the_instructions_own_tokens(engine):
    base = engine.text_inputs(INSTRUCTION).length
    e = PolicyEngine(EngineConfig(model='tiny', buckets=(base + 8,)), model=engine.model)
    long = INSTRUCTION + ' and then put it into the blue bowl on the left'
    own = len(engine.tokenizer.encode(long))
    with pytest.raises(ValueError, match=rf'prompt has \d+ tokens \({own} of them the '
                                         rf'instruction, the rest the 8 images'):
        e.text_inputs(long)


def test_check_instruction_gives_the_served_length_and_refuses_as_text_inputs(engine):
    base = engine.text_inputs(INSTRUCTION).length
    e = PolicyEngine(EngineConfig(model='tiny', buckets=(base + 8,)), model=engine.model)
    assert e.check_instruction(INSTRUCTION) == e.text_inputs(INSTRUCTION).length == base
    for bad, reason in (('  ', 'non-empty'), (INSTRUCTION + ' and then put it into the blue '
                                              'bowl on the left', 'too long')):
        with pytest.raises(ValueError, match=reason):
            e.check_instruction(bad)


def test_buckets_too_small_for_the_images_are_refused_at_construction(engine):
    """Not at warm-up or the first query: every bucket must hold the images and the chat
    template; the error names `buckets`, the ones too small, and suggests sizes."""
    shortest = engine.text_inputs('go').length
    for buckets in ((64,), (64, shortest + 64)):
        with pytest.raises(ValueError, match=rf'buckets \[{", ".join(map(str, buckets))}\]: '
                                             rf'\[64\] cannot hold even a one-word prompt '
                                             rf'\({shortest} tokens'):
            PolicyEngine(EngineConfig(model='tiny', buckets=buckets), model=engine.model)
    e = PolicyEngine(EngineConfig(model='tiny', buckets=(shortest,)), model=engine.model)
    assert e.text_inputs('go').bucket == shortest


def test_a_default_instruction_too_long_is_refused_at_construction_or_truncated(engine):
    base = engine.text_inputs(INSTRUCTION).length
    long = INSTRUCTION + ' and then put it into the blue bowl on the left'
    with pytest.raises(ValueError, match=r'the instruction parameter is refused: instruction too long'):
        PolicyEngine(EngineConfig(model='tiny', buckets=(base + 8,), instruction=long),
                     model=engine.model)
    e = PolicyEngine(EngineConfig(model='tiny', buckets=(base + 8,), instruction=long,
                                  overlong='truncate'), model=engine.model)
    assert e.check_instruction(long) <= base + 8


def test_truncation_is_logged_once_per_instruction(engine, caplog):
    base = engine.text_inputs(INSTRUCTION).length
    e = PolicyEngine(EngineConfig(model='tiny', buckets=(base + 8,), overlong='truncate'),
                     model=engine.model)
    long = INSTRUCTION + ' and then put it into the blue bowl on the left'
    with caplog.at_level('WARNING', logger='molmobot_policy.engine'):
        e.check_instruction(long)          # e.g. when set as a node parameter
        e.text_inputs(long)                # then served
        e.check_instruction(long)
    assert sum('instruction truncated' in r.getMessage() for r in caplog.records) == 1


def test_overlong_instruction_is_truncated_when_asked(engine):
    base = engine.text_inputs(INSTRUCTION).length
    e = PolicyEngine(EngineConfig(model='tiny', buckets=(base + 8,), overlong='truncate'),
                     model=engine.model)
    text = e.text_inputs(INSTRUCTION + ' and then put it into the blue bowl on the left')
    assert text.length <= base + 8 and text.bucket == base + 8
    chunk = e.predict(observation(instruction=INSTRUCTION + ' and then put it into the blue'
                                  ' bowl on the left'))
    assert np.isfinite(chunk.actions).all()


def test_overlong_instruction_without_buckets_is_rejected_at_the_model_limit(engine):
    """No buckets (eager on the CPU): the limit is the model's positions (its RoPE table),
    a clear error instead of an index error deep in the model."""
    limit = engine.model_config.llm.max_sequence_length
    with pytest.raises(ValueError, match=f"too long.*maximum sequence length is {limit}"):
        engine.text_inputs(' '.join(['grasp the red cube'] * 2500))


def test_overlong_instruction_without_buckets_is_truncated_to_the_model_limit(engine):
    limit = engine.model_config.llm.max_sequence_length
    e = PolicyEngine(EngineConfig(model='tiny', overlong='truncate'), model=engine.model)
    instruction = ' '.join(['grasp the red cube'] * 2500)
    text = e.text_inputs(instruction)
    assert limit - 8 <= text.length <= limit and text.bucket == 0
    chunk = e.predict(observation(instruction=instruction))
    assert np.isfinite(chunk.actions).all()


def test_gripper_threshold_binarises_one_dimension(engine):
    contract = RobotContract.numbered(8, 8, gripper_index=7, gripper_threshold=128.0,
                                      gripper_open=-1.0, gripper_closed=2.0)
    e = PolicyEngine(EngineConfig(model='tiny'), model=engine.model, contract=contract)
    chunk = e.predict(observation(), noise=noise(engine))
    plain = engine.predict(observation(), noise=noise(engine))
    expected = np.where(plain.actions[:, 7] >= 128.0, 2.0, -1.0)
    np.testing.assert_array_equal(chunk.actions[:, 7], expected)
    np.testing.assert_array_equal(chunk.actions[:, :7], plain.actions[:, :7])


def test_gripper_index_outside_the_action_dims_is_refused_at_construction(engine):
    with pytest.raises(ValueError, match=r'gripper_index=8 is not an action dimension.*0\.\.7'):
        PolicyEngine(EngineConfig(model='tiny'), model=engine.model,
                     contract=RobotContract.numbered(8, 8, gripper_index=8))


def test_engine_serves_the_reference_model_within_float_rounding(engine):
    """The served path (prepared model, K/V cache, precomputed conditioning) against
    `MolmoBot.generate_actions` of the same weights unprepared, fed the engine's inputs."""
    from molmobot_policy.model.checkpoint import random_model
    reference = random_model(engine.model_config, seed=0)
    obs = observation()
    inputs = engine.preprocessor(obs)
    with torch.no_grad():
        expected = reference.generate_actions(
            inputs.input_ids, inputs.images, inputs.token_pooling, inputs.states,
            noise=torch.as_tensor(noise(engine))[None], position_ids=inputs.position_ids,
            attention_mask=inputs.attention_mask)
    np.testing.assert_allclose(engine.predict(obs, noise=noise(engine)).actions_normalized,
                               expected[0].numpy(), atol=1e-5)


def test_cuda_graphs_need_buckets_and_a_cuda_device():
    with pytest.raises(ValueError, match='buckets'):
        EngineConfig(cuda_graphs=True, device='cuda')
    with pytest.raises(ValueError, match='CUDA'):
        EngineConfig(cuda_graphs=True, buckets=(2048,), device='cpu')


def test_unknown_options_are_rejected_by_name():
    with pytest.raises(ValueError, match='dtype'):
        EngineConfig(dtype='float8')
    with pytest.raises(ValueError, match='quantize'):
        EngineConfig(quantize='int4')


def test_mode_reports_the_engine_settings(engine):
    mode = engine.mode
    assert mode['model'] == 'tiny' and mode['compile'] == 'False' and mode['fp8'] == 'none'
    assert mode['fused_action_expert'].startswith('off (')     # CPU: the DiT blocks, and why


def test_fused_action_expert_option_is_validated():
    with pytest.raises(ValueError, match=r"fused_action_expert must be one of \('auto', .*\) "
                       r"\(or true / false: on / off\), got 'yes'"):
        EngineConfig(fused_action_expert='yes')
    with pytest.raises(ValueError, match='kv_cache'):
        EngineConfig(fused_action_expert='on', kv_cache=False)


def test_fused_action_expert_on_where_it_cannot_serve_fails_before_the_model_is_built():
    with pytest.raises(ValueError, match=r'fused_action_expert=on \(true reads as on: the '
                                         r'Triton kernel\) needs a CUDA device'):
        EngineConfig(model='tiny', fused_action_expert=True)
    with pytest.raises(ValueError, match=r"fused_action_expert=on \(.*\) needs dtype 'bfloat16'"):
        EngineConfig(model='tiny', device='cuda', dtype='float32', fused_action_expert='on')
    with pytest.raises(ValueError, match='fused_action_expert=cluster needs a CUDA device'):
        EngineConfig(model='tiny', fused_action_expert='cluster')
    with pytest.raises(ValueError, match="fused_action_expert=cluster needs dtype 'bfloat16'"):
        EngineConfig(model='tiny', device='cuda', dtype='float16', fused_action_expert='cluster')


def test_the_cluster_kernel_where_it_cannot_serve_fails_configure_saying_why():
    """The tiny model's action expert is not the width the kernel is compiled for (on a CPU
    the reason is the device; the model's widths are checked after it)."""
    from molmobot_policy.runtime.serving import fused_kernel_choice
    model = PolicyEngine(EngineConfig(model='tiny')).model
    config = EngineConfig(model='tiny', compile=True, buckets=(2048,))
    config.fused_action_expert = 'cluster'       # past __post_init__'s device check
    with pytest.raises(ValueError, match='fused_action_expert=cluster, but the kernel cannot '
                                         'serve: needs a CUDA device'):
        fused_kernel_choice(config, model.action_expert)


def test_cuda_graphs_on_a_cpu_says_it_needs_cuda_before_asking_for_buckets():
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device, got device='cpu'"):
        EngineConfig(model='tiny', cuda_graphs=True)
    with pytest.raises(ValueError, match='cuda_graphs needs fixed shapes'):
        EngineConfig(model='tiny', device='cuda', cuda_graphs=True)


def test_fused_action_expert_takes_booleans_as_on_off():
    assert EngineConfig(fused_action_expert=False).fused_action_expert == 'off'
    with pytest.raises(ValueError, match='needs a CUDA device'):
        EngineConfig(fused_action_expert=True)


def test_fused_action_expert_auto_falls_back_to_the_blocks_on_cpu_and_says_why():
    e = PolicyEngine(EngineConfig(model='tiny', compile=True, buckets=(2048,)))
    assert e.served.action_expert.fused_steps is None
    assert e.mode['fused_action_expert'] == 'off (needs a CUDA device, serving on cpu)'


def test_close_releases_the_model():
    e = PolicyEngine(EngineConfig(model='tiny'))
    e.close()
    assert e.model is None


def test_compiled_engine_matches_eager_and_never_recompiles_after_warmup(engine):
    """Inductor on the CPU (regional compile of the repeated blocks), one bucket."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled = PolicyEngine(EngineConfig(model='tiny', compile=True, buckets=(2048,)),
                            model=_copy_model(engine))
    compiled.warmup()
    before = counters['stats']['unique_graphs']
    obs = observation()
    n = noise(engine)
    eager = PolicyEngine(EngineConfig(model='tiny', buckets=(2048,)), model=engine.model)
    np.testing.assert_allclose(compiled.predict(obs, noise=n).actions_normalized,
                               eager.predict(obs, noise=n).actions_normalized, atol=1e-4)
    for words in (1, 5, 17, 40):
        instruction = ' '.join(['grasp'] * words)
        compiled.predict(observation(instruction=instruction))
    assert counters['stats']['unique_graphs'] == before


def _copy_model(engine: PolicyEngine):
    import copy
    return copy.deepcopy(engine.model)


def _choices_while_compiling(run) -> list[str]:
    """Runs `run()` and returns the class name of Inductor's choices handler active while each
    graph compiled (recorded by a post-grad pass; Inductor's graph cache is bypassed so that
    every graph really compiles)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.virtualized import V

    seen = []

    class Record(CustomGraphPass):
        def __call__(self, graph):
            seen.append(type(V.choices).__name__)

        def uuid(self):
            return None

    with inductor_config.patch(post_grad_custom_pre_pass=Record(), fx_graph_cache=False):
        run()
    return seen


def test_engine_blocks_compile_with_one_pass_row_reductions_whoever_calls_them_first():
    """With a row limit, every compiled block and glue piece carries the widened heuristic
    itself (`compile_module_`), so a first call from outside the engine's query compiles the
    served kernels too; without one (the CPU's default), Inductor's own heuristic."""
    from molmobot_policy.runtime.compile import (compile_action_expert_glue_,
                                                compile_repeated_blocks_)

    torch._dynamo.reset()
    e = PolicyEngine(EngineConfig(model='tiny', buckets=(2048,)))
    compile_repeated_blocks_(e.model, row_limit=4096)
    compile_action_expert_glue_(e.model.action_expert, row_limit=4096)
    obs = observation()
    # the first call to the compiled blocks comes from the model itself, not the engine
    seen = _choices_while_compiling(lambda: e.predict(obs))
    # the ViT, LLM and action-expert blocks, context_rows, embed_actions, final_layer
    assert len(seen) >= 6 and set(seen) == {'WideRowChoices'}, seen

    torch._dynamo.reset()
    plain = PolicyEngine(EngineConfig(model='tiny', compile=True, buckets=(2048,)))
    seen = _choices_while_compiling(lambda: plain.predict(obs))
    assert len(seen) >= 6 and 'WideRowChoices' not in seen, seen


def test_wide_row_reductions_returns_the_result_and_restores_inductor_heuristics():
    from torch._inductor.virtualized import V
    from molmobot_policy.runtime.compile import wide_row_reductions
    seen = []

    def fn(x):
        seen.append(type(V.choices).__name__)
        return x * 2

    before = type(V.choices).__name__
    assert wide_row_reductions(fn, 1024) is fn          # at Inductor's own threshold: as is
    out = wide_row_reductions(fn, 4096)(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))
    assert seen == ['WideRowChoices']                   # installed during the call
    assert type(V.choices).__name__ == before           # and removed after it


def test_compiled_vit_blocks_with_stacked_qkv_share_one_graph():
    """Regional compile traces one ViT block and reuses it for all: the served q|k|v stack
    is a graph input like the parameters, not a per-block constant (no recompile per block)."""
    from torch._dynamo.utils import counters
    from molmobot_policy.model.checkpoint import random_model
    from molmobot_policy.model.config import MolmoBotConfig
    from molmobot_policy.runtime.serving import prepare_for_serving

    torch._dynamo.reset()
    model = random_model(MolmoBotConfig.from_name('tiny'), seed=0)
    vit = model.vision_backbone.image_vit
    blocks = vit.transformer.resblocks
    assert len(blocks) >= 2
    patches = torch.rand(2, 729, vit.cfg.patch_dim) * 2 - 1
    with torch.no_grad():
        eager = vit(patches)[-1]
        prepare_for_serving(model, EngineConfig(model='tiny'), flow_steps=1)
        for block in blocks:
            block.compile(dynamic=False, fullgraph=True)
        before = counters['stats']['unique_graphs']
        compiled = vit(patches)[-1]
    assert counters['stats']['unique_graphs'] - before == 1
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_warmup_measures_one_query_for_the_first_latency_estimate():
    engine = PolicyEngine(EngineConfig(model='tiny', device='cpu', dtype='float32', seed=0,
                                       instruction='pick up the cube'))
    assert engine.inference_seconds is None
    engine.warmup()
    assert 0.0 < engine.inference_seconds < engine.warmup_seconds
