"""Text tokenizers: the tiny model's self-contained byte-level BPE, and Qwen `tokenizer.json`.

Both are wrapped in `TextTokenizer`, whose one job here is `encode(text) -> list[int]`
(plain text in, token ids out; special-token strings inside the text are NOT turned into
special ids, so an instruction cannot inject chat structure - `prompt.py` places every
special id itself).

The tiny tokenizer mirrors the structure of the golden one (golden README section 4):
- ids 0..255: the 256 byte symbols of byte-level BPE, in the GPT-2 `bytes_to_unicode`
  order (printable bytes keep their own code point, the others map to 256 + n; 'Ġ' is the
  space, 'Ċ' the newline);
- ids 256..319: 64 merges. The golden tokenizer's merge table is not shipped, so the
  merges here are chosen to give every token that the golden cases use its golden id
  (e.g. 'Image' = 259, 'Ġthe' = 265, 'Ġ1' = 267); the other ids of the range hold the
  intermediate merges those need, then unused placeholders;
- 320 `<|endoftext|>` (BOS), 321 `<|im_start|>`, 322 `<|im_end|>`;
- 323..511: upstream's padding tokens `|<EXTRA_TOKENS_k>|`, never produced;
- 512..521: the image special tokens (`TokenIds`; rows of `wte.new_embedding`).
Pre-tokenization is GPT-2's byte-level regex (a digit keeps its leading space: 'Ġ1').
"""
from __future__ import annotations

import os
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from molmobot_policy.model.config import TokenIds

# Names of the image special tokens (upstream order), with the TokenIds field of each.
IMAGE_TOKEN_FIELDS = {
    '<im_start>': 'im_start',
    '<im_end>': 'im_end',
    '<im_patch>': 'im_patch',
    '<im_col>': 'im_col',
    '<low_res_im_start>': 'low_res_im_start',
    '<|image|>': 'image',
    '<im_low>': 'im_low',
    '<frame_start>': 'frame_start',
    '<frame_end>': 'frame_end',
}
CHAT_TOKEN_FIELDS = {
    '<|endoftext|>': 'bos',
    '<|im_start|>': 'chat_im_start',
    '<|im_end|>': 'chat_im_end',
}

TINY_VOCAB_SIZE = 512

# Golden token strings at their golden ids (golden README section 4 and the cases'
# `input_token_strings`).
_TINY_GOLDEN_TOKENS = {
    259: 'Image', 265: 'Ġthe', 267: 'Ġ1', 268: 'Ġ2', 272: 'Ġp', 277: 'er', 278: 'Ġs',
    280: 'demo', 281: 'sta', 282: 'Ġin', 289: 'si', 290: 'wl', 292: 'Ġ3', 293: 'Ġ4',
    294: 'Ġ5', 295: 'Ġ6', 296: 'Ġ7', 297: 'Ġ8', 300: 'as', 303: 'ha', 304: 'ick',
    305: 'nt', 312: 'ut', 313: 'user', 315: 'Ġbo', 317: 'Ġup',
}
# The merges, by rank (earlier = applied first). 'user' must come before 'er'.
_TINY_MERGES = [
    ('I', 'm'), ('Im', 'a'), ('Ima', 'g'), ('Imag', 'e'),
    ('Ġ', '1'), ('Ġ', '2'), ('Ġ', '3'), ('Ġ', '4'), ('Ġ', '5'), ('Ġ', '6'), ('Ġ', '7'),
    ('Ġ', '8'),
    ('u', 's'), ('us', 'e'), ('use', 'r'),
    ('d', 'e'), ('de', 'm'), ('dem', 'o'),
    ('a', 's'), ('s', 'i'), ('s', 't'), ('st', 'a'), ('n', 't'),
    ('Ġ', 'p'), ('u', 't'), ('Ġ', 't'), ('Ġt', 'h'), ('Ġth', 'e'), ('Ġ', 's'), ('h', 'a'),
    ('e', 'r'), ('Ġ', 'i'), ('Ġi', 'n'), ('Ġ', 'b'), ('Ġb', 'o'), ('w', 'l'), ('i', 'c'),
    ('ic', 'k'), ('Ġ', 'u'), ('Ġu', 'p'),
]


def byte_symbols() -> list[str]:
    """The 256 byte symbols of byte-level BPE, in id order (GPT-2 `bytes_to_unicode`).

    Ids 0..187 are the bytes '!'..'~', '¡'..'¬', '®'..'ÿ', standing for themselves; ids
    188..255 are the other 68 bytes (controls, space, ...) in increasing byte order, shown
    as chr(256 + n): byte 10 (newline) -> 'Ċ' (id 198), byte 32 (space) -> 'Ġ' (id 220).
    """
    printable = (list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1))
                 + list(range(ord('®'), ord('ÿ') + 1)))
    n_other = 256 - len(printable)
    return [chr(b) for b in printable] + [chr(256 + n) for n in range(n_other)]


class TextTokenizer:
    """A `tokenizers.Tokenizer` with the one call the prompt builder needs.

    Attributes:
        source: where it came from ('tiny' or the tokenizer.json path), for messages.
    """

    def __init__(self, tokenizer: Tokenizer, source: str = '') -> None:
        self._tokenizer = tokenizer
        self._tokenizer.encode_special_tokens = True   # special strings in text stay text
        self.source = source

    def encode(self, text: str) -> list[int]:
        """Plain text -> token ids (no BOS/EOS added). Raises TypeError if text is not str."""
        if not isinstance(text, str):
            raise TypeError(f'text must be str, got {type(text).__name__}')
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (specials included), or None if the vocab lacks it."""
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of an id, or None if out of range."""
        return self._tokenizer.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as a Hugging Face `tokenizer.json`."""
        self._tokenizer.save(str(path))


def tiny_tokenizer(tokens: TokenIds | None = None) -> TextTokenizer:
    """The tiny model's byte-level BPE tokenizer, built in code (module docstring).

    Args:
        tokens: the config's TokenIds; must be the tiny ones
            (`TokenIds.for_vocab(512, bos=320, chat_im_start=321, chat_im_end=322)`).
    Returns:
        TextTokenizer with 522 ids.
    Raises:
        ValueError: `tokens` does not match the tiny layout.
    """
    expected = TokenIds.for_vocab(TINY_VOCAB_SIZE, bos=320, chat_im_start=321, chat_im_end=322)
    if tokens is not None and tokens != expected:
        raise ValueError(f'the tiny tokenizer has the token ids {expected}, got {tokens}; use '
                         'load_tokenizer() with a tokenizer.json for other models')
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    merged = [a + b for a, b in _TINY_MERGES]
    free_ids = iter(i for i in range(256, 320) if i not in _TINY_GOLDEN_TOKENS)
    for token in merged:
        golden_id = next((i for i, t in _TINY_GOLDEN_TOKENS.items() if t == token), None)
        vocab[token] = golden_id if golden_id is not None else next(free_ids)
    for k, token_id in enumerate(free_ids):
        vocab[f'<|tiny_unused_{k}|>'] = token_id
    specials = {expected.bos: '<|endoftext|>', expected.chat_im_start: '<|im_start|>',
                expected.chat_im_end: '<|im_end|>'}
    for k, token_id in enumerate(range(323, TINY_VOCAB_SIZE)):
        specials[token_id] = f'|<EXTRA_TOKENS_{k}>|'
    for name, field in IMAGE_TOKEN_FIELDS.items():
        specials[getattr(expected, field)] = name
    specials[expected.frame_end + 1] = '<|video|>'
    vocab.update({name: token_id for token_id, name in specials.items()})
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise AssertionError('tiny tokenizer vocab ids are not contiguous')   # a bug here

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_TINY_MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False)
                                  for _, name in sorted(specials.items())])
    return TextTokenizer(tokenizer, source='tiny')


def load_tokenizer(path_or_dir: str | os.PathLike, tokens: TokenIds) -> TextTokenizer:
    """Load a Qwen-style `tokenizer.json` and check its special ids against the config.

    Args:
        path_or_dir: the tokenizer.json file, or a directory holding one (e.g. the
            checkpoint directory).
        tokens: the model config's TokenIds.
    Returns:
        TextTokenizer.
    Raises:
        FileNotFoundError: no tokenizer.json there.
        ValueError: `<|endoftext|>`, `<|im_start|>` or `<|im_end|>` is missing or has
            another id than the config says; an image special token (`<im_start>`,
            `<im_patch>`, ...) present in the file has another id; or the config's
            image-token id is taken by a different token in the file.
    """
    path = Path(path_or_dir)
    if path.is_dir():
        path = path / 'tokenizer.json'
    if not path.is_file():
        raise FileNotFoundError(
            f'tokenizer file not found: {path}. The model needs its Qwen tokenizer.json: put it '
            'beside the checkpoint (config.yaml, model.pt) or set the `tokenizer_path` parameter')
    return check_tokenizer(TextTokenizer(Tokenizer.from_file(str(path)), source=str(path)),
                           tokens, str(path))


def check_tokenizer(tokenizer, tokens: TokenIds, source: str = 'the tokenizer'):
    """`tokenizer`'s special-token ids against the model config; returns the tokenizer.

    Args:
        tokenizer: anything with `token_to_id(str) -> int | None` and `id_to_token(int)`
            (`TextTokenizer`, a loaded tokenizer.json).
        tokens: the model config's TokenIds.
        source: names the tokenizer in messages (e.g. its path).
    Raises:
        ValueError: `<|endoftext|>`, `<|im_start|>` or `<|im_end|>` is missing or has another
            id than the config says; an image special token (`<im_start>`, `<im_patch>`, ...)
            present in the tokenizer has another id; or the config's image-token id is taken by
            a different token.
    """
    for name, field in CHAT_TOKEN_FIELDS.items():
        found, expected = tokenizer.token_to_id(name), getattr(tokens, field)
        if found != expected:
            raise ValueError(f'{source}: special token {name} has id {found}, but the model '
                             f'config expects {expected} (TokenIds.{field}); wrong tokenizer '
                             'for this model?')
    for name, field in IMAGE_TOKEN_FIELDS.items():
        found, expected = tokenizer.token_to_id(name), getattr(tokens, field)
        if found is not None and found != expected:
            raise ValueError(f'{source}: image token {name} has id {found}, but the model '
                             f'config expects {expected} (TokenIds.{field})')
        holder = tokenizer.id_to_token(expected)
        if found is None and holder is not None:
            raise ValueError(f'{source}: id {expected} (TokenIds.{field}, {name}) is the token '
                             f'{holder!r} there, not {name}')
    return tokenizer


TOKENIZER_MODES = ('auto', 'tiny', 'file')


def resolve_tokenizer(mode: str, tokens: TokenIds, tokenizer_path: str | os.PathLike = '',
                      checkpoint_path: str | os.PathLike = '') -> TextTokenizer:
    """The tokenizer a model is served with (the engine's `tokenizer` option).

    Args:
        mode: 'file': a Qwen tokenizer.json, from `tokenizer_path` (file or directory), else
            beside the checkpoint. 'tiny': the built-in tiny tokenizer (`tiny_tokenizer`), for
            random weights and for a checkpoint trained with it (its token ids must be the
            tiny ones). 'auto' (default): 'file' when `tokenizer_path` is set or a
            tokenizer.json lies beside the checkpoint; 'tiny' when there is no checkpoint (the
            built-in presets' random weights: any ids in range will do); else the error below:
            a checkpoint's vocabulary needs the tokenizer it was trained with, and two
            tokenizers of one vocabulary size tokenize differently.
        tokens: the model config's TokenIds.
        tokenizer_path: tokenizer.json or its directory; '' = beside the checkpoint.
        checkpoint_path: the checkpoint directory or weight file; '' = random weights.
    Returns:
        TextTokenizer.
    Raises:
        ValueError: unknown mode; 'tiny' for a checkpoint whose token ids are not the tiny
            ones (its vocabulary needs its own tokenizer).
        FileNotFoundError: a checkpoint without tokenizer.json beside it or at
            `tokenizer_path` ('auto' or 'file'); the message names the file.
        See `check_tokenizer` for the special-token id checks.
    """
    if mode not in TOKENIZER_MODES:
        raise ValueError(f'tokenizer must be one of {list(TOKENIZER_MODES)}, got {mode!r}')
    tiny_ids = TokenIds.for_vocab(TINY_VOCAB_SIZE, bos=320, chat_im_start=321, chat_im_end=322)
    beside = None
    if checkpoint_path:
        checkpoint = Path(checkpoint_path)
        beside = (checkpoint if checkpoint.is_dir() else checkpoint.parent) / 'tokenizer.json'
    if mode == 'auto':
        if tokenizer_path or (beside is not None and beside.is_file()):
            mode = 'file'
        elif beside is None:
            mode = 'tiny'
        else:
            tiny = (" (or set `tokenizer` to 'tiny' if it was trained with the built-in tiny "
                    'tokenizer)' if tokens == tiny_ids else '')
            raise FileNotFoundError(
                f'no tokenizer for checkpoint {checkpoint_path}: it needs the tokenizer.json it '
                f'was trained with. Put tokenizer.json beside the checkpoint ({beside}) or set '
                f'the `tokenizer_path` parameter to it{tiny}')
    if mode == 'tiny':
        if beside is not None and tokens != tiny_ids:
            raise ValueError(f'tokenizer=tiny, but checkpoint {checkpoint_path} has the token ids '
                             f'{tokens}, not the tiny ones; give it its tokenizer.json '
                             "(tokenizer='file' or 'auto')")
        return tiny_tokenizer(tokens if beside is not None else None)
    if tokenizer_path:
        return load_tokenizer(tokenizer_path, tokens)
    if beside is None:
        raise FileNotFoundError("tokenizer='file' needs `tokenizer_path` (the Qwen "
                                'tokenizer.json) or a checkpoint with tokenizer.json beside it')
    return load_tokenizer(beside, tokens)
