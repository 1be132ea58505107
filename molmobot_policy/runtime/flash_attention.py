"""The LLM's masked attention through FlashAttention-4's Hopper kernel with its tiles classified
(`EngineConfig.llm_attention`; docs/decisions/llm-masked-attention.md).

The served mask (`MolmoBot.attention_allowed`: key j visible to query i iff j <= i, or both are
image special tokens; padded keys never) is ~95 % dense. Given to SDPA as an additive (L, L)
bias, cuDNN reads a bias tile for every score tile and runs a slower engine: the mask costs
about as much again as the unmasked attention. FlashAttention-4 (`flash_attn.cute`, the CuTe
DSL kernels of Dao-AILab/flash-attention, package `flash-attn-4`) has a Hopper forward kernel
(TMA loads, warpgroup MMA, producer / consumer warpgroups) that takes the mask as a rule,
`mask_mod`, evaluated per score in registers, and a *block sparsity* description that says,
for each 128-row block of queries, which 128-key blocks are full (every pair visible: the
kernel does no mask work there), which are partial (the rule per score) and, by omission,
which are empty (skipped). This module gives it both:

- per-token kinds, int32 (B, L): `KIND_IMAGE` for an image special token, `KIND_TEXT` for any
  other real token, `KIND_PAD` for padding (`token_kinds`). The mask (`visible`) is:
  kind[j] != PAD and (j <= i or kind[i] == kind[j] == IMAGE);
- the tile classes (`tile_classes`), computed from the kinds on the device with a few small
  torch operations once per query (inside the engine's CUDA graph; no host sync). In the
  8-camera layout nearly every tile is full: the image tokens are ~95 % of the prompt;
- for the partial tiles, the rule the kernel evaluates per score (`image_tokens_mask`), on
  per-token *limits* (`key_limits`): -1 for an image token, its own index for any other.
  Key j is visible to query i iff (limit[j] if limit[i] < 0 else j) <= i. On every real query
  row this is the mask (a padded key's limit is its index, beyond every real query; an image
  query sees image keys whatever their index, and other keys causally); padded query rows
  differ (they see earlier keys; nothing reads them). It costs one select and one compare per
  score where the mask's own form costs two kind compares and the padding check
  (docs/decisions/llm-masked-attention.md has the timings). It needs the padding after every
  real token (right padding), which is how the engine pads (`PromptFitter.pad`): a padded key
  before a real text query would be visible to it.

The attention is one custom op (`molmobot::image_tokens_attention`): Inductor treats it as
one opaque kernel call inside the compiled LLM blocks and CUDA graphs capture it. Its kernels
are compiled by the CuTe DSL on first use for each shape (a few seconds, during the engine's
warm-up) and kept for the process. `unavailable_reason` and `self_check` decide, once per
engine, whether this path serves.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

KIND_PAD, KIND_TEXT, KIND_IMAGE = 0, 1, 2
TILE_M = TILE_N = 128        # the Hopper kernel's tile at head_dim 128 (FA4's sm90 config)
INSTALL_HINT = 'pip install -r requirements/gpu.txt (flash-attn-4)'


@functools.lru_cache(maxsize=1)
def _flash():
    """(flash_attn_func, BlockSparseTensorsTorch), or why they do not load (str)."""
    try:
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    except Exception as error:     # noqa: BLE001 - any failure to load is a reason to fall back
        return f'FlashAttention-4 (flash_attn.cute) does not load: {error}; {INSTALL_HINT}'
    return flash_attn_func, BlockSparseTensorsTorch


def unavailable_reason(cfg, device: torch.device, dtype: torch.dtype) -> str:
    """'' when this attention can serve the model, else why not (one line, for a log).

    cfg: `MolmoBotConfig`; device, dtype: the serving device and the parameters' dtype."""
    if device.type != 'cuda':
        return f'needs a CUDA device, serving on {device}'
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return (f'needs a Hopper or data-centre Blackwell GPU (compute capability 9.x / '
                f'10.x: H100, H200, B200), '
                f'got {major}.{minor}')
    if dtype not in (torch.bfloat16, torch.float16):
        return f'needs bfloat16 or float16 parameters, got {dtype}'
    head_dim = cfg.llm.head_dim
    if head_dim % 8 or not 8 <= head_dim <= 256:
        return f'needs a head_dim in 8..256 divisible by 8, got {head_dim}'
    loaded = _flash()
    return loaded if isinstance(loaded, str) else ''


def token_kinds(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                image_ids: torch.Tensor | None) -> torch.Tensor:
    """int32 (B, L): KIND_IMAGE / KIND_TEXT / KIND_PAD per token.

    input_ids int64 (B, L); attention_mask bool (B, L), False = padding (None: no padding);
    image_ids int64 (n,): the ids that attend bi-directionally (None: causal only)."""
    kinds = torch.full(input_ids.shape, KIND_TEXT, dtype=torch.int32, device=input_ids.device)
    if image_ids is not None:
        is_image = (input_ids.unsqueeze(-1) == image_ids).any(-1)
        kinds = torch.where(is_image, KIND_IMAGE, kinds)
    if attention_mask is not None:
        kinds = torch.where(attention_mask, kinds, KIND_PAD)
    return kinds.to(torch.int32)


def key_limits(kinds: torch.Tensor) -> torch.Tensor:
    """int32 (B, L): -1 for an image token, the token's index otherwise (text or padding):
    the per-token tensor the kernel's rule reads (module docstring), from kinds int32 (B, L)
    of right-padded prompts."""
    index = torch.arange(kinds.shape[1], dtype=torch.int32, device=kinds.device)
    return torch.where(kinds == KIND_IMAGE, -1, index).to(torch.int32).contiguous()


def rule(limits: torch.Tensor) -> torch.Tensor:
    """bool (B, L, L) [query, key]: the kernel's per-score rule (`image_tokens_mask`) on
    limits int32 (B, L) (`key_limits`); equals `visible` on the real query rows."""
    index = torch.arange(limits.shape[1], device=limits.device)
    image_query = (limits < 0)[:, :, None]
    bound = torch.where(image_query, limits[:, None, :], index[None, None, :])
    return bound <= index[None, :, None]


def visible(kinds: torch.Tensor) -> torch.Tensor:
    """bool (B, L, L) [query, key]: the mask (`MolmoBot.attention_allowed`'s) for kinds int32
    (B, L); the kernel's `rule` equals it on the real query rows."""
    index = torch.arange(kinds.shape[1], device=kinds.device)
    causal = index[None, None, :] <= index[None, :, None]
    image = kinds == KIND_IMAGE
    return (kinds[:, None, :] != KIND_PAD) & (causal | (image[:, :, None] & image[:, None, :]))


@dataclass
class TileClasses:
    """Which key tiles each query tile visits (FA4's block-sparsity layout, heads broadcast).

    partial_count int32 (B, 1, nm): partial tiles per query tile (the rule per score);
    partial_index int32 (B, 1, nm, nn): their key-tile indices, ascending, first
    partial_count valid; full_count / full_index: the same for full tiles (no mask work).
    Key tiles in neither list are skipped. nm = ceil(L / TILE_M), nn = ceil(L / TILE_N)."""

    partial_count: torch.Tensor
    partial_index: torch.Tensor
    full_count: torch.Tensor
    full_index: torch.Tensor


def tile_classes(kinds: torch.Tensor, tile: int = TILE_M) -> TileClasses:
    """Classify the (tile x tile) tiles of the rule for kinds int32 (B, L), from per-tile
    summaries of the kinds (O(L) work and a few small kernels; no (L, L) mask is built).

    A tile of query rows R and keys C is full iff every key in C is real (not padding, not
    beyond L), every key is at most the first non-image row of R, and every non-image key is
    at most the first image row of R (image rows see every image key); it is visited at all
    iff some real key is at most the last row of R, or R and C both hold image tokens. Keys
    beyond L count as hidden, so a tile that holds the end of the sequence is never full: the
    kernel masks the sequence end only in the partial tile it visits first (the highest-index
    one), which is that tile. Rows beyond L do not exist (nothing is written there): they
    count as seeing every key before L, so they never make a tile partial."""
    b, length = kinds.shape
    count = -(-length // tile)
    big = 1 << 30
    padded = torch.full((b, count * tile), -1, dtype=torch.int32, device=kinds.device)
    padded[:, :length] = kinds
    padded = padded.view(b, count, tile)
    index = torch.arange(count * tile, device=kinds.device, dtype=torch.int32).view(count, tile)
    real, image = padded >= 0, padded == KIND_IMAGE
    valid, text = padded > KIND_PAD, padded == KIND_TEXT

    def first(where: torch.Tensor) -> torch.Tensor:
        return torch.where(where, index, big).amin(-1)

    def last(where: torch.Tensor) -> torch.Tensor:
        return torch.where(where, index, -1).amax(-1)

    # per query tile (B, count, 1) and per key tile (B, 1, count)
    first_text_row = first(real & ~image)[:, :, None]
    first_image_row = first(image)[:, :, None]
    last_row = last(real)[:, :, None]
    image_rows = image.any(-1)[:, :, None]
    rows_beyond = (~real).any(-1)[:, :, None]
    all_valid = valid.all(-1)[:, None, :]
    last_key = last(real)[:, None, :]
    last_text_key = last(text)[:, None, :]
    first_key = first(valid)[:, None, :]
    image_keys = image.any(-1)[:, None, :]
    real_keys = real.any(-1)[:, None, :]
    full = all_valid & (last_key <= first_text_row) & (last_text_key <= first_image_row)
    visited = ((first_key <= last_row) | (image_rows & image_keys)
               | (rows_beyond & real_keys))
    partial = visited & ~full

    def listed(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # selected key tiles first, ascending; the entries past the count are never read
        slot = torch.where(selected, selected.cumsum(-1) - 1, count)
        column = torch.arange(count, device=kinds.device, dtype=torch.int32).expand_as(slot)
        lists = torch.zeros(b, count, count + 1, dtype=torch.int32, device=kinds.device)
        lists.scatter_(2, slot, column)
        return (selected.sum(-1, dtype=torch.int32).unsqueeze(1).contiguous(),
                lists[:, None, :, :count].contiguous())

    partial_count, partial_index = listed(partial)
    full_count, full_index = listed(full)
    return TileClasses(partial_count, partial_index, full_count, full_index)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kinds: torch.Tensor,
              scale: float) -> torch.Tensor:
    """float32 attention (B, L, Hq, D) under the rule, q (B, L, Hq, D), k / v (B, L, Hkv, D)
    (query head h reads KV head h // (Hq / Hkv)): what `self_check` and the tests compare with."""
    return _masked_attention(q, k, v, visible(kinds), scale)


@functools.lru_cache(maxsize=1)
def image_tokens_mask():
    """The rule (`rule`) as a CuTe DSL `mask_mod` (FA4's signature: batch, head, query index,
    key index, sequence info, aux tensors -> visible), aux_tensors[0] = limits int32 (B, L)
    (`key_limits`)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        limits = aux_tensors[0]
        query = utils.scalar_to_ssa(limits[batch[0], q_idx[0]], cutlass.Int32)
        key = utils.scalar_to_ssa(limits[batch[0], kv_idx[0]], cutlass.Int32)
        zero = utils.scalar_to_ssa(0, cutlass.Int32)
        return cute.where(query < zero, key, kv_idx) <= q_idx

    return mask_mod


@torch.library.custom_op('molmobot::image_tokens_attention', mutates_args=())
def image_tokens_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           limits: torch.Tensor, partial_count: torch.Tensor,
                           partial_index: torch.Tensor, full_count: torch.Tensor,
                           full_index: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention under the rule: q (B, L, Hq, D), k / v (B, L, Hkv, D) in bf16 / fp16 on a
    Hopper / Blackwell GPU -> (B, L, Hq, D) contiguous, q's dtype; within bf16 rounding of the
    mask on the real query rows. limits int32 (B, L) as `key_limits` gives them, the tile
    classes as `tile_classes` (both of the same kinds); scale: the softmax scale
    (1 / sqrt(D))."""
    flash_attn_func, sparse_tensors = _flash()
    tiles = sparse_tensors(mask_block_cnt=partial_count, mask_block_idx=partial_index,
                           full_block_cnt=full_count, full_block_idx=full_index,
                           block_size=(TILE_M, TILE_N))
    out = flash_attn_func(q, k, v, softmax_scale=scale, mask_mod=image_tokens_mask(),
                          aux_tensors=[limits], block_sparse_tensors=tiles)
    return out[0] if isinstance(out, tuple) else out


@image_tokens_attention.register_fake
def _(q, k, v, limits, partial_count, partial_index, full_count, full_index, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@image_tokens_attention.register_kernel('cpu')
def _(q, k, v, limits, partial_count, partial_index, full_count, full_index, scale):
    # The kernel's schedule in float32 (CPU CI, the golden tests): each query tile attends to
    # its listed full tiles with no mask and its listed partial tiles under the rule, nothing
    # else; a wrong tile class or a wrong rule shows as a wrong result.
    tiles = TileClasses(partial_count, partial_index, full_count, full_index)
    allowed = visited(limits, tiles)
    return _masked_attention(q, k, v, allowed, scale).to(q.dtype).contiguous()


def visited(limits: torch.Tensor, tiles: TileClasses) -> torch.Tensor:
    """bool (B, L, L) [query, key]: the scores the kernel keeps, as `tiles` direct it (full
    tiles whole, partial tiles under `rule`, others not at all), limits int32 (B, L)
    (`key_limits`); equals `visible` on the real query rows for the classes `tile_classes`
    gives."""
    b, length = limits.shape
    nm, nn = tiles.partial_index.shape[-2:]
    classes = torch.zeros(b, nm, nn + 1, dtype=torch.int8, device=limits.device)
    column = torch.arange(nn, device=limits.device)
    for value, count, index in ((1, tiles.partial_count, tiles.partial_index),
                                (2, tiles.full_count, tiles.full_index)):
        listed = column < count[:, 0, :, None]                 # (B, nm, nn)
        # unlisted entries write into the spare column nn
        target = torch.where(listed, index[:, 0].long(), nn)
        classes.scatter_(2, target, torch.full_like(target, value, dtype=torch.int8))
    classes = classes[:, :, :nn]
    grid = classes.repeat_interleave(TILE_M, 1).repeat_interleave(TILE_N, 2)[:, :length, :length]
    return (grid == 2) | ((grid == 1) & rule(limits))


def _masked_attention(q, k, v, allowed, scale):
    """float32 (B, L, Hq, D) attention of q (B, L, Hq, D) over k / v (B, L, Hkv, D) where
    allowed (B, L, L) says so (query head h reads KV head h // (Hq / Hkv))."""
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], float('-inf'))
    return (torch.softmax(scores, -1) @ vf).transpose(1, 2)


@dataclass
class ImageTokensMask:
    """The served LLM mask (module docstring), called as mask(q (B, Hq, L, D), k, v
    (B, Hkv, L, D)) -> (B, L, Hq, D) in q's dtype (`OLMoSequentialBlock.attention`).

    limits: int32 (B, L) (`key_limits`); tiles: the `TileClasses` of the same kinds."""

    limits: torch.Tensor
    tiles: TileClasses

    @staticmethod
    def build(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              image_ids: torch.Tensor | None) -> ImageTokensMask:
        """Once per query, outside the LLM blocks (arguments as `token_kinds`; the padding
        after every real token, as `PromptFitter.pad` gives it)."""
        kinds = token_kinds(input_ids, attention_mask, image_ids)
        return ImageTokensMask(key_limits(kinds), tile_classes(kinds))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = self.tiles
        # (B, H, L, D) -> (B, L, H, D): inside a compiled block the rotary embedding's kernel
        # writes this layout directly
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        return image_tokens_attention(q, k, v, self.limits, t.partial_count, t.partial_index,
                                      t.full_count, t.full_index, 1.0 / math.sqrt(q.shape[-1]))


def self_check(cfg, device: torch.device, dtype: torch.dtype, tolerance: float = 2e-2) -> str:
    """'' when the kernel matches float32 attention under the rule on a random prompt of the
    model's heads (two image runs, text between, padding), else why not. Compiles the kernel
    for that shape (a few seconds on first use). tolerance: on ||out - ref|| / ||ref|| over the
    real rows (bf16 lands near 3e-3)."""
    llm = cfg.llm
    length, heads, kv_heads, head_dim = 448, llm.n_heads, llm.n_kv_heads, llm.head_dim
    kinds = torch.full((1, length), KIND_TEXT, dtype=torch.int32)
    kinds[0, 5:150] = KIND_IMAGE
    kinds[0, 160:330] = KIND_IMAGE
    kinds[0, 420:] = KIND_PAD
    kinds = kinds.to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, length, h, head_dim, device=device, dtype=dtype,
                           generator=generator) for h in (heads, kv_heads, kv_heads))
    scale = 1.0 / math.sqrt(head_dim)
    try:
        t = tile_classes(kinds)
        out = image_tokens_attention(q, k, v, key_limits(kinds), t.partial_count, t.partial_index,
                                     t.full_count, t.full_index, scale)
        torch.cuda.synchronize(device)
    except Exception as error:     # noqa: BLE001 - a failed kernel is a reason to fall back
        return f'the kernel failed its self-check: {type(error).__name__}: {error}'
    real = kinds[0] != KIND_PAD
    ref = reference(q, k, v, kinds, scale)[0][real]
    got = out.float()[0][real]
    if not torch.isfinite(got).all():
        return 'the kernel failed its self-check: non-finite output'
    error = float((got - ref).norm() / ref.norm())
    if error > tolerance:
        return f'the kernel failed its self-check: relative error {error:.2e} > {tolerance:.0e}'
    return ''
