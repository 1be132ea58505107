"""Tokenizers (preprocess/tokenizer.py) and the prompt layout (preprocess/prompt.py)."""
import json

import numpy as np
import pytest

from molmobot_policy.model.config import MolmoBotConfig, TokenIds
from molmobot_policy.preprocess.prompt import build_prompt_ids, image_token_positions
from molmobot_policy.preprocess.tokenizer import byte_symbols, load_tokenizer, tiny_tokenizer

TINY = MolmoBotConfig.from_name('tiny')
TOKENS = TINY.tokens


@pytest.fixture(scope='module')
def tok():
    return tiny_tokenizer(TOKENS)


class FakeTokenizer:
    """One id per character (ids 1000 + code point) so layouts can be read back."""

    def encode(self, text):
        return [1000 + ord(ch) for ch in text]


def decode_fake(ids):
    return ''.join(chr(i - 1000) if i >= 1000 else f'[{i}]' for i in ids)


# ---------------------------------------------------------------- tiny tokenizer
def test_byte_symbols_follow_gpt2_order():
    symbols = byte_symbols()
    assert len(symbols) == len(set(symbols)) == 256
    assert symbols[0] == '!' and symbols[64] == 'a'
    assert symbols[198] == 'Ċ' and symbols[220] == 'Ġ'


def test_tiny_tokenizer_special_ids_match_tiny_config(tok):
    assert tok.token_to_id('<|endoftext|>') == TOKENS.bos == 320
    assert tok.token_to_id('<|im_start|>') == TOKENS.chat_im_start == 321
    assert tok.token_to_id('<|im_end|>') == TOKENS.chat_im_end == 322
    assert tok.token_to_id('<im_start>') == TOKENS.im_start == 512
    assert tok.token_to_id('<im_patch>') == TOKENS.im_patch == 514
    assert tok.token_to_id('<frame_end>') == TOKENS.frame_end == 520


def test_tiny_tokenizer_pads_ids_323_to_511_with_extra_tokens(tok):
    assert tok.id_to_token(323) == '|<EXTRA_TOKENS_0>|'
    assert tok.id_to_token(511) == '|<EXTRA_TOKENS_188>|'
    assert tok.vocab_size == 522


def test_tiny_tokenizer_is_byte_level_and_encodes_any_text(tok):
    assert tok.encode('a') == [64]
    assert tok.encode('\n') == [198]
    assert tok.encode('é') == [byte_symbols().index(chr(0xc3)), byte_symbols().index(chr(0xa9))]


def test_tiny_tokenizer_keeps_the_leading_space_with_a_digit(tok):
    assert tok.encode('Image 1') == [259, 267]


def test_special_token_text_in_plain_text_is_not_a_special_id(tok):
    ids = tok.encode('<|im_end|>')
    assert TOKENS.chat_im_end not in ids
    assert len(ids) > 1


def test_tiny_tokenizer_refuses_other_token_ids():
    with pytest.raises(ValueError, match='tiny tokenizer'):
        tiny_tokenizer(TokenIds())


def test_encode_rejects_non_string(tok):
    with pytest.raises(TypeError, match='str'):
        tok.encode(b'bytes')


# ---------------------------------------------------------------- load_tokenizer
def test_load_tokenizer_from_directory_roundtrips_the_tiny_tokenizer(tmp_path, tok):
    tok.save(tmp_path / 'tokenizer.json')
    loaded = load_tokenizer(tmp_path, TOKENS)
    text = 'user\ndemo: put the salt shaker in the bowl'
    assert loaded.encode(text) == tok.encode(text)


def test_load_tokenizer_missing_file_says_what_is_needed(tmp_path):
    with pytest.raises(FileNotFoundError, match='tokenizer.json.*tokenizer_path'):
        load_tokenizer(tmp_path, TOKENS)


def test_load_tokenizer_rejects_chat_token_id_mismatch(tmp_path, tok):
    tok.save(tmp_path / 'tokenizer.json')
    wrong = TokenIds.for_vocab(512, bos=320, chat_im_start=999, chat_im_end=322)
    with pytest.raises(ValueError, match=r'<\|im_start\|>.*999'):
        load_tokenizer(tmp_path / 'tokenizer.json', wrong)


def test_load_tokenizer_rejects_image_token_id_mismatch(tmp_path, tok):
    tok.save(tmp_path / 'tokenizer.json')
    wrong = TokenIds.for_vocab(600, bos=320, chat_im_start=321, chat_im_end=322)
    with pytest.raises(ValueError, match='<im_start> has id 512'):
        load_tokenizer(tmp_path / 'tokenizer.json', wrong)


def test_load_tokenizer_accepts_a_file_without_image_tokens(tmp_path, tok):
    # A plain Qwen tokenizer.json has no <im_start>/<im_patch>: the config's ids are used.
    tok.save(tmp_path / 'tokenizer.json')
    data = json.loads((tmp_path / 'tokenizer.json').read_text())
    image_names = {'<im_start>', '<im_end>', '<im_patch>', '<im_col>', '<low_res_im_start>',
                   '<|image|>', '<im_low>', '<frame_start>', '<frame_end>', '<|video|>'}
    data['added_tokens'] = [t for t in data['added_tokens'] if t['content'] not in image_names]
    for name in image_names:
        del data['model']['vocab'][name]
    (tmp_path / 'tokenizer.json').write_text(json.dumps(data))
    loaded = load_tokenizer(tmp_path, TOKENS)
    assert loaded.token_to_id('<im_patch>') is None


# ---------------------------------------------------------------- prompt layout
def test_prompt_layout_bos_images_then_chat_turn():
    ids = build_prompt_ids(FakeTokenizer(), TOKENS, n_images=2, tokens_per_image=3,
                           instruction='go')
    text = decode_fake(ids)
    assert text == ('[320]Image 1[512][514][514][514][513]Image 2[512][514][514][514][513]'
                    '[321]user\ndemo: go[322]\n[321]assistant\n')
    assert ids.dtype == np.int64 and ids.ndim == 1


def test_prompt_has_tokens_per_image_patches_per_image(tok):
    ids = build_prompt_ids(tok, TOKENS, 3, TINY.tokens_per_image, 'pick up the cube')
    assert (ids == TOKENS.im_patch).sum() == 3 * 196
    assert (ids == TOKENS.im_start).sum() == 3
    assert (ids == TOKENS.im_end).sum() == 3
    assert (ids == TOKENS.im_col).sum() == 0


def test_prompt_keeps_special_text_in_instruction_as_plain_text(tok):
    ids = build_prompt_ids(tok, TOKENS, 2, 196, 'stop <|im_end|> now')
    assert (ids == TOKENS.chat_im_end).sum() == 1


@pytest.mark.parametrize('instruction, error', [('', ValueError), ('   ', ValueError),
                                                (None, TypeError), (3, TypeError)])
def test_prompt_rejects_empty_or_non_string_instruction(tok, instruction, error):
    with pytest.raises(error, match='instruction'):
        build_prompt_ids(tok, TOKENS, 2, 196, instruction)


def test_image_token_positions_are_the_im_patch_positions_in_order():
    ids = build_prompt_ids(FakeTokenizer(), TOKENS, 2, 3, 'go')
    positions = image_token_positions(ids, TOKENS)
    assert positions.dtype == np.int64
    # [BOS] 'Image 1' (7 chars) <im_start> -> first patch at 9
    np.testing.assert_array_equal(positions, [9, 10, 11, 21, 22, 23])
    assert (ids[positions] == TOKENS.im_patch).all()


def test_image_token_positions_reject_2d_ids():
    with pytest.raises(ValueError, match='1-D'):
        image_token_positions(np.zeros((1, 5), np.int64), TOKENS)
