"""A-B (temporary): the query's host part, per-camera pageable uploads + resizes (old) against
one pinned upload + one batched resize per frame size (new). One process, same engine, the
two paths interleaved; prints p50 / p99 of `images()` alone and of the full `predict`, with
predict's preprocess / model / postprocess split, and checks both give the same patches.

    python3 benchmarks/experiments/ab_query_host.py --out $OUT/ab_query_host.json   (H200)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from benchmark_inference import rung_configs  # noqa: E402
from molmobot_policy.model.checkpoint import random_model  # noqa: E402
from molmobot_policy.model.config import MolmoBotConfig  # noqa: E402
from molmobot_policy.preprocess import pipeline  # noqa: E402
from molmobot_policy.preprocess.images import resize_and_patchify  # noqa: E402
from molmobot_policy.preprocess.prompt import suggested_buckets  # noqa: E402

NEW = pipeline.Preprocessor.images


def old_images(self, images):
    out = []
    for image in images:
        frame = torch.from_numpy(np.ascontiguousarray(image))
        out.append(resize_and_patchify(frame.to(self.device, non_blocking=True)[None],
                                       self.image_size, self.patch_size)[0])
    return torch.stack(out)[None]


NEW_UPLOAD = pipeline.Preprocessor._upload


def upload_pageable(self, frames):
    return torch.stack(frames).to(self.device, non_blocking=True)


def upload_pinned_numpy(self, frames):
    key = ('np', len(frames), *frames[0].shape)
    staged = self._pinned.get(key)
    if staged is None:
        with torch.inference_mode(False):
            staged = (torch.empty(key[1:], dtype=torch.uint8, pin_memory=True),
                      torch.cuda.Event())
        self._pinned[key] = staged
    buffer, uploaded = staged
    uploaded.synchronize()
    view = buffer.numpy()
    for j, frame in enumerate(frames):
        np.copyto(view[j], frame.numpy())
    batch = buffer.to(self.device, non_blocking=True)
    uploaded.record()
    return batch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument('--iters', type=int, default=150)
    ap.add_argument('--out', default=None)
    ap.add_argument('--preset', default='molmobot-4b-8cam')
    ap.add_argument('--device', default='cuda')
    args = ap.parse_args()
    cfg = MolmoBotConfig.from_name(args.preset)
    model = random_model(cfg, seed=0, device=args.device, dtype=torch.bfloat16).requires_grad_(False)
    probe, _ = common.make_engine(dict(device=args.device, dtype='bfloat16',
                                       model=args.preset), model=model, warm_up=False)
    buckets = suggested_buckets(probe.text_inputs('x').length)
    del probe
    engine, _ = common.make_engine(dict(rung_configs(args.device, buckets, 2048)['+fused_ae'], model=args.preset),
                                   model=model, label='ab')
    obs = common.full_size_observation(cfg.max_images, cfg.state_dim)
    pre = engine.preprocessor
    sync = torch.cuda.synchronize if args.device.startswith('cuda') else (lambda: None)
    same = bool(torch.equal(old_images(pre, obs.images), NEW(pre, obs.images)))
    paths = {'old': (old_images, NEW_UPLOAD), 'pageable': (NEW, upload_pageable),
             'pinned_stack': (NEW, NEW_UPLOAD), 'pinned_numpy': (NEW, upload_pinned_numpy)}
    if not args.device.startswith('cuda'):      # no pinned memory: a check of the script
        paths = {k: v for k, v in paths.items() if k in ('old', 'pageable')}
    res = {name: {'images': [], 'predict': [], 'preprocess': [], 'model': [], 'post': []}
           for name in paths}
    for i in range(args.iters + 5):
        order = list(paths.items())
        order = order[i % len(order):] + order[:i % len(order)]
        for name, (fn, upload) in order:
            pipeline.Preprocessor.images = fn
            pipeline.Preprocessor._upload = upload
            sync()
            t0 = time.perf_counter()
            fn(pre, obs.images)
            sync()
            t1 = time.perf_counter()
            chunk = engine.predict(obs)
            t2 = time.perf_counter()
            if i >= 5:
                r = res[name]
                r['images'].append((t1 - t0) * 1e3)
                r.setdefault('iteration', []).append(i)
                r['predict'].append((t2 - t1) * 1e3)
                r['preprocess'].append(chunk.timings_ms['preprocess'])
                r['model'].append(chunk.timings_ms['model'])
                r['post'].append(chunk.timings_ms['postprocess'])
            time.sleep(0.03)
    pipeline.Preprocessor.images = NEW
    pipeline.Preprocessor._upload = NEW_UPLOAD
    rows = []
    for name, r in res.items():
        iteration = r.pop('iteration')
        worst = np.argsort(r['preprocess'])[-4:]
        print(name, 'slowest preprocess (iteration: ms, images() ms):',
              [(iteration[j], round(r['preprocess'][j], 2), round(r['images'][j], 2))
               for j in worst])
        s = {k: common.summary(v) for k, v in r.items()}
        rows.append([name] + [f"{s[k]['p50']:.3f} / {s[k]['p99']:.3f}" for k in r])
    print(f'same patches: {same}')
    common.print_table(['path', 'images() p50/p99', 'predict', 'preprocess', 'model',
                        'postprocess'], rows)
    if args.out:
        common.write_json(args.out, {**common.provenance(), 'same': same,
                                     'results': {n: {k: common.summary(v, samples=True) for k, v in r.items()}
                                                 for n, r in res.items()}})
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
