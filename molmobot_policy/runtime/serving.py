"""Every serving-time change to a loaded `MolmoBot`, made once at load time (`prepare_for_serving`).

The model's modules (`molmobot_policy.model`) compute upstream's math one way each; what makes
the served query fast lives here and is applied after the model is on its device and in its
dtype (moving it afterwards is not supported), the way gpt-fast fuses its weights at load:
- the ViT's self-attention projects q|k|v with one GEMM over the three weights stacked in
  place (`ServedViTAttention`), and its float32 attention is a choice
  (`EngineConfig.vit_fp32_attention`; the bf16 kernel also accumulates in float32 but rounds the
  probabilities to bf16);
- the connector's pooling attention (one query over a window of a few patches) runs as float32
  products and sums (`PoolingWindowAttention`): a handful of elementwise kernels that read the
  windows once, where SDPA runs a fused kernel per window batch;
- on CUDA the ViT MLP's w1 + bias + tanh-GELU is one cuBLASLt GEMM with its GELU epilogue
  (`GeluEpilogueMLP`);
- fp8 LLM Linears (`model.fp8.quantize_llm_fp8_`, `EngineConfig.quantize`);
- the LLM's masked attention through FlashAttention-4 with the mask as a rule per score and
  its tiles classified per query (`runtime.flash_attention`, `EngineConfig.llm_attention`;
  `ServedModel.llm_mask`);
- the action expert's per-query context projects every block's cross-attention K/V with one
  batched GEMM over the stacked kv_proj weights and without kv_proj's bias, the value bias
  folded into the output bias (`ServedActionExpert`); its AdaLN conditioning is computed once
  per flow time; the fused DiT kernel's weights are stacked (`runtime.fused_dit`), and for the
  cluster kernel also repacked in its stream order (`runtime.cluster_dit`);
- torch.compile of the repeated blocks and the action expert's glue (`runtime.compile`).
Each is tested against the model's own forward (test/test_serving.py).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from molmobot_policy.model.action_expert import ActionExpert, ActionExpertContext
from molmobot_policy.model.molmobot import euler_flow
from molmobot_policy.model.vision import ViTMLP, ViTMultiHeadDotProductAttention
from molmobot_policy.runtime.compile import compile_action_expert_glue_, compile_repeated_blocks_
from molmobot_policy.runtime.stacking import is_stack_of, stack_parameters_

log = logging.getLogger('molmobot_policy.engine')


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query over a few keys as float32 products and sums.

    q: (..., H, 1, hd), k/v: (..., H, Tk, hd); attn_mask bool broadcastable to (..., H, 1, Tk),
    True = may attend. Returns (..., H, 1, hd) in q's dtype; equals SDPA in float32.
    """
    scores = (q.float() * k.float()).sum(-1, keepdim=True).transpose(-1, -2)  # (.., H, 1, Tk)
    scores = scores * q.shape[-1] ** -0.5
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float('-inf'))
    probs = torch.softmax(scores, dim=-1)
    return (probs.transpose(-1, -2) * v.float()).sum(-2, keepdim=True).to(q.dtype)


class ServedViTAttention(nn.Module):
    """The ViT's self-attention with q, k and v projected by one GEMM.

    Keeps the model module's wq/wk/wv/wo (state-dict keys unchanged); their weights and biases
    are re-pointed to slices of one (3, H * hd, in_dim) weight and one (3, H * hd) bias
    (`stack_parameters_`, no second copy), held as non-persistent buffers so that the compiled
    blocks share one graph. `float32_attention`: q, k, v cast to float32 before SDPA (upstream).
    forward(x_q, x_kv, attn_mask) as `ViTMultiHeadDotProductAttention`, self-attention only.
    """

    def __init__(self, attention: ViTMultiHeadDotProductAttention, float32_attention: bool):
        super().__init__()
        self.n_heads, self.head_dim = attention.n_heads, attention.head_dim
        self.float32_attention = float32_attention
        self.wq, self.wk, self.wv, self.wo = attention.wq, attention.wk, attention.wv, attention.wo
        linears = (self.wq, self.wk, self.wv)
        self.register_buffer('qkv_weight', stack_parameters_([m.weight for m in linears]),
                             persistent=False)
        self.register_buffer('qkv_bias', stack_parameters_([m.bias for m in linears]),
                             persistent=False)

    def forward(self, x_q: torch.Tensor, x_kv: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if x_kv is not x_q:
            raise ValueError('ServedViTAttention is self-attention: x_kv must be x_q')
        b, t = x_q.shape[:2]
        qkv = F.linear(x_q, self.qkv_weight.flatten(0, 1), self.qkv_bias.flatten())
        q, k, v = qkv.view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.float32_attention:
            q, k, v = q.float(), k.float(), v.float()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).to(x_q.dtype)
        return self.wo(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class PoolingWindowAttention(nn.Module):
    """The connector's pooling attention (one query per window) through
    `single_query_attention`, with the model module's wq/wk/wv/wo. forward as
    `ViTMultiHeadDotProductAttention` with Tq = 1."""

    def __init__(self, attention: ViTMultiHeadDotProductAttention):
        super().__init__()
        self.n_heads, self.head_dim = attention.n_heads, attention.head_dim
        self.wq, self.wk, self.wv, self.wo = attention.wq, attention.wk, attention.wv, attention.wo

    def forward(self, x_q: torch.Tensor, x_kv: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, tk = x_q.shape[0], x_kv.shape[1]
        q = self.wq(x_q).view(b, 1, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x_kv).view(b, tk, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x_kv).view(b, tk, self.n_heads, self.head_dim).transpose(1, 2)
        out = single_query_attention(q, k, v, attn_mask)
        return self.wo(out.transpose(1, 2).reshape(b, 1, self.n_heads * self.head_dim))


class GeluEpilogueMLP(nn.Module):
    """The ViT MLP on CUDA: w1 + bias + GELU as one cuBLASLt GEMM with its GELU epilogue
    (`torch._addmm_activation`, which computes the tanh approximation on CUDA: tested against
    F.gelu(approximate='tanh'); on the CPU it computes the erf form, so it is not used there).
    That saves a pass over the (N, mlp_dim) activations and leaves w2's input contiguous.
    Keeps the model module's w1/w2; x (..., dim) on CUDA -> (..., dim)."""

    def __init__(self, mlp: ViTMLP):
        super().__init__()
        self.w1, self.w2 = mlp.w1, mlp.w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = torch._addmm_activation(self.w1.bias, x.reshape(-1, shape[-1]), self.w1.weight.t(),
                                    use_gelu=True)
        return self.w2(h.view(*shape[:-1], h.shape[-1]))


class ServedActionExpert:
    """The action expert's per-query context and flow step as served.

    Cross-attention K/V of every block come from one batched GEMM over the blocks' attn2.kv_proj
    weights, stacked in place once (a non-persistent buffer `served_kv_weight` of the action
    expert, (n_blocks, 2 hidden, hidden), no second copy), without kv_proj's bias: that changes
    no attention output in exact arithmetic. The key bias b_k adds q . b_k to every score of a
    query row, and softmax is invariant to a constant per row; every row of the probabilities P
    sums to 1, so P (V + 1 b_v^T) = P V + 1 b_v^T, and the value bias reaches the output as
    proj.weight @ b_v, folded into the output bias once (`out_bias`). Without a bias the
    batched GEMM needs no (n_blocks, S, 2 hidden) bias broadcast. The K/V are strided views of
    the GEMM's (n_blocks, B, S, 2, H, head_dim) output (copying them into the (.., H, S, ..)
    order costs a pass over them).

    Args:
        ae: the model's `ActionExpert`, on its serving device and dtype.
        flow_steps: Euler steps; the AdaLN modulation of each flow time i / flow_steps is
            computed once (it depends on the weights only).
        kernel: run each flow step's blocks as one kernel: 'triton' (`runtime.fused_dit`),
            'cluster' (`runtime.cluster_dit`; `flow` then runs each whole Euler step in it,
            embedding, final layer and update included), or '' (the blocks).
    """

    def __init__(self, ae: ActionExpert, flow_steps: int, kernel: str = '') -> None:
        self.ae = ae
        params = [block.attn2.kv_proj.weight for block in ae.blocks]
        if not is_stack_of(getattr(ae, 'served_kv_weight', None), params):
            ae.register_buffer('served_kv_weight', stack_parameters_(params), persistent=False)
        device = ae.served_kv_weight.device
        d = ae.cfg.hidden_size
        with torch.no_grad():
            self.out_bias = torch.stack([   # (n_blocks, hidden): proj.weight @ b_v + proj.bias
                F.linear(block.attn2.kv_proj.bias[d:], block.attn2.proj.weight,
                         block.attn2.proj.bias) for block in ae.blocks])
            self.conditioning = [ae.time_conditioning(torch.full(
                (1,), i / flow_steps, device=device, dtype=torch.float32))
                for i in range(flow_steps)]
            self.fused_steps = None
            self.step_kernel = None     # the cluster kernel, for whole Euler steps (`flow`)
            if kernel:
                if kernel == 'cluster':
                    from molmobot_policy.runtime import cluster_dit
                    step = cluster_dit.ClusterDiTStep(ae)   # stacks and repacks the weights
                else:
                    from molmobot_policy.runtime import fused_dit
                    step = fused_dit.FusedDiTStep(ae)   # stacks the blocks' weights in place
                tables = [step.tables(c.blocks) for c in self.conditioning]
                self.fused_steps = [functools.partial(step, tables=t) for t in tables]
                if kernel == 'cluster':
                    self.step_kernel = step
                    self.flow_tables = [(t, step.final_tables(c.final))
                                        for t, c in zip(tables, self.conditioning)]

    def key_values(self, rows: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rows (n_blocks, B, S, hidden) -> keys, values (n_blocks, B, H, S, head_dim) without
        kv_proj's bias, and the folded out_bias; as `ActionExpert.cross_key_values`."""
        n, b, s, d = rows.shape
        kv = torch.bmm(rows.reshape(n, b * s, d), self.ae.served_kv_weight.transpose(1, 2))
        attn = self.ae.blocks[0].attn2
        kv = kv.view(n, b, s, 2, attn.n_heads, attn.head_dim)
        return kv[:, :, :, 0].transpose(2, 3), kv[:, :, :, 1].transpose(2, 3), self.out_bias

    def context(self, hidden: torch.Tensor, encoder_mask: torch.Tensor,
                states: torch.Tensor) -> ActionExpertContext:
        """`ActionExpert.prepare_context` with the served K/V (shapes there)."""
        return self.ae.prepare_context(hidden, encoder_mask, states, self.key_values)

    def flow(self, noise: torch.Tensor, ctx: ActionExpertContext) -> torch.Tensor:
        """`euler_flow` from noise (B, horizon, action_dim) (a float dtype) with the served
        velocity -> float32 (B, horizon, action_dim). Where the cluster kernel serves and takes
        the query (`ClusterDiTStep.flow_reason`: one query, `states_mode: cross_attn`, horizon
        and action_dim <= 16, 128..2048 keys), each Euler step is one launch of it: the action
        embedding, the blocks, the final layer and the update x + dt * velocity inside the
        kernel (the same operations, float32 sums in the kernel's order: within bf16 rounding
        of the separate path); else the separate path. Raises RuntimeError if a kernel launch
        fails (CUDA's message)."""
        steps, kernel = len(self.conditioning), self.step_kernel
        if kernel is not None and not kernel.flow_reason(noise.shape[1], ctx.keys.shape[-2],
                                                         noise.shape[0]):
            x = noise.float().contiguous()
            for i, c in enumerate(self.conditioning):
                tables, final_tables = self.flow_tables[i]
                x = kernel.flow_step(x, c.blocks, c.final, ctx, 1.0 / steps, tables,
                                     final_tables)
            return x
        return euler_flow(noise, lambda x, i: self.velocity(x, i, ctx), steps)

    def velocity(self, x_t: torch.Tensor, step: int, ctx: ActionExpertContext) -> torch.Tensor:
        """x_t (1, horizon, action_dim) at flow step `step` (t = step / flow_steps) -> velocity
        (1, horizon, action_dim) in the parameter dtype."""
        blocks_fn = self.fused_steps[step] if self.fused_steps else None
        return self.ae.velocity_from_conditioning(x_t, self.conditioning[step], ctx, blocks_fn)


def fused_kernel_choice(config, ae: ActionExpert) -> tuple[str, str]:
    """Which kernel runs the DiT blocks of each flow step under `config` (`EngineConfig`):
    (kernel, reason) with kernel 'cluster' (`runtime.cluster_dit`; 'auto' where it can serve,
    'cluster'), 'triton' (`runtime.fused_dit`; 'auto' where the cluster kernel cannot serve,
    'on', 'triton') or '' (the compiled blocks), and why the preferred kernel does not serve
    ('' when it does), for `PolicyEngine.mode` and a log line. 'auto' prefers the cluster
    kernel: the faster one where it serves (docs/decisions/cluster-dit-kernel.md), and asking
    builds it (nvcc, ~10-20 s, once). Raises ValueError where `fused_action_expert` requires a
    kernel ('on', 'triton', 'cluster') that cannot serve."""
    mode = config.fused_action_expert
    if mode == 'off':
        return '', 'as configured'
    if not config.kv_cache:
        return '', 'kv_cache=false'
    param = next(ae.parameters())
    if mode == 'auto' and not (config.compile or config.cuda_graphs):
        return '', ('auto uses it with compile or cuda_graphs' if param.device.type == 'cuda'
                    else f'needs a CUDA device, serving on {param.device}')
    from molmobot_policy.runtime import cluster_dit, fused_dit
    preferred = ''
    if mode in ('auto', 'cluster'):
        reason = cluster_dit.unavailable_reason(ae, param.device, param.dtype)
        if not reason:
            return 'cluster', ''
        if mode == 'cluster':
            raise ValueError(f'fused_action_expert=cluster, but the kernel cannot serve: '
                             f'{reason}')
        preferred = f'cluster kernel not used: {reason}'
    reason = fused_dit.unavailable_reason(ae, param.device, param.dtype)
    if not reason:
        if preferred:
            log.info('fused action-expert kernel: the Triton kernel (%s)', preferred)
        return 'triton', preferred
    if mode != 'auto':
        raise ValueError(f'fused_action_expert={mode}, but the kernel cannot serve: {reason}')
    log.info('fused action-expert kernel not used: %s (compiled blocks instead)', reason)
    return '', reason


def llm_attention_choice(config, model) -> tuple[str, str]:
    """How the LLM attends under `config` (`EngineConfig.llm_attention`): ('flash', '') once
    `runtime.flash_attention.self_check` has passed on the model's device ('auto', 'flash'),
    else ('masked', why not) ('' when configured so).

    Raises:
        ValueError: llm_attention=flash where it cannot serve (the reason named).
    """
    if config.llm_attention == 'masked':
        return 'masked', ''
    from molmobot_policy.runtime import flash_attention
    param = next(model.parameters())
    reason = flash_attention.unavailable_reason(model.config, param.device, param.dtype)
    # a kernel that loads on a capable GPU but computes wrongly is news (WARN); a missing
    # package or another GPU is a set-up (INFO)
    failed_check = False
    if not reason:
        reason = flash_attention.self_check(model.config, param.device, param.dtype)
        failed_check = bool(reason)
    if not reason:
        return 'flash', ''
    if config.llm_attention == 'flash':
        raise ValueError(f'llm_attention=flash cannot serve: {reason}')
    (log.warning if failed_check else log.info)(
        'FlashAttention-4 not used for the LLM: %s (SDPA with the additive mask instead)',
        reason)
    return 'masked', reason


def image_tokens_mask(model) -> Callable:
    """`llm_mask(input_ids, attention_mask)` for `MolmoBot.llm_hidden_states`: the query's
    `runtime.flash_attention.ImageTokensMask` (image tokens bi-directional where the model's
    config says so)."""
    from molmobot_policy.runtime.flash_attention import ImageTokensMask
    image_ids = model.image_special_ids if model.config.bi_directional_attn else None

    def llm_mask(input_ids, attention_mask):
        return ImageTokensMask.build(input_ids, attention_mask, image_ids)
    return llm_mask


def _quantize_(model, quantize: str) -> str:
    """fp8 LLM Linears for quantize 'fp8' / 'fp8-rowwise' / 'fp8-tensor' (once per model);
    returns the granularity the model serves with: 'rowwise', 'tensor' or 'none'."""
    from molmobot_policy.model.fp8 import Fp8Linear, quantize_llm_fp8_
    blocks = model.transformer.blocks
    if len(blocks) and isinstance(blocks[0].att_proj, Fp8Linear):
        return blocks[0].att_proj.granularity
    if quantize == 'none':
        return 'none'
    return quantize_llm_fp8_(blocks, 'tensor' if quantize == 'fp8-tensor' else 'rowwise')


@dataclass
class ServedModel:
    """What `prepare_for_serving` made of a model.

    model: the `MolmoBot`, its modules changed in place. action_expert: its served flow head.
    fp8: granularity of the fp8 LLM Linears ('rowwise', 'tensor' or 'none').
    fused_kernel: the kernel that runs each flow step's blocks: 'cluster', 'triton' or ''
        (the compiled blocks). fused_reason: why the preferred kernel does not serve ('' when
        it does). llm_attention: 'masked' or 'flash'; attention_reason: why not 'flash' ('' when
        it serves or 'masked' is configured). llm_mask: the `llm_mask` to give
        `MolmoBot.llm_hidden_states` (None: the additive mask).
    """

    model: nn.Module
    action_expert: ServedActionExpert
    fp8: str
    fused_kernel: str
    fused_reason: str
    llm_attention: str = 'masked'
    attention_reason: str = ''
    llm_mask: Callable | None = None


def prepare_for_serving(model, config, flow_steps: int) -> ServedModel:
    """Applies every serving change (module docstring) to `model` in place, as `config`
    (`EngineConfig`: vit_fp32_attention, quantize, fused_action_expert, llm_attention,
    kv_cache, compile, cuda_graphs) asks; the model must already be on its serving device
    and dtype. Idempotent for the model's modules, so engines may share one model (each gets
    its own conditioning and fused-kernel tables for its `flow_steps`).

    Raises:
        ValueError: fused_action_expert or llm_attention requires a kernel that cannot
            serve.
    """
    model.eval().requires_grad_(False)
    on_cuda = next(model.parameters()).is_cuda
    vision = model.vision_backbone
    for block in vision.image_vit.transformer.resblocks:
        if not isinstance(block.attention, ServedViTAttention):
            block.attention = ServedViTAttention(block.attention, config.vit_fp32_attention)
        block.attention.float32_attention = config.vit_fp32_attention
        if on_cuda and not isinstance(block.feed_forward, GeluEpilogueMLP):
            block.feed_forward = GeluEpilogueMLP(block.feed_forward)
    if not isinstance(vision.image_pooling_2d, PoolingWindowAttention):
        vision.image_pooling_2d = PoolingWindowAttention(vision.image_pooling_2d)
    fp8 = _quantize_(model, config.quantize)
    kernel, reason = fused_kernel_choice(config, model.action_expert)
    served = ServedActionExpert(model.action_expert, flow_steps, kernel)
    attention, attention_reason = llm_attention_choice(config, model)
    if config.compile:     # one-pass row reductions on CUDA: `compile.served_row_limit`
        compile_repeated_blocks_(model)
        compile_action_expert_glue_(model.action_expert)
    return ServedModel(model, served, fp8, kernel, reason, attention, attention_reason,
                       image_tokens_mask(model) if attention == 'flash' else None)
