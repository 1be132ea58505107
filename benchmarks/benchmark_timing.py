"""CPU sanity benchmark of the timing core: the node's worker loop on a real clock.

Timing model (DESIGN.md, "Timing model"): the worker takes the next tick of an
absolute-deadline schedule, sleeps until `start_at = deadline - lead`, runs inference on
the newest observation, sleeps until the deadline and publishes; `lead` follows the p99
of measured inference latency times a margin. This script runs that loop with
`time.monotonic`, a fake inference that sleeps for a latency drawn from a configurable
distribution (log-normal around a median, plus rare spikes), and a background thread
standing in for the subscription callbacks (GIL contention). It measures publish jitter
(publish time - deadline), inference latency, observation age at publish and misses, for
two ways of waiting: plain `time.sleep`, and `time.sleep` with a busy-wait tail for the
last ~1 ms. It prints a table and writes JSON under benchmarks/out/ (git-ignored).

A sanity benchmark, not a test: numbers depend on the machine and its load.

    .venv/bin/python benchmarks/benchmark_timing.py               # ~40 s
    .venv/bin/python benchmarks/benchmark_timing.py --ticks 50    # quicker
"""
from __future__ import annotations

import argparse
import json
import platform
import threading
import time
from pathlib import Path

import numpy as np

from molmobot_policy.timing import (ChunkStitcher, DeadlineScheduler, LatencyEstimator,
                                    ObservationGate, RollingStats)

OUT_DIR = Path(__file__).resolve().parent / 'out'


def make_sleep_until(busy_tail: float):
    """A sleep_until(t) on time.monotonic; busy-waits the last `busy_tail` seconds."""
    def sleep_until(t: float) -> bool:
        remaining = t - time.monotonic() - busy_tail
        if remaining > 0:
            time.sleep(remaining)
        while time.monotonic() < t:
            pass
        return True
    return sleep_until


class FakeSensors(threading.Thread):
    """Stands in for the camera callbacks: at `hz`, a small copy, then a new stamped frame."""

    def __init__(self, hz: float):
        super().__init__(daemon=True)
        self.period = 1.0 / hz
        self.stamp, self.seq = time.monotonic(), 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.frame = np.zeros((96, 96, 3), np.uint8)

    def run(self):
        next_time = time.monotonic()
        while not self.stop.is_set():
            next_time += self.period
            self.frame = self.frame.copy()  # decode-sized work, holds the GIL briefly
            with self.lock:
                self.stamp, self.seq = time.monotonic(), self.seq + 1
            self.stop.wait(max(0.0, next_time - time.monotonic()))

    def latest(self):
        with self.lock:
            return self.stamp, self.seq


def run_scenario(name, args, rng, busy_tail, spike_prob, max_lead=None):
    sensors = FakeSensors(args.callback_hz)
    sensors.start()
    sleep_until = make_sleep_until(busy_tail)
    estimator = LatencyEstimator(initial=args.latency_ms / 1000 * 2, max_lead=max_lead)
    gate = ObservationGate()
    stitcher = ChunkStitcher(args.period / args.horizon, smoothing='linear')
    jitter, latency, age = RollingStats(), RollingStats(), RollingStats()
    actions = np.zeros((args.horizon, 7))

    def fake_inference():
        seconds = args.latency_ms / 1000 * rng.lognormal(0.0, args.latency_sigma)
        if rng.random() < spike_prob:
            seconds *= args.spike_factor
        time.sleep(seconds)

    for _ in range(3):  # warm-up: measured, but not warm
        start = time.monotonic()
        fake_inference()
        estimator.record(time.monotonic() - start, warm=False)

    scheduler = DeadlineScheduler(args.period, t0=time.monotonic() + args.period)
    published = 0
    for _ in range(args.ticks):
        scheduler.set_lead(estimator.lead())
        tick = scheduler.next_tick(time.monotonic())
        scheduler.wait(tick, sleep_until, now=time.monotonic)
        stamp, seq = sensors.latest()
        if not gate.accept(stamp, seq):
            continue
        start = time.monotonic()
        fake_inference()
        estimator.record(time.monotonic() - start)
        latency.add(time.monotonic() - start)
        actions = actions + rng.normal(0.0, 0.01, actions.shape)
        scheduler.wait(tick, sleep_until, now=time.monotonic, target='deadline')
        publish_time = time.monotonic()
        stitcher.stitch(actions, first_time=tick.deadline, now=publish_time)
        jitter.add(publish_time - tick.deadline)
        age.add(publish_time - stamp)
        published += 1
    sensors.stop.set()
    sensors.join()

    return {
        'scenario': name, 'busy_tail_ms': busy_tail * 1000, 'spike_prob': spike_prob,
        'max_lead_ms': None if max_lead is None else max_lead * 1000,
        'ticks': args.ticks, 'published': published, 'missed': scheduler.missed,
        'refused_observations': gate.refused, 'final_lead_ms': scheduler.lead * 1000,
        'publish_jitter_ms': jitter.summary(scale=1000.0),
        'inference_ms': latency.summary(scale=1000.0),
        'observation_age_ms': age.summary(scale=1000.0),
    }


def print_table(results):
    header = (f"{'scenario':<24}{'pub':>5}{'miss':>6}{'jit p50':>9}{'jit p99':>9}"
              f"{'jit max':>9}{'inf p50':>9}{'inf p99':>9}{'lead':>8}{'age p50':>9}")
    print(header)
    print('-' * len(header))
    for r in results:
        j, i, a = r['publish_jitter_ms'], r['inference_ms'], r['observation_age_ms']
        print(f"{r['scenario']:<24}{r['published']:>5}{r['missed']:>6}{j['p50']:>9.3f}"
              f"{j['p99']:>9.3f}{j['max']:>9.3f}{i['p50']:>9.2f}{i['p99']:>9.2f}"
              f"{r['final_lead_ms']:>8.2f}{a['p50']:>9.2f}")
    print('(milliseconds; jitter = publish time - deadline; pub/miss = ticks published/missed)')


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--period', type=float, default=0.05, help='policy period, s')
    parser.add_argument('--ticks', type=int, default=100, help='ticks per scenario')
    parser.add_argument('--horizon', type=int, default=8, help='actions per chunk')
    parser.add_argument('--latency-ms', type=float, default=20.0, help='median inference, ms')
    parser.add_argument('--latency-sigma', type=float, default=0.15,
                        help='log-normal sigma of the inference latency')
    parser.add_argument('--spike-prob', type=float, default=0.03,
                        help='probability of a latency spike in the spiky scenarios')
    parser.add_argument('--spike-factor', type=float, default=3.0,
                        help='latency multiplier of a spike')
    parser.add_argument('--busy-tail-ms', type=float, default=1.0,
                        help='busy-wait this long before each target time, ms')
    parser.add_argument('--callback-hz', type=float, default=240.0,
                        help='rate of the fake sensor callbacks (8 cameras x 30 Hz)')
    parser.add_argument('--max-lead-fraction', type=float, default=0.9,
                        help='lead cap as a fraction of the period, in the last scenario')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    tail, cap = args.busy_tail_ms / 1000, args.max_lead_fraction * args.period
    scenarios = [('sleep', 0.0, 0.0, None), ('sleep+busy', tail, 0.0, None),
                 ('sleep, spiky', 0.0, args.spike_prob, None),
                 ('sleep+busy, spiky', tail, args.spike_prob, None),
                 ('sleep+busy, spiky, cap', tail, args.spike_prob, cap)]
    results = [run_scenario(name, args, rng, *scenario) for name, *scenario in scenarios]
    print_table(results)

    OUT_DIR.mkdir(exist_ok=True)
    path = OUT_DIR / f"timing_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps({'config': vars(args), 'machine': platform.platform(),
                                'results': results}, indent=2))
    print(f'wrote {path}')


if __name__ == '__main__':
    main()
