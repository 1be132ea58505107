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

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.preprocess.tokenizer import TOKENIZER_MODES
from molmobot_policy.runtime.compile import compile_action_expert_glue_, compile_repeated_blocks_
from molmobot_policy.runtime.graphs import StaticRunner
from molmobot_policy.types import ActionChunk, Observation

log = logging.getLogger('molmobot_policy.engine')

DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}
QUANTIZE_MODES = ('none', 'fp8', 'fp8-rowwise', 'fp8-tensor')
OVERLONG_MODES = ('error', 'truncate')
FUSED_AE_MODES = ('auto', 'on', 'off')


def fused_action_expert_mode(value):
    """`fused_action_expert` as written by a user: True / False (YAML's unquoted on / off,
    `-p fused_action_expert:=on`) read as 'on' / 'off'; any other value unchanged
    (`EngineConfig` validates it)."""
    if isinstance(value, bool):
        return 'on' if value else 'off'
    return value


@dataclass
class EngineConfig:
    """Engine options; each is also a node parameter of the same name, except num_cameras
    (the node sets it from camera_topics).

    Attributes:
        model: preset name (`MolmoBotConfig.from_name`), used when `checkpoint_path` is empty.
        checkpoint_path: upstream checkpoint directory (config.yaml + model.pt/safetensors).
        tokenizer_path: Qwen tokenizer.json (file or directory); default: beside the checkpoint.
        tokenizer: 'auto', 'tiny' or 'file' (`preprocess.tokenizer.resolve_tokenizer`): auto
            takes tokenizer_path / the tokenizer.json beside the checkpoint, else the built-in
            tiny tokenizer for tiny-vocabulary models and random weights, else fails naming
            the file needed.
        norm_stats_key: dataset key of the checkpoint's normalization stats
            (`stats_by_repo`, e.g. 'synthmanip'); '' = the checkpoint's default_repo_id.
        device: 'cpu', 'cuda', 'cuda:1', ...
        dtype: serving dtype of the weights: 'float32', 'bfloat16' or 'float16'.
        seed: seed of the random weights (no checkpoint) and of the flow noise.
        flow_steps: Euler steps; 0 = the model config's (10 upstream).
        num_cameras: images per observation; 0 = the model's max_images.
        compile: torch.compile every repeated block (inductor, regional compilation);
            note: compiles the (possibly shared) model in place. On CUDA, row reductions
            of up to PERSISTENT_ROW_LIMIT elements compile to one-pass kernels
            (`runtime.compile.wide_row_reductions`).
        cuda_graphs: capture each bucket's query as one CUDA graph (CUDA only).
        kv_cache: compute the action expert's cross-attention context once per query
            (False recomputes it every flow step; for comparison only).
        buckets: fixed prompt lengths (tokens) to pad to; empty = no padding (eager only).
        overlong: what to do with a prompt longer than the largest bucket (without buckets:
            than the model's max_sequence_length): 'error' or 'truncate' (words are cut from
            the end of the instruction until it fits).
        quantize: 'none', or 'fp8' / 'fp8-rowwise' / 'fp8-tensor' for e4m3 LLM Linears.
        vit_fp32_attention: upstream's `float32_attention` in the ViT and the pooling
            (q, k, v cast to float32 before attention). False (default) runs the fused bf16
            kernel, which also accumulates in float32 but rounds the probabilities to bf16;
            2.5x faster ViT on an H200. No effect when dtype is float32.
        fused_action_expert: run each flow step's DiT blocks as one persistent Triton kernel
            (`runtime.fused_dit`; CUDA, bf16/fp16, with kv_cache): 'auto' (default) uses it
            when the engine compiles or captures graphs and the kernel can serve the model,
            else the compiled blocks, with a log line saying why; 'on' requires it (error
            otherwise; True / False read as 'on' / 'off'); 'off' never. `mode` says which
            runs and why. Same math within bf16 rounding (closer to float32 than the blocks:
            the residual stream stays float32 in the kernel).
        instruction: default instruction, used when an observation carries none.
        gripper_index, gripper_threshold, gripper_open, gripper_closed: optional binarisation
            of one action dimension (index -1 = off), in robot units.
    """

    model: str = 'tiny'
    checkpoint_path: str = ''
    tokenizer_path: str = ''
    tokenizer: str = 'auto'
    norm_stats_key: str = ''
    device: str = 'cpu'
    dtype: str = 'float32'
    seed: int = 0
    flow_steps: int = 0
    num_cameras: int = 0
    compile: bool = False
    cuda_graphs: bool = False
    kv_cache: bool = True
    buckets: tuple[int, ...] = ()
    overlong: str = 'error'
    quantize: str = 'none'
    vit_fp32_attention: bool = False
    fused_action_expert: str = 'auto'
    instruction: str = ''
    gripper_index: int = -1
    gripper_threshold: float = 0.0
    gripper_open: float = 0.0
    gripper_closed: float = 1.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f'dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}')
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f'quantize must be one of {QUANTIZE_MODES}, got {self.quantize!r}')
        if self.tokenizer not in TOKENIZER_MODES:
            raise ValueError(f'tokenizer must be one of {TOKENIZER_MODES}, got {self.tokenizer!r}')
        if self.norm_stats_key and not self.checkpoint_path:
            raise ValueError(f'norm_stats_key={self.norm_stats_key!r} needs a checkpoint_path '
                             '(presets carry one set of stats)')
        if self.gripper_index < -1:
            raise ValueError(f'gripper_index must be -1 (off) or an action dimension, got '
                             f'{self.gripper_index}')
        self.fused_action_expert = fused_action_expert_mode(self.fused_action_expert)
        if self.fused_action_expert not in FUSED_AE_MODES:
            raise ValueError(f'fused_action_expert must be one of {FUSED_AE_MODES}, got '
                             f'{self.fused_action_expert!r}')
        if self.fused_action_expert == 'on':
            if not self.kv_cache:
                raise ValueError('fused_action_expert=on needs kv_cache=true (the kernel reads '
                                 'the cached cross-attention K/V)')
            if not self.device.startswith('cuda'):
                raise ValueError(f'fused_action_expert=on needs a CUDA device, got '
                                 f'device={self.device!r}')
            if self.dtype == 'float32':
                raise ValueError("fused_action_expert=on needs dtype 'bfloat16' or 'float16', "
                                 "got 'float32'")
        if self.overlong not in OVERLONG_MODES:
            raise ValueError(f'overlong must be one of {OVERLONG_MODES}, got {self.overlong!r}')
        self.buckets = tuple(sorted(int(b) for b in self.buckets))
        if any(b <= 0 for b in self.buckets):
            raise ValueError(f'buckets must be positive token counts, got {self.buckets}')
        if self.cuda_graphs and not self.buckets:
            raise ValueError('cuda_graphs needs fixed shapes: set buckets (e.g. [2048])')
        if self.cuda_graphs and not self.device.startswith('cuda'):
            raise ValueError(f'cuda_graphs needs a CUDA device, got device={self.device!r}')
        if self.quantize != 'none' and not self.device.startswith('cuda'):
            raise ValueError(f'quantize={self.quantize!r} needs a CUDA device, got {self.device!r}')


def set_vit_fp32_attention_(model, enabled: bool) -> None:
    """Sets `float32_attention` of every ViT / pooling attention module of `model`."""
    from molmobot_policy.model.vision import ViTMultiHeadDotProductAttention
    for module in model.modules():
        if isinstance(module, ViTMultiHeadDotProductAttention):
            module.float32_attention = enabled


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
        self.model.eval().requires_grad_(False)
        set_vit_fp32_attention_(self.model, config.vit_fp32_attention)
        self.model.action_expert.stack_kv_projections_()   # K/V cache: one batched GEMM
        for block in self.model.vision_backbone.image_vit.transformer.resblocks:
            block.attention.stack_qkv_()                     # ViT q|k|v: one GEMM
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
        self.fp8 = 'none'
        if config.quantize != 'none':
            from molmobot_policy.model.fp8 import quantize_llm_fp8_
            wanted = 'tensor' if config.quantize == 'fp8-tensor' else 'rowwise'
            self.fp8 = quantize_llm_fp8_(self.model.transformer.blocks, wanted)
        self._conditioning = self._precompute_conditioning()
        with torch.inference_mode():     # depends only on the weights, like the conditioning
            self._cross_out_bias = self.model.action_expert.cross_output_bias()
        self.fused_reason = ''     # why the fused kernel is not used ('' when it is)
        self._fused_blocks = self._make_fused_blocks()
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

    def _precompute_conditioning(self) -> list:
        """AdaLN parameters of every block for each fixed flow time i/steps (computed once)."""
        ae = self.model.action_expert
        steps = self.flow_steps
        with torch.inference_mode():
            return [ae.time_conditioning(torch.full((1,), i / steps, device=self.device,
                                                    dtype=torch.float32))
                    for i in range(steps)]

    def _make_fused_blocks(self) -> list | None:
        """Per flow step, the fused DiT kernel (`runtime.fused_dit.FusedDiTStep`) bound to
        that step's precomputed tables; None where `fused_action_expert` or the hardware says
        the compiled blocks run instead. Raises ValueError when 'on' and it cannot serve."""
        c = self.config
        if c.fused_action_expert == 'off':
            self.fused_reason = 'as configured'
            return None
        if not c.kv_cache:
            self.fused_reason = 'kv_cache=false'
            return None
        from molmobot_policy.runtime import fused_dit
        reason = fused_dit.unavailable_reason(self.model.action_expert, self.device, self.dtype)
        if reason:
            if c.fused_action_expert == 'on':
                raise ValueError(f'fused_action_expert=on, but the kernel cannot serve: {reason}')
            self.fused_reason = reason
            log.info('fused action-expert kernel not used: %s (compiled blocks instead)', reason)
            return None
        if c.fused_action_expert == 'auto' and not (c.compile or c.cuda_graphs):
            self.fused_reason = 'auto uses it with compile or cuda_graphs'
            return None
        step = fused_dit.FusedDiTStep(self.model.action_expert)
        with torch.inference_mode():
            return [functools.partial(step, tables=step.tables(c.blocks))
                    for c in self._conditioning]

    def _make_query_fn(self) -> Callable[..., torch.Tensor]:
        """The device part of one query as one function of tensors (compiled if asked)."""
        model, ae = self.model, self.model.action_expert
        layer_ids = list(self.model_config.ae_layer_ids)
        conditioning, steps = self._conditioning, self.flow_steps
        kv_cache, dt = self.config.kv_cache, 1.0 / self.flow_steps
        fused, out_bias = self._fused_blocks, self._cross_out_bias

        def query(input_ids, attention_mask, position_ids, image_positions, token_pooling,
                  images, states, noise):
            hidden = model.llm_hidden_states(
                input_ids, images, token_pooling, position_ids=position_ids,
                attention_mask=attention_mask, image_positions=image_positions)
            hidden = hidden[layer_ids] if len(layer_ids) != hidden.shape[0] else hidden
            x = noise
            if kv_cache:
                ctx = ae.prepare_context(hidden, attention_mask, states, out_bias)
                for i in range(steps):
                    blocks_fn = fused[i] if fused else None
                    x = x + dt * ae.velocity_from_conditioning(x, conditioning[i], ctx,
                                                               blocks_fn)
            else:
                for i in range(steps):
                    t = torch.full((x.shape[0],), i / steps, device=x.device)
                    x = x + dt * ae(x, t, hidden, attention_mask, states)
            return x.float()

        if self.config.compile:     # one-pass row reductions on CUDA: `served_row_limit`
            compile_repeated_blocks_(self.model)
            compile_action_expert_glue_(ae)
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
                'kv_cache': str(c.kv_cache), 'fp8': self.fp8,
                'vit_fp32_attention': str(c.vit_fp32_attention),
                'fused_action_expert': 'on' if self._fused_blocks is not None
                else f'off ({self.fused_reason})',
                'buckets': ','.join(map(str, c.buckets)) or 'none',
                'flow_steps': str(self.flow_steps), 'cameras': str(self.num_cameras)}

    def close(self) -> None:
        """Releases the model, graphs and cached tensors (and the GPU memory they held)."""
        self._runners.clear()
        self._text_cache.clear()
        self._fit_cache.clear()
        self._conditioning = []
        self._cross_out_bias = None
        self._fused_blocks = None
        self._query_fn = None
        self.model = None
        if self.device.type == 'cuda':
            torch.cuda.empty_cache()
