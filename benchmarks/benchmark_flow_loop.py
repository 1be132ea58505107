"""The action expert's flow loop alone (10 Euler steps x 36 DiT blocks), in variants.

The loop is the largest stage of a query on the H200 (31.9 ms of ~69, 9100 kernel launches,
25 per block-step; benchmarks/RESULTS.md "Where the time goes"). This builds only the
full-size action expert (36 blocks x 768, 8 heads, cross-attention to an aligned 1680-token
context: a 1664-token bucket + 1 state token, padded to 16), random weights N(0, 0.02),
bf16, blocks compiled as the engine compiles them, the 10-step loop replayed as one CUDA
graph, and times block-step variants that keep the math:

- `current`: molmobot_policy.model.action_expert.DiTBlock as shipped;
- `fused self q/kv`: the self-attention's q_proj and kv_proj as one GEMM (weights
  concatenated once);
- `+ self-attn as reductions`: the 16 x 16 self-attention written as broadcast products
  summed in float32 instead of two batched matmuls, so that inductor can fuse it with the
  reshapes and the softmax instead of launching copies and GEMMs;
- `+ cross-attn as reductions`: the same for the 16 x 1680 cross-attention (expected slower:
  it reads K once per query row);
- `fused adaLN GEMMs (Triton)`: every Linear of the block as a Triton kernel with the rest
  of its sub-layer fused in (benchmarks/fused_dit_kernels.py): LayerNorm + modulation in the
  prologue of the fused self q/kv GEMM, the cross-attention q_proj and fc1 (+ GELU), the
  gated residual in the epilogue of both attention projections and fc2; the attention itself
  as in `current`. Needs CUDA and Triton (else skipped, with the reason); the kernels are
  `torch.library.triton_op`s, and opaque `custom_op`s if those fail to compile.

Each row: median / p99 ms of the graphed loop, kernel launches per loop (torch.profiler on
the compiled, ungraphed loop), max |difference| of the loop output from `current` relative to
its max |value|. `python3 benchmarks/benchmark_flow_loop.py --out $OUT/flow_loop.json`; on a
machine without CUDA it runs the tiny shapes once as a correctness smoke test.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)

import fused_dit_kernels as fdk  # noqa: E402
from benchmark_fused_dit import build  # noqa: E402
from molmobot_policy.model import action_expert as ae_mod  # noqa: E402
from molmobot_policy.runtime.graphs import StaticRunner  # noqa: E402
from profile_stages import time_runner  # noqa: E402

ORIGINAL_FORWARD = ae_mod.DiTBlock.forward


def _fused_qkv(block):
    if not hasattr(block, '_bench_qkv_w'):
        a = block.attn1
        block._bench_qkv_w = torch.cat([a.q_proj.weight, a.kv_proj.weight]).detach()
        block._bench_qkv_b = torch.cat([a.q_proj.bias, a.kv_proj.bias]).detach()
    return block._bench_qkv_w, block._bench_qkv_b


def _self_attn_matmul(block, h):
    a = block.attn1
    w, b = _fused_qkv(block)
    bsz, n, dim = h.shape
    q, k, v = F.linear(h, w, b).view(bsz, n, 3, a.n_heads, a.head_dim).unbind(2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(q * a.head_dim ** -0.5, k.transpose(-1, -2)).float()
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return a.proj(torch.matmul(probs, v).transpose(1, 2).reshape(bsz, n, dim))


def _attn_reduce(q, k, v, scale, bias=None):
    """q (B, T, H, hd), k/v (B, S, H, hd) -> (B, T, H, hd); float32 products and sums."""
    scores = (q.float().unsqueeze(2) * k.float().unsqueeze(1)).sum(-1) * scale  # B T S H
    if bias is not None:
        scores = scores + bias
    probs = torch.softmax(scores, dim=2)
    return (probs.unsqueeze(-1) * v.float().unsqueeze(1)).sum(2).to(q.dtype)


def _self_attn_reduce(block, h):
    a = block.attn1
    w, b = _fused_qkv(block)
    bsz, n, dim = h.shape
    q, k, v = F.linear(h, w, b).view(bsz, n, 3, a.n_heads, a.head_dim).unbind(2)
    return a.proj(_attn_reduce(q, k, v, a.head_dim ** -0.5).reshape(bsz, n, dim))


def _cross_attn_reduce(block, x, k, v, bias, out_bias):
    a = block.attn2
    bsz, n, dim = x.shape
    q = a.q_proj(x).view(bsz, n, a.n_heads, a.head_dim)
    # cached K/V are (B, H, S, hd); bias (B, 1, 1, S) -> (B, 1, S, 1)
    out = _attn_reduce(q, k.transpose(1, 2), v.transpose(1, 2), a.head_dim ** -0.5,
                       bias[:, 0, 0, :, None].unsqueeze(1))
    return F.linear(out.reshape(bsz, n, dim), a.proj.weight, out_bias)


def make_forward(self_attn, cross_reduce):
    def forward(self, x, mod, k, v, bias, out_bias):
        sh1, sc1, g1, sh2, sc2, g2, sh3, sc3, g3 = mod.unbind(0)
        h = ae_mod.modulate(self.norm1(x), sh1, sc1)
        x = x + g1.unsqueeze(1) * self_attn(self, h)
        h = ae_mod.modulate(self.norm2(x), sh2, sc2)
        if cross_reduce:
            x = x + g2.unsqueeze(1) * _cross_attn_reduce(self, h, k, v, bias, out_bias)
        else:
            x = x + g2.unsqueeze(1) * self.attn2.attend(h, k, v, bias, out_bias)
        return x + g3.unsqueeze(1) * self.mlp(ae_mod.modulate(self.norm3(x), sh3, sc3))
    return forward


def _attention(q, k, v, scale, bias=None):
    """`Attention.attend` after its q_proj: q (B, H, T, hd) unscaled, k/v (B, H, S, hd),
    bias (B, 1, 1, S) or None -> (B, T, H * hd); float32 softmax."""
    scores = torch.matmul(q * scale, k.transpose(-1, -2)).float()
    if bias is not None:
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def make_fused_forward(adaln_linear, gated_linear):
    """Block-step of seven fused Linears (fused_dit_kernels ops) around the two attentions."""
    def forward(self, x, mod, k, v, bias, out_bias):
        sh1, sc1, g1, sh2, sc2, g2, sh3, sc3, g3 = mod.unbind(0)
        a1, a2, mlp = self.attn1, self.attn2, self.mlp
        bsz, n, _ = x.shape
        qkv = adaln_linear(x, sh1, sc1, *_fused_qkv(self))  # q | keys | values
        q1, k1, v1 = qkv.view(bsz, n, 3, a1.n_heads, a1.head_dim).transpose(1, 3).unbind(2)
        x = gated_linear(_attention(q1, k1, v1, a1.head_dim ** -0.5), a1.proj.weight,
                         a1.proj.bias, g1, x)
        q2 = adaln_linear(x, sh2, sc2, a2.q_proj.weight, a2.q_proj.bias)
        q2 = q2.view(bsz, n, a2.n_heads, a2.head_dim).transpose(1, 2)
        x = gated_linear(_attention(q2, k, v, a2.head_dim ** -0.5, bias), a2.proj.weight,
                         out_bias, g2, x)
        h = adaln_linear(x, sh3, sc3, mlp.fc1.weight, mlp.fc1.bias, True)
        return gated_linear(h, mlp.fc2.weight, mlp.fc2.bias, g3, x)
    return forward


FUSED = 'fused adaLN GEMMs (Triton)'
VARIANTS = {
    'current': ORIGINAL_FORWARD,
    'fused self q/kv': make_forward(_self_attn_matmul, False),
    '+ self-attn as reductions': make_forward(_self_attn_reduce, False),
    '+ cross-attn as reductions': make_forward(_self_attn_reduce, True),
    FUSED: None,  # built per kind of op in `variant_forwards`
}


def variant_forwards(name, cuda):
    """name -> ([(label, DiTBlock.forward), ...] to try in order, reason to skip or None)."""
    if name != FUSED:
        return [(None, VARIANTS[name])], None
    missing = [reason for ok, reason in ((cuda, 'no CUDA device'),
                                         (fdk.AVAILABLE, fdk.UNAVAILABLE_REASON)) if not ok]
    if missing:
        return [], 'needs CUDA and Triton: ' + '; '.join(missing)
    return [(kind, make_fused_forward(*ops)) for kind, ops in fdk.OPS.items()], None


def launches(fn, inputs) -> int:
    from torch.profiler import ProfilerActivity, profile
    fn(**inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(**inputs)
        torch.cuda.synchronize()
    return int(sum(e.count for e in prof.key_averages() if e.self_device_time_total > 0))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--context', type=int, default=1664, help='LLM tokens (the bucket)')
    parser.add_argument('--iters', type=int, default=50)
    parser.add_argument('--out', default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device('cuda' if cuda else 'cpu')
    dtype = torch.bfloat16 if cuda else torch.float32
    ae, hidden, mask, states, noise = build(args.context if cuda else 40, dev,
                                            'molmobot-4b-8cam' if cuda else 'tiny', dtype)
    steps = 10
    with torch.inference_mode():
        ctx = ae.prepare_context(hidden, mask, states)
        cond = [ae.time_conditioning(torch.full((1,), i / steps, device=dev))
                for i in range(steps)]

        def loop_fn(noise, keys, values, mask_bias, state_tokens, out_bias):
            c = ae_mod.ActionExpertContext(keys, values, mask_bias, state_tokens, out_bias)
            x = noise
            for i in range(steps):
                x = x + (1.0 / steps) * ae.velocity_from_conditioning(x, cond[i], c)
            return x.float()

        inputs = dict(noise=noise, keys=ctx.keys, values=ctx.values, mask_bias=ctx.mask_bias,
                      state_tokens=ctx.state_tokens, out_bias=ctx.out_bias)
        for block in ae.blocks:  # the fused variants' weights, concatenated outside compile
            _fused_qkv(block)

        def measure(forward):
            """Installs `forward`, compiles, graphs and times the loop -> (row fields, out)."""
            ae_mod.DiTBlock.forward = forward
            torch._dynamo.reset()
            for block in ae.blocks:
                block.compile(dynamic=False, fullgraph=True)
            t0 = time.perf_counter()
            runner = StaticRunner(loop_fn, inputs, cuda_graph=cuda)
            fields = {'warmup_s': time.perf_counter() - t0}
            runner.load(**inputs)
            out = runner.run().clone()
            if cuda:
                timing = time_runner(runner, args.iters)
                fields['median_ms'], fields['p99_ms'] = timing['median'], timing['p99']
                fields['launches'] = launches(loop_fn, inputs)
            return fields, out

        rows, reference = [], None
        for name in VARIANTS:
            candidates, skip = variant_forwards(name, cuda)
            row = {'variant': name, 'skipped': skip} if skip else None
            failures = []  # candidates that failed, before the one measured (if any)
            for kind, forward in candidates:
                try:
                    fields, out = measure(forward)
                except Exception as exc:  # noqa: BLE001 - a variant may fail to compile
                    failures.append(f"{kind + ': ' if kind else ''}{type(exc).__name__}: "
                                    f"{str(exc)[:300]}")
                    continue
                if reference is None:
                    reference = out
                err = float((out - reference).abs().max() / reference.abs().max())
                row = {'variant': name, **({'ops': kind} if kind else {}), **fields,
                       'rel_diff_vs_current': err}
                break
            if failures and row is None:
                row = {'variant': name, 'error': ' | '.join(failures)}
            elif failures:
                row['failed_first'] = ' | '.join(failures)
            rows.append(row)
            print(row, flush=True)
        ae_mod.DiTBlock.forward = ORIGINAL_FORWARD

    print(f'\nflow loop: {steps} steps x {len(ae.blocks)} blocks x {ae.cfg.hidden_size}, '
          f'{ae.cfg.num_heads} heads, context {ctx.keys.shape[-2]} tokens, {dtype}; '
          f'{torch.cuda.get_device_name() if cuda else "CPU smoke test"}')
    print(f"{'variant':<30}{'median ms':>10}{'p99 ms':>9}{'launches':>10}{'rel diff':>10}")
    for r in rows:
        if 'error' in r:
            print(f"{r['variant']:<30} failed: {r['error']}")
        elif 'skipped' in r:
            print(f"{r['variant']:<30} skipped: {r['skipped']}")
        else:
            print(f"{r['variant']:<30}{r.get('median_ms', float('nan')):>10.2f}"
                  f"{r.get('p99_ms', float('nan')):>9.2f}{r.get('launches', 0):>10}"
                  f"{r['rel_diff_vs_current']:>10.2e}")
    if args.out:
        with open(args.out, 'w') as f:
            json.dump({'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'), 'command': ' '.join(sys.argv),
                       'device': torch.cuda.get_device_name() if cuda else 'cpu',
                       'torch': torch.__version__, 'rows': rows}, f, indent=1)
    return 0 if all('error' not in r for r in rows) else 1


if __name__ == '__main__':
    raise SystemExit(main())
