"""Where a query's time goes: each stage of the full-size model timed alone as a CUDA graph,
plus the top kernels of each stage (torch.profiler, compiled blocks, no graph).

    python benchmarks/profile_stages.py --out benchmarks/out/stages.json        (H200: ~2 min)
    python benchmarks/profile_stages.py --preset tiny --buckets '' --iters 3   (CPU check)

Stages, with the default engine options (bf16, compiled blocks, the prompt padded to its
bucket): vision (ViT + connector), llm (embedding + vision + 36 blocks, every hidden state),
prepare_context (the action expert's K/V cache), flow_loop (10 Euler steps, precomputed
conditioning; `ServedActionExpert.flow` as the engine runs it: the cluster kernel's whole
Euler steps or the fused DiT kernel where the engine serves one, and then also the compiled
blocks as `flow_loop, compiled blocks`). On a CPU (a check of the script, not a measure)
the stages run compiled without graphs and no kernels are listed. Writes JSON with
`common.provenance()`.
"""
from __future__ import annotations

import argparse

import torch

import common
from molmobot_policy.model.action_expert import ActionExpertContext
from molmobot_policy.runtime.graphs import StaticRunner


def top_kernels(fn, inputs: dict, n: int = 10) -> list[tuple[str, float, int]]:
    """[('TOTAL kernels ms / launches', ms, launches), then the n longest kernels as (name,
    ms, launches)] of one call of fn(**inputs), from torch.profiler; [] without CUDA."""
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--preset', default='molmobot-4b-8cam')
    ap.add_argument('--iters', type=int, default=20)
    ap.add_argument('--out', default='benchmarks/out/stages.json')
    ap.add_argument('--buckets', default='1664,1856',
                    help="prompt padding buckets as the ladder uses; '' for the unpadded prompt")
    args = ap.parse_args()

    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    graphs = device == 'cuda'
    buckets = tuple(int(b) for b in args.buckets.split(',') if b)
    engine, _ = common.make_engine(dict(model=args.preset, device=device, dtype='bfloat16',
                                        compile=True, buckets=buckets), warm_up=False)
    model, ae = engine.model, engine.model.action_expert
    served = engine.served.action_expert    # the served K/V, conditioning and fused kernel
    mcfg = engine.model_config
    obs = common.full_size_observation(len(engine.contract.camera_names), mcfg.state_dim, seed=0)
    with torch.inference_mode():
        inputs = common.device_inputs(engine, obs)
        text, images, states = inputs.text, inputs.images, inputs.states
        noise = torch.randn(1, mcfg.action_horizon, mcfg.action_dim, device=device)
        llm_in = dict(input_ids=inputs.input_ids, images=images,
                      token_pooling=inputs.token_pooling, position_ids=inputs.position_ids,
                      attention_mask=inputs.attention_mask, image_positions=inputs.image_positions)
        # the first call compiles the blocks, with the engine's one-pass row reductions
        # (`runtime.compile.compile_module_`)
        hidden = model.select_ae_layers(model.llm_hidden_states(**llm_in))
        ctx = served.context(hidden, inputs.attention_mask, states)
        steps = engine.flow_steps
        fused = served.fused_steps       # the engine's fused DiT kernel (None: not used)

        def vision_fn(images, token_pooling):
            return model.vision_backbone(images, token_pooling)

        def llm_fn(**kw):
            return model.llm_hidden_states(**kw)

        def context_fn(hidden, attention_mask, states):
            return served.context(hidden, attention_mask, states).keys

        def loop_fn(noise, keys, values, mask_bias, state_tokens, out_bias, use_fused=True):
            c = ActionExpertContext(keys, values, mask_bias, state_tokens, out_bias)
            if use_fused:
                return served.flow(noise, c)        # the engine's loop (whole-step kernel)
            x = noise
            for i in range(steps):
                x = x + (1.0 / steps) * ae.velocity_from_conditioning(
                    x, served.conditioning[i], c, None)
            return x

        def loop_blocks_fn(**kw):
            return loop_fn(**kw, use_fused=False)

        stages = {
            'vision': (vision_fn, dict(images=images, token_pooling=inputs.token_pooling)),
            'llm (incl. vision)': (llm_fn, llm_in),
            'prepare_context': (context_fn, dict(hidden=hidden,
                                                 attention_mask=inputs.attention_mask,
                                                 states=states)),
            'flow_loop': (loop_fn, dict(noise=noise, keys=ctx.keys, values=ctx.values,
                                        mask_bias=ctx.mask_bias, state_tokens=ctx.state_tokens,
                                        out_bias=ctx.out_bias)),
        }
        if fused:
            stages['flow_loop, compiled blocks'] = (loop_blocks_fn, stages['flow_loop'][1])
        results, kernels = {}, {}
        for name, (fn, inputs) in stages.items():
            runner = StaticRunner(fn, inputs, cuda_graph=graphs)
            results[name] = common.summary(common.time_replays(runner, args.iters))
            kernels[name] = top_kernels(fn, inputs)
            print(f'{name:<28} p50 {results[name]["p50"]:8.2f} ms  p99 '
                  f'{results[name]["p99"]:8.2f}', flush=True)

    result = {**common.provenance(), 'preset': args.preset, 'prompt_tokens': text.length,
              'padded_to': text.bucket or text.length, 'stages_ms': results, 'kernels': kernels}
    print(f"\n{result['gpu'] or 'cpu'}, {args.preset}, prompt {text.length} tokens, padded to "
          f"{result['padded_to']}, commit {result['commit']}, package {result['package_digest']}")
    common.print_table(['stage', 'p50 ms', 'p99 ms'],
                       [[name, r['p50'], r['p99']] for name, r in results.items()])
    for name, rows in kernels.items():
        if not rows:
            continue
        print(f'\n== {name}')
        for kname, ms, count in rows:
            print(f'  {ms:9.3f} ms  {count:6d}  {kname}')
    common.write_json(args.out, result)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    main()
