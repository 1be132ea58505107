"""The LLM's masked attention as one unmasked cuDNN call plus a small Triton kernel.

The served mask (`MolmoBot.attention_allowed`: causal, or query and key both image tokens;
padded keys hidden) is ~95 % dense, but an additive (L, L) mask makes cuDNN read a bias tile
for every score tile, which costs as much again as the attention itself
(docs/decisions/llm-masked-attention.md). Here the mask is split by query rows:

Image rows. An image token sees every image key and the non-image keys before its own image:
for a token of image run g (a run: a maximal span of image tokens; runs counted 1, 2, ... in
sequence order), the non-image key t is visible iff fewer than g runs start before t. That is
a rule over run indices, which a few extra head dimensions encode exactly: the query gets
`one_hot(g)` (E dims), the key `-BIG` in dim g' where it is hidden from run g' (a non-image
key with >= g' runs before it, or a padded key), 0 elsewhere. q_aug . k_aug is then q . k for
every visible pair (the extra product is exactly 0) and q . k - BIG for a hidden one, whose
weight exp(-BIG * scale) underflows to exactly 0 in float32: so one unmasked call over
[q | extra] x [k | extra] (head dim 128 + E for the scores, 128 for the values, the scale of
the 128 real dims) gives the image rows' exact masked result at the unmasked kernel's speed.

Other rows (BOS, the `Image k` labels, the chat text, padding; ~80 of 1664) got every key in
that call (their extra dims are 0). `text_rows_attention` recomputes them in place: a Triton
kernel over (KV head, block of folded (query head, row) pairs) that walks the keys up to the
block's last row with the mask "key <= row, key not padded" computed in registers.

`ImageRunMask.build` makes the per-query tensors once (outside the LLM blocks); each block
calls the mask with its q, k, v (`OLMoSequentialBlock.attention`). The attention itself is
one custom op (`molmobot::image_run_attention`): Inductor treats it as one opaque kernel
call, and its output is (B, L, Hq, D) contiguous, which the block's output projection reads
without a copy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:   # triton ships with CUDA builds of torch; CPU builds run the torch path
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - exercised on CPU-only installs
    triton = None
    tl = None

HIDDEN = 2.0 ** 15     # the extra dims' -BIG: exp(-BIG / sqrt(128)) is exactly 0 in float32
BLOCK_ROWS = 64        # folded (query head, row) pairs per Triton program
BLOCK_KEYS = 64        # keys per step of its loop
WARPS = 4              # warps per program
KEY_SPLITS = 1         # programs per row block over the keys (> 1: partials, then a merge)
MIN_EXTRA = 8          # fewest extra score dims (more, e.g. 64 for a 192-wide score head,
                       # only if cuDNN runs that shape faster: benchmark_llm_attention.py)


def extra_dims(max_runs: int) -> int:
    """Extra score dimensions for up to `max_runs` image runs: a multiple of 8 (cuDNN's head
    dimension granularity), at least MIN_EXTRA."""
    return max(MIN_EXTRA, -(-int(max_runs) // 8) * 8)


def unavailable_reason(cfg, device: torch.device, dtype: torch.dtype) -> str:
    """'' when the image-run attention can serve this model, else why not (for a log line).

    cfg: `MolmoBotConfig`; device, dtype: serving device and parameter dtype."""
    if not cfg.bi_directional_attn:
        return 'the model attends causally (bi_directional_attn false): no image block'
    if device.type != 'cuda':
        return f'needs a CUDA device (cuDNN attention), serving on {device}'
    if triton is None:
        return 'triton is not installed'
    if dtype not in (torch.bfloat16, torch.float16):
        return f'needs bfloat16 or float16 parameters, got {dtype}'
    hd = cfg.llm.head_dim
    if hd & (hd - 1) or not 16 <= hd <= 128:
        return f'needs a power-of-two head_dim in 16..128 (the text-row kernel), got {hd}'
    return ''


def masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     allowed: torch.Tensor) -> torch.Tensor:
    """float32 attention (B, L, Hq, D) of q (B, Hq, L, D) over k, v (B, Hkv, L, D) (query
    head h reads KV head h // (Hq / Hkv)) under the boolean mask `allowed` (B, 1, L, L), scale
    1 / sqrt(D): what `self_check` and benchmarks/benchmark_llm_attention.py compare with."""
    group = q.shape[1] // k.shape[1]
    scores = q.float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2)
    scores = scores / math.sqrt(q.shape[-1]) + torch.where(allowed, 0.0, float('-inf'))
    return (torch.softmax(scores, -1) @ v.float().repeat_interleave(group, 1)).transpose(1, 2)


def self_check(cfg, device: torch.device, dtype: torch.dtype, seed: int = 0) -> str:
    """'' when `image_run_attention` matches float32 attention under the boolean mask on a
    small prompt-shaped input (the model's head counts, a few image runs, labels, text and
    padding) as closely as the masked SDPA does, else what went wrong (an exception from the
    kernels, e.g. cuDNN refusing the shapes, or the error). Run once before serving."""
    from molmobot_policy.model.molmobot import attention_allowed
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
    allowed = attention_allowed(input_ids, image_ids, valid)
    gen = torch.Generator(device=device).manual_seed(seed)
    hq, hk, hd = llm.n_heads, llm.n_kv_heads, llm.head_dim
    q, k, v = (torch.randn(1, length, h, hd, device=device, generator=gen).mul(2)
               .to(dtype).transpose(1, 2) for h in (hq, hk, hk))
    ref = masked_reference(q, k, v, allowed)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    bias = bias.masked_fill(~allowed, torch.finfo(dtype).min)
    try:
        mask = ImageRunMask.build(input_ids, valid, image_ids, ids.count(tokens.im_patch),
                                  extra_dims(cfg.max_images), dtype)
        got = mask(q, k, v).float()
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    except Exception as error:    # noqa: BLE001 - any kernel failure is the answer
        return f'{type(error).__name__}: {error}'.split('\n')[0][:300]
    scale = ref.abs().max()
    err = float((got - ref).abs().max() / scale)
    masked_err = float((masked.transpose(1, 2).float() - ref).abs().max() / scale)
    if not err <= 2 * masked_err + 1e-3:
        return (f'self-check: max error {err:.2e} of the largest output against float32 '
                f'(the masked SDPA: {masked_err:.2e})')
    return ''


@dataclass
class ImageRunMask:
    """The served mask of one query in the form `image_run_attention` takes.

    q_extra: (B, L, 1, E) one-hot image run of each query row (zeros for non-image rows);
    k_extra: (B, L, 1, E) 0 / -HIDDEN per key and run; both in the attention dtype.
    rows: int64 (B, R) the non-image row positions in order, then filler (image rows: not
    written); n_rows: int32 (B,) how many of `rows` are non-image; key_valid: int8 (B, L),
    1 = a real key. R = L - (number of `<im_patch>` tokens): an upper bound on the non-image
    rows that is known from the shapes alone.
    """

    q_extra: torch.Tensor
    k_extra: torch.Tensor
    rows: torch.Tensor
    n_rows: torch.Tensor
    key_valid: torch.Tensor

    @staticmethod
    def build(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              image_ids: torch.Tensor, n_patch_tokens: int, extra: int,
              dtype: torch.dtype) -> ImageRunMask:
        """The mask for `input_ids` int64 (B, L), `attention_mask` bool (B, L) or None (no
        padding), `image_ids` int64 (n,) (the image special token ids), `n_patch_tokens` the
        number of `<im_patch>` tokens per row, `extra` = E (`extra_dims`). Shapes depend on
        (B, L, n_patch_tokens, E) only, no host sync: safe under compile and CUDA graphs.
        A row with more than E image runs is not representable: the caller guarantees at most E
        (one run per image, `max_images` <= E)."""
        b, length = input_ids.shape
        is_image = (input_ids.unsqueeze(-1) == image_ids).any(-1)
        valid = (torch.ones_like(is_image) if attention_mask is None else attention_mask)
        starts = is_image.clone()
        starts[:, 1:] &= ~is_image[:, :-1]
        runs = starts.long().cumsum(1)          # image token: its run (1..); other: runs before
        slot = torch.arange(1, extra + 1, device=input_ids.device)
        q_extra = (is_image.unsqueeze(-1) & (runs.unsqueeze(-1) == slot)).to(dtype)
        hidden = ~valid.unsqueeze(-1) | (~is_image.unsqueeze(-1) & (runs.unsqueeze(-1) >= slot))
        k_extra = hidden.to(dtype) * -HIDDEN
        order = torch.argsort(is_image.to(torch.uint8), dim=1, stable=True)
        n_rows_bound = length - n_patch_tokens
        return ImageRunMask(q_extra=q_extra.unsqueeze(2), k_extra=k_extra.unsqueeze(2),
                            rows=order[:, :n_rows_bound].contiguous(),
                            n_rows=(~is_image).sum(1).to(torch.int32),
                            key_valid=valid.to(torch.int8))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, Hq, L, D), k / v (B, Hkv, L, D) (RoPE applied) -> (B, L, Hq, D) attention
        output under the served mask, contiguous."""
        b, hq, length, d = q.shape
        hk, e = k.shape[1], self.q_extra.shape[-1]
        # [q | extra] laid out (B, L, H, D + E): cuDNN's output takes that layout, (B, L, H, D)
        q_aug = torch.cat([q.transpose(1, 2), self.q_extra.expand(b, length, hq, e)], -1)
        k_aug = torch.cat([k.transpose(1, 2), self.k_extra.expand(b, length, hk, e)], -1)
        return torch.ops.molmobot.image_run_attention(
            q_aug.transpose(1, 2), k_aug.transpose(1, 2), v, self.rows, self.n_rows,
            self.key_valid, 1.0 / math.sqrt(d))


def text_rows_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                        n_rows: torch.Tensor, key_valid: torch.Tensor, scale: float
                        ) -> torch.Tensor:
    """What `text_rows_attention` writes, in float32 torch (CPU tests, and the CPU path):
    (B, R, Hq, D) attention of the rows `rows[:, :n_rows]` (the others zero) over the keys
    at or before each row that are valid. q (B, Hq, L, >= D), k (B, Hkv, L, >= D), v (B, Hkv,
    L, D); only the first D = v.shape[-1] dims of q / k are read."""
    b, hq, length, _ = q.shape
    d = v.shape[-1]
    group = hq // k.shape[1]
    out = torch.zeros(b, rows.shape[1], hq, d, dtype=torch.float32, device=q.device)
    keys = torch.arange(length, device=q.device)
    for i in range(b):
        pos = rows[i]
        qi = q[i, :, pos, :d].float()                                    # (Hq, R, D)
        ki = k[i, :, :, :d].float().repeat_interleave(group, 0)          # (Hq, L, D)
        vi = v[i].float().repeat_interleave(group, 0)
        scores = qi @ ki.transpose(1, 2) * scale                         # (Hq, R, L)
        visible = (keys[None, :] <= pos[:, None]) & key_valid[i].bool()[None, :]
        scores = scores.masked_fill(~visible, float('-inf'))
        o = torch.softmax(scores, -1) @ vi                               # (Hq, R, D)
        live = (torch.arange(rows.shape[1], device=q.device) < n_rows[i])[None, :, None]
        out[i] = (o * live).transpose(0, 1)
    return out


if triton is not None:

    @triton.jit
    def _row_block(pid, rows_ptr, n_rows_ptr, R, HK, G: tl.constexpr, BM: tl.constexpr):
        """Program (pid, program_id(1))'s rows: batch b, KV head kvh, the BM folded pairs f =
        g * R + r, which are live (a query head of the group, r < n_rows), their positions
        rows[b, r] and query heads kvh * G + g."""
        b = pid // HK
        kvh = pid % HK
        f = tl.program_id(1) * BM + tl.arange(0, BM)
        g = f // R
        r = f % R
        live = (g < G) & (r < tl.load(n_rows_ptr + b))
        pos = tl.load(rows_ptr + b * R + r, mask=live, other=0)
        return b, kvh, f, live, pos, kvh * G + g

    @triton.jit
    def _text_rows_kernel(q_ptr, k_ptr, v_ptr, o_ptr, ws_ptr, rows_ptr, n_rows_ptr,
                          valid_ptr, scale_log2, sqb, sqh, sql, skb, skh, skl, svb, svh, svl,
                          sob, soh, sol, L, R, HK, CHUNK,
                          G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                          BN: tl.constexpr, SPLIT: tl.constexpr):
        """One program: KV head `kvh` of batch `b`, BM folded pairs f = g * R + r (query head
        kvh * G + g, row r of `rows`), keys [split * CHUNK, (split + 1) * CHUNK) up to the
        block's last row. Online softmax, mask "key <= row and key valid" in registers.
        SPLIT == 1: writes o[b, h, rows[r], :]; else the partial (row max, sum, unnormalized
        output: base-2 exponents) to ws[b * HK + kvh, split, f] for `_combine_kernel`."""
        pid = tl.program_id(0)
        b, kvh, f, live, pos, h = _row_block(pid, rows_ptr, n_rows_ptr, R, HK, G, BM)
        split = tl.program_id(2)
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + b * sqb + h[:, None] * sqh + pos[:, None] * sql + dims[None, :],
                    mask=live[:, None], other=0.0)
        last = tl.max(tl.where(live, pos, -1), axis=0)
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, last + 1)
        m_i = tl.full([BM], float('-inf'), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        k_base = k_ptr + b * skb + kvh * skh
        v_base = v_ptr + b * svb + kvh * svh
        for start in range(lo, hi, BN):
            keys = start + tl.arange(0, BN)
            inside = keys < L
            kt = tl.load(k_base + keys[:, None] * skl + dims[None, :], mask=inside[:, None],
                         other=0.0)
            vt = tl.load(v_base + keys[:, None] * svl + dims[None, :], mask=inside[:, None],
                         other=0.0)
            ok = tl.load(valid_ptr + b * L + keys, mask=inside, other=0) != 0
            s = tl.dot(q, tl.trans(kt)) * scale_log2
            visible = (keys[None, :] <= pos[:, None]) & ok[None, :] & live[:, None]
            s = tl.where(visible, s, float('-inf'))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float('-inf'), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        if SPLIT == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(o_ptr + b * sob + h[:, None] * soh + pos[:, None] * sol + dims[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=live[:, None])
        else:
            fs = G * R
            base = ws_ptr + ((pid * SPLIT + split) * fs) * (D + 2)
            tl.store(base + f[:, None] * (D + 2) + dims[None, :], acc, mask=(f < fs)[:, None])
            tl.store(base + f * (D + 2) + D, m_i, mask=f < fs)
            tl.store(base + f * (D + 2) + D + 1, l_i, mask=f < fs)

    @triton.jit
    def _combine_kernel(o_ptr, ws_ptr, rows_ptr, n_rows_ptr, sob, soh, sol, R, HK,
                        G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                        SPLIT: tl.constexpr):
        """Merges the SPLIT partials of `_text_rows_kernel` in split order (fixed: bitwise
        reproducible) and writes o[b, h, rows[r], :]."""
        pid = tl.program_id(0)
        b, kvh, f, live, pos, h = _row_block(pid, rows_ptr, n_rows_ptr, R, HK, G, BM)
        dims = tl.arange(0, D)
        fs = G * R
        m = tl.full([BM], float('-inf'), tl.float32)
        for split in range(SPLIT):
            base = ws_ptr + ((pid * SPLIT + split) * fs) * (D + 2)
            m = tl.maximum(m, tl.load(base + f * (D + 2) + D, mask=live, other=float('-inf')))
        m_safe = tl.where(m == float('-inf'), 0.0, m)
        total = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for split in range(SPLIT):
            base = ws_ptr + ((pid * SPLIT + split) * fs) * (D + 2)
            weight = tl.exp2(tl.load(base + f * (D + 2) + D, mask=live, other=float('-inf'))
                             - m_safe)
            total += weight * tl.load(base + f * (D + 2) + D + 1, mask=live, other=0.0)
            acc += weight[:, None] * tl.load(base + f[:, None] * (D + 2) + dims[None, :],
                                             mask=live[:, None], other=0.0)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(o_ptr + b * sob + h[:, None] * soh + pos[:, None] * sol + dims[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=live[:, None])


def text_rows_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        rows: torch.Tensor, n_rows: torch.Tensor, key_valid: torch.Tensor,
                        scale: float) -> None:
    """Overwrites out[b, :, rows[b, :n_rows[b]], :] with those rows' causal attention over the
    valid keys. out (B, Hq, L, D) any strides (last dim contiguous); q (B, Hq, L, >= D), k
    (B, Hkv, L, >= D) (first D dims read), v (B, Hkv, L, D); rows int64 (B, R); n_rows int32
    (B,); key_valid int8 (B, L); scale: the score scale. CUDA tensors: the Triton kernel
    (KEY_SPLITS > 1: the keys split over that many programs per row block, their partials
    merged by a second kernel); else `text_rows_reference` written in."""
    b, hq, length, d = out.shape
    hk = k.shape[1]
    r = rows.shape[1]
    if r == 0:
        return
    if triton is None or not out.is_cuda:
        vals = text_rows_reference(q, k, v, rows, n_rows, key_valid, scale)
        for i in range(b):
            n = int(n_rows[i])
            out[i][:, rows[i, :n]] = vals[i, :n].transpose(0, 1).to(out.dtype)
        return
    group = hq // hk
    splits = max(1, min(KEY_SPLITS, triton.cdiv(length, BLOCK_KEYS)))
    chunk = triton.cdiv(triton.cdiv(length, splits), BLOCK_KEYS) * BLOCK_KEYS
    splits = triton.cdiv(length, chunk)
    blocks = triton.cdiv(group * r, BLOCK_ROWS)
    ws = (out.new_empty((b * hk, splits, group * r, d + 2), dtype=torch.float32)
          if splits > 1 else out)
    _text_rows_kernel[(b * hk, blocks, splits)](
        q, k, v, out, ws, rows, n_rows, key_valid, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        length, r, hk, chunk, G=group, D=d, BM=BLOCK_ROWS, BN=BLOCK_KEYS, SPLIT=splits,
        num_warps=WARPS, num_stages=2)
    if splits > 1:
        _combine_kernel[(b * hk, blocks)](
            out, ws, rows, n_rows, out.stride(0), out.stride(1), out.stride(2), r, hk,
            G=group, D=d, BM=BLOCK_ROWS, SPLIT=splits, num_warps=WARPS)


@torch.library.custom_op('molmobot::image_run_attention', mutates_args=())
def image_run_attention(q_aug: torch.Tensor, k_aug: torch.Tensor, v: torch.Tensor,
                        rows: torch.Tensor, n_rows: torch.Tensor, key_valid: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Attention under the served mask, (B, L, Hq, D) contiguous (module docstring).

    q_aug (B, Hq, L, D + E), k_aug (B, Hkv, L, D + E): RoPE'd q / k with the ImageRunMask's
    extra dims (memory (B, L, H, D + E)); v (B, Hkv, L, D); rows, n_rows, key_valid as in
    `ImageRunMask`; scale: 1 / sqrt(D)."""
    if q_aug.is_cuda:   # cuDNN or an error: never a silent fall back to the math kernel
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(q_aug, k_aug, v, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q_aug, k_aug, v, scale=scale, enable_gqa=True)
    text_rows_attention(out, q_aug, k_aug, v, rows, n_rows, key_valid, scale)
    return out.transpose(1, 2).contiguous()


@image_run_attention.register_fake
def _(q_aug, k_aug, v, rows, n_rows, key_valid, scale):
    b, hq, length, _ = q_aug.shape
    return q_aug.new_empty((b, length, hq, v.shape[-1]), dtype=v.dtype)
