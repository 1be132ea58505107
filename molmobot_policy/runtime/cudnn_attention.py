"""The LLM's masked attention as one cuDNN graph whose mask is a score modifier.

The served mask (`MolmoBot.attention_allowed`: causal, or query and key both image tokens;
padded keys hidden) is ~95 % dense. Given to SDPA as an additive (L, L) bias, cuDNN reads a
bias tile for every score tile and runs a slower engine: it costs about as much again as the
unmasked attention (docs/decisions/llm-masked-attention.md). cuDNN's frontend graph API
(`nvidia-cudnn-frontend`, the Python package of NVIDIA's open-source cuDNN frontend) lets the
attention take a *score modifier* instead: a chain of elementwise operations applied to each
score tile in registers (cudnn-frontend's `SDPA_attributes::set_score_mod`, since v1.9). The
mask is a rule over per-token values, so no (L, L) tensor is read:

    key j is visible to query i  iff  j <= i  or  j + query_offset[i] < key_image[j]

with query_offset[i] = 0 for an image query and 2^20 otherwise, key_image[j] = j + 1 for an
image key and 0 otherwise: causal, or both tokens image special tokens. It equals the served
mask on every valid query: the engine pads prompts on the right (`PromptBuilder.pad`) and
padding is never an image token, so causality alone hides the padded keys from them. A padded
query sees the padded keys before it, where the additive mask hides them; nothing reads a
padded query's output (the LLM's valid queries never see it, the action expert's
cross-attention masks padded context). `RuleMask.build` makes
the per-token tensors once per query (outside the LLM blocks); each block calls the mask with
its q, k, v (`OLMoSequentialBlock.attention`). The attention is one custom op
(`molmobot::score_mod_attention`): Inductor treats it as one opaque kernel call and CUDA
graphs capture it; its output is (B, L, Hq, D) contiguous, which the block's output
projection reads without a copy.

Graphs are built once per shape (first call: a few hundred ms, during the engine's warm-up)
and kept. `unavailable_reason` and `self_check` decide, once per engine, whether this path
serves (`EngineConfig.llm_attention`).
"""
from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEG = -1.0e9    # a hidden score; exp(NEG - max) is exactly 0 in float32
OFFSET = 1 << 20    # > any sequence length: a non-image query's key + OFFSET never passes
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _frontend():
    """The `cudnn` frontend module, or the ImportError's text (str) where it cannot load."""
    try:
        import cudnn
    except Exception as error:     # noqa: BLE001 - any failure to load is a reason to fall back
        return f'the cuDNN frontend (nvidia-cudnn-frontend) does not load: {error}'
    return cudnn


def unavailable_reason(cfg, device: torch.device, dtype: torch.dtype) -> str:
    """'' when the score-modifier attention can serve this model, else why not (a log line).

    cfg: `MolmoBotConfig`; device, dtype: the serving device and parameter dtype."""
    if device.type != 'cuda':
        return f'needs a CUDA device (cuDNN), serving on {device}'
    if dtype not in (torch.bfloat16, torch.float16):
        return f'needs bfloat16 or float16 parameters, got {dtype}'
    if not torch.backends.cudnn.is_available():
        return 'this torch build has no cuDNN'
    cudnn = _frontend()
    if isinstance(cudnn, str):
        return cudnn
    if cfg.llm.head_dim % 8:
        return f'needs a head_dim divisible by 8 (cuDNN), got {cfg.llm.head_dim}'
    return ''


@dataclass
class RuleMask:
    """The served LLM mask as per-token tensors (module docstring), called as
    mask(q (B, Hq, L, D), k, v (B, Hkv, L, D)) -> (B, L, Hq, D) in q's dtype.

    query_offset: int32 (B, 1, L, 1), 0 for an image special token, OFFSET otherwise.
    key_image: int32 (B, 1, 1, L), position + 1 for an image special token, 0 otherwise.
    """

    query_offset: torch.Tensor
    key_image: torch.Tensor

    @staticmethod
    def build(input_ids: torch.Tensor, image_ids: torch.Tensor | None) -> RuleMask:
        """input_ids int64 (B, L), right-padded; image_ids int64 (n,) of the image special
        tokens (None: causal only)."""
        b, length = input_ids.shape
        is_image = torch.zeros(b, length, dtype=torch.bool, device=input_ids.device)
        if image_ids is not None:
            is_image = (input_ids.unsqueeze(-1) == image_ids).any(-1)
        pos = torch.arange(length, device=input_ids.device)
        offset = torch.where(is_image, 0, OFFSET).to(torch.int32)
        key_image = torch.where(is_image, pos + 1, 0).to(torch.int32)
        return RuleMask(offset.view(b, 1, length, 1), key_image.view(b, 1, 1, length))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return score_mod_attention(q, k, v, self.query_offset, self.key_image,
                                   1.0 / math.sqrt(q.shape[-1]))


def visible(query_offset: torch.Tensor, key_image: torch.Tensor) -> torch.Tensor:
    """bool (B, 1, L, L) [query, key]: the rule as the cuDNN graph evaluates it."""
    length_q, length_k = query_offset.shape[2], key_image.shape[3]
    keys = torch.arange(length_k, device=key_image.device).view(1, 1, 1, length_k)
    queries = torch.arange(length_q, device=key_image.device).view(1, 1, length_q, 1)
    return (keys <= queries) | (keys + query_offset < key_image)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_offset: torch.Tensor,
              key_image: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 attention (B, L, Hq, D) under the rule (query head h reads KV head
    h // (Hq / Hkv)): the CPU path of the op and what `self_check` compares with."""
    group = q.shape[1] // k.shape[1]
    scores = q.float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2) * scale
    scores = scores.masked_fill(~visible(query_offset, key_image), float('-inf'))
    return (torch.softmax(scores, -1) @ v.float().repeat_interleave(group, 1)).transpose(1, 2)


RULE_FORMS = ('min', 'mul', 'hide')


class _Graph:
    """One built cuDNN SDPA graph for one set of shapes and strides, its workspace and the
    graph-tensor handles its execute() binds.

    cuDNN's score modifiers take a narrow set of graphs on Hopper (cuDNN 9.19, measured:
    docs/decisions/llm-masked-attention.md): an operation between two tensors not derived from
    the scores, a LOGICAL_OR, a LOGICAL_NOT or three per-token tensors found no engine, and
    two selects in a row ran a generic engine at 2.5x the additive mask's time. So the rule
    is one integer expression of the tile's indices and the two per-token tensors, compared
    once, in the first of RULE_FORMS this cuDNN builds (`form`):
    'min':  min(key - query - 1, key + query_offset - key_image) < 0;
    'mul':  key - query - 2^20 * [key + query_offset < key_image] <= 0;
    'hide': the score where not (key > query and key + query_offset >= key_image)."""

    def __init__(self, cudnn, handle, q, k, v, query_offset, key_image, out, scale,
                 form: str):
        d = cudnn.data_type
        io = d.BFLOAT16 if q.dtype == torch.bfloat16 else d.HALF
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=d.FLOAT,
                          compute_data_type=d.FLOAT, handle=handle)
        self.form = form
        self.q, self.k, self.v = g.tensor_like(q), g.tensor_like(k), g.tensor_like(v)
        self.query_offset, self.key_image = g.tensor_like(query_offset), g.tensor_like(key_image)
        self.scalars = {}

        def scalar(name, value, dtype, torch_dtype):
            t = g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                         is_pass_by_value=True, data_type=dtype)
            self.scalars[t] = torch.full((1, 1, 1, 1), value, dtype=torch_dtype)
            return t

        def typed(t, dtype=d.INT32):
            t.set_data_type(dtype)
            return t

        def rule(sg, scores):
            def index(axis):
                return typed(sg.gen_index(input=scores, axis=axis, compute_data_type=d.INT32))

            def op(fn, a, b, dtype=d.INT32):
                return typed(fn(a=a, b=b, compute_data_type=dtype), dtype)

            def cmp(fn, a, b, dtype=d.BOOLEAN):
                return typed(fn(input=a, comparison=b, compute_data_type=dtype), dtype)

            neg = scalar('neg', NEG, d.FLOAT, torch.float32)
            after = op(sg.sub, index(3), index(2))                     # key - query
            image = op(sg.sub, op(sg.add, index(3), self.query_offset), self.key_image)
            if form == 'min':      # image < 0: both image tokens
                low = typed(sg.min(input0=op(sg.sub, after, scalar('one', 1, d.INT32,
                                                                    torch.int32)),
                                   input1=image, compute_data_type=d.INT32))
                keep = cmp(sg.cmp_lt, low, scalar('zero', 0, d.INT32, torch.int32))
                return sg.binary_select(input0=scores, input1=neg, mask=keep)
            zero = scalar('zero', 0, d.INT32, torch.int32)
            if form == 'mul':
                both = cmp(sg.cmp_lt, image, zero, d.INT32)
                lifted = op(sg.sub, after, op(sg.mul, both, scalar('big', OFFSET, d.INT32,
                                                                    torch.int32)))
                keep = cmp(sg.cmp_le, lifted, zero)
                return sg.binary_select(input0=scores, input1=neg, mask=keep)
            hide = typed(sg.logical_and(a=cmp(sg.cmp_gt, after, zero),
                                        b=cmp(sg.cmp_ge, image, zero),
                                        compute_data_type=d.BOOLEAN), d.BOOLEAN)
            return sg.binary_select(input0=neg, input1=scores, mask=hide)

        o, _ = g.sdpa(name='llm_attention', q=self.q, k=self.k, v=self.v, generate_stats=False,
                      attn_scale=scale, score_mod=rule)
        o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride()))
        self.o = o
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
        self.graph = g
        self.workspace = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8,
                                     device=q.device)

    @classmethod
    def first_that_builds(cls, cudnn, handle, *tensors, scale) -> _Graph:
        """The graph in the first of RULE_FORMS this cuDNN builds; raises the last form's
        error where none does."""
        for form in RULE_FORMS:
            try:
                return cls(cudnn, handle, *tensors, scale, form)
            except cudnn.cudnnGraphNotSupportedError as error:
                failure = error
        raise failure

    def execute(self, cudnn, handle, q, k, v, query_offset, key_image, out) -> None:
        pack = {self.q: q, self.k: k, self.v: v, self.query_offset: query_offset,
                self.key_image: key_image, self.o: out}
        pack.update(self.scalars)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
        self.graph.execute(pack, self.workspace, handle=handle)


_GRAPHS: dict[tuple, _Graph] = {}
_HANDLES: dict[int, object] = {}


def served_forms() -> list[str]:
    """The RULE_FORMS of the graphs built so far in this process (for the engine's mode)."""
    return sorted({graph.form for graph in _GRAPHS.values()})


def _key(*tensors, scale) -> tuple:
    return (scale,) + tuple((t.dtype, tuple(t.shape), t.stride(), t.device.index)
                            for t in tensors)


@torch.library.custom_op('molmobot::score_mod_attention', mutates_args=())
def score_mod_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        query_offset: torch.Tensor, key_image: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Attention of q (B, Hq, L, D) over k, v (B, Hkv, L, D) (Hq a multiple of Hkv) under
    `RuleMask`'s rule -> (B, L, Hq, D) contiguous, q's dtype. CUDA: one cuDNN graph (built on
    the first call per shape); elsewhere the float32 `reference`.

    Raises:
        RuntimeError: the cuDNN frontend does not load (CUDA).
        cudnn.cudnnGraphNotSupportedError: cuDNN builds none of RULE_FORMS for the shapes.
    """
    b, hq, length, _ = q.shape
    out = torch.empty(b, length, hq, v.shape[-1], dtype=q.dtype, device=q.device)
    if not q.is_cuda:
        return out.copy_(reference(q, k, v, query_offset, key_image, scale))
    cudnn = _frontend()
    if isinstance(cudnn, str):
        raise RuntimeError(cudnn)
    view = out.transpose(1, 2)     # (B, Hq, L, D) with the output's (B, L, Hq, D) strides
    key = _key(q, k, v, query_offset, key_image, view, scale=scale)
    with _LOCK:
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        handle = _HANDLES.get(index)
        if handle is None:
            with torch.cuda.device(index):
                handle = _HANDLES[index] = cudnn.create_handle()
        graph = _GRAPHS.get(key)
        if graph is None:
            graph = _GRAPHS[key] = _Graph.first_that_builds(
                cudnn, handle, q, k, v, query_offset, key_image, view, scale=scale)
    graph.execute(cudnn, handle, q, k, v, query_offset, key_image, view)
    return out


@score_mod_attention.register_fake
def _(q, k, v, query_offset, key_image, scale):
    b, hq, length, _ = q.shape
    return q.new_empty(b, length, hq, v.shape[-1])


def self_check(cfg, device: torch.device, dtype: torch.dtype, seed: int = 0) -> str:
    """'' when `score_mod_attention` matches float32 attention under the boolean mask on a
    small prompt-shaped input (the model's head counts, image runs, labels, text and right
    padding; its valid queries) as closely as the masked SDPA does, else what went wrong (an exception, e.g. cuDNN
    refusing the graph, or the error). Run once before serving."""
    llm, tokens = cfg.llm, cfg.tokens
    ids = [tokens.bos]
    for run in range(min(3, cfg.max_images)):
        ids += [tokens.bos + 1 + run, tokens.bos + 2]
        ids += [tokens.im_start] + [tokens.im_patch] * (37 + 11 * run) + [tokens.im_end]
    ids += [tokens.chat_im_start] * 21
    length = -(-len(ids) // 64) * 64 + 64
    valid = torch.zeros(1, length, dtype=torch.bool, device=device)
    valid[:, :len(ids)] = True
    input_ids = torch.tensor([ids + [tokens.bos] * (length - len(ids))], device=device)
    image_ids = torch.tensor(tokens.image_special_ids, device=device)
    is_image = (input_ids.unsqueeze(-1) == image_ids).any(-1)
    allowed = (torch.ones(length, length, dtype=torch.bool, device=device).tril()[None]
               | (is_image[:, :, None] & is_image[:, None, :])) & valid[:, None, :]
    gen = torch.Generator(device=device).manual_seed(seed)
    hq, hk, hd = llm.n_heads, llm.n_kv_heads, llm.head_dim
    q, k, v = (torch.randn(1, length, h, hd, device=device, generator=gen).mul(2)
               .to(dtype).transpose(1, 2) for h in (hq, hk, hk))
    group = hq // hk
    scores = q.float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(~allowed[:, None], float('-inf'))
    ref = (torch.softmax(scores, -1) @ v.float().repeat_interleave(group, 1)).transpose(1, 2)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)[:, None]
    bias = bias.masked_fill(~allowed[:, None], torch.finfo(dtype).min)
    try:
        got = RuleMask.build(input_ids, image_ids)(q, k, v).float()
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                enable_gqa=True).transpose(1, 2).float()
    except Exception as error:    # noqa: BLE001 - any kernel failure is the answer
        return f'{type(error).__name__}: {error}'.splitlines()[0][:300]
    n = len(ids)      # the valid queries (module docstring: padded ones are never read)
    got, masked, ref = got[:, :n], masked[:, :n], ref[:, :n]
    err = float((got - ref).abs().max() / ref.abs().max())
    served = float((masked - ref).abs().max() / ref.abs().max())
    if not err <= max(2 * served, 1e-2):
        return f'error {err:.2e} against float32 (the masked SDPA: {served:.2e})'
    return ''
