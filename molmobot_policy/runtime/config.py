"""`EngineConfig`: the inference engine's options (each also a node parameter of the same name).
The robot's side (cameras, joints, gripper) is the `preprocess.transforms.RobotContract` given
to the engine beside it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from molmobot_policy.preprocess.prompt import OVERLONG_MODES
from molmobot_policy.preprocess.tokenizer import TOKENIZER_MODES

DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}
QUANTIZE_MODES = ('none', 'fp8', 'fp8-rowwise', 'fp8-tensor')
FUSED_AE_MODES = ('auto', 'on', 'off', 'cluster', 'triton')
LLM_ATTENTION_MODES = ('auto', 'masked', 'flash')


# the options that take one of a fixed set of values: name -> (the values, a hint for the message)
CHOICES = {
    'dtype': (tuple(sorted(DTYPES)), ''),
    'quantize': (QUANTIZE_MODES, ''),
    'tokenizer': (TOKENIZER_MODES, ''),
    'fused_action_expert': (FUSED_AE_MODES, ' (or true / false: on / off)'),
    'llm_attention': (LLM_ATTENTION_MODES, ''),
    'overlong': (OVERLONG_MODES, ''),
}


def check_choices(**values) -> None:
    """Checks that each option given (a name of `CHOICES`) takes one of its values; the others
    are not looked at. Needs no device: the node calls it before it starts to build an
    engine, `EngineConfig` on construction.

    Raises:
        ValueError: '<name> must be one of <values>, got <value>' for the first one that does
            not (`fused_action_expert` after `fused_action_expert_mode`).
    """
    for name, value in values.items():
        allowed, hint = CHOICES[name]
        if name == 'fused_action_expert':
            value = fused_action_expert_mode(value)
        if value not in allowed:
            raise ValueError(f'{name} must be one of {allowed}{hint}, got {value!r}')


def fused_action_expert_mode(value):
    """`fused_action_expert` as written by a user: True / False (YAML's unquoted on / off,
    `-p fused_action_expert:=on`) read as 'on' / 'off'; any other value unchanged
    (`EngineConfig` validates it)."""
    if isinstance(value, bool):
        return 'on' if value else 'off'
    return value


@dataclass
class EngineConfig:
    """Engine options; each is also a node parameter of the same name.

    Attributes:
        model: preset name (`MolmoBotConfig.from_name`), used when `checkpoint_path` is empty.
        checkpoint_path: upstream checkpoint directory (config.yaml + model.pt/safetensors).
        tokenizer_path: Qwen tokenizer.json (file or directory); default: beside the checkpoint.
        tokenizer: 'auto', 'tiny' or 'file' (`preprocess.tokenizer.resolve_tokenizer`): auto
            takes tokenizer_path / the tokenizer.json beside the checkpoint, else the built-in
            tiny tokenizer for random weights (no checkpoint), else fails naming the file
            needed; 'tiny' serves the built-in tokenizer to a checkpoint of its token ids.
            Ignored when the engine is given a tokenizer object.
        norm_stats_key: dataset key of the checkpoint's normalization stats
            (`stats_by_repo`, e.g. 'synthmanip'); '' = the checkpoint's default_repo_id.
        device: 'cpu', 'cuda', 'cuda:1', ...
        dtype: serving dtype of the weights: 'float32', 'bfloat16' or 'float16'.
        seed: seed of the random weights (no checkpoint) and of the flow noise.
        flow_steps: Euler steps; 0 = the model config's (10 upstream).
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
        vit_fp32_attention: upstream's `float32_attention` in the ViT's self-attention
            (q, k, v cast to float32 before attention). False (default) runs the fused bf16
            kernel, which also accumulates in float32 but rounds the probabilities to bf16,
            for a much faster ViT. No effect when dtype is float32. The pooling attention
            always runs in float32 (`runtime.serving`).
        fused_action_expert: run each flow step's DiT blocks as one kernel (CUDA, with
            kv_cache): 'auto' (default), when the engine compiles or captures graphs, runs
            the thread-block-cluster kernel (`runtime.cluster_dit`: Hopper, bf16, the
            full-size expert's widths; built with nvcc on first use, ~10-20 s) where it can
            serve, else the persistent Triton kernel (`runtime.fused_dit`: bf16/fp16), else
            the compiled blocks, with a log line saying why; 'cluster' requires the cluster
            kernel and 'on' / 'triton' the Triton kernel (error otherwise; True / False read
            as 'on' / 'off'); 'off' never. `mode` says which runs and why. Same math within
            bf16 rounding (closer to float32 than the blocks: the residual stream stays
            float32 in the kernels).
        llm_attention: how the LLM attends under its mask ("causal, or both tokens image
            tokens", padding hidden): 'flash' runs FlashAttention-4's Hopper / Blackwell
            kernel with the mask as a rule per score and its 128 x 128 tiles classified full /
            partial / empty per query (`runtime.flash_attention`: CUDA, bf16/fp16, the
            flash-attn-4 package), checked against float32 at start-up; 'masked' passes the
            (L, L) additive mask to SDPA (upstream's form); 'auto' (default) runs 'flash' where
            it can serve, else 'masked' with a log line saying why. Same result within bf16
            rounding; `mode` says which runs and why.
        instruction: default instruction, used when an observation carries none.
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
    compile: bool = False
    cuda_graphs: bool = False
    kv_cache: bool = True
    buckets: tuple[int, ...] = ()
    overlong: str = 'error'
    quantize: str = 'none'
    vit_fp32_attention: bool = False
    fused_action_expert: str = 'auto'
    llm_attention: str = 'auto'
    instruction: str = ''

    def __post_init__(self) -> None:
        check_choices(**{name: getattr(self, name) for name in CHOICES})
        if self.norm_stats_key and not self.checkpoint_path:
            raise ValueError(f'norm_stats_key={self.norm_stats_key!r} needs a checkpoint_path '
                             '(presets carry one set of stats)')
        self.fused_action_expert = fused_action_expert_mode(self.fused_action_expert)
        mode = self.fused_action_expert
        if mode in ('on', 'cluster', 'triton'):
            if mode == 'on':                    # what a YAML true became: say which kernel
                mode = 'on (true reads as on: the Triton kernel)'
            if not self.kv_cache:
                raise ValueError(f'fused_action_expert={mode} needs kv_cache=true (the kernel '
                                 'reads the cached cross-attention K/V)')
            if not self.device.startswith('cuda'):
                raise ValueError(f'fused_action_expert={mode} needs a CUDA device, got '
                                 f'device={self.device!r}')
            if self.dtype == 'float32':
                raise ValueError(f"fused_action_expert={mode} needs dtype 'bfloat16' or "
                                 "'float16', got 'float32'")
            if mode == 'cluster' and self.dtype != 'bfloat16':
                raise ValueError(f"fused_action_expert=cluster needs dtype 'bfloat16', got "
                                 f'{self.dtype!r}')
        if self.llm_attention == 'flash' and not self.device.startswith('cuda'):
            raise ValueError(f'llm_attention=flash needs a CUDA device, got '
                             f'device={self.device!r}')
        if self.llm_attention == 'flash' and self.dtype == 'float32':
            raise ValueError("llm_attention=flash needs dtype 'bfloat16' or 'float16', got "
                             "'float32'")
        self.buckets = tuple(sorted(int(b) for b in self.buckets))
        if any(b <= 0 for b in self.buckets):
            raise ValueError(f'buckets must be positive token counts, got {self.buckets}')
        if self.cuda_graphs and not self.device.startswith('cuda'):
            raise ValueError(f'cuda_graphs needs a CUDA device, got device={self.device!r}')
        if self.cuda_graphs and not self.buckets:
            raise ValueError('cuda_graphs needs fixed shapes: set buckets (e.g. [2048])')
        if self.quantize != 'none' and not self.device.startswith('cuda'):
            raise ValueError(f'quantize={self.quantize!r} needs a CUDA device, got {self.device!r}')
