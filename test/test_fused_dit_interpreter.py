"""The fused DiT kernel's math on the CPU, through Triton's interpreter (TRITON_INTERPRET=1).

The kernel (molmobot_policy/runtime/fused_dit.py) is GPU code; its phases run here one launch
at a time (`phased=True`: the persistent launch's grid barrier needs concurrent programs,
which the interpreter does not have; test_fused_dit_gpu.py checks that both give the same
bits on the GPU), and once as the persistent launch with a single program (its loop
order). The interpreter must be switched on before Triton compiles anything, so
each check runs in a fresh interpreter process. Tiny model, float16 (the interpreter has no
bfloat16), weights perturbed so that every gate and shift matters.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip('triton')

CHECK = r'''
import copy, json, sys
import torch
from molmobot_policy.model import checkpoint as ckpt
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.runtime import fused_dit

states_mode, padded, tiles = sys.argv[1], sys.argv[2] == '1', json.loads(sys.argv[3])
poison = sys.argv[4] == '1'     # the kernel's float scratch allocated full of NaN
persistent = sys.argv[5] == '1'  # the persistent launch (one program here: no real barrier)
cfg = MolmoBotConfig.from_name('tiny')
torch.manual_seed(0)
ae = ckpt.random_model(cfg, 0, torch.device('cpu'), torch.float32).action_expert
ae.states_mode = states_mode
with torch.no_grad():
    for p in ae.parameters():
        p.add_(torch.randn_like(p) * 0.05)
length = 45
hidden = torch.randn(len(ae.blocks), 1, length, cfg.llm.d_model)
mask = torch.ones(1, length, dtype=torch.bool)
if padded:
    mask[:, 33:] = False
states = torch.randn(1, 1, cfg.state_dim)
x_t = torch.randn(1, cfg.action_horizon, cfg.action_dim)

def blocks(a, dtype):
    ctx = a.prepare_context(hidden.to(dtype), mask, states.to(dtype))
    cond = a.time_conditioning(torch.tensor([0.3]))
    x = a.embed_actions(x_t.to(dtype), ctx.state_tokens)
    out = x
    for i, block in enumerate(a.blocks):
        out = block(out, cond.blocks[i], ctx.keys[i], ctx.values[i], ctx.mask_bias,
                    ctx.out_bias[i])
    return x, out, ctx, cond

with torch.inference_mode():
    _, ref32, _, _ = blocks(copy.deepcopy(ae), torch.float32)
    ae16 = copy.deepcopy(ae).half()
    x, ref16, ctx, cond = blocks(ae16, torch.float16)
    empty = torch.empty
    if poison:
        def nan_empty(*args, **kwargs):
            t = empty(*args, **kwargs)
            return t.fill_(float('nan')) if t.is_floating_point() else t
        torch.empty = nan_empty
    try:
        fused = fused_dit.FusedDiTStep(ae16, phased=not persistent, tiles=tiles)(
            x, cond.blocks, ctx)
    finally:
        torch.empty = empty
scale = ref32.abs().max()
print(json.dumps({'fused': float((fused.float() - ref32).abs().max() / scale),
                  'blocks': float((ref16.float() - ref32).abs().max() / scale),
                  'shape_ok': fused.shape == ref16.shape and fused.dtype == torch.float16,
                  'finite': bool(torch.isfinite(fused).all()),
                  'digest': fused.float().sum().item()}))
'''


VELOCITY_CHECK = r'''
import copy, dataclasses, json, sys
import torch
sys.path.insert(0, sys.argv[1])     # test/, for the re-derivation
import _dit_reference as ref
from molmobot_policy.model import checkpoint as ckpt
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.runtime import fused_dit

tiny = MolmoBotConfig.from_name('tiny')
cfg = tiny.replace(states_mode='self_attn', action_expert_layer_mode='even',
                   llm=dataclasses.replace(tiny.llm, n_layers=6),
                   action_expert=dataclasses.replace(tiny.action_expert, num_layers=3))
torch.manual_seed(0)
ae = ckpt.random_model(cfg, 0, torch.device('cpu'), torch.float32).action_expert
with torch.no_grad():
    for p in ae.parameters():
        p.add_(torch.randn_like(p) * 0.05)
length = 45
layers = torch.randn(len(ae.blocks), 1, length, cfg.llm.d_model)
mask = torch.ones(1, length, dtype=torch.bool)
mask[:, 33:] = False
states = torch.randn(1, 1, cfg.state_dim)
x_t = torch.randn(1, cfg.action_horizon, cfg.action_dim)
t = torch.tensor([0.3])
expected = ref.velocity({'action_expert.' + k: v for k, v in ae.state_dict().items()}, x_t, t,
                        list(layers), mask, states, states_mode='self_attn',
                        heads=cfg.action_expert.num_heads)
with torch.inference_mode():
    ae16 = copy.deepcopy(ae).half()
    ctx = ae16.prepare_context(layers.half(), mask, states.half())
    cond = ae16.time_conditioning(t)
    blocks16 = ae16.velocity_from_conditioning(x_t, cond, ctx)
    fused = ae16.velocity_from_conditioning(x_t, cond, ctx,
                                            fused_dit.FusedDiTStep(ae16, phased=True))
scale = expected.abs().max()
print(json.dumps({'fused': float((fused.float() - expected).abs().max() / scale),
                  'blocks': float((blocks16.float() - expected).abs().max() / scale),
                  'shape_ok': fused.shape == x_t.shape}))
'''


def run_check(states_mode: str, padded: bool, tiles: dict | None = None,
              poison: bool = False, persistent: bool = False) -> dict:
    env = dict(os.environ, TRITON_INTERPRET='1')
    out = subprocess.run([sys.executable, '-c', CHECK, states_mode, '1' if padded else '0',
                          json.dumps(tiles or {}), '1' if poison else '0',
                          '1' if persistent else '0'], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize('states_mode, padded', [('cross_attn', True), ('self_attn', False)])
def test_interpreted_kernel_matches_float32_no_worse_than_the_fp16_blocks(states_mode, padded):
    r = run_check(states_mode, padded)
    assert r['shape_ok']
    # the kernel keeps the residual stream in float32: no worse than the fp16 blocks
    assert r['fused'] <= max(1.5 * r['blocks'], 2e-3), r


def test_interpreted_kernel_self_attn_velocity_matches_the_float32_re_derivation():
    """The whole velocity through the kernel in self_attn mode (state token at position 0,
    actions at 1..H, the state token dropped before the final layer), 3 blocks fed by even
    layers, against the plain float32 re-derivation of test/_dit_reference.py."""
    env = dict(os.environ, TRITON_INTERPRET='1')
    out = subprocess.run([sys.executable, '-c', VELOCITY_CHECK, os.path.dirname(__file__)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r['shape_ok']
    assert r['fused'] <= max(1.5 * r['blocks'], 2e-3), r
    assert r['fused'] < 1e-2, r      # float16 rounding, not a different function


def test_interpreted_kernel_with_fc2_unsplit_agrees():
    """KS2=1 (fc2 in one piece per tile) against the default split-K fc2: same math."""
    r = run_check('cross_attn', True, {'KS2': 1})
    assert r['fused'] <= max(1.5 * r['blocks'], 2e-3), r


def test_interpreted_kernel_reads_no_scratch_it_has_not_written():
    """Every float scratch buffer of the step (the residual stream, xm, the row statistics,
    the partials, the output) allocated full of NaN: the kernel writes before it reads
    (its prologue fills x, xm and the statistics; unused statistics tiles and padding rows
    are masked), so the result stays finite and as accurate."""
    r = run_check('self_attn', True, poison=True)
    assert r['finite'], r
    assert r['fused'] <= max(1.5 * r['blocks'], 2e-3), r


def test_interpreted_persistent_launch_equals_the_phased_launches():
    """The persistent launch's loop (prologue before block 0, then 9 phases per block) run by
    one program (its barriers pass at once) against one launch per phase: the same result."""
    phased = run_check('cross_attn', True)
    persistent = run_check('cross_attn', True, persistent=True)
    assert persistent['fused'] == phased['fused'] and persistent['digest'] == phased['digest']


def test_keys_and_values_with_different_strides_are_refused():
    """The kernel reads K and V with one set of strides; a mismatch is an error, not
    garbage (checked before anything is compiled or launched)."""
    import torch

    from molmobot_policy.model import checkpoint as ckpt
    from molmobot_policy.model.action_expert import ActionExpertContext
    from molmobot_policy.model.config import MolmoBotConfig
    from molmobot_policy.runtime import fused_dit

    cfg = MolmoBotConfig.from_name('tiny')
    ae = ckpt.random_model(cfg, seed=0, dtype=torch.float16).action_expert
    n, d, h = len(ae.blocks), cfg.action_expert.hidden_size, cfg.action_expert.num_heads
    keys = torch.zeros(n, 1, h, 32, d // h, dtype=torch.float16)
    values = torch.zeros(n, 1, 32, h, d // h, dtype=torch.float16).transpose(2, 3)
    ctx = ActionExpertContext(keys, values, torch.zeros(1, 1, 1, 32, dtype=torch.float16),
                              torch.zeros(1, 1, d, dtype=torch.float16),
                              torch.zeros(n, d, dtype=torch.float16))
    step = fused_dit.FusedDiTStep(ae, phased=True)
    with pytest.raises(ValueError, match='one set of strides'):
        step(torch.zeros(1, 16, d, dtype=torch.float16),
             torch.zeros(n, 9, 1, d, dtype=torch.float16), ctx)
