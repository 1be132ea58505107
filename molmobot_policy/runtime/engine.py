"""The inference engine: `PolicyEngine.predict(observation) -> ActionChunk`.

Owns device placement, dtype, padding buckets, compile, CUDA graphs, fp8 and timing; the
model (`molmobot_policy.model`) and the preprocessing (`molmobot_policy.preprocess`) stay
plain. No rclpy here (DESIGN.md layers).

One query, on the serving device:
  raw uint8 frames -> 378x378 resize + patchify (on the device) -> ViT + connector -> LLM
  (every block's output, no ln_f / LM head) -> action-expert context (K/V computed once) ->
  `flow_steps` Euler steps with precomputed time conditioning -> unnormalize on the host.
The text side (prompt ids, <im_patch> positions, pooling indices) depends only on the
instruction and the camera count, so it is built once per instruction and cached.
With `buckets`, the prompt is right-padded to the smallest bucket that fits and the
padding is masked out of the action expert's cross-attention (causal attention already
hides it from real tokens), so every bucket is one fixed shape: compiled and captured at
warm-up, never while serving.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.model.molmobot import euler_flow
from molmobot_policy.runtime.config import DTYPES, EngineConfig
from molmobot_policy.runtime.graphs import StaticRunner
from molmobot_policy.runtime.serving import prepare_for_serving
from molmobot_policy.types import ActionChunk, Observation

log = logging.getLogger('molmobot_policy.engine')


def suggested_buckets(shortest_prompt: int) -> tuple[int, ...]:
    """Two padding buckets for prompts of at least `shortest_prompt` tokens: room for ~32 and
    ~224 instruction tokens, rounded up to multiples of 64 (e.g. 1617 -> (1664, 1856), the
    8-camera default)."""
    return tuple(sorted({-(-(shortest_prompt + extra) // 64) * 64 for extra in (32, 224)}))


@dataclass(frozen=True)
class TextInputs:
    """The instruction-dependent half of a query, padded to its bucket (device tensors).

    input_ids int64 (1, L); attention_mask bool (1, L) (False = padding); position_ids int64
    (1, L); image_positions int64 (1, N*196); token_pooling int64 (1, N*196, 4);
    length: real (unpadded) prompt length; bucket: L (0 when unpadded).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    image_positions: torch.Tensor
    token_pooling: torch.Tensor
    length: int
    bucket: int


class PolicyEngine:
    """Serves one MolmoBot model: `predict(observation) -> ActionChunk`.

    Args:
        config: EngineConfig.
        model: optional already-built `MolmoBot` (shares weights between engines, e.g. in
            benchmarks); its dtype/device must match the config.

    Raises:
        ValueError / FileNotFoundError: bad configuration (named field), at construction.
    """

    def __init__(self, config: EngineConfig, model=None) -> None:
        from molmobot_policy.model import checkpoint as ckpt

        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        start = time.perf_counter()
        if model is not None:
            self.model = model
            self.model_config = model.config
        elif config.checkpoint_path:
            self.model, self.model_config = ckpt.load_checkpoint(
                config.checkpoint_path, device=self.device, dtype=self.dtype,
                norm_stats_key=config.norm_stats_key or None)
        else:
            self.model_config = MolmoBotConfig.from_name(config.model)
            self.model = ckpt.random_model(self.model_config, config.seed, self.device, self.dtype)
        self.load_seconds = time.perf_counter() - start
        mcfg = self.model_config
        self.num_cameras = config.num_cameras or mcfg.max_images
        if self.num_cameras > mcfg.max_images:
            raise ValueError(f'num_cameras={self.num_cameras} exceeds the checkpoint\'s max_images='
                             f'{mcfg.max_images}; use at most {mcfg.max_images} cameras')
        if config.gripper_index >= mcfg.action_dim:
            raise ValueError(f'gripper_index={config.gripper_index} is not an action dimension '
                             f'of this model (0..{mcfg.action_dim - 1}, or -1 for off)')
        self.flow_steps = config.flow_steps or mcfg.flow_steps
        self._build_preprocessing()
        self._fit_cache: dict[str, tuple[np.ndarray, int]] = {}
        self._check_prompt_fits()
        self.served = prepare_for_serving(self.model, config, self.flow_steps)
        self._text_cache: dict[str, TextInputs] = {}
        self._runners: dict[int, StaticRunner] = {}
        self._query_fn = self._make_query_fn()
        self._noise_generator = torch.Generator().manual_seed(config.seed)
        self.warmup_seconds = 0.0

    # ------------------------------------------------------------------ set-up
    def _build_preprocessing(self) -> None:
        from molmobot_policy.preprocess import images as pimages
        from molmobot_policy.preprocess import prompt as pprompt
        from molmobot_policy.preprocess import tokenizer as ptok
        from molmobot_policy.preprocess.normalize import QuantileNormalizer

        mcfg = self.model_config
        self._pimages, self._pprompt = pimages, pprompt
        self.tokenizer = ptok.resolve_tokenizer(self.config.tokenizer, mcfg.tokens,
                                                self.config.tokenizer_path,
                                                self.config.checkpoint_path)
        stats = mcfg.norm_stats
        if stats is None:   # random full-size presets: identity normalization
            ones = [1.0] * mcfg.state_dim
            stats_state = ([-1.0] * mcfg.state_dim, ones)
            stats_action = ([-1.0] * mcfg.action_dim, [1.0] * mcfg.action_dim)
        else:
            stats_state = (stats.state_q01, stats.state_q99)
            stats_action = (stats.action_q01, stats.action_q99)
        self.state_normalizer = QuantileNormalizer(*stats_state)
        self.action_normalizer = QuantileNormalizer(*stats_action)
        self._pooling = torch.as_tensor(
            pimages.pooling_indices(self.num_cameras), device=self.device)[None]

    def _make_query_fn(self) -> Callable[..., torch.Tensor]:
        """The device part of one query as one function of tensors: the served, K/V-cached form
        of `MolmoBot.generate_actions` (the same `euler_flow`, the served velocity)."""
        model, served = self.model, self.served.action_expert
        kv_cache, steps = self.config.kv_cache, self.flow_steps

        def query(input_ids, attention_mask, position_ids, image_positions, token_pooling,
                  images, states, noise):
            hidden = model.select_ae_layers(model.llm_hidden_states(
                input_ids, images, token_pooling, position_ids=position_ids,
                attention_mask=attention_mask, image_positions=image_positions))
            cached = served.context(hidden, attention_mask, states) if kv_cache else None

            def velocity(x, i):    # kv_cache=False recomputes the context every flow step
                ctx = cached if kv_cache else served.context(hidden, attention_mask, states)
                return served.velocity(x, i, ctx)
            return euler_flow(noise, velocity, steps)
        return query

    # ------------------------------------------------------------------ text side
    def text_inputs(self, instruction: str) -> TextInputs:
        """Prompt for `instruction`, padded to its bucket; cached per instruction.

        Raises:
            ValueError: empty instruction, or a prompt longer than the largest bucket
                (without buckets: the model's max_sequence_length) when `overlong='error'`.
        """
        cached = self._text_cache.get(instruction)
        if cached is not None:
            return cached
        ids, bucket = self._fit_prompt(instruction)
        text = self._padded_text(ids, bucket)
        self._text_cache[instruction] = text
        return text

    def check_instruction(self, instruction: str) -> int:
        """Prompt length in tokens that `instruction` will be served with (after truncation
        where `overlong='truncate'`). Tokenizes on the host only, no device work: safe to call
        from another thread while the engine serves (e.g. a ROS parameter callback).

        Raises:
            ValueError: as `text_inputs` (empty, or too long with `overlong='error'`).
        """
        return len(self._fit_prompt(instruction)[0])

    def _prompt_limit(self) -> tuple[int, str]:
        """(tokens, name) of the longest prompt served: the largest bucket, or without buckets
        the model's positions (its RoPE table)."""
        if self.config.buckets:
            return self.config.buckets[-1], 'the largest bucket'
        return self.model_config.llm.max_sequence_length, "the model's maximum sequence length"

    def _check_prompt_fits(self) -> None:
        """At construction: every bucket holds the images and the chat template with a
        one-word instruction (a smaller one could never serve, and would fail its warm-up),
        and the configured default instruction fits (or is truncated).
        Raises ValueError naming `buckets` or `instruction`."""
        shortest = len(self._prompt_ids('go'))
        small = [b for b in self.config.buckets if b < shortest]
        if small:
            suggest = list(suggested_buckets(shortest))
            raise ValueError(
                f'buckets {list(self.config.buckets)}: {small} cannot hold even a one-word '
                f'prompt ({shortest} tokens with {self.num_cameras} images of '
                f'{self.model_config.tokens_per_image} patch tokens each); use larger buckets, '
                f'e.g. {suggest}')
        if self.config.instruction.strip():
            try:
                self.check_instruction(self.config.instruction)
            except ValueError as error:
                raise ValueError(f'configured instruction: {error}') from None

    def _fit_prompt(self, instruction: str) -> tuple[np.ndarray, int]:
        """(prompt ids int64 (L,), bucket or 0 without buckets) for `instruction`, cut to the
        longest word prefix that fits where `overlong='truncate'` (logged once per
        instruction: the result is cached). Host only."""
        fitted = self._fit_cache.get(instruction)
        if fitted is None:
            fitted = self._fit_cache[instruction] = self._fit_prompt_uncached(instruction)
        return fitted

    def _fit_prompt_uncached(self, instruction: str) -> tuple[np.ndarray, int]:
        ids = self._prompt_ids(instruction)
        length, bucket = len(ids), 0
        largest, limit = self._prompt_limit()
        advice = ('shorten the instruction, add a larger bucket, or' if self.config.buckets
                  else 'shorten the instruction or')
        if length > largest:
            if self.config.overlong == 'error':
                own = len(self.tokenizer.encode(instruction))
                raise ValueError(f'instruction too long: the prompt has {length} tokens '
                                 f'({own} of them the instruction, the rest the '
                                 f'{self.num_cameras} images and the chat template), {limit} '
                                 f"is {largest} ({advice} set overlong='truncate')")
            # keep the longest word prefix that fits (prompt length grows with the words):
            # a bisection, O(log n) tokenizations even for a page of text
            words = instruction.split()
            lo, hi = 1, len(words) - 1           # words[:hi + 1] is known not to fit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if len(self._prompt_ids(' '.join(words[:mid]))) <= largest:
                    lo = mid
                else:
                    hi = mid - 1
            words = words[:lo]
            ids = self._prompt_ids(' '.join(words))
            length = len(ids)
            if length > largest:
                raise ValueError(f'the prompt needs {length} tokens even with a one-word '
                                 f'instruction; {limit} is {largest}')
            log.warning('instruction truncated to %d words to fit %d tokens', len(words),
                        largest)
        if self.config.buckets:
            bucket = next(b for b in self.config.buckets if b >= length)
        return ids, bucket

    def _padded_text(self, ids: np.ndarray, bucket: int) -> TextInputs:
        """Prompt ids int64 (L,) right-padded to `bucket` tokens (0: unpadded), on the device;
        padding is masked out and repeats the last real position."""
        mcfg = self.model_config
        length = len(ids)
        total = bucket or length
        padded = np.full(total, mcfg.tokens.bos, dtype=np.int64)   # pad id: any valid id
        padded[:length] = ids
        mask = np.zeros(total, dtype=bool)
        mask[:length] = True
        positions = np.minimum(np.arange(total), length - 1)
        image_positions = self._pprompt.image_token_positions(ids, mcfg.tokens)
        dev = self.device
        return TextInputs(
            input_ids=torch.as_tensor(padded, device=dev)[None],
            attention_mask=torch.as_tensor(mask, device=dev)[None],
            position_ids=torch.as_tensor(positions, device=dev)[None],
            image_positions=torch.as_tensor(np.asarray(image_positions, np.int64),
                                            device=dev)[None],
            token_pooling=self._pooling, length=length, bucket=bucket)

    def _prompt_ids(self, instruction: str) -> np.ndarray:
        mcfg = self.model_config
        return np.asarray(self._pprompt.build_prompt_ids(
            self.tokenizer, mcfg.tokens, self.num_cameras, mcfg.tokens_per_image, instruction),
            dtype=np.int64)

    # ------------------------------------------------------------------ serving
    def _images_to_device(self, images) -> torch.Tensor:
        """N uint8 (H, W, 3) frames -> uint8 (1, N, 729, 588) on the device (resize there)."""
        if len(images) != self.num_cameras:
            raise ValueError(f'observation has {len(images)} images, the engine expects '
                             f'{self.num_cameras} (num_cameras)')
        out = []
        for k, img in enumerate(images):
            if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 \
                    or img.shape[2] != 3:
                raise ValueError(f'image {k}: expected uint8 (H, W, 3) RGB, got '
                                 f'{getattr(img, "dtype", type(img))} {getattr(img, "shape", "")}')
            frame = torch.from_numpy(np.ascontiguousarray(img)).to(self.device, non_blocking=True)
            out.append(self._pimages.resize_and_patchify(frame[None])[0])
        return torch.stack(out)[None]

    def _states_to_device(self, state: np.ndarray) -> torch.Tensor:
        mcfg = self.model_config
        state = np.asarray(state, dtype=np.float32).reshape(-1)
        if state.shape[0] > mcfg.state_dim:
            raise ValueError(f'state has {state.shape[0]} values, the model takes at most '
                             f'{mcfg.state_dim}')
        if not np.isfinite(state).all():
            raise ValueError(f'state contains non-finite values: {state.tolist()}')
        padded = np.zeros(mcfg.state_dim, dtype=np.float32)
        padded[:state.shape[0]] = state
        norm = self.state_normalizer.normalize(padded)
        norm[state.shape[0]:] = 0.0     # zero-padding stays zero in normalized space
        return torch.as_tensor(norm, device=self.device).reshape(1, 1, -1)

    def _noise(self) -> torch.Tensor:
        mcfg = self.model_config
        noise = torch.randn((1, mcfg.action_horizon, mcfg.action_dim),
                            generator=self._noise_generator, dtype=torch.float32)
        return noise.to(self.device, non_blocking=True)

    def _run(self, text: TextInputs, images: torch.Tensor, states: torch.Tensor,
             noise: torch.Tensor) -> torch.Tensor:
        inputs = dict(input_ids=text.input_ids, attention_mask=text.attention_mask,
                      position_ids=text.position_ids, image_positions=text.image_positions,
                      token_pooling=text.token_pooling, images=images,
                      states=states.to(self.dtype), noise=noise)
        if not text.bucket:
            return self._query_fn(**inputs)
        runner = self._runners.get(text.bucket)
        if runner is None:
            if self.config.cuda_graphs or self.config.compile:
                log.warning('bucket %d was not prepared at warm-up; compiling now', text.bucket)
            runner = self._prepare_bucket(text.bucket, inputs)
        return runner(**inputs)

    def _prepare_bucket(self, bucket: int, example_inputs: dict) -> StaticRunner:
        runner = StaticRunner(self._query_fn, example_inputs, cuda_graph=self.config.cuda_graphs,
                              warmup_iters=3 if (self.config.compile or self.config.cuda_graphs)
                              else 1)
        self._runners[bucket] = runner
        return runner

    def warmup(self, progress: Callable[[str], None] | None = None) -> float:
        """Compiles and captures every bucket (or runs once, eager); returns seconds taken."""
        say = progress or log.info
        start = time.perf_counter()
        mcfg = self.model_config
        rng = np.random.default_rng(0)
        frames = tuple(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
                       for _ in range(self.num_cameras))
        state = np.zeros(mcfg.state_dim, dtype=np.float32)
        with torch.inference_mode():
            images = self._images_to_device(frames)
            states = self._states_to_device(state)
            if not self.config.buckets:
                text = self.text_inputs(self.config.instruction.strip() or 'warm up')
                self._run(text, images, states, self._noise())
            for bucket in self.config.buckets:
                say(f'warm-up: preparing bucket {bucket} (compile={self.config.compile}, '
                    f'cuda_graphs={self.config.cuda_graphs})')
                t0 = time.perf_counter()
                text = self._padding_probe(bucket)
                inputs = dict(input_ids=text.input_ids, attention_mask=text.attention_mask,
                              position_ids=text.position_ids,
                              image_positions=text.image_positions,
                              token_pooling=text.token_pooling, images=images,
                              states=states.to(self.dtype), noise=self._noise())
                self._prepare_bucket(bucket, inputs)
                say(f'warm-up: bucket {bucket} ready in {time.perf_counter() - t0:.1f} s')
            if self.device.type == 'cuda':
                torch.cuda.synchronize(self.device)
        self.warmup_seconds = time.perf_counter() - start
        say(f'warm-up done in {self.warmup_seconds:.1f} s')
        return self.warmup_seconds

    def _padding_probe(self, bucket: int) -> TextInputs:
        """Text inputs of exactly `bucket` tokens' shape (a short instruction, padded)."""
        text = self.text_inputs('warm up')
        if text.bucket == bucket:
            return text
        # same image layout, padded to this bucket: only shapes matter for compile/capture
        return self._padded_text(self._prompt_ids('warm up'), bucket)

    def predict(self, observation: Observation, noise: np.ndarray | None = None) -> ActionChunk:
        """Runs one query.

        Args:
            observation: `num_cameras` uint8 RGB frames (any size), raw state (robot units),
                instruction (empty -> the configured default).
            noise: optional float32 (horizon, action_dim) initial flow sample (tests);
                default: drawn from the engine's seeded generator.

        Returns:
            ActionChunk with actions in robot units, float32 (horizon, action_dim).

        Raises:
            ValueError: wrong camera count, bad image dtype/shape, bad state, empty or
                over-long instruction.
        """
        start = time.perf_counter()
        instruction = observation.instruction or self.config.instruction
        if not isinstance(instruction, str) or not instruction.strip():
            raise ValueError('instruction is empty: set it in the observation or the '
                             "engine's `instruction`")
        mcfg = self.model_config
        with torch.inference_mode():
            text = self.text_inputs(instruction)
            images = self._images_to_device(observation.images)
            states = self._states_to_device(observation.state)
            if noise is None:
                noise_t = self._noise()
            else:
                noise = np.asarray(noise, dtype=np.float32)
                if noise.shape != (mcfg.action_horizon, mcfg.action_dim):
                    raise ValueError('noise: expected shape '
                                     f'{(mcfg.action_horizon, mcfg.action_dim)}, '
                                     f'got {noise.shape}')
                noise_t = torch.as_tensor(noise, device=self.device)[None]
            t_model = time.perf_counter()
            actions_n = self._run(text, images, states, noise_t)[0].cpu().numpy()
        t_done = time.perf_counter()
        actions = self.action_normalizer.unnormalize(actions_n).astype(np.float32)
        c = self.config
        if c.gripper_index >= 0:
            g = actions[:, c.gripper_index]
            actions[:, c.gripper_index] = np.where(g >= c.gripper_threshold, c.gripper_closed,
                                                   c.gripper_open)
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
                'fused_action_expert': f'off ({self.served.fused_reason})'
                if self.served.fused_reason else 'on',
                'buckets': ','.join(map(str, c.buckets)) or 'none',
                'flow_steps': str(self.flow_steps), 'cameras': str(self.num_cameras)}

    def close(self) -> None:
        """Releases the model, graphs and cached tensors (and the GPU memory they held)."""
        self._runners.clear()
        self._text_cache.clear()
        self._fit_cache.clear()
        self.served = None
        self._query_fn = None
        self.model = None
        if self.device.type == 'cuda':
            torch.cuda.empty_cache()
