"""Where fp8 in the vision tower puts the actions off (issue 20, part 2), before any kernel.

An earlier all-ViT fp8 attempt moved the actions 6.7 % (max) of the action range off the bf16
default (docs/decisions/fp8.md). This measures which ViT Linears and which activations that
comes from: the model's reference `MolmoBot.generate_actions` (the plain forward, bf16 on a
GPU) with e4m3 *fake quantization* (quantize, then dequantize, with the scales of
`model/fp8.py`: row-wise for the weights, per token for the activations; the matmul stays in
the parameter dtype, so only the rounding of fp8 is measured) applied to one set of
Linears at a time:

- `llm`: the LLM's Linears (what `quantize: fp8` serves): the calibration row, to read
  against that rung's deviation in docs/PERFORMANCE.md;
- `all`: every Linear of every ViT block (attention wq, wk, wv, wo; MLP w1, w2);
- `kind:<name>`: one kind in every block (`qkv`, `wo`, `w1`, `w2`);
- `block:<i>`: every Linear of block i;
- `kind:<name>/weights`, `/activations`: that kind with only one side quantized;

and reports the deviation of the normalized actions from the unquantized run (max and mean
|difference| over the action range of 2, in %, max over `--inputs` observations), plus the
shape of every kind's input activations (per-token amax / rms: row-wise scaling is hurt by
large values within a token; channel amax / median channel amax: per-token scales cannot
help outlier channels). Random weights unless `--checkpoint`: their activations lack a
trained model's outliers, so read the ranking with that in mind.

    python3 benchmarks/fp8_vit_sensitivity.py --out $OUT/fp8_vit.json            (H200)
    python3 benchmarks/fp8_vit_sensitivity.py --weight-group 128 --only llm,all,kind: ...
    .venv/bin/python benchmarks/fp8_vit_sensitivity.py --preset tiny --device cpu --blocks 2
"""
from __future__ import annotations

import argparse
import contextlib
import time

import numpy as np
import torch

import common
from molmobot_policy.model.fp8 import E4M3_MAX

KINDS = {'qkv': ('attention.wq', 'attention.wk', 'attention.wv'), 'wo': ('attention.wo',),
         'w1': ('feed_forward.w1',), 'w2': ('feed_forward.w2',)}


def fake_e4m3(x: torch.Tensor, group: int = 0) -> torch.Tensor:
    """x quantized to e4m3 with one scale per row (last dim), or per `group` consecutive
    elements of a row when group > 0 (the 1 x 128 blocks of block-scaled fp8 GEMMs; a short
    last group where it does not divide the row), then back to x's dtype (the scaling of `model.fp8`: amax / 448,
    amax clamped to >= 1e-12)."""
    shape = x.shape
    xf = x.float()
    if group:
        pad = -shape[-1] % group             # a short last group (the ViT's 4304-wide w2)
        xf = torch.nn.functional.pad(xf, (0, pad)).reshape(*shape[:-1], -1, group)
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / E4M3_MAX
    q = ((xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale)
    if group:
        q = q.flatten(-2)[..., :shape[-1]]
    return q.reshape(shape).to(x.dtype)


def llm_linears(model):
    """(block index, 'llm', nn.Linear) of the LLM blocks: what `quantize: fp8` quantizes, the
    calibration row (its real-kernel deviation is in docs/PERFORMANCE.md)."""
    for i, block in enumerate(model.transformer.blocks):
        for name in ('att_proj', 'attn_out', 'ff_proj', 'ff_out'):
            yield i, 'llm', getattr(block, name)


def linears(model, kinds=tuple(KINDS), blocks=None):
    """(block index, kind, nn.Linear) of the ViT blocks."""
    resblocks = model.vision_backbone.image_vit.transformer.resblocks
    for i, block in enumerate(resblocks):
        if blocks is not None and i not in blocks:
            continue
        for kind in kinds:
            for path in KINDS[kind]:
                yield i, kind, block.get_submodule(path)


@contextlib.contextmanager
def quantized(layers, weights: bool = True, activations: bool = True, weight_group: int = 0):
    """The Linears in `layers` with fake-e4m3 weights (scales per row, or per `weight_group`
    inputs of a row) and / or inputs (per token) while inside."""
    saved, hooks = [], []
    with torch.no_grad():
        for _, _, lin in layers:
            if weights:
                saved.append((lin, lin.weight.detach().clone()))
                lin.weight.copy_(fake_e4m3(lin.weight, weight_group))
            if activations:
                hooks.append(lin.register_forward_pre_hook(
                    lambda _m, args: (fake_e4m3(args[0]),) + tuple(args[1:])))
    try:
        yield
    finally:
        with torch.no_grad():
            for lin, w in saved:
                lin.weight.copy_(w)
        for h in hooks:
            h.remove()


def activation_shapes(model, run) -> dict:
    """Per kind, over every block: max of (per-token amax / per-token rms) and of (channel
    amax / median channel amax) of the Linears' inputs, from one run."""
    stats = {kind: {'token_amax_over_rms': 0.0, 'channel_amax_over_median': 0.0}
             for kind in KINDS}
    hooks = []

    def record(kind):
        def hook(_m, args):
            x = args[0].detach().float().flatten(0, -2)
            rms = x.pow(2).mean(-1).sqrt().clamp(min=1e-12)
            s = stats[kind]
            s['token_amax_over_rms'] = max(s['token_amax_over_rms'],
                                           float((x.abs().amax(-1) / rms).max()))
            ch = x.abs().amax(0)
            s['channel_amax_over_median'] = max(
                s['channel_amax_over_median'], float(ch.max() / ch.median().clamp(min=1e-12)))
        return hook
    seen = set()
    for _, kind, lin in linears(model):
        if kind == 'qkv' and id(lin) in seen:
            continue
        seen.add(id(lin))
        hooks.append(lin.register_forward_pre_hook(record(kind)))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--preset', default='molmobot-4b-8cam')
    ap.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    ap.add_argument('--dtype', default=None, help='default: bfloat16 on CUDA, float32 on CPU')
    ap.add_argument('--checkpoint', default='', help='a checkpoint directory (default: random)')
    ap.add_argument('--inputs', type=int, default=3, help='observations (seeds 1..N)')
    ap.add_argument('--blocks', type=int, default=None,
                    help='only the first N blocks get a block:<i> row (default all)')
    ap.add_argument('--weight-group', type=int, default=0,
                    help='one weight scale per this many inputs of a row (0: per row)')
    ap.add_argument('--only', default='',
                    help='comma list of variant name prefixes to run (default all), e.g. '
                         'all,kind:,llm')
    ap.add_argument('--out', default=None)
    args = ap.parse_args(argv)
    from molmobot_policy.model.checkpoint import load_checkpoint, random_model
    from molmobot_policy.model.config import MolmoBotConfig
    from molmobot_policy.preprocess.pipeline import Preprocessor
    from molmobot_policy.preprocess.tokenizer import resolve_tokenizer
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ('bfloat16' if dev.type == 'cuda' else 'float32'))
    cfg = MolmoBotConfig.from_name(args.preset)
    if args.checkpoint:
        model, cfg = load_checkpoint(args.checkpoint, device=dev, dtype=dtype)
    else:
        model = random_model(cfg, seed=0, device=dev, dtype=dtype)
    model = model.requires_grad_(False).eval()
    # the inputs as the engine builds them, without an engine: it would change the model for
    # serving (stacked q|k|v), and this measures the model's own forward
    tokenizer = resolve_tokenizer('auto', cfg.tokens, checkpoint_path=args.checkpoint)
    preprocessor = Preprocessor(cfg, tokenizer, device=dev)
    rng = np.random.default_rng(2)
    queries = []
    for seed in range(1, args.inputs + 1):
        obs = common.full_size_observation(cfg.max_images, cfg.state_dim, seed=seed,
                                           height=480 if dev.type == 'cuda' else 96,
                                           width=640 if dev.type == 'cuda' else 128)
        noise = torch.as_tensor(rng.standard_normal(
            (1, cfg.action_horizon, cfg.action_dim)).astype(np.float32), device=dev)
        queries.append((preprocessor(obs, obs.instruction).tensors(), noise))

    def actions():
        with torch.inference_mode():
            return [model.generate_actions(**t, noise=n).float().cpu() for t, n in queries]

    t0 = time.perf_counter()
    reference = actions()
    seconds = time.perf_counter() - t0
    n_blocks = len(model.vision_backbone.image_vit.transformer.resblocks)
    variants = [('llm', dict(layers=list(llm_linears(model)))),
                ('all', dict(layers=list(linears(model))))]
    for kind in KINDS:
        variants.append((f'kind:{kind}', dict(layers=list(linears(model, (kind,))))))
    for kind in KINDS:
        for side in ('weights', 'activations'):
            variants.append((f'kind:{kind}/{side}',
                             dict(layers=list(linears(model, (kind,))),
                                  weights=side == 'weights', activations=side == 'activations')))
    for i in range(n_blocks if args.blocks is None else min(args.blocks, n_blocks)):
        variants.append((f'block:{i}', dict(layers=list(linears(model, blocks={i})))))
    if args.only:
        prefixes = tuple(args.only.split(','))
        variants = [v for v in variants if v[0].startswith(prefixes)]
    print(f'{args.preset} on {args.device} ({dtype}), {args.inputs} inputs, {len(variants)} '
          f'variants, ~{seconds:.1f} s each; weight scales per '
          f"{args.weight_group or 'row'}", flush=True)
    rows = []
    for label, spec in variants:
        layers = spec.pop('layers')
        with quantized(layers, **spec, weight_group=args.weight_group):
            got = actions()
        diffs = [(g - r).abs() / 2.0 * 100 for g, r in zip(got, reference)]
        rows.append({'variant': label, 'linears': len({id(x[2]) for x in layers}),
                     'max_pct': max(float(d.max()) for d in diffs),
                     'mean_pct': max(float(d.mean()) for d in diffs)})
        print(f"{label:24s} max {rows[-1]['max_pct']:7.3f} %  mean {rows[-1]['mean_pct']:7.3f} %",
              flush=True)
    shapes = activation_shapes(model, lambda: actions())
    print('\ninput activations per kind (max over blocks and tokens):')
    for kind, s in shapes.items():
        print(f"  {kind:4s} token amax / rms {s['token_amax_over_rms']:8.2f}   channel amax / "
              f"median channel amax {s['channel_amax_over_median']:8.2f}")
    if args.out:
        common.write_json(args.out, {**common.provenance(), 'preset': args.preset,
                                     'checkpoint': args.checkpoint or None,
                                     'dtype': str(dtype), 'inputs': args.inputs,
                                     'weight_group': args.weight_group,
                                     'rows': rows, 'activations': shapes})
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
