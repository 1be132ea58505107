"""benchmarks/probe_masked_attention.py (issue 20): the Triton kernel that computes the served
mask in registers, on the CPU through Triton's interpreter (TRITON_INTERPRET=1), against
float32 math attention with the boolean mask (`MolmoBot.attention_allowed`'s rule); and
its tile plan against the mask it summarizes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip('triton')
BENCHMARKS = Path(__file__).resolve().parents[1] / 'benchmarks'
sys.path.insert(0, str(BENCHMARKS))

import probe_masked_attention as probe  # noqa: E402

CHECK = r'''
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
import probe_masked_attention as probe
torch.manual_seed(0)
block_m, block_n = int(sys.argv[2]), int(sys.argv[3])
length, heads, kv_heads, dim = 100, 4, 2, 16
is_image, valid = probe.served_layout(length=length, prompt=93, cameras=3, labels=2,
                                      image_tokens=20)
q = torch.randn(1, heads, length, dim, dtype=torch.float16)
k = torch.randn(1, kv_heads, length, dim, dtype=torch.float16)
v = torch.randn(1, kv_heads, length, dim, dtype=torch.float16)
expected = probe.reference(q, k, v, is_image, valid)
got = probe.masked_attention(q, k, v, is_image, valid, block_m=block_m, block_n=block_n)
causal_only = probe.reference(q, k, v, torch.zeros_like(is_image), valid)
scale = expected.abs().max()
print(json.dumps({'err': float((got.float() - expected).abs().max() / scale),
                  'causal_only_err': float((causal_only - expected).abs().max() / scale)}))
'''


@pytest.mark.parametrize('block_m, block_n', [(32, 16), (16, 32)])
def test_interpreted_kernel_matches_float32_math_under_the_served_mask(block_m, block_n):
    env = dict(os.environ, TRITON_INTERPRET='1')
    out = subprocess.run([sys.executable, '-c', CHECK, str(BENCHMARKS), str(block_m),
                          str(block_n)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r['err'] < 2e-3, r                     # float16 rounding
    assert r['causal_only_err'] > 0.05, r         # the image block matters at this layout


def test_the_tile_plan_summarizes_the_mask():
    is_image, valid = probe.served_layout(length=100, prompt=93, cameras=3, labels=2,
                                          image_tokens=20)
    allowed = probe.allowed_mask(is_image, valid)
    kinds, kv_end = probe.tile_plan(allowed, 32, 16)
    assert kinds.shape == (1, 4, 7) and kv_end.shape == (1, 4)
    for qb in range(4):
        rows = slice(32 * qb, min(32 * qb + 32, 100))
        seen = allowed[0, rows].nonzero()[:, 1]
        assert kv_end[0, qb] >= seen.max() + 1           # no visible key beyond the loop
        for kb in range(7):
            tile = allowed[0, rows, 16 * kb:min(16 * kb + 16, 100)]
            kind = int(kinds[0, qb, kb])
            if kind == probe.FULL:
                assert tile.all() and tile.shape == (32, 16)
            elif kind == probe.EMPTY:
                assert not tile.any()
            else:
                assert tile.any()
    assert (kinds == probe.FULL).any() and (kinds == probe.PARTIAL).any()
