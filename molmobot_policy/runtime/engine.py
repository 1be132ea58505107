"""The inference engine: `PolicyEngine.predict(observation) -> ActionChunk`.

openpi's shape: input transforms -> model -> output transforms. The engine loads the model,
prepares it for serving once (`runtime.serving.prepare_for_serving`), warms it up (compiles and
captures each padding bucket) and then serves; device placement, dtype, buckets, compile, CUDA
graphs and fp8 are its options (`EngineConfig`), the robot's side is a
`preprocess.transforms.RobotContract`. No rclpy here (DESIGN.md layers).

One query, on the serving device:
  raw uint8 frames -> resize + patchify to the checkpoint's image size (on the device);
  instruction -> prompt ids, <im_patch> positions, pooling indices (host, cached per
  instruction); raw state -> pad + normalize (`preprocess.pipeline.Preprocessor`) ->
  ViT + connector -> LLM (every block's output, no ln_f / LM head) -> action-expert context
  (K/V computed once) -> `flow_steps` Euler steps (`model.molmobot.euler_flow`) with the
  precomputed time conditioning -> unnormalize, gripper threshold on the host.
With `buckets`, the prompt is right-padded to the smallest bucket that fits and the padding is
masked out of the action expert's cross-attention (causal attention already hides it from real
tokens), so every bucket is one fixed shape: compiled and captured at warm-up, never while
serving.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.model.molmobot import euler_flow
from molmobot_policy.preprocess.pipeline import ModelInputs, Preprocessor
from molmobot_policy.preprocess.prompt import Encoder, TextInputs
from molmobot_policy.preprocess.tokenizer import check_tokenizer, resolve_tokenizer
from molmobot_policy.preprocess.transforms import RobotContract
from molmobot_policy.runtime.config import DTYPES, EngineConfig
from molmobot_policy.runtime.devices import check_device
from molmobot_policy.runtime.graphs import StaticRunner
from molmobot_policy.runtime.serving import prepare_for_serving
from molmobot_policy.types import ActionChunk, Observation

log = logging.getLogger('molmobot_policy.engine')

WARMUP_FRAME = (480, 640)     # pixels of the random frames the warm-up serves


def _model_config(config: EngineConfig) -> MolmoBotConfig:
    """The checkpoint's config.yaml (no weights read) or the preset."""
    if config.checkpoint_path:
        from molmobot_policy.model.checkpoint import load_config
        return load_config(config.checkpoint_path, norm_stats_key=config.norm_stats_key or None)
    return MolmoBotConfig.from_name(config.model)


def _tokenizer(config: EngineConfig, model: MolmoBotConfig, given: Encoder | None) -> Encoder:
    """`given` (its special ids checked where it has token_to_id), else the one that
    config.tokenizer names (`resolve_tokenizer`)."""
    if given is None:
        return resolve_tokenizer(config.tokenizer, model.tokens, config.tokenizer_path,
                                 config.checkpoint_path)
    if hasattr(given, 'token_to_id'):
        check_tokenizer(given, model.tokens, getattr(given, 'source', '') or 'the given tokenizer')
    return given


def _load_model(config: EngineConfig, model: MolmoBotConfig):
    """The checkpoint's weights, or the preset's seeded random weights, on the serving device
    in the serving dtype."""
    from molmobot_policy.model import checkpoint as ckpt
    device, dtype = torch.device(config.device), DTYPES[config.dtype]
    if config.checkpoint_path:
        return ckpt.load_checkpoint(config.checkpoint_path, device=device, dtype=dtype,
                                    norm_stats_key=config.norm_stats_key or None)[0]
    return ckpt.random_model(model, config.seed, device, dtype)


class PolicyEngine:
    """Serves one MolmoBot model: `predict(observation) -> ActionChunk`.

    Args:
        config: EngineConfig.
        model: optional already-built `MolmoBot` (shares weights between engines, e.g. in
            benchmarks); its dtype/device must match the config.
        contract: the robot (cameras, joints, gripper); default
            `RobotContract.numbered(max_images, state_dim)` of the model.
        tokenizer: optional tokenizer object (anything with `encode(text) -> list[int]`, e.g.
            `preprocess.tokenizer.tiny_tokenizer()`), used instead of `config.tokenizer`; one
            with `token_to_id` has its special ids checked (`check_tokenizer`).

    Raises:
        ValueError / FileNotFoundError: bad configuration (named field), a contract that does
            not fit the model, at construction (before the weights are read).
    """

    def __init__(self, config: EngineConfig, model=None, *,
                 contract: RobotContract | None = None, tokenizer: Encoder | None = None
                 ) -> None:
        self.config = config
        self.device = check_device(config.device)    # ValueError naming the device
        self.dtype = DTYPES[config.dtype]
        start = time.perf_counter()
        # load: the config first (a checkpoint's config.yaml), so that the tokenizer, the
        # contract and the prompts are checked before the weights are read
        self.model_config = model.config if model is not None else _model_config(config)
        self.tokenizer = _tokenizer(config, self.model_config, tokenizer)
        self.preprocessor = Preprocessor(self.model_config, self.tokenizer, contract,
                                         buckets=config.buckets, overlong=config.overlong,
                                         device=self.device)
        self.contract = self.preprocessor.contract
        if config.instruction.strip():
            try:
                self.check_instruction(config.instruction)
            except ValueError as error:
                raise ValueError(f'the instruction parameter is refused: {error}') from None
        self.flow_steps = config.flow_steps or self.model_config.flow_steps
        self.model = model if model is not None else _load_model(config, self.model_config)
        self.load_seconds = time.perf_counter() - start
        # prepare: every serving change to the model, once
        self.served = prepare_for_serving(self.model, config, self.flow_steps)
        self._query_fn = self._make_query_fn()
        self._runners: dict[int, StaticRunner] = {}
        self._noise_generator = torch.Generator().manual_seed(config.seed)
        self.warmup_seconds = 0.0
        self.inference_seconds: float | None = None    # one warm query, measured at warm-up

    def _make_query_fn(self) -> Callable[..., torch.Tensor]:
        """The device part of one query as one function of tensors: the served, K/V-cached form
        of `MolmoBot.generate_actions` (the same `euler_flow`, the served velocity)."""
        model, served = self.model, self.served.action_expert
        kv_cache, steps, llm_mask = self.config.kv_cache, self.flow_steps, self.served.llm_mask

        def query(input_ids, attention_mask, position_ids, image_positions, token_pooling,
                  images, states, noise):
            hidden = model.select_ae_layers(model.llm_hidden_states(
                input_ids, images, token_pooling, position_ids=position_ids,
                attention_mask=attention_mask, image_positions=image_positions,
                llm_mask=llm_mask))
            if kv_cache:
                return served.flow(noise, served.context(hidden, attention_mask, states))

            def velocity(x, i):    # kv_cache=False recomputes the context every flow step
                return served.velocity(x, i, served.context(hidden, attention_mask, states))
            return euler_flow(noise, velocity, steps)
        return query

    # ------------------------------------------------------------------ text side
    def text_inputs(self, instruction: str) -> TextInputs:
        """Host-side text inputs of `instruction`, padded to its bucket; cached per instruction
        (`preprocess.prompt.PromptFitter`).

        Raises:
            ValueError: empty instruction, or a prompt longer than the largest bucket
                (without buckets: the model's max_sequence_length) when `overlong='error'`.
        """
        return self.preprocessor.text_inputs(instruction)

    def check_instruction(self, instruction: str) -> int:
        """Prompt length in tokens that `instruction` will be served with (after truncation
        where `overlong='truncate'`). Tokenizes on the host only, no device work: safe to call
        from another thread while the engine serves (e.g. a ROS parameter callback).

        Raises:
            ValueError: as `text_inputs` (empty, or too long with `overlong='error'`).
        """
        return self.text_inputs(instruction).length

    # ------------------------------------------------------------------ serving
    def sample_actions(self, inputs: ModelInputs, noise: torch.Tensor) -> torch.Tensor:
        """The model part of one query: `inputs` and noise float32 (1, horizon, action_dim) on
        the device -> normalized actions float32 (1, horizon, action_dim) on the device
        (replaying the bucket's captured graph where there is one)."""
        tensors = dict(inputs.tensors(), noise=noise)
        bucket = inputs.text.bucket
        if not bucket:
            return self._query_fn(**tensors)
        runner = self._runners.get(bucket)
        if runner is None:
            if self.config.cuda_graphs or self.config.compile:
                log.warning('bucket %d was not prepared at warm-up; compiling now', bucket)
            runner = self._prepare_bucket(bucket, tensors)
        return runner(**tensors)

    def _prepare_bucket(self, bucket: int, example_inputs: dict) -> StaticRunner:
        compiled = self.config.compile or self.config.cuda_graphs
        runner = StaticRunner(self._query_fn, example_inputs, cuda_graph=self.config.cuda_graphs,
                              warmup_iters=3 if compiled else 1)
        self._runners[bucket] = runner
        return runner

    def _noise(self, noise: np.ndarray | None = None) -> torch.Tensor:
        """float32 (1, horizon, action_dim) on the device: `noise` (horizon, action_dim), or
        drawn from the engine's seeded generator. ValueError on another shape."""
        mcfg = self.model_config
        shape = (mcfg.action_horizon, mcfg.action_dim)
        if noise is None:
            drawn = torch.randn((1, *shape), generator=self._noise_generator,
                                dtype=torch.float32)
            return drawn.to(self.device, non_blocking=True)
        noise = np.asarray(noise, dtype=np.float32)
        if noise.shape != shape:
            raise ValueError(f'noise: expected shape {shape}, got {noise.shape}')
        return torch.as_tensor(noise, device=self.device)[None]

    def warmup(self, progress: Callable[[str], None] | None = None) -> float:
        """Compiles and captures every bucket (or runs once, eager), then times one query
        (`inference_seconds`); returns seconds taken."""
        say = progress or log.info
        start = time.perf_counter()
        rng = np.random.default_rng(0)
        frames = tuple(rng.integers(0, 256, (*WARMUP_FRAME, 3), dtype=np.uint8)
                       for _ in self.contract.camera_names)
        state = np.zeros(len(self.contract.joint_names), dtype=np.float32)
        prompt = self.preprocessor.prompt
        with torch.inference_mode():
            if not self.config.buckets:
                text = self.text_inputs(self.config.instruction.strip() or 'warm up')
                self.sample_actions(self.preprocessor.inputs(text, frames, state), self._noise())
            for bucket in self.config.buckets:
                say(f'warm-up: preparing bucket {bucket} (compile={self.config.compile}, '
                    f'cuda_graphs={self.config.cuda_graphs})')
                t0 = time.perf_counter()
                # a one-word prompt padded to this bucket: only the shapes matter
                text = prompt.pad(prompt.prompt_ids('go'), bucket)
                inputs = self.preprocessor.inputs(text, frames, state)
                self._prepare_bucket(bucket, dict(inputs.tensors(), noise=self._noise()))
                say(f'warm-up: bucket {bucket} ready in {time.perf_counter() - t0:.1f} s')
            if self.device.type == 'cuda':
                torch.cuda.synchronize(self.device)
        self.inference_seconds = self._time_warm_query(frames, state)
        self.warmup_seconds = time.perf_counter() - start
        say(f'warm-up done in {self.warmup_seconds:.1f} s (one query '
            f'{self.inference_seconds * 1e3:.0f} ms)')
        return self.warmup_seconds

    def _time_warm_query(self, frames: tuple[np.ndarray, ...], state: np.ndarray) -> float:
        """Seconds of one whole `predict` after warm-up (the second of two, the first may still
        touch cold caches): the node's first latency estimate, before any measured inference."""
        observation = Observation(images=frames, state=state,
                                  instruction=self.config.instruction.strip() or 'warm up')
        noise = np.zeros((self.model_config.action_horizon, self.model_config.action_dim),
                         np.float32)     # explicit: the seeded noise stream stays the served one's
        seconds = 0.0
        for _ in range(2):
            seconds = self.predict(observation, noise=noise).inference_ms / 1e3
        return seconds

    def predict(self, observation: Observation, noise: np.ndarray | None = None) -> ActionChunk:
        """Runs one query.

        Args:
            observation: one uint8 RGB frame (any size) per contract camera, the raw state
                of the contract's joints (robot units), the instruction (empty -> the
                configured default).
            noise: optional float32 (horizon, action_dim) initial flow sample (tests);
                default: drawn from the engine's seeded generator.

        Returns:
            ActionChunk with actions in robot units, float32 (horizon, action_dim).

        Raises:
            TypeError, ValueError: wrong camera count, bad image dtype/shape, bad state, empty
                or over-long instruction, bad noise shape.
        """
        start = time.perf_counter()
        with torch.inference_mode():
            inputs = self.preprocessor(observation,
                                       observation.instruction or self.config.instruction)
            noise_t = self._noise(noise)
            t_model = time.perf_counter()
            actions_n = self.sample_actions(inputs, noise_t)[0].cpu().numpy()
        t_done = time.perf_counter()
        actions = self.preprocessor.postprocess(actions_n)
        end = time.perf_counter()
        return ActionChunk(
            actions=actions, actions_normalized=actions_n.astype(np.float32),
            observation_stamp=observation.stamp, observation_seq=observation.seq,
            inference_ms=(end - start) * 1e3,
            timings_ms={'preprocess': (t_model - start) * 1e3,
                        'model': (t_done - t_model) * 1e3,
                        'postprocess': (end - t_done) * 1e3})

    @property
    def mode(self) -> dict[str, str]:
        """Engine settings for /diagnostics."""
        c = self.config
        return {'model': self.model_config.name, 'device': c.device, 'dtype': c.dtype,
                'compile': str(c.compile), 'cuda_graphs': str(c.cuda_graphs),
                'kv_cache': str(c.kv_cache), 'fp8': self.served.fp8,
                'vit_fp32_attention': str(c.vit_fp32_attention),
                'fused_action_expert': (self.served.fused_kernel or 'off') + (
                    f' ({self.served.fused_reason})' if self.served.fused_reason else ''),
                'llm_attention': self.served.llm_attention + (
                    f' ({self.served.attention_reason})' if self.served.attention_reason
                    else ''),
                'buckets': ','.join(map(str, c.buckets)) or 'none',
                'flow_steps': str(self.flow_steps),
                'cameras': str(len(self.contract.camera_names))}

    def close(self) -> None:
        """Releases the model, graphs and cached tensors (and the GPU memory they held)."""
        self._runners.clear()
        self.preprocessor = None
        self.served = None
        self._query_fn = None
        self.model = None
        if self.device.type == 'cuda':
            torch.cuda.empty_cache()
