"""The tile-classified masked attention's host side (runtime/flash_attention.py) on the CPU:
the per-token kinds give the model's own mask (`MolmoBot.attention_allowed`), and attention
computed the way the kernel visits tiles (full tiles unmasked, partial tiles with the rule,
the others skipped) equals attention under the mask. The kernel itself:
test_flash_attention_gpu.py."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from molmobot_policy.model.checkpoint import random_model
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.runtime import flash_attention as fa

sys.path.insert(0, os.path.dirname(__file__))
from _prompt_layouts import served_kinds  # noqa: E402  (test/_prompt_layouts.py)

TINY = MolmoBotConfig.from_name('tiny')


def layout(length: int, runs: list[tuple[int, int]], real: int) -> torch.Tensor:
    """kinds int32 (1, length): image runs [start, end), text elsewhere, padding from `real`."""
    kinds = torch.full((1, length), fa.KIND_TEXT, dtype=torch.int32)
    for start, end in runs:
        kinds[0, start:end] = fa.KIND_IMAGE
    kinds[0, real:] = fa.KIND_PAD
    return kinds


LAYOUTS = {
    'eight cameras (1664, the default bucket)': served_kinds(1664),
    'eight cameras, bucket not a tile multiple (1856)': served_kinds(1856),
    'runs across tile edges, no padding (300)': layout(300, [(5, 140), (150, 257)], 300),
    'causal only (no image tokens, 200)': layout(200, [], 190),
}


def random_layout(seed: int) -> torch.Tensor:
    """kinds int32 (1, L), L in 130..699: random image runs and text gaps, padding or not."""
    g = torch.Generator().manual_seed(seed)
    length = int(torch.randint(130, 700, (1,), generator=g))
    kinds = torch.full((1, length), fa.KIND_TEXT, dtype=torch.int32)
    at = int(torch.randint(0, 40, (1,), generator=g))
    while at < length:
        run = int(torch.randint(1, 260, (1,), generator=g))
        kinds[0, at:at + run] = fa.KIND_IMAGE
        at += run + int(torch.randint(0, 12, (1,), generator=g))
    real = length - int(torch.randint(0, 3, (1,), generator=g)) * int(
        torch.randint(0, 60, (1,), generator=g))
    kinds[0, real:] = fa.KIND_PAD
    return kinds


def tiled_attention(q, k, v, kinds, tiles, scale, tile_m=fa.TILE_M, tile_n=fa.TILE_N):
    """float32 attention (B, L, H, D) as the kernel visits tiles: for each query tile, the
    listed full tiles with no mask, the listed partial tiles with the rule, nothing else."""
    b, length, heads, _ = q.shape
    rule = fa.visible(kinds)
    allowed = torch.zeros(b, length, length, dtype=torch.bool)
    for bi in range(b):
        for m in range(tiles.partial_count.shape[-1]):
            rows = slice(m * tile_m, min((m + 1) * tile_m, length))
            for counts, index, masked in ((tiles.full_count, tiles.full_index, False),
                                          (tiles.partial_count, tiles.partial_index, True)):
                for n in index[bi, 0, m, :int(counts[bi, 0, m])].tolist():
                    cols = slice(n * tile_n, min((n + 1) * tile_n, length))
                    allowed[bi, rows, cols] = rule[bi, rows, cols] if masked else True
    group = heads // k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    scores = ((qf @ kf.transpose(-1, -2)) * scale).masked_fill(~allowed[:, None], float('-inf'))
    return (torch.softmax(scores, -1) @ vf).transpose(1, 2)


def test_token_kinds_give_the_models_mask():
    model = random_model(TINY, seed=0)
    tok = TINY.tokens
    ids = [tok.bos, 259, tok.im_start] + [tok.im_patch] * 7 + [tok.im_end, 260,
                                                                 tok.im_start, tok.im_patch,
                                                                 tok.im_end, 313, 314]
    input_ids = torch.tensor([ids + [tok.bos] * 4])
    attention_mask = torch.tensor([[True] * len(ids) + [False] * 4])
    kinds = fa.token_kinds(input_ids, attention_mask, model.image_special_ids)
    expected = model.attention_allowed(input_ids, attention_mask)[:, 0]
    assert torch.equal(fa.visible(kinds), expected)


def test_token_kinds_without_bidirectional_images_are_causal():
    input_ids = torch.tensor([[1, 2, 3, 4, 5]])
    kinds = fa.token_kinds(input_ids, None, None)
    assert torch.equal(fa.visible(kinds)[0], torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize('name', list(LAYOUTS))
def test_attention_over_the_classified_tiles_equals_the_masked_attention(name):
    kinds = LAYOUTS[name]
    length, heads, kv_heads, dim = kinds.shape[1], 4, 2, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, length, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    scale = 1.0 / math.sqrt(dim)
    tiles = fa.tile_classes(kinds)
    real = kinds[0] != fa.KIND_PAD
    got = tiled_attention(q, k, v, kinds, tiles, scale)[0][real]
    want = fa.reference(q, k, v, kinds, scale)[0][real]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def brute_force_classes(kinds: torch.Tensor, tile: int = fa.TILE_M):
    """(full, visited) bool (B, nm, nn) straight from the (L, L) rule: keys beyond L hidden,
    rows beyond L seeing every key before L."""
    b, length = kinds.shape
    n = -(-length // tile)
    grid = torch.zeros(b, n * tile, n * tile, dtype=torch.bool)
    grid[:, :length, :length] = fa.visible(kinds)
    grid[:, length:, :length] = True
    tiles = grid.view(b, n, tile, n, tile)
    return tiles.all(dim=4).all(dim=2), tiles.any(dim=4).any(dim=2)


def listed_set(count, index):
    return {(m, int(c)) for m in range(count.shape[-1])
            for c in index[0, 0, m, :int(count[0, 0, m])].tolist()}


@pytest.mark.parametrize('seed', range(40))
def test_tile_classes_equal_the_classes_of_the_full_mask(seed):
    kinds = random_layout(seed)
    tiles = fa.tile_classes(kinds)
    full, visited = brute_force_classes(kinds)
    partial = visited & ~full
    want_full = {tuple(x) for x in torch.nonzero(full[0]).tolist()}
    want_partial = {tuple(x) for x in torch.nonzero(partial[0]).tolist()}
    assert listed_set(tiles.full_count, tiles.full_index) == want_full
    assert listed_set(tiles.partial_count, tiles.partial_index) == want_partial


def test_tile_lists_are_ascending_and_disjoint():
    tiles = fa.tile_classes(LAYOUTS['eight cameras, bucket not a tile multiple (1856)'])
    for m in range(tiles.partial_count.shape[-1]):
        partial = tiles.partial_index[0, 0, m, :int(tiles.partial_count[0, 0, m])].tolist()
        full = tiles.full_index[0, 0, m, :int(tiles.full_count[0, 0, m])].tolist()
        assert partial == sorted(partial) and full == sorted(full)
        assert not set(partial) & set(full)


def test_the_tile_holding_the_sequence_end_is_never_full():
    kinds = LAYOUTS['eight cameras, bucket not a tile multiple (1856)']
    tiles = fa.tile_classes(kinds)
    last = tiles.partial_index.shape[-1] - 1     # key tile 14 holds keys 1792..1855 of 1920
    for m in range(tiles.full_count.shape[-1]):
        full = tiles.full_index[0, 0, m, :int(tiles.full_count[0, 0, m])].tolist()
        assert last not in full


@pytest.mark.parametrize('name', list(LAYOUTS) + [f'random {seed}' for seed in range(20)])
def test_the_kernels_rule_on_limits_is_the_mask_on_every_real_query(name):
    kinds = LAYOUTS[name] if name in LAYOUTS else random_layout(int(name.split()[1]))
    real = kinds[0] != fa.KIND_PAD
    got = fa.rule(fa.key_limits(kinds))[0][real]
    assert torch.equal(got, fa.visible(kinds)[0][real])


def test_the_rule_sees_image_keys_ahead_only_from_image_queries():
    # BOS, image x 3, text, image, padding: the rule's cases one by one
    kinds = torch.tensor([[fa.KIND_TEXT] + [fa.KIND_IMAGE] * 3 + [fa.KIND_TEXT, fa.KIND_IMAGE,
                                                                   fa.KIND_PAD]],
                         dtype=torch.int32)
    seen = fa.rule(fa.key_limits(kinds))[0]
    assert seen[1, 5] and seen[3, 2]          # image -> a later image key, across text
    assert not seen[0, 1] and not seen[4, 5]  # text -> a later image key
    assert not seen[1, 4] and seen[4, 1]      # image -> a later text key; text -> earlier image
    assert not seen[:6, 6].any()              # the padded key, from every real query


def test_the_engine_pads_after_every_real_token_as_the_rule_needs():
    # the rule on limits shows a padded key to a later real text query: the engine's prompts
    # must be right-padded (the module docstring)
    from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine
    engine = PolicyEngine(EngineConfig(model='tiny', buckets=(1664,)))
    text = engine.text_inputs('pick up the red cube')
    mask = torch.as_tensor(text.attention_mask)
    assert 0 < text.length < mask.numel()
    assert mask[:text.length].all() and not mask[text.length:].any()


@pytest.mark.parametrize('name', list(LAYOUTS))
def test_the_ops_cpu_schedule_keeps_exactly_the_masks_scores(name):
    kinds = LAYOUTS[name]
    real = kinds[0] != fa.KIND_PAD
    kept = fa.visited(fa.key_limits(kinds), fa.tile_classes(kinds))
    assert torch.equal(kept[0][real], fa.visible(kinds)[0][real])


def test_a_wrong_tile_class_changes_the_ops_result():
    kinds = LAYOUTS['runs across tile edges, no padding (300)']
    tiles = fa.tile_classes(kinds)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 300, h, 16, generator=g) for h in (4, 2, 2))
    args = (tiles.partial_count, tiles.partial_index, tiles.full_count, tiles.full_index, 0.25)
    limits = fa.key_limits(kinds)
    right = fa.image_tokens_attention(q, k, v, limits, *args)
    # query tile 0: its partial tiles listed as full instead
    wrong_full_count = tiles.full_count.clone()
    wrong_full_index = tiles.full_index.clone()
    n = int(tiles.partial_count[0, 0, 0])
    wrong_full_index[0, 0, 0, :n] = tiles.partial_index[0, 0, 0, :n]
    wrong_full_count[0, 0, 0] = n
    zero = torch.zeros_like(tiles.partial_count)
    wrong = fa.image_tokens_attention(q, k, v, limits, zero, tiles.partial_index,
                                      wrong_full_count, wrong_full_index, 0.25)
    assert not torch.allclose(right[:, :128], wrong[:, :128], atol=1e-3)
    torch.testing.assert_close(right, fa.reference(q, k, v, kinds, 0.25), rtol=1e-5, atol=1e-5)


def test_unavailable_without_cuda():
    reason = fa.unavailable_reason(TINY, torch.device('cpu'), torch.bfloat16)
    assert 'CUDA' in reason


def test_compiled_llm_blocks_take_the_mask_object_and_match_the_additive_mask():
    """The served path's wiring on the CPU: fullgraph-compiled LLM blocks given the mask
    object (custom op, its CPU schedule) equal the eager model with the additive mask on
    every real token, right padding included."""
    from molmobot_policy.runtime.compile import compile_repeated_blocks_
    from molmobot_policy.runtime.serving import image_tokens_mask
    model = random_model(TINY, seed=0).eval()
    tok, per_image = TINY.tokens, TINY.tokens_per_image
    ids = [tok.bos]
    for k in range(2):
        ids += [259, 267 + k, tok.im_start] + [tok.im_patch] * per_image + [tok.im_end]
    ids += [tok.chat_im_start, 313, 198, 280, tok.chat_im_end] + [tok.bos] * 7
    input_ids = torch.tensor([ids])
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    mask[0, -7:] = False
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (1, 2, 729, 588), generator=g, dtype=torch.uint8)
    rows, cols = torch.arange(14).repeat_interleave(14), torch.arange(14).repeat(14)
    window = [(2 * rows + i) * 27 + 2 * cols + j for i in (0, 1) for j in (0, 1)]
    valid = [(2 * rows + i < 27) & (2 * cols + j < 27) for i in (0, 1) for j in (0, 1)]
    pool = torch.where(torch.stack(valid, 1), torch.stack(window, 1), -1)
    pool = torch.cat([torch.where(pool >= 0, pool + 729 * k, -1) for k in range(2)])[None]
    with torch.no_grad():
        want = model.llm_hidden_states(input_ids, images, pool, attention_mask=mask)
        compile_repeated_blocks_(model)
        got = model.llm_hidden_states(input_ids, images, pool, attention_mask=mask,
                                      llm_mask=image_tokens_mask(model))
    torch.testing.assert_close(got[:, :, mask[0]], want[:, :, mask[0]], rtol=1e-4, atol=1e-4)


def test_auto_serves_the_additive_mask_on_the_cpu_and_says_why():
    from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine
    engine = PolicyEngine(EngineConfig(model='tiny'))
    assert engine.mode['llm_attention'].startswith('masked (needs a CUDA device')
    assert engine.served.llm_mask is None


def test_flash_is_refused_without_cuda():
    from molmobot_policy.runtime.config import EngineConfig
    with pytest.raises(ValueError, match='llm_attention=flash needs a CUDA device'):
        EngineConfig(model='tiny', llm_attention='flash')


def test_auto_falls_back_with_a_warning_when_the_kernel_fails_its_self_check(monkeypatch,
                                                                             caplog):
    """A capable GPU whose kernel computes wrongly: auto serves the additive mask and warns;
    flash refuses to serve, naming the failure."""
    import logging
    from types import SimpleNamespace
    from molmobot_policy.runtime.serving import llm_attention_choice
    failure = 'the kernel failed its self-check: relative error 1.00e-01 > 2e-02'
    monkeypatch.setattr(fa, 'unavailable_reason', lambda *args: '')
    monkeypatch.setattr(fa, 'self_check', lambda *args: failure)
    model = random_model(TINY, seed=0)
    with caplog.at_level(logging.INFO, logger='molmobot_policy.engine'):
        auto = SimpleNamespace(llm_attention='auto')    # EngineConfig refuses flash on a CPU
        assert llm_attention_choice(auto, model) == ('masked', failure)
    assert [r.levelno for r in caplog.records if failure in r.getMessage()] == [logging.WARNING]
    with pytest.raises(ValueError, match='relative error'):
        llm_attention_choice(SimpleNamespace(llm_attention='flash'), model)


def test_flash_is_refused_in_float32_before_the_model_is_built():
    from molmobot_policy.runtime.config import EngineConfig
    with pytest.raises(ValueError, match="llm_attention=flash needs dtype 'bfloat16'"):
        EngineConfig(model='tiny', device='cuda', dtype='float32', llm_attention='flash')
