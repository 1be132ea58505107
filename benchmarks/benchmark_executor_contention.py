"""What the ROS side of the node costs the inference thread: executor and garbage collector.

The policy node runs inference in a worker thread while an rclpy executor stores incoming
camera frames (8 x 30 Hz x 480x640 rgb8 = 240 messages/s) and joint states (100 Hz). Both
share the GIL, and a garbage collection stops every thread, so the executor's Python work
and the collector's pauses show up as inference latency and publish jitter.

This benchmark runs the real `PolicyNode` (synchronizer, scheduler, publishing) with a
stand-in engine that behaves like the GPU engine from Python's side: `--ops` small torch
calls (each releases and re-takes the GIL, as the engine's upload, resize and graph replay
calls do) and `--gpu-ms` of waiting with the GIL released (the CUDA graph running). Its
ideal predict time is therefore known (~gpu-ms), and everything above it is contention.
Optionally `--heap-objects` long-lived objects stand in for the millions of Python objects
that torch.compile leaves behind, which full collections must walk unless frozen.

Variants, each in a fresh process for `--duration` s after 5 s of settling, against the same
publishers (started once, by benchmarks/benchmark_node_jitter.py's `publish` command):
executor (rclpy MultiThreadedExecutor(4) as the node used before 2026-11-29, or the
SingleThreadedExecutor it uses now) x gc_freeze (off / on). Prints a table; writes JSON.

    .venv/bin/python benchmarks/benchmark_executor_contention.py --out out/contention.json

Environment as benchmark_node_jitter.py (ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST set here if
unset, FASTDDS_DEFAULT_PROFILES_FILE from --dds-profile). CPU figures on small machines are
noise-prone: compare variants within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
JOINTS = [f'joint_{k}' for k in range(7)]
VARIANTS = (('multi4', False), ('multi4', True), ('single', False), ('single', True))
SETTLE_S = 5.0


# ------------------------------------------------------------------------ one variant
def run_variant(args) -> int:
    """`variant` sub-command: the node in this process; prints one JSON line of results."""
    import threading

    import numpy as np
    import rclpy
    import torch
    from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor
    from rclpy.parameter import Parameter

    from molmobot_policy.model.config import MolmoBotConfig
    from molmobot_policy.ros.main import SWITCH_INTERVAL_S
    from molmobot_policy.ros.node import PolicyNode
    from molmobot_policy.timing import RollingStats
    from molmobot_policy.types import ActionChunk

    torch.set_num_threads(1)
    heap = [(k, str(k)) for k in range(args.heap_objects)]   # long-lived, gc-tracked

    class GpuLikeEngine:
        """Python-side behaviour of the CUDA engine: small GIL-releasing calls + a wait."""

        def __init__(self, config):
            self.model_config = MolmoBotConfig.from_name('molmobot-4b-8cam')
            self.mode = {'engine': 'gpu-like stand-in'}

        def warmup(self, progress=None):
            return 0.0

        def close(self):
            pass

        def predict(self, observation):
            start = time.perf_counter()
            x = torch.zeros(4)
            for image in observation.images:
                torch.from_numpy(image)
            for _ in range(args.ops):
                x = x + 1
            time.sleep(args.gpu_ms * 1e-3)        # GIL released, like a CUDA sync
            actions = np.zeros((50, 14), np.float32) + x.numpy()[0]
            return ActionChunk(actions=actions, actions_normalized=actions,
                               observation_stamp=observation.stamp,
                               observation_seq=observation.seq,
                               inference_ms=(time.perf_counter() - start) * 1e3)

    sys.setswitchinterval(SWITCH_INTERVAL_S)     # as the node's main()
    rclpy.init()
    cameras = [f'/cam{k}/image_raw' for k in range(args.cameras)]
    params = dict(camera_topics=cameras, joint_names=JOINTS, action_joint_names=JOINTS,
                  instruction='x', chunk_period=args.chunk_period, control_period=0.05,
                  max_image_age=0.5, max_state_age=0.5, model='molmobot-4b-8cam',
                  autostart=False, gc_freeze=args.gc_freeze)
    node = PolicyNode(engine_factory=GpuLikeEngine, parameter_overrides=[
        Parameter(k, value=v) for k, v in params.items()])
    executor = (MultiThreadedExecutor(num_threads=4) if args.executor == 'multi4'
                else SingleThreadedExecutor())
    executor.add_node(node)
    if not node.autostart():
        print('autostart failed', file=sys.stderr)
        return 1
    threading.Thread(target=executor.spin, daemon=True).start()
    time.sleep(SETTLE_S)
    stats = node.loop.stats
    stats.jitter_ms, stats.inference_ms = RollingStats(100000), RollingStats(100000)
    gc_pauses = node.gc_pauses
    gc_pauses.pauses_ms = RollingStats(100000)
    collections0 = list(gc_pauses.collections)
    gc_pauses.max_ms = 0.0
    chunks0, misses0 = stats.chunks_published, stats.deadline_misses
    received0 = node._sync.stats(node._now())
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(args.duration)
    wall = time.monotonic() - wall0
    received = node._sync.stats(node._now())
    result = {
        'executor': args.executor, 'gc_freeze': args.gc_freeze,
        'chunks': stats.chunks_published - chunks0,
        'expected_chunks': int(wall / args.chunk_period),
        'deadline_misses': stats.deadline_misses - misses0,
        'frames_received': sum(received[t].count - received0[t].count for t in cameras),
        'inference_ms': stats.inference_ms.summary(), 'publish_jitter_ms': stats.jitter_ms.summary(),
        'cpu_percent': 100.0 * (time.process_time() - cpu0) / wall,
        'gc_collections': [b - a for a, b in zip(collections0, gc_pauses.collections)],
        'gc_pause_ms': gc_pauses.pauses_ms.summary(), 'gc_pause_max_ms': gc_pauses.max_ms,
        'heap_objects': len(heap)}
    print('RESULT ' + json.dumps(result), flush=True)
    os._exit(0)      # skip teardown: the measurement is done


# ------------------------------------------------------------------------------ driver
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = parser.add_subparsers(dest='command')
    variant = sub.add_parser('variant', help='(internal) one variant in this process')
    variant.add_argument('--executor', choices=['multi4', 'single'], required=True)
    variant.add_argument('--gc-freeze', type=lambda s: s == 'true', required=True)
    add = parser.add_argument
    for p in (parser, variant):
        p.add_argument('--cameras', type=int, default=8)
        p.add_argument('--ops', type=int, default=90,
                       help='GIL-releasing torch calls per predict (the CUDA engine makes ~90)')
        p.add_argument('--gpu-ms', type=float, default=65.0, help='GIL-free wait per predict')
        p.add_argument('--heap-objects', type=int, default=0,
                       help='long-lived objects standing in for a compiled model')
        p.add_argument('--chunk-period', type=float, default=0.15, help='s')
        p.add_argument('--duration', type=float, default=20.0, help='measured s per variant')
    add('--camera-rate', type=float, default=30.0)
    add('--height', type=int, default=480)
    add('--width', type=int, default=640)
    add('--joint-rate', type=float, default=100.0)
    add('--dds-profile', default=str(REPO / 'config' / 'fastdds_large_images.xml'))
    add('--out', type=Path, default=None, help='JSON results')
    args = parser.parse_args(argv)
    if args.command == 'variant':
        return run_variant(args)

    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    if args.dds_profile != 'none':
        os.environ['FASTDDS_DEFAULT_PROFILES_FILE'] = str(Path(args.dds_profile).resolve())
    jitter_bench = str(REPO / 'benchmarks' / 'benchmark_node_jitter.py')
    publishers = []
    for k in range(0, args.cameras, 2):
        topics = [f'/cam{j}/image_raw' for j in range(k, min(k + 2, args.cameras))]
        publishers.append(subprocess.Popen(
            [sys.executable, jitter_bench, 'publish', '--rate', str(args.camera_rate),
             '--height', str(args.height), '--width', str(args.width), '--cameras', *topics],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    publishers.append(subprocess.Popen(
        [sys.executable, jitter_bench, 'publish', '--rate', str(args.joint_rate),
         '--joints', *JOINTS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    results = []
    try:
        time.sleep(2.0)
        for executor, freeze in VARIANTS:
            command = [sys.executable, __file__, 'variant', '--executor', executor,
                       '--gc-freeze', 'true' if freeze else 'false']
            for name in ('cameras', 'ops', 'gpu_ms', 'heap_objects', 'chunk_period',
                         'duration'):
                command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=args.duration + 120)
            lines = [x for x in done.stdout.splitlines() if x.startswith('RESULT ')]
            if not lines:
                print(f'{executor} gc_freeze={freeze}: no result (status {done.returncode})\n'
                      + done.stderr[-2000:])
                continue
            results.append(json.loads(lines[-1][len('RESULT '):]))
            print(f'{executor} gc_freeze={freeze}: done', flush=True)
    finally:
        for p in publishers:
            p.terminate()
        for p in publishers:
            p.wait(timeout=10)

    print(f'\nexecutor contention: {args.cameras} cameras x {args.camera_rate:g} Hz x '
          f'{args.height}x{args.width} rgb8 + joint_states {args.joint_rate:g} Hz; stand-in '
          f'engine {args.ops} GIL-releasing calls + {args.gpu_ms:g} ms GIL-free; '
          f'{args.heap_objects} extra heap objects; chunk_period {args.chunk_period:g} s; '
          f'{args.duration:g} s per variant; {os.cpu_count()} CPUs')
    header = (f"{'executor':<9}{'gc_freeze':>10}{'inf p50':>9}{'inf p99':>9}{'inf max':>9}"
              f"{'jit p50':>9}{'jit p99':>9}{'jit max':>9}{'misses':>7}{'chunks':>8}"
              f"{'frames':>8}{'CPU %':>7}{'gc n':>7}{'gc max':>8}")
    print(header)
    for r in results:
        i, j = r['inference_ms'], r['publish_jitter_ms']
        print(f"{r['executor']:<9}{str(r['gc_freeze']):>10}{i['p50']:>9.2f}{i['p99']:>9.2f}"
              f"{i['max']:>9.2f}{j['p50']:>9.3f}{j['p99']:>9.3f}{j['max']:>9.3f}"
              f"{r['deadline_misses']:>7}{r['chunks']:>4}/{r['expected_chunks']:<3}"
              f"{r['frames_received']:>8}{r['cpu_percent']:>7.0f}"
              f"{sum(r['gc_collections']):>7}{r['gc_pause_max_ms']:>8.1f}")
    print('inf = predict wall time as the node measured it (ideal ~gpu-ms), jit = publish - '
          'deadline, ms; CPU % of the node process (100 = one core); gc n = collections; '
          'gc max = longest collector pause, ms')
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'), 'command': ' '.join(sys.argv),
            'machine': platform.platform(), 'cpus': os.cpu_count(),
            'python': platform.python_version(), 'config': {
                k: v for k, v in vars(args).items() if k not in ('out', 'command')},
            'results': results}, indent=1, default=str))
        print(f'wrote {args.out}')
    return 0 if results else 1


if __name__ == '__main__':
    raise SystemExit(main())
