"""The token layout of one MolmoBot query (golden README section 4), built from ids, and its
fitting to the prompt lengths the engine serves.

    [BOS]
    for k = 1..N:  tok("Image k")  <im_start>  tokens_per_image x <im_patch>  <im_end>
    <|im_start|> tok("user\\ndemo: {instruction}") <|im_end|> tok("\\n")
    <|im_start|> tok("assistant\\n")

BOS is `<|endoftext|>` (Qwen has no BOS; upstream uses EOS). "demo: " comes from upstream's
`system_prompt: demo_or_style_v2`, the chat turn from `message_format: qwen3`; no `<im_col>`
tokens (`use_single_crop_col_tokens: false`), no EOS at inference. Special ids are placed
here, never parsed out of text, so the instruction is always plain text.

The text side of a query depends only on the instruction and the camera count: `PromptFitter`
builds it once per instruction (`TextInputs`), cut to the longest prompt served and padded to
its bucket.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from molmobot_policy.model.config import MolmoBotConfig, TokenIds
from molmobot_policy.preprocess.images import pooling_indices

log = logging.getLogger('molmobot_policy.engine')

TEXT_CACHE_SIZE = 64     # distinct instructions whose text inputs are kept
OVERLONG_MODES = ('error', 'truncate')


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def build_prompt_ids(tokenizer: Encoder, tokens: TokenIds, n_images: int, tokens_per_image: int,
                     instruction: str) -> np.ndarray:
    """Token ids of one query, upstream layout (module docstring).

    Args:
        tokenizer: anything with `encode(text) -> list[int]` (e.g. `TextTokenizer`).
        tokens: special-token ids of the model (`MolmoBotConfig.tokens`).
        n_images: number of camera images (the robot contract checks it against the model).
            Camera k (0-based) is "Image k+1".
        tokens_per_image: `<im_patch>` tokens per image (`MolmoBotConfig.tokens_per_image`).
        instruction: the task text, non-empty.
    Returns:
        int64 (L,), L = 1 + sum_k(len(tok("Image k")) + tokens_per_image + 2) + chat turn.
    Raises:
        TypeError: instruction is not str.
        ValueError: blank instruction.
    """
    if not isinstance(instruction, str):
        raise TypeError(f'instruction must be str, got {type(instruction).__name__}')
    if not instruction.strip():
        raise ValueError(f'instruction must be a non-empty task text, got {instruction!r}')
    ids = [tokens.bos]
    for k in range(1, int(n_images) + 1):
        ids += tokenizer.encode(f'Image {k}')
        ids += [tokens.im_start] + [tokens.im_patch] * tokens_per_image + [tokens.im_end]
    ids += [tokens.chat_im_start] + tokenizer.encode(f'user\ndemo: {instruction}')
    ids += [tokens.chat_im_end] + tokenizer.encode('\n')
    ids += [tokens.chat_im_start] + tokenizer.encode('assistant\n')
    return np.asarray(ids, dtype=np.int64)


def image_token_positions(prompt_ids: np.ndarray, tokens: TokenIds) -> np.ndarray:
    """Positions of the `<im_patch>` tokens, in order: where the pooled image features go.

    Args:
        prompt_ids: int (L,) token ids.
        tokens: the model's TokenIds.
    Returns:
        int64 (n_patch_tokens,), increasing; row j of the image features is added at
        position [j].
    Raises:
        ValueError: prompt_ids is not 1-D.
    """
    prompt_ids = np.asarray(prompt_ids)
    if prompt_ids.ndim != 1:
        raise ValueError(f'prompt_ids must be 1-D (L,), got shape {prompt_ids.shape}')
    return np.flatnonzero(prompt_ids == tokens.im_patch).astype(np.int64)


def suggested_buckets(shortest_prompt: int) -> tuple[int, ...]:
    """Two padding buckets for prompts of at least `shortest_prompt` tokens: room for ~32 and
    ~224 instruction tokens, rounded up to multiples of 64 (e.g. 1617 -> (1664, 1856), the
    8-camera default)."""
    return tuple(sorted({-(-(shortest_prompt + extra) // 64) * 64 for extra in (32, 224)}))


def _read_only(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class TextInputs:
    """The instruction-dependent half of one query, padded to its bucket (host numpy arrays,
    read-only; shared by the cache, compared by identity).

    Attributes:
        input_ids: int64 (L,) prompt ids, then padding (any valid id: BOS).
        attention_mask: bool (L,), False = padding.
        position_ids: int64 (L,); padding repeats the last real position.
        image_positions: int64 (N*T,) positions of `<im_patch>` in input_ids.
        token_pooling: int64 (N*T, pool_h*pool_w) patch indices per image token, -1 = pad.
        length: real (unpadded) prompt tokens.
        bucket: L when padded to a bucket, 0 when unpadded.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    position_ids: np.ndarray
    image_positions: np.ndarray
    token_pooling: np.ndarray
    length: int
    bucket: int


class PromptFitter:
    """The prompts of one model and camera count, fitted to the prompt lengths served.

    Args:
        tokenizer: anything with `encode(text) -> list[int]`.
        model: the model config (tokens, tokens_per_image, the ViT grid and the pooling window
            for the pooling indices, max_sequence_length).
        n_images: cameras per observation (checked against the model by the robot contract).
        buckets: fixed prompt lengths to pad to, increasing; () = no padding.
        overlong: a prompt longer than the largest bucket (without buckets: than the model's
            max_sequence_length): 'error', or 'truncate' (words cut from the end of the
            instruction until it fits, logged once per instruction).
    Raises:
        ValueError: an unknown `overlong`; a bucket too small for even a one-word prompt (the
            images and the chat template), naming the buckets and suggesting sizes.
    """

    def __init__(self, tokenizer: Encoder, model: MolmoBotConfig, n_images: int,
                 buckets: tuple[int, ...] = (), overlong: str = 'error') -> None:
        if overlong not in OVERLONG_MODES:
            raise ValueError(f'overlong must be one of {OVERLONG_MODES}, got {overlong!r}')
        self.tokenizer, self.tokens = tokenizer, model.tokens
        self.n_images, self.tokens_per_image = n_images, model.tokens_per_image
        self.buckets, self.overlong = tuple(sorted(buckets)), overlong
        self.limit, self.limit_name = (
            (self.buckets[-1], 'the largest bucket') if self.buckets
            else (model.llm.max_sequence_length, "the model's maximum sequence length"))
        self.token_pooling = _read_only(pooling_indices(
            n_images, model.vit.grid, model.connector.pooling_h, model.connector.pooling_w))
        shortest = len(self.prompt_ids('go'))
        small = [b for b in self.buckets if b < shortest]
        if small:
            raise ValueError(
                f'buckets {list(self.buckets)}: {small} cannot hold even a one-word prompt '
                f'({shortest} tokens with {n_images} images of {self.tokens_per_image} patch '
                f'tokens each); use larger buckets, e.g. {list(suggested_buckets(shortest))}')
        # thread-safe: the node checks a new instruction from its parameter callback
        self.text_inputs = functools.lru_cache(maxsize=TEXT_CACHE_SIZE)(self._text_inputs)

    def prompt_ids(self, instruction: str) -> np.ndarray:
        """`build_prompt_ids` for this model and camera count: int64 (L,)."""
        return build_prompt_ids(self.tokenizer, self.tokens, self.n_images,
                                self.tokens_per_image, instruction)

    def _text_inputs(self, instruction: str) -> TextInputs:
        """`text_inputs(instruction)` (cached per instruction, least recently used evicted
        after TEXT_CACHE_SIZE): the prompt, cut where `overlong='truncate'`, padded to the
        smallest bucket that holds it.

        Raises:
            TypeError, ValueError: a non-str or blank instruction; a prompt longer than
                `limit` with `overlong='error'`, or even with a one-word instruction.
        """
        ids = self.prompt_ids(instruction)
        if len(ids) > self.limit:
            ids = self._truncated(instruction, ids)
        bucket = next(b for b in self.buckets if b >= len(ids)) if self.buckets else 0
        return self.pad(ids, bucket)

    def _truncated(self, instruction: str, ids: np.ndarray) -> np.ndarray:
        if self.overlong == 'error':
            own = len(self.tokenizer.encode(instruction))
            advice = ('shorten the instruction, add a larger bucket, or' if self.buckets
                      else 'shorten the instruction or')
            raise ValueError(f'instruction too long: the prompt has {len(ids)} tokens ({own} '
                             f'of them the instruction, the rest the {self.n_images} images and '
                             f'the chat template), {self.limit_name} is {self.limit} ({advice} '
                             "set overlong='truncate')")
        # keep the longest word prefix that fits (prompt length grows with the words): a
        # bisection, O(log n) tokenizations even for a page of text
        words = instruction.split()
        lo, hi = 1, len(words) - 1           # words[:hi + 1] is known not to fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self.prompt_ids(' '.join(words[:mid]))) <= self.limit:
                lo = mid
            else:
                hi = mid - 1
        ids = self.prompt_ids(' '.join(words[:lo]))
        if len(ids) > self.limit:
            raise ValueError(f'the prompt needs {len(ids)} tokens even with a one-word '
                             f'instruction; {self.limit_name} is {self.limit}')
        log.warning('instruction truncated to %d words to fit %d tokens', lo, self.limit)
        return ids

    def pad(self, ids: np.ndarray, bucket: int) -> TextInputs:
        """Prompt ids int64 (L,) right-padded to `bucket` tokens (0: unpadded) -> TextInputs.
        The engine's warm-up pads a short prompt to each bucket (only the shapes matter)."""
        length = len(ids)
        total = bucket or length
        padded = np.full(total, self.tokens.bos, dtype=np.int64)   # pad id: any valid id
        padded[:length] = ids
        mask = np.zeros(total, dtype=bool)
        mask[:length] = True
        return TextInputs(
            input_ids=_read_only(padded), attention_mask=_read_only(mask),
            position_ids=_read_only(np.minimum(np.arange(total), length - 1)),
            image_positions=_read_only(image_token_positions(ids, self.tokens)),
            token_pooling=self.token_pooling, length=length, bucket=bucket)
