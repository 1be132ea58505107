"""The token layout of one MolmoBot query (golden README section 4), built from ids.

    [BOS]
    for k = 1..N:  tok("Image k")  <im_start>  tokens_per_image x <im_patch>  <im_end>
    <|im_start|> tok("user\\ndemo: {instruction}") <|im_end|> tok("\\n")
    <|im_start|> tok("assistant\\n")

BOS is `<|endoftext|>` (Qwen has no BOS; upstream uses EOS). "demo: " comes from upstream's
`system_prompt: demo_or_style_v2`, the chat turn from `message_format: qwen3`; no `<im_col>`
tokens (`use_single_crop_col_tokens: false`), no EOS at inference. Special ids are placed
here, never parsed out of text, so the instruction is always plain text.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from molmobot_policy.model.config import TokenIds


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def check_instruction(instruction: object) -> str:
    """Return `instruction` if it is a non-blank str; TypeError/ValueError otherwise."""
    if not isinstance(instruction, str):
        raise TypeError(f'instruction must be str, got {type(instruction).__name__}')
    if not instruction.strip():
        raise ValueError(f'instruction must be a non-empty task text, got {instruction!r}')
    return instruction


def build_prompt_ids(tokenizer: Encoder, tokens: TokenIds, n_images: int, tokens_per_image: int,
                     instruction: str, max_images: int | None = None) -> np.ndarray:
    """Token ids of one query, upstream layout (module docstring).

    Args:
        tokenizer: anything with `encode(text) -> list[int]` (e.g. `TextTokenizer`).
        tokens: special-token ids of the model (`MolmoBotConfig.tokens`).
        n_images: number of camera images, 2..max_images. Camera k (0-based) is "Image k+1".
        tokens_per_image: `<im_patch>` tokens per image (`MolmoBotConfig.tokens_per_image`,
            196).
        instruction: the task text, non-empty.
        max_images: the checkpoint's `max_images`; None skips that check.
    Returns:
        int64 (L,), L = 1 + sum_k(len(tok("Image k")) + tokens_per_image + 2) + chat turn.
    Raises:
        TypeError: instruction is not str.
        ValueError: empty instruction; n_images < 2 (upstream encodes a single image
            through another code path, without the "Image 1" text, that is not reproduced
            here); n_images > max_images (upstream would silently drop the extra cameras);
            tokens_per_image < 1.
    """
    check_instruction(instruction)
    if int(n_images) != n_images or n_images < 2:
        raise ValueError(f'n_images must be an integer >= 2, got {n_images!r}: upstream encodes a '
                         'single image with another token layout, which this package does not '
                         'reproduce; configure at least 2 cameras')
    if max_images is not None and n_images > max_images:
        raise ValueError(f'{n_images} camera images do not fit the checkpoint: max_images is '
                         f'{max_images}. Configure at most {max_images} cameras (upstream would '
                         'silently drop the extra ones)')
    if tokens_per_image < 1:
        raise ValueError(f'tokens_per_image must be >= 1, got {tokens_per_image}')

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
