"""Inference ladder on one GPU: eager -> compile -> +CUDA graphs -> +KV cache -> +buckets ->
+bf16 ViT attention -> +fused action-expert kernel (Triton) -> +cluster kernel instead (the
default where it serves: Hopper, nvcc) -> +fp8.

Builds the full-size MolmoBot with random weights (preset `molmobot-4b-8cam`: 8 cameras
480x640, 14-D state and actions, horizon 16, 10 flow steps) once, then times each rung of
the ladder in the same process on the same weights:

  generate_actions: the device part of a query (ViT + connector + LLM + action expert,
                    inputs already on the device); what the published numbers measure.
  full query:       `PolicyEngine.predict` from 8 raw uint8 480x640 frames + raw state to
                    unnormalized actions on the host (upload, resize on the GPU, model,
                    download).

Per rung: p50 (median) / p99 / max ms of both, peak and reserved GPU memory, speed-up over eager,
warm-up (compile + capture) seconds, and the deviation of its actions from the eager
bf16 rung on the same inputs and noise (max / mean |delta| over the normalized action range
of 2), and of the rungs after the default one from the default (`dev vs default`: what fp8
changes). Then the zero-recompile check: instructions of 1..200 words after warm-up.

    python benchmarks/benchmark_inference.py --out benchmarks/out/inference.json   (H200: ~4 min)
    python benchmarks/benchmark_inference.py --rungs +fused_ae,+cluster_ae,+fp8 --iters 150 \
        --period-ms 120
    python benchmarks/benchmark_inference.py --preset tiny --device cpu --rungs eager,compile \
        --iters 5                                      (CPU: checks the script, ~1 min)

`--period-ms 120` also times generate_actions started every 120 ms (the node's chunk period)
instead of back to back: on an H200 running back to back, the SW power cap moves the SM
clock between ~1875 and ~1980 MHz, which widens p99. Rungs must come in ladder order: they
share one model, and +fp8 quantizes it in place.

Prints a table last; writes every number as JSON, with `common.provenance()` (date, command,
machine, git commit, package digest). docs/PERFORMANCE.md quotes the current figures.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import common
from molmobot_policy.model.checkpoint import random_model
from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.preprocess.prompt import suggested_buckets
from molmobot_policy.types import Observation


def rung_configs(device: str, buckets: tuple[int, ...], pad: int) -> dict[str, dict]:
    """Engine options per rung; each rung adds one option to the rung before it."""
    base = dict(device=device, dtype='bfloat16', llm_attention='masked')
    cuda = device.startswith('cuda')
    exact = dict(vit_fp32_attention=True)      # upstream's float32 ViT attention
    blocks = dict(fused_action_expert='off')   # the compiled DiT blocks, not the fused kernel
    opt = dict(base, compile=True, buckets=buckets, cuda_graphs=cuda)
    return {
        'eager': dict(base, **exact, **blocks, kv_cache=False),
        'compile': dict(base, **exact, **blocks, kv_cache=False, compile=True, buckets=(pad,)),
        '+cuda_graphs': dict(base, **exact, **blocks, kv_cache=False, compile=True,
                             buckets=(pad,), cuda_graphs=cuda),
        '+kv_cache': dict(base, **exact, **blocks, compile=True, buckets=(pad,),
                          cuda_graphs=cuda),
        '+buckets': dict(opt, **exact, **blocks),
        '+vit_bf16_attn': dict(opt, **blocks),
        '+fused_ae': dict(opt, fused_action_expert='triton'),   # the Triton kernel
        '+cluster_ae': dict(opt),       # the default without flash-attn-4: auto, the cluster
                                        # kernel where it serves (Hopper), else the Triton's
        '+flash_attn': dict(opt, llm_attention='flash'),   # the default (auto) with it
        '+fp8': dict(opt, quantize='fp8'),
        '+flash_attn_fp8': dict(opt, llm_attention='flash', quantize='fp8'),
        '+fp8_tensor': dict(opt, quantize='fp8-tensor'),   # alternative to +fp8 (one per process)
    }


def run_rung(name: str, model, config: dict, obs: Observation, noise: np.ndarray, iters: int,
             device: str, period_ms: float = 0.0) -> tuple[dict, object]:
    """Warm up an engine with `config` on the shared model and time it; (row, engine)."""
    cuda = device.startswith('cuda')
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    engine, warm_s = common.make_engine(config, model=model, label=name)
    with torch.inference_mode():
        inputs = common.device_inputs(engine, obs)
        text = inputs.text
        noise_t = torch.as_tensor(noise, device=device)[None]

        def generate():
            return engine.sample_actions(inputs, noise_t)

        reference = generate()[0].float().cpu().numpy()
        model_iters = iters if config.get('cuda_graphs') or config.get('compile') else max(
            5, iters // 5)
        gen = common.time_calls(generate, model_iters, cuda)
        paced = common.time_calls(generate, model_iters, cuda, period_ms) if period_ms > 0 \
            else None
    parts = []      # predict's own split of each full query: preprocess, model, postprocess
    query = common.time_calls(lambda: parts.append(engine.predict(obs).timings_ms),
                              model_iters, cuda)
    # the node's `inference_ms` is a full query (predict) started every chunk period
    query_paced = common.time_calls(lambda: engine.predict(obs), model_iters, cuda,
                                    period_ms) if period_ms > 0 else None
    row = {'rung': name, 'config': {k: (list(v) if isinstance(v, tuple) else v)
                                    for k, v in config.items()},
           'fp8': engine.mode['fp8'], 'bucket': text.bucket, 'prompt_tokens': text.length,
           'warmup_s': warm_s, 'generate_actions_ms': common.summary(gen, samples=True),
           'full_query_ms': common.summary(query, samples=True),
           'full_query_parts_ms': {k: common.summary([p[k] for p in parts], samples=True)
                                   for k in parts[0]},
           'actions_normalized': reference.tolist()}
    if paced:
        row['generate_actions_paced_ms'] = dict(common.summary(paced, samples=True),
                                                period_ms=period_ms)
        row['full_query_paced_ms'] = dict(common.summary(query_paced, samples=True),
                                          period_ms=period_ms)
    if cuda:
        row['peak_gb'] = torch.cuda.max_memory_allocated() / 2**30
        row['reserved_gb'] = torch.cuda.memory_reserved() / 2**30
    return row, engine


def recompile_check(engine, obs: Observation, max_tokens: int = 200) -> dict:
    """Instructions of 1..max_tokens tokens after warm-up: counts Dynamo compiles."""
    from torch._dynamo.utils import counters
    before = dict(counters['stats'])
    words = ('pick up the red cube and place it gently inside the blue bowl on the left '
             'side of the table').split()
    token_counts, lengths, errors = [], [], 0
    for n in range(1, max_tokens + 1, 7):
        chosen = []
        while len(engine.tokenizer.encode(' '.join(chosen))) < n:
            chosen.append(words[len(chosen) % len(words)])
        text = ' '.join(chosen)
        token_counts.append(len(engine.tokenizer.encode(text)))
        try:
            engine.predict(Observation(images=obs.images, state=obs.state, instruction=text))
            lengths.append(engine.text_inputs(text).length)
        except ValueError:
            errors += 1          # longer than the largest bucket: rejected, by design
    after = dict(counters['stats'])
    return {'instructions': len(token_counts), 'instruction_tokens_min': min(token_counts),
            'instruction_tokens_max': max(token_counts), 'rejected_overlong': errors,
            'prompt_tokens_min': min(lengths) if lengths else 0,
            'prompt_tokens_max': max(lengths) if lengths else 0,
            'new_unique_graphs': after.get('unique_graphs', 0) - before.get('unique_graphs', 0),
            'new_calls_captured': after.get('calls_captured', 0) - before.get('calls_captured', 0)}


def add_deviations(rows: list[dict]) -> None:
    """Per row: action deviation from the eager rung (or the first) over the normalized
    action range of 2, the speed-up over it, and for the rungs after the default one their
    deviation from the default (`dev_vs_default`: what fp8 changes)."""
    eager = next((r for r in rows if r['rung'] == 'eager'), rows[0])
    ref = np.asarray(eager['actions_normalized'])
    for r in rows:
        dev = np.abs(np.asarray(r['actions_normalized']) - ref) / 2.0
        r['action_dev_max_pct'] = float(dev.max() * 100)
        r['action_dev_mean_pct'] = float(dev.mean() * 100)
        r['speedup_vs_eager'] = eager['generate_actions_ms']['p50'] / \
            r['generate_actions_ms']['p50']
    names = [r['rung'] for r in rows]
    default = next((n for n in ('+cluster_ae', '+fused_ae', '+vit_bf16_attn') if n in names),
                   None)
    if default is not None:
        ref_default = np.asarray(rows[names.index(default)]['actions_normalized'])
        for r in rows[names.index(default) + 1:]:
            dev = np.abs(np.asarray(r['actions_normalized']) - ref_default) / 2.0
            r['dev_vs_default'] = {'rung': default, 'max_pct': float(dev.max() * 100),
                                   'mean_pct': float(dev.mean() * 100)}


def print_report(result: dict) -> None:
    print(f"\n{result['gpu'] or 'cpu'}, torch {result['torch']}, {result['preset']}, "
          f"{result['date']}, commit {result['commit']}, package {result['package_digest']}")
    paced = any('generate_actions_paced_ms' in r for r in result['rows'])
    headers = ['rung', 'gen p50', 'gen p99', 'gen max'] + (['paced p50', 'paced p99']
                                                           if paced else []) + [
        'query p50', 'query p99', 'x eager', 'peak GB', 'warm s', 'dev max %']
    table = []
    for r in result['rows']:
        g, q, p = r['generate_actions_ms'], r['full_query_ms'], r.get(
            'generate_actions_paced_ms', {})
        table.append([r['rung'], g['p50'], g['p99'], g['max']]
                     + ([p.get('p50'), p.get('p99')] if paced else [])
                     + [q['p50'], q['p99'], r['speedup_vs_eager'], r.get('peak_gb'),
                        r['warmup_s'], r['action_dev_max_pct']])
    common.print_table(headers, table)
    for r in result['rows']:
        if 'dev_vs_default' in r:
            d = r['dev_vs_default']
            print(f"{r['rung']} vs {d['rung']}: max {d['max_pct']:.3f} %, mean "
                  f"{d['mean_pct']:.3f} % of the action range")
    if 'recompile_check' in result:
        print('recompile check:', result['recompile_check'])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--preset', default='molmobot-4b-8cam')
    ap.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    ap.add_argument('--rungs', default='eager,compile,+cuda_graphs,+kv_cache,+buckets,'
                    '+vit_bf16_attn,+fused_ae,+cluster_ae,+fp8',
                    help='comma list, in ladder order; also +fp8_tensor (instead of +fp8)')
    ap.add_argument('--iters', type=int, default=50)
    ap.add_argument('--pad', type=int, default=2048, help='the single published padding length')
    ap.add_argument('--buckets', default='auto', help="comma list, or 'auto'")
    ap.add_argument('--recompile-check', action='store_true')
    ap.add_argument('--period-ms', type=float, default=0.0,
                    help='also time generate_actions started every PERIOD ms (the GPU idle in '
                         'between, as under the node\'s chunk schedule), besides back to back')
    ap.add_argument('--out', default='benchmarks/out/inference.json')
    args = ap.parse_args()
    configs_known = rung_configs('cpu', (), 0)
    rungs = args.rungs.split(',')
    unknown = [r for r in rungs if r not in configs_known]
    if unknown:
        ap.error(f'unknown rungs {unknown}; known: {list(configs_known)}')

    device = args.device
    cfg = MolmoBotConfig.from_name(args.preset)
    t0 = time.perf_counter()
    model = random_model(cfg, seed=0, device=device, dtype=torch.bfloat16).requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    print(f'built {args.preset}: {n_params / 1e9:.3f} B parameters in '
          f'{time.perf_counter() - t0:.1f} s', flush=True)

    obs = common.full_size_observation(cfg.max_images, cfg.state_dim)
    noise = np.random.default_rng(2).standard_normal(
        (cfg.action_horizon, cfg.action_dim)).astype(np.float32)
    if args.buckets == 'auto':
        probe, _ = common.make_engine(dict(device=device, dtype='bfloat16', model=args.preset),
                                      model=model, warm_up=False)
        buckets = suggested_buckets(probe.text_inputs('x').length)
        print(f'prompt: {probe.text_inputs(common.INSTRUCTION).length} tokens for the '
              f'benchmark instruction; auto buckets {buckets}')
        del probe
    else:
        buckets = tuple(int(b) for b in args.buckets.split(','))

    configs = rung_configs(device, buckets, args.pad)
    result = {**common.provenance(), 'preset': args.preset, 'params_b': n_params / 1e9,
              'buckets': list(buckets), 'partial': True, 'rows': []}
    engine = None
    for name in rungs:
        print(f'rung {name} ...', flush=True)
        del engine                               # one engine's graphs and caches at a time
        row, engine = run_rung(name, model, configs[name], obs, noise, args.iters, device,
                               args.period_ms)
        result['rows'].append(row)
        common.write_json(args.out, result)
        g, q = row['generate_actions_ms'], row['full_query_ms']
        print(f'  {name}: generate_actions p50 {g["p50"]:.2f} ms p99 {g["p99"]:.2f}; '
              f'full query p50 {q["p50"]:.2f} ms; warm-up {row["warmup_s"]:.1f} s', flush=True)
        print('  ' + name + ': full query p50 / p99 / max ms: ' + '; '.join(
            f"{k} {v['p50']:.2f} / {v['p99']:.2f} / {v['max']:.2f}"
            for k, v in row['full_query_parts_ms'].items()), flush=True)
        if 'generate_actions_paced_ms' in row:
            p = row['generate_actions_paced_ms']
            print(f'  {name}: generate_actions started every {args.period_ms:g} ms: p50 '
                  f'{p["p50"]:.2f} ms p99 {p["p99"]:.2f} max {p["max"]:.2f}', flush=True)
            p = row['full_query_paced_ms']
            print(f'  {name}: full query started every {args.period_ms:g} ms: p50 '
                  f'{p["p50"]:.2f} ms p99 {p["p99"]:.2f} max {p["max"]:.2f}', flush=True)

    add_deviations(result['rows'])
    if args.recompile_check and engine is not None:
        result['recompile_check'] = recompile_check(engine, obs)
    result['partial'] = False
    common.write_json(args.out, result)
    print_report(result)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    main()
