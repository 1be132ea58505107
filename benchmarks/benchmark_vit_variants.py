"""The ViT's MLP and attention kernels at full size: which variant the model should run.

The SigLIP so400m-shaped ViT of the 8-camera preset (25 built blocks, 8 images x 729
patches, bf16, attention in bf16 as the engine serves it), blocks compiled as the engine
compiles them, the whole stack replayed as one CUDA graph. MLP variants (w2(gelu_tanh(w1 x))):

- `F.gelu`: Linear, then tanh-GELU (Inductor fuses the GELU into one pointwise kernel; w2
  then reads a stride-padded input and loses its cuBLASLt bias epilogue);
- `cuBLASLt GELU epilogue`: w1 + bias + GELU as one `torch._addmm_activation` GEMM (what
  `vision.ViTMLP` runs on CUDA);
- `custom op`: the same two GEMMs hidden from Inductor in a `torch.library` op.

Attention projections: wq / wk / wv as three GEMMs (upstream's parameters as loaded) or as
one q|k|v GEMM over the same parameters stacked in place (`stack_qkv_`, what the engine
serves: N = 3456 instead of 3 x 1152, fewer and fuller waves on 132 SMs). Both with the
engine's one-pass row reductions (`runtime.engine.wide_row_reductions`), three GEMMs also
without them.

Also: SDPA backends at the ViT's attention shape (8 x 16 heads x 729 x 72), and which GELU
cuBLASLt's epilogue computes (float32 in and out, pre-activations over [-4, 4]).
Errors are max |difference| / max |reference| against the same ViT run eagerly.

    python3 benchmarks/benchmark_vit_variants.py --out $OUT/vit_variants.json   (CUDA only)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmark_llm_attention import time_graph  # noqa: E402

from molmobot_policy.model import vision  # noqa: E402
from molmobot_policy.runtime import compile as engine  # noqa: E402  (its compile helpers)
from molmobot_policy.model.config import MolmoBotConfig  # noqa: E402


def timed(fn, iters: int) -> tuple[dict, torch.Tensor]:
    """(median / p99 ms of `fn` replayed as one CUDA graph, fn's output run eagerly)."""
    out = fn()
    return time_graph(fn, iters), out


def build_vit(cfg: MolmoBotConfig, dev: torch.device) -> vision.SiglipVisionTransformer:
    """The preset's ViT, random N(0, 0.02) weights, bf16, attention in bf16 (as served)."""
    torch.manual_seed(0)
    vit = vision.SiglipVisionTransformer(cfg.vit).to(dev, torch.bfloat16).eval()
    for p in vit.parameters():
        p.data.normal_(0, 0.02)
    for m in vit.modules():
        if isinstance(m, vision.ViTMultiHeadDotProductAttention):
            m.float32_attention = False
    return vit


def report(title: str, rows: list[dict], out: str | None, **extra) -> None:
    """Prints the rows (variant, median / p99 ms, relative error, or the failure) under
    `title` and writes them, with `extra`, as JSON to `out` (if given)."""
    width = max(len(r['variant']) for r in rows) + 2
    print(f'\n{title}; {torch.cuda.get_device_name()}, torch {torch.__version__}')
    print(f"{'variant':<{width}}{'median ms':>10}{'p99 ms':>9}{'rel err':>10}")
    for r in rows:
        if 'median_ms' in r:
            print(f"{r['variant']:<{width}}{r['median_ms']:>10.3f}{r['p99_ms']:>9.3f}"
                  f"{r['rel_err']:>10.2e}")
        else:
            print(f"{r['variant']:<{width}} failed: {r['error']}")
    if out:
        with open(out, 'w') as f:
            json.dump({'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'), 'command': ' '.join(sys.argv),
                       'gpu': torch.cuda.get_device_name(), 'torch': torch.__version__,
                       'rows': rows, **extra}, f, indent=1)


@torch.library.custom_op('molmobot_bench::vit_mlp', mutates_args=())
def vit_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
            b2: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    h = torch._addmm_activation(b1, x.reshape(-1, shape[-1]), w1.t(), use_gelu=True)
    return torch.addmm(b2, h, w2.t()).view(*shape[:-1], -1)


@vit_mlp.register_fake
def _(x, w1, b1, w2, b2):
    return x.new_empty(*x.shape[:-1], w2.shape[0])


def mlp_gelu(self, x):
    return self.w2(F.gelu(self.w1(x), approximate='tanh'))


def mlp_custom_op(self, x):
    return vit_mlp(x, self.w1.weight, self.w1.bias, self.w2.weight, self.w2.bias)


MLP_VARIANTS = {'F.gelu': mlp_gelu, 'cuBLASLt GELU epilogue': vision.ViTMLP.forward,
                'custom op': mlp_custom_op}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--iters', type=int, default=40)
    parser.add_argument('--out', default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print('needs CUDA')
        return 1
    from torch._inductor import config as inductor_config
    dev = torch.device('cuda')
    cfg = MolmoBotConfig.from_name('molmobot-4b-8cam')
    vit = build_vit(cfg, dev)
    x = torch.randn(8, 729, cfg.vit.patch_dim, device=dev, dtype=torch.bfloat16)
    rows = []
    with torch.inference_mode():
        ref = vit(x)[-1].float()
        for blk in vit.transformer.resblocks:
            blk.compile(dynamic=False, fullgraph=True)
        for name, fwd in MLP_VARIANTS.items():
            torch._dynamo.reset()
            for blk in vit.transformer.resblocks:
                blk.feed_forward.forward = fwd.__get__(blk.feed_forward)
            timing, out = timed(lambda: vit(x)[-1], args.iters)
            rows.append({'variant': f'ViT, MLP {name}', **timing,
                         'rel_err': float((out.float() - ref).abs().max() / ref.abs().max())})
            print(rows[-1], flush=True)
        for blk in vit.transformer.resblocks:       # back to the model's MLP
            blk.feed_forward.forward = vision.ViTMLP.forward.__get__(blk.feed_forward)
        attention_variants = (      # the last one stacks for good: keep it last
            ('three q / k / v GEMMs, Inductor defaults', False, 0),
            ('three q / k / v GEMMs, one-pass rows', False, engine.PERSISTENT_ROW_LIMIT),
            ('one q|k|v GEMM (stack_qkv_), one-pass rows (as served)', True,
             engine.PERSISTENT_ROW_LIMIT))
        for name, stacked, limit in attention_variants:
            torch._dynamo.reset()
            if stacked:
                for blk in vit.transformer.resblocks:
                    blk.attention.stack_qkv_()
            with inductor_config.patch(fx_graph_cache=False):   # fresh kernels per row
                timing, out = timed(engine.wide_row_reductions(lambda: vit(x)[-1], limit),
                                    args.iters)
            rows.append({'variant': f'ViT, {name}', **timing,
                         'rel_err': float((out.float() - ref).abs().max() / ref.abs().max())})
            print(rows[-1], flush=True)

        from torch.nn.attention import SDPBackend, sdpa_kernel
        q, k, v = (torch.randn(8, 729, 16, 72, device=dev, dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(3))
        ref_attn = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        for name, backend in (('cuDNN', SDPBackend.CUDNN_ATTENTION),
                              ('flash', SDPBackend.FLASH_ATTENTION),
                              ('efficient', SDPBackend.EFFICIENT_ATTENTION)):
            def attention(backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v)
            try:
                timing, out = timed(attention, 50)
                rows.append({'variant': f'ViT attention, {name}', **timing, 'rel_err': float(
                    (out.float() - ref_attn).abs().max() / ref_attn.abs().max())})
            except RuntimeError as exc:
                rows.append({'variant': f'ViT attention, {name}', 'error': str(exc)[:200]})
            print(rows[-1], flush=True)

        a = torch.zeros(4096, 16, device=dev)
        a[:, 0] = torch.linspace(-4, 4, 4096, device=dev)
        pick = torch.zeros(16, 16, device=dev)
        pick[0] = 1
        epilogue = torch._addmm_activation(torch.zeros(16, device=dev), a, pick,
                                           use_gelu=True)[:, 0]
        gelu_form = {'max_abs_vs_tanh': float((epilogue - F.gelu(a[:, 0], approximate='tanh'))
                                              .abs().max()),
                     'max_abs_vs_erf': float((epilogue - F.gelu(a[:, 0])).abs().max())}
        print('cuBLASLt GELU epilogue, float32:', gelu_form)

    report('ViT variants: 25 blocks x 8 images x 729 patches, bf16', rows, args.out,
           gelu_epilogue=gelu_form)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
