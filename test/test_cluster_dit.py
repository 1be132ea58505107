"""The cluster DiT kernel's host side on the CPU (runtime/cluster_dit.py): the weights and the
cross-attention K/V in the mma fragment order the kernel reads, each CTA's stream holding the
rows and columns of its share, and the reasons it does not serve. The kernel itself runs on
the GPU (test_cluster_dit_gpu.py)."""
from __future__ import annotations

import types

import pytest
import torch

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.model import checkpoint as ckpt
from molmobot_policy.runtime import cluster_dit as cd

D, F, HD = cd.D, cd.F, cd.HD


def fragment(w: torch.Tensor, n: int, s: int, lane: int) -> torch.Tensor:
    """Lane `lane`'s B registers of n-tile n, k-step s of mma.m16n8k16 (PTX ISA, "Matrix
    fragments for mma.m16n8k16"): b0 = W[8n + g, 16s + 2t + (0, 1)], b1 = the same + 8."""
    g, t = lane // 4, lane % 4
    row, k = 8 * n + g, 16 * s + 2 * t
    return torch.stack([w[row, k], w[row, k + 1], w[row, k + 8], w[row, k + 9]])


def test_pack_b_puts_every_lanes_fragment_in_its_8_bytes():
    w = torch.randn(24, 48)
    packed = cd.pack_b(w)
    assert packed.shape == (3, 3, 32, 4)
    for n in range(3):
        for s in range(3):
            for lane in range(32):
                assert torch.equal(packed[n, s, lane], fragment(w, n, s, lane))


@pytest.fixture(scope='module')
def stacked():
    nb = 2
    g = torch.Generator().manual_seed(0)
    shapes = dict(wq1=(D, D), wkv1=(2 * D, D), wo1=(D, D), wq2=(D, D), wo2=(D, D), w1=(F, D),
                  w2=(D, F))
    w = types.SimpleNamespace(**{k: torch.randn(nb, *s, generator=g) for k, s in shapes.items()})
    return w, cd.pack_weights(w)


@pytest.mark.parametrize('h, r', [(0, 0), (3, 1), (7, 6)])
def test_each_ctas_stream_holds_its_share_of_the_block(stacked, h, r):
    """Slot by slot (cluster_dit.cu's item order): q|k|v n-tiles of head h (4 or 5 of 36),
    the self proj's columns of head h for output columns [96 r, 96 r + 96), cross q n-tiles
    (1 or 2 of 12), the cross proj likewise, fc1 rows of hidden units [384 h + 48 r, +48), fc2
    columns of the cluster's 384 hidden units for output columns [96 r, +96)."""
    w, wp = stacked
    b = 1
    slot = cd.SLOT_E
    stream = wp[b, h, r]
    assert stream.shape == (cd.WSLOTS * slot,)
    heads = torch.cat([w.wq1[b, h * HD:(h + 1) * HD], w.wkv1[b, h * HD:(h + 1) * HD],
                       w.wkv1[b, D + h * HD:D + (h + 1) * HD]])
    j0, nt = cd._split(36, r)
    assert nt in (4, 5)
    for i in range(5):
        got = stream[i * slot:(i + 1) * slot]
        if i < nt:
            assert torch.equal(got, cd.pack_b(heads[8 * (j0 + i):8 * (j0 + i + 1)]).reshape(-1))
        else:
            assert not got.any()                 # never copied: zero bytes in its item
    cols = slice(96 * r, 96 * (r + 1))
    o1 = cd.pack_b(w.wo1[b, cols, h * HD:(h + 1) * HD]).reshape(-1)
    assert torch.equal(stream[5 * slot:5 * slot + o1.numel()], o1)
    q0, nq = cd._split(12, r)
    for i in range(nq):
        expected = cd.pack_b(w.wq2[b, h * HD + 8 * (q0 + i):h * HD + 8 * (q0 + i + 1)])
        assert torch.equal(stream[(7 + i) * slot:(8 + i) * slot], expected.reshape(-1))
    o2 = cd.pack_b(w.wo2[b, cols, h * HD:(h + 1) * HD]).reshape(-1)
    assert torch.equal(stream[9 * slot:9 * slot + o2.numel()], o2)
    hid = slice(384 * h + 48 * r, 384 * h + 48 * (r + 1))
    assert torch.equal(stream[11 * slot:17 * slot], cd.pack_b(w.w1[b, hid]).reshape(-1))
    assert torch.equal(stream[17 * slot:23 * slot],
                       cd.pack_b(w.w2[b, cols, 384 * h:384 * (h + 1)]).reshape(-1))


def test_packed_context_keeps_each_ctas_keys_contiguous():
    """Keys: n-tiles of 8 keys (k-steps over the head dim); values: k-steps of 16 keys, each
    holding the 12 n-tiles of head dims; both from strided views as the engine serves them."""
    nb, h, s = 2, cd.H, 160
    kv = torch.randn(nb, 1, s, 2, h, HD)               # the served (.., S, 2, H, hd) GEMM output
    keys, values = kv[:, :, :, 0].transpose(2, 3), kv[:, :, :, 1].transpose(2, 3)
    kp, vp = cd.pack_context(keys, values)
    assert kp.shape == vp.shape == (nb, h, s * HD)
    k = kp[1, 5].view(s // 8, HD // 16, 32, 4)
    v = vp[1, 5].view(s // 16, HD // 8, 32, 4)
    vt = values[1, 0, 5].transpose(0, 1)                # B of P V: W[d, key]
    for lane in (0, 13, 31):
        assert torch.equal(k[7, 2, lane], fragment(keys[1, 0, 5], 7, 2, lane))
        assert torch.equal(v[4, 9, lane], fragment(vt, 9, 4, lane))


def test_the_kernel_does_not_serve_where_it_cannot_and_says_why():
    tiny = ckpt.random_model(MolmoBotConfig.from_name('tiny'), 0, torch.device('cpu'),
                             torch.float32).action_expert
    assert cd.unavailable_reason(tiny, torch.device('cpu'), torch.bfloat16) == \
        'needs a CUDA device, serving on cpu'
