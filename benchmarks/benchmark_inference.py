"""Inference ladder on one GPU: eager -> compile -> +CUDA graphs -> +KV cache -> +buckets ->
+bf16 ViT attention -> +fused action-expert kernel (the default) -> +fp8.

Builds the full-size MolmoBot with random weights (preset `molmobot-4b-8cam`: 8 cameras
480x640, 14-D state and actions, horizon 16, 10 flow steps) once, then times each rung of
the ladder in the same process on the same weights:

  generate_actions: the device part of a query (ViT + connector + LLM + action expert,
                    inputs already on the device); what the published numbers measure.
  full query:       `PolicyEngine.predict` from 8 raw uint8 480x640 frames + raw state to
                    unnormalized actions on the host (upload, resize on the GPU, model,
                    download).

Per rung: median / p99 / max ms of both, peak and reserved GPU memory, speed-up over eager,
warm-up (compile + capture) seconds, and the deviation of its actions from the eager
bf16 rung on the same inputs and noise (max / mean |delta| over the normalized action range
of 2), and of the rungs after the default one from the default (`dev vs default`: what fp8
changes). Then the zero-recompile check: instructions of 1..200 words after warm-up.

    python benchmarks/benchmark_inference.py --out benchmarks/out/inference.json
    python benchmarks/benchmark_inference.py --preset tiny --device cpu --rungs eager,compile

`--period-ms 120` also times generate_actions started every 120 ms (the node's chunk period)
instead of back to back: on an H200 running back to back, the SW power cap moves the SM
clock between ~1875 and ~1980 MHz, which widens p99. Rungs must come in ladder order: they
share one model, and +fp8 quantizes it in place.

Prints a table last; writes every number as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from molmobot_policy.model.checkpoint import random_model  # noqa: E402
from molmobot_policy.model.config import MolmoBotConfig  # noqa: E402
from molmobot_policy.model.molmobot import MolmoBot  # noqa: E402
import molmobot_policy.runtime.compile as engine_module  # noqa: E402  (PERSISTENT_ROW_LIMIT)
from molmobot_policy.preprocess.prompt import suggested_buckets  # noqa: E402
from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine  # noqa: E402
from molmobot_policy.types import Observation  # noqa: E402

INSTRUCTION = 'pick up the red cube and put it in the bowl'


def rung_configs(device: str, buckets: tuple[int, ...], pad: int) -> dict[str, dict]:
    base = dict(device=device, dtype='bfloat16')
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
        '+fused_ae': dict(opt),                 # the default configuration
        '+fp8': dict(opt, quantize='fp8'),
        '+fp8_tensor': dict(opt, quantize='fp8-tensor'),   # alternative to +fp8 (one per process)
    }


def percentiles(samples: list[float]) -> dict:
    """median / p99 / max / n of per-call ms, and the samples in call order (a drift, e.g.
    clocks settling under a power cap, shows there and not in the percentiles)."""
    a = np.asarray(samples, dtype=np.float64)
    return {'median': float(np.median(a)), 'p99': float(np.percentile(a, 99)),
            'max': float(a.max()), 'n': int(a.size),
            'samples': [round(float(v), 3) for v in a]}


def sync(device: str) -> None:
    if device.startswith('cuda'):
        torch.cuda.synchronize()


def time_calls(fn, iters: int, device: str, period_ms: float = 0.0) -> list[float]:
    """ms per call of fn (synchronized); period_ms > 0: calls start every period_ms (the
    GPU idles in between, as under the node's chunk schedule) instead of back to back."""
    out = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
        if period_ms > 0:
            time.sleep(max(0.0, period_ms / 1e3 - (time.perf_counter() - t0)))
    return out


def make_observation(cfg: MolmoBotConfig, cameras: int, seed: int) -> Observation:
    rng = np.random.default_rng(seed)
    frames = tuple(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8) for _ in range(cameras))
    state = rng.uniform(-0.5, 0.5, cfg.state_dim).astype(np.float32)
    return Observation(images=frames, state=state, instruction=INSTRUCTION)


def run_rung(name: str, model: MolmoBot, kwargs: dict, obs: Observation, noise: np.ndarray,
             iters: int, device: str, period_ms: float = 0.0) -> dict:
    if device.startswith('cuda'):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = PolicyEngine(EngineConfig(instruction=INSTRUCTION, **kwargs), model=model)
    engine.warmup(progress=lambda msg: print(f'  [{name}] {msg}', flush=True))
    warm_s = time.perf_counter() - t0
    with torch.inference_mode():
        text = engine.text_inputs(INSTRUCTION)
        images = engine._images_to_device(obs.images)
        states = engine._states_to_device(obs.state)
        noise_t = torch.as_tensor(noise, device=device)[None]
        reference = engine._run(text, images, states, noise_t)[0].float().cpu().numpy()
        model_iters = iters if kwargs.get('cuda_graphs') or kwargs.get('compile') else max(
            5, iters // 5)
        gen = time_calls(lambda: engine._run(text, images, states, noise_t), model_iters, device)
        paced = time_calls(lambda: engine._run(text, images, states, noise_t), model_iters,
                           device, period_ms) if period_ms > 0 else None
    query = time_calls(lambda: engine.predict(obs), model_iters, device)
    row = {'rung': name, 'config': {k: (list(v) if isinstance(v, tuple) else v)
                                    for k, v in kwargs.items()},
           'fp8': engine.fp8, 'bucket': text.bucket, 'prompt_tokens': text.length,
           'warmup_s': warm_s, 'generate_actions_ms': percentiles(gen),
           'full_query_ms': percentiles(query), 'actions_normalized': reference.tolist()}
    if paced:
        row['generate_actions_paced_ms'] = dict(percentiles(paced), period_ms=period_ms)
    if device.startswith('cuda'):
        row['peak_gb'] = torch.cuda.max_memory_allocated() / 2**30
        row['reserved_gb'] = torch.cuda.memory_reserved() / 2**30
    row['engine'] = engine
    return row


def recompile_check(engine: PolicyEngine, obs: Observation, max_tokens: int = 200) -> dict:
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


def package_digest() -> str:
    """sha256 (first 16 hex digits) of the molmobot_policy sources (*.py, sorted by path):
    names the code a result came from where git cannot (the device runs a copy of the
    working tree whose HEAD may be stale). `python3 -c 'import sys; sys.path.insert(0,
    "benchmarks"); import benchmark_inference as b; print(b.package_digest())'` at a commit
    gives the digest to compare."""
    import hashlib
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        'molmobot_policy')
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(f for f in filenames if f.endswith('.py')):
            path = os.path.join(dirpath, name)
            digest.update(os.path.relpath(path, root).encode() + b'\0')
            with open(path, 'rb') as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(data, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--preset', default='molmobot-4b-8cam')
    ap.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    ap.add_argument('--rungs', default='eager,compile,+cuda_graphs,+kv_cache,+buckets,'
                    '+vit_bf16_attn,+fused_ae,+fp8')
    ap.add_argument('--iters', type=int, default=50)
    ap.add_argument('--pad', type=int, default=2048, help='the single published padding length')
    ap.add_argument('--buckets', default='auto', help="comma list, or 'auto'")
    ap.add_argument('--recompile-check', action='store_true')
    ap.add_argument('--period-ms', type=float, default=0.0,
                    help='also time generate_actions started every PERIOD ms (the GPU idle in '
                         'between, as under the node\'s chunk schedule), besides back to back')
    ap.add_argument('--persistent-rows', type=int, default=None,
                    help='override engine.PERSISTENT_ROW_LIMIT (0: Inductor\'s default); '
                         'compiled code is shared within a process and cached on disk, so '
                         'compare values in separate processes with separate '
                         'TORCHINDUCTOR_CACHE_DIR')
    ap.add_argument('--out', default='benchmarks/out/inference.json')
    args = ap.parse_args()
    if args.persistent_rows is not None:
        engine_module.PERSISTENT_ROW_LIMIT = args.persistent_rows

    device = args.device
    cfg = MolmoBotConfig.from_name(args.preset)
    t0 = time.perf_counter()
    model = random_model(cfg, seed=0, device=device, dtype=torch.bfloat16).requires_grad_(False)
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    print(f'built {args.preset}: {n_params / 1e9:.3f} B parameters in {build_s:.1f} s', flush=True)

    obs = make_observation(cfg, cfg.max_images, seed=1)
    noise = np.random.default_rng(2).standard_normal(
        (cfg.action_horizon, cfg.action_dim)).astype(np.float32)
    if args.buckets == 'auto':
        probe = PolicyEngine(EngineConfig(device=device, dtype='bfloat16', model=args.preset,
                                          instruction=INSTRUCTION), model=model)
        length = probe.text_inputs(INSTRUCTION).length
        base = probe.text_inputs('x').length
        buckets = suggested_buckets(base)
        del probe
        print(f'prompt: {length} tokens for the benchmark instruction; auto buckets {buckets}')
    else:
        buckets = tuple(int(b) for b in args.buckets.split(','))

    configs = rung_configs(device, buckets, args.pad)
    rows, last_engine = [], None
    for name in args.rungs.split(','):
        print(f'rung {name} ...', flush=True)
        row = run_rung(name, model, configs[name], obs, noise, args.iters, device,
                       args.period_ms)
        last_engine = row.pop('engine')
        rows.append(row)
        write_json(args.out, {'partial': True, 'rows': rows})
        g, q = row['generate_actions_ms'], row['full_query_ms']
        print(f'  {name}: generate_actions median {g["median"]:.2f} ms p99 {g["p99"]:.2f}; '
              f'full query median {q["median"]:.2f} ms; warm-up {row["warmup_s"]:.1f} s',
              flush=True)
        if 'generate_actions_paced_ms' in row:
            p = row['generate_actions_paced_ms']
            print(f'  {name}: generate_actions started every {args.period_ms:g} ms: median '
                  f'{p["median"]:.2f} ms p99 {p["p99"]:.2f} max {p["max"]:.2f}', flush=True)

    eager = next((r for r in rows if r['rung'] == 'eager'), rows[0])
    ref = np.asarray(eager['actions_normalized'])
    for r in rows:
        a = np.asarray(r['actions_normalized'])
        dev = np.abs(a - ref) / 2.0          # normalized action range is [-1, 1]
        r['action_dev_max_pct'] = float(dev.max() * 100)
        r['action_dev_mean_pct'] = float(dev.mean() * 100)
        r['speedup_vs_eager'] = eager['generate_actions_ms']['median'] / \
            r['generate_actions_ms']['median']
    names = [r['rung'] for r in rows]
    default = next((n for n in ('+fused_ae', '+vit_bf16_attn') if n in names), None)
    if default is not None:
        ref_default = np.asarray(rows[names.index(default)]['actions_normalized'])
        for r in rows[names.index(default) + 1:]:
            dev = np.abs(np.asarray(r['actions_normalized']) - ref_default) / 2.0
            r['dev_vs_default'] = {'rung': default, 'max_pct': float(dev.max() * 100),
                                   'mean_pct': float(dev.mean() * 100)}
    result = {'date': datetime.now(timezone.utc).isoformat(timespec='seconds'),
              'command': ' '.join(sys.argv), 'host': platform.node(),
              'package_digest': package_digest(),
              'gpu': torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu',
              'torch': torch.__version__, 'preset': args.preset, 'params_b': n_params / 1e9,
              'buckets': list(buckets),
              'persistent_row_limit': engine_module.PERSISTENT_ROW_LIMIT, 'rows': rows}
    if args.recompile_check and last_engine is not None:
        result['recompile_check'] = recompile_check(last_engine, obs)
    write_json(args.out, result)

    print(f'\n{result["gpu"]}, torch {result["torch"]}, {args.preset}, {result["date"]}')
    head = (f'{"rung":<13}{"gen med":>9}{"gen p99":>9}{"gen max":>9}{"query med":>10}'
            f'{"query p99":>10}{"x eager":>8}{"peak GB":>8}{"warm s":>8}{"dev max%":>9}')
    print(head)
    for r in rows:
        g, q = r['generate_actions_ms'], r['full_query_ms']
        print(f'{r["rung"]:<13}{g["median"]:>9.2f}{g["p99"]:>9.2f}{g["max"]:>9.2f}'
              f'{q["median"]:>10.2f}{q["p99"]:>10.2f}{r["speedup_vs_eager"]:>8.2f}'
              f'{r.get("peak_gb", 0):>8.1f}{r["warmup_s"]:>8.1f}{r["action_dev_max_pct"]:>9.3f}')
    for r in rows:
        if 'dev_vs_default' in r:
            d = r['dev_vs_default']
            print(f'{r["rung"]} vs {d["rung"]}: max {d["max_pct"]:.3f} %, mean '
                  f'{d["mean_pct"]:.3f} % of the action range')
    if 'recompile_check' in result:
        print('recompile check:', result['recompile_check'])


if __name__ == '__main__':
    main()
