"""Where a query's time goes: each stage of the full-size model timed alone as a CUDA graph,
plus the top kernels of each stage (torch.profiler, compiled blocks, no graph).

    python benchmarks/profile_stages.py --out benchmarks/out/stages.json

Stages: vision (ViT + connector), llm (embedding + vision + 36 blocks, every hidden state),
prepare_context (action-expert K/V cache), flow_loop (10 Euler steps, precomputed
conditioning). Variants show what a change would buy before it is made.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from molmobot_policy.model.action_expert import ActionExpertContext  # noqa: E402
from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine  # noqa: E402
from molmobot_policy.runtime.graphs import StaticRunner  # noqa: E402

INSTRUCTION = 'pick up the red cube and put it in the bowl'


def time_runner(runner: StaticRunner, iters: int) -> dict:
    if not torch.cuda.is_available():          # CPU smoke run of this script
        import time
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            runner.run()
            samples.append((time.perf_counter() - t0) * 1e3)
        return {'median': float(np.median(samples)), 'p99': float(np.percentile(samples, 99))}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        runner.run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    a = np.asarray(samples)
    return {'median': float(np.median(a)), 'p99': float(np.percentile(a, 99))}


def top_kernels(fn, inputs: dict, n: int = 10) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile
    if not torch.cuda.is_available():
        return []
    fn(**inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(**inputs)
        torch.cuda.synchronize()
    rows = [(e.key[:70], e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    launches = sum(r[2] for r in rows)
    return [('TOTAL kernels ms / launches', total, launches)] + rows[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument('--preset', default='molmobot-4b-8cam')
    ap.add_argument('--iters', type=int, default=20)
    ap.add_argument('--out', default='benchmarks/out/stages.json')
    ap.add_argument('--buckets', default='1664,1856',
                    help="prompt padding buckets as the ladder uses; '' for the unpadded prompt")
    ap.add_argument('--variants', action='store_true',
                    help='also time the old what-if variants (fp32 ViT attention, unmasked '
                         'LLM, max-autotune blocks)')
    args = ap.parse_args()

    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    graphs = device == 'cuda'
    buckets = tuple(int(b) for b in args.buckets.split(',') if b)
    engine = PolicyEngine(EngineConfig(model=args.preset, device=device, dtype='bfloat16',
                                       compile=True, instruction=INSTRUCTION, buckets=buckets))
    model, ae = engine.model, engine.model.action_expert
    text = engine.text_inputs(INSTRUCTION)
    rng = np.random.default_rng(0)
    frames = tuple(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
                   for _ in range(engine.num_cameras))
    with torch.inference_mode():
        images = engine._images_to_device(frames)
        states = engine._states_to_device(np.zeros(engine.model_config.state_dim, np.float32))
        states = states.to(engine.dtype)
        noise = torch.randn(1, engine.model_config.action_horizon, engine.model_config.action_dim,
                            device=device)
        llm_in = dict(input_ids=text.input_ids, images=images, token_pooling=text.token_pooling,
                      position_ids=text.position_ids, attention_mask=text.attention_mask,
                      image_positions=text.image_positions)
        # the first call compiles the blocks, with the engine's one-pass row reductions
        # (`runtime.engine.compile_module_`)
        hidden = model.llm_hidden_states(**llm_in)
        ctx = ae.prepare_context(hidden, text.attention_mask, states, engine._cross_out_bias)
        cond, steps = engine._conditioning, engine.flow_steps

        def vision_fn(images, token_pooling):
            return model.vision_backbone(images, token_pooling)

        def llm_fn(**kw):
            return model.llm_hidden_states(**kw)

        def context_fn(hidden, attention_mask, states):
            return ae.prepare_context(hidden, attention_mask, states, engine._cross_out_bias).keys

        fused = engine._fused_blocks     # the engine's fused DiT kernel (None: not used)

        def loop_fn(noise, keys, values, mask_bias, state_tokens, out_bias, use_fused=True):
            c = ActionExpertContext(keys, values, mask_bias, state_tokens, out_bias)
            x = noise
            for i in range(steps):
                blocks_fn = fused[i] if fused and use_fused else None
                x = x + (1.0 / steps) * ae.velocity_from_conditioning(x, cond[i], c, blocks_fn)
            return x

        def loop_blocks_fn(**kw):
            return loop_fn(**kw, use_fused=False)

        def llm_blocks_no_mask_fn(x, position_ids):
            return model.transformer(x, position_ids, None)

        stages = {
            'vision': (vision_fn, dict(images=images, token_pooling=text.token_pooling)),
            'llm (incl. vision)': (llm_fn, llm_in),
            'prepare_context': (context_fn, dict(hidden=hidden, attention_mask=text.attention_mask,
                                                 states=states)),
            'flow_loop': (loop_fn, dict(noise=noise, keys=ctx.keys, values=ctx.values,
                                        mask_bias=ctx.mask_bias, state_tokens=ctx.state_tokens,
                                        out_bias=ctx.out_bias)),
        }
        if fused:
            stages['flow_loop, compiled blocks'] = (loop_blocks_fn, stages['flow_loop'][1])
        if args.variants:
            x_emb = model.embed_inputs(text.input_ids, images, text.token_pooling,
                                       text.image_positions)
            stages['llm blocks, no mask (flash)'] = (llm_blocks_no_mask_fn,
                                                     dict(x=x_emb, position_ids=text.position_ids))
        results, kernels = {}, {}
        for name, (fn, inputs) in stages.items():
            runner = StaticRunner(fn, inputs, cuda_graph=graphs)
            results[name] = time_runner(runner, args.iters)
            kernels[name] = top_kernels(fn, inputs)
            print(f'{name:<32} median {results[name]["median"]:8.2f} ms  p99 '
                  f'{results[name]["p99"]:8.2f}', flush=True)

        def variant(name, fn, inputs, patch=None, unpatch=None):
            try:
                if patch:
                    patch()
                runner = StaticRunner(fn, inputs, cuda_graph=graphs)
                results[name] = time_runner(runner, args.iters)
                kernels[name] = top_kernels(fn, inputs)
                print(f'{name:<32} median {results[name]["median"]:8.2f} ms', flush=True)
            except Exception as err:  # noqa: BLE001 - an experiment may not run; report it
                print(f'{name:<32} FAILED: {type(err).__name__}: {str(err)[:300]}', flush=True)
            finally:
                if unpatch:
                    unpatch()

        if args.variants:
            # variant: ViT attention in float32 (upstream), against the bf16 default
            from molmobot_policy.runtime.engine import set_vit_fp32_attention_
            variant('vision, fp32 attention', vision_fn, stages['vision'][1],
                    lambda: set_vit_fp32_attention_(model, True),
                    lambda: set_vit_fp32_attention_(model, False))

            # variant: action-expert blocks compiled with max-autotune (Triton GEMM templates,
            # epilogue fusion)
            def autotune():
                for block in ae.blocks:
                    block.compile(dynamic=False, fullgraph=True,
                                  mode='max-autotune-no-cudagraphs')
            variant('flow_loop, max-autotune', loop_blocks_fn, stages['flow_loop'][1], autotune)

    print(f'\nprompt {text.length} tokens, padded to {text.bucket or text.length}')
    for name, rows in kernels.items():
        print(f'\n== {name}')
        for kname, ms, count in rows:
            print(f'  {ms:9.3f} ms  {count:6d}  {kname}')
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump({'stages_ms': results, 'kernels': kernels, 'prompt_tokens': text.length,
                   'padded_to': text.bucket or text.length}, f,
                  indent=1)


if __name__ == '__main__':
    main()
