"""End-to-end timing of the policy node under camera load, over real DDS (jitter, latency, age).

Starts, as separate processes: camera publishers (N cameras of H x W rgb8 at a fixed rate,
a few cameras per process so that Python publishing keeps up; with `--camera-transport
compressed` the same synthetic frames as `sensor_msgs/CompressedImage`, jpeg at
`--jpeg-quality`, on `<topic>/compressed`, each encoded once before publishing starts, and
the node's `camera_transports: [compressed]`), a `sensor_msgs/JointState`
publisher (the configured joint names, header stamps = now) and the policy node itself
(`python -m molmobot_policy.ros.node --ros-args --params-file <generated yaml>`). A recorder
in this process subscribes to the node's `~/chunk_info` (one `diagnostic_msgs/
DiagnosticStatus` per published chunk: publish_jitter_ms, observation_age_ms, inference_ms,
frames_decoded, decode_ms, tick) and to `/diagnostics` (the node's cumulative counters), and samples
the CPU time of every process from /proc/<pid>/stat (utime + stime, all threads).

It waits for the node's first chunk (configure = build + warm-up + compile/capture), lets
`--warmup` more seconds pass, measures for `--duration` seconds, then stops everything,
prints a table and writes JSON (`--out`). Measures:
- publish jitter: publish time - the tick's deadline, ms (node clock; deadlines are
  absolute, `t0 + k * chunk_period`); p50 / p99 / max over every chunk in the window.
- sensor-to-publish age: publish time - observation stamp (the oldest input header stamp),
  ms; inference: `engine.predict` wall time as the node measured it, ms.
- where a late publish's time went (per chunk; absent from older nodes' chunk_info): the worker's
  timed wait before the deadline returning late (wake_late_ms), the worker thread runnable
  without a CPU from before that wait to after the publish (runqueue_wait_ms, Linux
  schedstat: the operating system's share; the rest of a delay is the GIL or a lock), the
  publish call (publish_call_ms), the deadline poll's longest gap (tail_stall_ms), and,
  for a publish late because the work overran its lead, the work's parts: start_late_ms
  (the work began after the tick's start_at), observe_ms, preprocess_ms and model_ms (the
  engine's split of the inference), after_predict_ms (inference end to the deadline
  wait); summarized over all chunks and over the late ones (jitter > LATE_MS).
- deadline misses, skipped ticks, failed ticks, dropped actions: differences of the node's
  /diagnostics counters across the window; tick gaps: ticks without a chunk (chunk_info).
- frames decoded vs received: the synchronizer decodes a camera frame only when an
  observation uses it, so decoded per chunk should equal the camera count, far below the
  frames received.
- decode: the wall time the node's synchronizer spent decoding the frames of each chunk's
  observation (decode_ms; part of the observation age, not of inference), ms per chunk and
  per frame (each chunk's decode_ms / frames_decoded); raw rgb8 is a copy, jpeg a real
  decode. The frames are uniform noise, the hardest case for jpeg: camera images compress
  smaller and decode faster.
- CPU: percent of one core per process over the window (100 = one core busy), and the
  whole machine's busy percent and steal percent (/proc/stat: time the hypervisor ran
  something else while a virtual CPU had work).
- achieved publisher rates (each publisher prints its cumulative counts once a second).
Targets (issue 19): jitter p99 <= 1 ms, max <= 3 ms, zero deadline misses and skipped ticks
(the shortest chunk period meeting them: <= 0.085 s). Exits 1 if no chunk arrived, else 0
(targets are reported, not enforced).

Beside the JSON (`<out stem>_latency_timeline.png`, `<out stem>_jitter_histogram.png`, paths
printed at the end): inference, observation age and publish jitter of every measured chunk
over time, and the jitter's histogram with the targets (molmobot_policy_demo.sim.plots; needs
matplotlib, requirements/demo.txt: without it the run says so and writes only the JSON).

Full size on the GPU machine (see benchmarks/h200_node_jitter.sh):
    python benchmarks/benchmark_node_jitter.py --model molmobot-4b-8cam --device cuda \\
        --dtype bfloat16 --compile --cuda-graphs --buckets auto --chunk-period 0.15 \\
        --duration 300 --out out/node_jitter.json
CPU sanity run with the tiny model (2 cores: fewer, smaller frames; ratios only):
    .venv/bin/python benchmarks/benchmark_node_jitter.py --model tiny --camera-rate 10 \\
        --height 96 --width 128 --chunk-period 1.0 --control-period 0.2 --duration 60
Compressed cameras (jpeg; the decode rows then show what decoding costs the node): add
`--camera-transport compressed` to either.
Where the node receives the cameras (`--camera-receiver`, the node's camera_receiver):
`auto` (the node's default; here, on the system clock with room in /dev/shm: a child
process subscribing the cameras and passing the newest frames through shared memory, issue
19; the node log says which), `subprocess`, or `in_process` (its own subscriptions). With
the child, the node's CPU row leaves it out; `node_children` is the CPU of every process the
node started (the receiver and multiprocessing's resource tracker).

Export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST (the default set here if unset) and a
ROS_DOMAIN_ID of your own; every process inherits them, and FASTDDS_DEFAULT_PROFILES_FILE
(--dds-profile, default config/fastdds_large_images.xml: without it rmw_fastrtps_cpp's 512 KiB
shared-memory segment loses most ~1 MB images; README 'Large images over DDS').
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import yaml

import common
from common import REPO, cpu_seconds, summary
from molmobot_policy.ros.messages import ChunkInfo  # noqa: E402
from molmobot_policy.ros.parameters import CAMERA_RECEIVERS, CAMERA_TRANSPORTS  # noqa: E402

NODE_NAME = 'molmobot_policy'
CHUNK_INFO_TOPIC = f'/{NODE_NAME}/chunk_info'
SCHEDULE_STATUS = f'{NODE_NAME}: schedule'
CAMERA_STATUS_PREFIX = f'{NODE_NAME}: camera '
# joint names per model preset: the tiny preset serves the 7-joint Jaco of config/
# policy_tiny.yaml; the full-size 8-camera preset has 14-D state and actions (two arms)
PRESET_JOINTS = {
    'tiny': [f'jaco_joint_{k}' for k in range(1, 7)] + ['jaco_finger_1'],
    'molmobot-4b-8cam': ([f'left_joint_{k}' for k in range(1, 7)] + ['left_gripper']
                         + [f'right_joint_{k}' for k in range(1, 7)] + ['right_gripper']),
}
BUCKET_MULTIPLE = 64        # --buckets auto: the prompt length rounded up to this
STATS_PREFIX = 'STATS '     # publisher stdout lines carrying their counters
LATE_MS = 1.0               # chunks published later than this after their deadline count as late
STALL_PLACES = 20           # the most frequent places of other threads after a poll stall
                            # (threads always found in one place are listed as parked)
TARGET_P99_MS, TARGET_MAX_MS = 1.0, 3.0    # issue 19's publish jitter targets
DELAY_KEYS = ChunkInfo.DELAY     # parts of the delay (the node's debug_timing)
DDS_PROFILE = REPO / 'config' / 'fastdds_large_images.xml'   # README 'Large images over DDS'
JPEG_QUALITY = 95           # OpenCV's default IMWRITE_JPEG_QUALITY


# ----------------------------------------------------------------------------- publishers
def run_publisher(args) -> int:
    """`publish` sub-command: publish images and/or joint states on a fixed absolute schedule.

    Prints `STATS {"t": monotonic s, "published": {topic: n}, "late": n, "bytes": {topic:
    n}}` once a second (cumulative; `late` counts ticks dropped because the loop fell a whole
    period behind; `bytes`: each camera's image data size). With `--transport compressed`
    each camera's frame is encoded to jpeg once, here, and the message restamped and resent.
    """
    import rclpy
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import CompressedImage, JointState

    from molmobot_policy.ros import codec

    rclpy.init()
    node = rclpy.create_node(f'bench_publisher_{os.getpid()}')
    clock = node.get_clock()
    rng = np.random.default_rng(os.getpid())
    cameras = []
    for topic in args.cameras:
        msg = common.random_rgb8_image(topic, args.height, args.width, rng)
        if args.transport == 'compressed':      # the same frame, encoded once
            jpeg = codec.rgb_to_jpeg(codec.image_to_rgb(msg), args.jpeg_quality)
            msg = CompressedImage(header=msg.header, format=codec.JPEG_FORMAT, data=jpeg)
            topic = f'{topic}/compressed'
        cameras.append((topic, node.create_publisher(type(msg), topic, qos_profile_sensor_data),
                        msg))
    sizes = {topic: len(msg.data) for topic, _, msg in cameras}
    joints = None
    if args.joints:
        joints = (node.create_publisher(JointState, args.joint_topic, qos_profile_sensor_data),
                  JointState(name=list(args.joints)))
    counts = {topic: 0 for topic, _, _ in cameras}
    if joints is not None:
        counts[args.joint_topic] = 0

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    period = 1.0 / args.rate
    t0 = time.monotonic()
    next_report, k, late = t0 + 1.0, 0, 0
    while not stop.is_set():
        k += 1
        target = t0 + k * period
        delay = target - time.monotonic()
        if delay > 0:
            stop.wait(delay)
        elif -delay > period:                   # a whole period behind: drop, do not burst
            skip = int(-delay // period)
            k += skip
            late += skip
        stamp = clock.now().to_msg()
        for topic, publisher, msg in cameras:
            msg.header.stamp = stamp
            publisher.publish(msg)
            counts[topic] += 1
        if joints is not None:
            publisher, msg = joints
            msg.header.stamp = stamp
            msg.position = [0.1 * math.sin(0.5 * k * period + j) for j in range(len(msg.name))]
            publisher.publish(msg)
            counts[args.joint_topic] += 1
        if time.monotonic() >= next_report:
            next_report += 1.0
            print(STATS_PREFIX + json.dumps({'t': time.monotonic(), 'published': counts,
                                             'late': late, 'bytes': sizes}), flush=True)
    print(STATS_PREFIX + json.dumps({'t': time.monotonic(), 'published': counts,
                                     'late': late, 'bytes': sizes}), flush=True)
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


class Process:
    """A child process; stdout parsed for STATS lines (publishers) or sent to a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, stats: bool = False):
        self.name = name
        self.log_path = log_path
        self.stats: list[dict] = []
        env = dict(os.environ, PYTHONUNBUFFERED='1', RCUTILS_LOGGING_BUFFERED_STREAM='0')
        self._log = open(log_path, 'wb')
        self.popen = subprocess.Popen(
            argv, cwd=REPO, env=env, stderr=self._log if stats else subprocess.STDOUT,
            stdout=subprocess.PIPE if stats else self._log, text=stats)
        self._reader = None
        if stats:
            self._reader = threading.Thread(target=self._read_stats, daemon=True)
            self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read_stats(self) -> None:
        for line in self.popen.stdout:
            if line.startswith(STATS_PREFIX):
                self.stats.append(json.loads(line[len(STATS_PREFIX):]))

    def running(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float) -> int:
        """SIGINT, then SIGKILL after `timeout` s; returns the exit status."""
        common.interrupt_then_kill(self.popen, timeout)
        if self._reader is not None:
            self._reader.join(timeout=2.0)
        self._log.close()
        return self.popen.returncode

    def rates(self, start: float, end: float) -> dict[str, float]:
        """Messages per second per topic between the STATS lines nearest to start and end."""
        if len(self.stats) < 2:
            return {}
        first = min(self.stats, key=lambda s: abs(s['t'] - start))
        last = min(self.stats, key=lambda s: abs(s['t'] - end))
        span = last['t'] - first['t']
        if span <= 0:
            return {}
        return {topic: (n - first['published'][topic]) / span
                for topic, n in last['published'].items()}


# ------------------------------------------------------------------------------- recorder
class Recorder:
    """Subscribes to the node's chunk_info and /diagnostics; spins in a background thread."""

    def __init__(self) -> None:
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import QoSProfile

        rclpy.init()
        self.node = rclpy.create_node('node_jitter_recorder')
        self.lock = threading.Lock()
        self.chunks: list[tuple[float, dict]] = []        # (monotonic receive time, values)
        self.diagnostics: list[tuple[float, dict]] = []   # (time, {status name: values})
        self.node.create_subscription(DiagnosticStatus, CHUNK_INFO_TOPIC, self._on_chunk,
                                      QoSProfile(depth=100))
        self.node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diagnostics,
                                      QoSProfile(depth=20))
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        from rclpy.executors import ExternalShutdownException
        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    def _on_chunk(self, msg) -> None:
        with self.lock:
            self.chunks.append((time.monotonic(), {kv.key: kv.value for kv in msg.values}))

    def _on_diagnostics(self, msg) -> None:
        statuses = {s.name: {kv.key: kv.value for kv in s.values} for s in msg.status}
        if SCHEDULE_STATUS in statuses:
            with self.lock:
                self.diagnostics.append((time.monotonic(), statuses))

    def chunk_count(self) -> int:
        with self.lock:
            return len(self.chunks)

    def chunks_between(self, start: float, end: float) -> list[dict]:
        with self.lock:
            return [values for t, values in self.chunks if start <= t <= end]

    def diagnostics_after(self, t: float):
        """The first /diagnostics (time, statuses) received at or after t, or None."""
        with self.lock:
            return next(((r, s) for r, s in self.diagnostics if r >= t), None)

    def close(self) -> None:
        import rclpy
        self.executor.shutdown(timeout_sec=2.0)
        self.node.destroy_node()
        rclpy.try_shutdown()
        self._thread.join(timeout=5.0)


# ------------------------------------------------------------------------------------ CPU
def machine_cpu() -> tuple[float, float, float]:
    """(busy, total, steal) jiffies of the whole machine from /proc/stat (proc(5): user nice
    system idle iowait irq softirq steal ...)."""
    values = [int(v) for v in Path('/proc/stat').read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]             # idle + iowait
    steal = values[7] if len(values) > 7 else 0
    return sum(values) - idle, sum(values), steal


# ---------------------------------------------------------------------------- parameters
def auto_buckets(model: str, cameras: int, instruction: str) -> list[int]:
    """One padding bucket: the prompt length rounded up to BUCKET_MULTIPLE tokens."""
    from molmobot_policy.model.config import MolmoBotConfig
    from molmobot_policy.preprocess import prompt, tokenizer
    config = MolmoBotConfig.from_name(model)
    ids = prompt.build_prompt_ids(tokenizer.tiny_tokenizer(), config.tokens, cameras,
                                  config.tokens_per_image, instruction)
    return [int(math.ceil(len(ids) / BUCKET_MULTIPLE) * BUCKET_MULTIPLE)]


def node_parameters(args, camera_topics: list[str], joints: list[str]) -> dict:
    """The node's ros__parameters for this run (lists copied: rcl's YAML parser rejects
    aliases). Empty arrays are left out: rcl cannot type an empty YAML list."""
    parameters = {
        'autostart': True,
        'camera_topics': list(camera_topics), 'camera_qos': 'sensor_data',
        'camera_transports': [args.camera_transport],
        'camera_receiver': args.camera_receiver,
        'joint_state_topic': args.joint_topic,
        'joint_names': list(joints), 'action_joint_names': list(joints),
        'instruction': args.instruction,
        'chunk_period': args.chunk_period, 'control_period': args.control_period,
        'max_image_age': args.max_image_age, 'max_state_age': args.max_state_age,
        'model': args.model, 'allow_random_weights': True,     # the random-weight model
        'device': args.device, 'dtype': args.dtype, 'seed': 0,
        'flow_steps': args.flow_steps, 'compile': args.compile,
        'cuda_graphs': args.cuda_graphs, 'quantize': args.quantize,
        'diagnostics_period': 1.0, 'debug_timing': True,
    }
    if args.buckets:
        parameters['buckets'] = list(args.buckets)
    return parameters


def parse_buckets(text: str) -> list[int] | str:
    if text in ('auto', 'none', ''):
        return text or 'none'
    try:
        return [int(b) for b in text.split(',')]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--buckets: expected 'auto', 'none' or comma-separated token counts, got "
            f'{text!r}') from None


# --------------------------------------------------------------------------------- report
def _floats(chunks: list[dict], key: str) -> list[float]:
    """A chunk_info value as floats, leaving out chunks without it (older nodes, '')."""
    return [float(c[key]) for c in chunks if c.get(key, '') != '']


def publish_delay(chunks: list[dict]) -> dict:
    """The parts of publish jitter the node reports per chunk, over all chunks and over
    the late ones (jitter > LATE_MS): {'all' | 'late': {key: summary}, 'late_chunks': n}."""
    late = [c for c in chunks if float(c['publish_jitter_ms']) > LATE_MS]
    stalls = collections.Counter(part for c in chunks for part in
                                 c.get(ChunkInfo.STALLED_THREADS, '').split('; ') if part)
    places = collections.defaultdict(set)       # thread name -> its places after stalls
    for place in stalls:
        places[place.split(': ', 1)[0]].add(place)
    parked = sorted(name for name, seen in places.items() if len(seen) == 1)
    accounts = [dict(item.split('=') for item in c[ChunkInfo.STALL_ACCOUNT].split())
                for c in chunks if c.get(ChunkInfo.STALL_ACCOUNT)]
    return {'late_chunks': len(late), 'late_ms': LATE_MS,
            'stall_accounts': {key: summary([float(a[key]) for a in accounts])
                               for key in (accounts[0] if accounts else {})},
            'stalled_threads': [(place, n) for place, n in stalls.most_common()
                                if place.split(': ', 1)[0] not in parked][:STALL_PLACES],
            'parked_threads': parked,
            **{group: {key: summary(_floats(members, key)) for key in DELAY_KEYS}
               for group, members in (('all', chunks), ('late', late))}}


def counter_differences(first: dict, last: dict) -> dict:
    """Differences of the node's cumulative /diagnostics counters between two snapshots."""
    schedule_first, schedule_last = first[SCHEDULE_STATUS], last[SCHEDULE_STATUS]
    result = {}
    for key in ('chunks_published', 'deadline_misses', 'skipped_ticks', 'failed_ticks',
                'dropped_actions', 'frames_decoded'):
        if key in schedule_last and key in schedule_first:   # frames_decoded: newer nodes
            result[key] = int(schedule_last[key]) - int(schedule_first[key])
    received = [int(last[name]['messages']) - int(first[name].get('messages', 0))
                for name in last if name.startswith(CAMERA_STATUS_PREFIX) and name in first]
    result['frames_received'] = sum(received)
    return result


def measure(args, recorder: Recorder, processes: dict[str, Process], start: float,
            end: float) -> dict:
    """Everything measured in [start, end] (monotonic s)."""
    chunks = recorder.chunks_between(start, end)
    result = {
        'window_s': end - start, 'chunks': len(chunks),
        'publish_jitter_ms': summary([float(c['publish_jitter_ms']) for c in chunks]),
        'observation_age_ms': summary([float(c['observation_age_ms']) for c in chunks]),
        'inference_ms': summary([float(c['inference_ms']) for c in chunks]),
        'dropped_per_chunk': summary([int(c['dropped']) for c in chunks]),
    }
    ticks = [int(c['tick']) for c in chunks]
    result['tick_gaps'] = int(sum(b - a - 1 for a, b in zip(ticks, ticks[1:])))
    result['expected_chunks'] = int(round(result['window_s'] / args.chunk_period))
    decoded = [int(c['frames_decoded']) for c in chunks if 'frames_decoded' in c]
    result['frames_decoded_per_chunk'] = summary(decoded)
    timed = [c for c in chunks if c.get('decode_ms', '') != '']     # absent from older nodes
    result['decode_ms_per_chunk'] = summary([float(c['decode_ms']) for c in timed])
    result['decode_ms_per_frame'] = summary([float(c['decode_ms']) / int(c['frames_decoded'])
                                             for c in timed if int(c['frames_decoded'])])
    result['publish_delay'] = publish_delay(chunks)
    first, last = recorder.diagnostics_after(start), recorder.diagnostics_after(end)
    if first is not None and last is not None and last[0] > first[0]:
        result['counters'] = counter_differences(first[1], last[1])
        result['counters_window_s'] = last[0] - first[0]
        schedule = last[1][SCHEDULE_STATUS]
        if 'gc_collections' in schedule:        # garbage-collector pauses (newer nodes)
            result['gc'] = {'collections_by_generation': schedule['gc_collections'],
                            'pause_max_since_activate_ms':
                                float(schedule['gc_pause_max_since_activate_ms']),
                            'pause_p99_recent_ms': float(schedule['gc_pause_p99_ms'])}
    rates, sizes = {}, {}
    for name, process in processes.items():
        if name != 'node':
            rates.update(process.rates(start, end))
            sizes.update(process.stats[-1].get('bytes', {}) if process.stats else {})
    result['publish_rates_hz'] = rates
    result['camera_message_bytes'] = sizes      # image data per message, per camera topic
    return result


def cpu_percent(before: dict, after: dict, seconds: float) -> dict:
    return {name: 100.0 * (after[name] - before[name]) / seconds for name in before
            if name != 'machine'} | {
        'machine_busy': 100.0 * (after['machine'][0] - before['machine'][0])
        / max(1, after['machine'][1] - before['machine'][1]),
        'machine_steal': 100.0 * (after['machine'][2] - before['machine'][2])
        / max(1, after['machine'][1] - before['machine'][1])}


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs (/proc/<pid>/task/<tid>/children)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f'/proc/{parent}/task').glob('*/children'):
            try:
                pids = [int(c) for c in children.read_text().split()]
            except OSError:
                continue
            found.extend(pids)
            todo.extend(pids)
    return found


def cpu_snapshot(processes: dict[str, Process]) -> dict:
    snapshot = {name: cpu_seconds(p.pid) for name, p in processes.items()}
    if 'node' in processes:     # the camera receiver process (--camera-receiver subprocess)
        snapshot['node_children'] = sum(cpu_seconds(c)
                                        for c in descendants(processes['node'].pid))
    snapshot['recorder'] = cpu_seconds(os.getpid())
    snapshot['machine'] = machine_cpu()
    return snapshot


def print_table(run: dict) -> None:
    r, c = run['results'], run['config']
    images = ('rgb8' if c['camera_transport'] == 'raw'
              else f"rgb8 as jpeg q{c['jpeg_quality']} on <topic>/compressed")
    images += f" received {c.get('camera_receiver', 'in_process')}"
    sizes = list(r.get('camera_message_bytes', {}).values())
    if sizes:
        images += f' ({np.mean(sizes) / 1024:.0f} KiB per message)'
    print()
    print(f"node jitter benchmark: {c['model']} on {c['device']} ({c['dtype']}, compile="
          f"{c['compile']}, cuda_graphs={c['cuda_graphs']}, buckets={c['buckets'] or 'none'}, "
          f"quantize={c['quantize']}); {c['cameras']} cameras x {c['camera_rate']:g} Hz x "
          f"{c['height']}x{c['width']} {images}, joint_states {c['joint_rate']:g} Hz; "
          f"chunk_period {c['chunk_period']:g} s, control_period {c['control_period']:g} s; "
          f"{r['window_s']:.0f} s measured after {c['warmup']:g} s warm-up")
    print(f"{'':<28}{'p50':>10}{'p99':>10}{'max':>10}")
    for label, key in (('publish jitter (ms)', 'publish_jitter_ms'),
                       ('sensor-to-publish age (ms)', 'observation_age_ms'),
                       ('inference (ms)', 'inference_ms'),
                       ('decode per chunk (ms)', 'decode_ms_per_chunk'),
                       ('decode per frame (ms)', 'decode_ms_per_frame')):
        s = r[key]
        print(f'{label:<28}{s["p50"]:>10.3f}{s["p99"]:>10.3f}{s["max"]:>10.3f}')
    counters = r.get('counters', {})
    print(f"chunks {r['chunks']} (expected {r['expected_chunks']}), tick gaps "
          f"{r['tick_gaps']}, deadline misses {counters.get('deadline_misses', '?')}, skipped "
          f"ticks {counters.get('skipped_ticks', '?')}, failed ticks "
          f"{counters.get('failed_ticks', '?')}, dropped actions "
          f"{counters.get('dropped_actions', '?')} (per chunk p50 "
          f"{r['dropped_per_chunk']['p50']:g})")
    per_chunk = r['frames_decoded_per_chunk']
    received, decoded = counters.get('frames_received'), counters.get('frames_decoded')
    ratio = f'{decoded / received:.3f}' if received and decoded is not None else '?'
    print(f"frames: received {received if received is not None else '?'}, decoded "
          f"{decoded if decoded is not None else '?'} (decoded/received {ratio}; per chunk "
          f"min {per_chunk['min']:g} max {per_chunk['max']:g}, cameras {c['cameras']})")
    rates = r['publish_rates_hz']
    camera_rates = [v for k, v in rates.items() if k != c['joint_topic']]
    if camera_rates:
        print(f"achieved camera rates (Hz): min {min(camera_rates):.2f} mean "
              f"{np.mean(camera_rates):.2f} max {max(camera_rates):.2f} (target "
              f"{c['camera_rate']:g}); joint_states "
              f"{rates.get(c['joint_topic'], math.nan):.2f} (target {c['joint_rate']:g})")
    if 'gc' in r:
        g = r['gc']
        print(f"garbage collector since activate: collections (gen 0/1/2) "
              f"{g['collections_by_generation']}, longest pause "
              f"{g['pause_max_since_activate_ms']:.2f} ms")
    delay = r.get('publish_delay')
    if delay and delay['all']['publish_call_ms']['n']:
        print(f"publish delay parts, ms: p50 / p99 / max over all chunks; p50 / max over the "
              f"{delay['late_chunks']} published more than {delay['late_ms']:g} ms late:")
        for label, key in (('timed wait returned late', 'wake_late_ms'),
                           ('runnable without a CPU', 'runqueue_wait_ms'),
                           ('publish call', 'publish_call_ms'),
                           ('deadline poll stalled', 'tail_stall_ms'),
                           ('work began after start_at', 'start_late_ms'),
                           ('observe (frames, sync)', 'observe_ms'),
                           ('inference: preprocess', 'preprocess_ms'),
                           ('inference: model', 'model_ms'),
                           ('inference end to wait', 'after_predict_ms')):
            a, late = delay['all'].get(key), delay['late'].get(key)
            if not a or not a['n']:
                continue
            print(f"  {label:<26}{a['p50']:>8.3f}{a['p99']:>8.3f}{a['max']:>8.3f}   late: "
                  f"{late['p50']:.3f} / {late['max']:.3f}")
        if delay.get('stalled_threads') or delay.get('parked_threads'):
            print(f"where the other threads were after the deadline poll stalled over 1 ms "
                  f"(chunks; the {STALL_PLACES} most frequent places of threads seen in more "
                  f"than one):")
            for place, n in delay.get('stalled_threads', []):
                print(f"  {n:5d}  {place}")
            print('  always in one place (parked): ' + (', '.join(delay['parked_threads'])
                                                        or 'none'))
        accounts = delay.get('stall_accounts')
        if accounts:
            n = next(iter(accounts.values()))['n']
            print(f"the worker's own accounts over those {n} stalls, p50 / max (on a CPU, on a "
                  "run queue, neither = asleep: the GIL, a lock, or the virtual CPU not run):")
            print('  ' + ', '.join(f"{key} {a['p50']:g} / {a['max']:g}"
                                   for key, a in accounts.items()))
    print('CPU % (100 = one core): ' + ', '.join(f'{k} {v:.1f}'
                                                  for k, v in r['cpu_percent'].items()))
    jitter = r['publish_jitter_ms']
    verdict = {True: 'PASS', False: 'FAIL'}
    misses, skips = counters.get('deadline_misses'), counters.get('skipped_ticks')
    print(f"targets: jitter p99 {jitter['p99']:.3f} <= {TARGET_P99_MS:g} ms "
          f"{verdict[jitter['p99'] <= TARGET_P99_MS]}; max {jitter['max']:.3f} <= "
          f"{TARGET_MAX_MS:g} ms {verdict[jitter['max'] <= TARGET_MAX_MS]}; deadline misses "
          f"{misses} and skipped ticks {skips} {verdict[misses == 0 and skips == 0]} "
          f"(period / p99 inference = {1e3 * c['chunk_period'] / r['inference_ms']['p99']:.2f})")


# ----------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = parser.add_subparsers(dest='command')
    pub = sub.add_parser('publish', help='(internal) one publisher process')
    pub.add_argument('--cameras', nargs='*', default=[])
    pub.add_argument('--joints', nargs='*', default=[])
    pub.add_argument('--joint-topic', default='/joint_states')
    pub.add_argument('--rate', type=float, required=True)
    pub.add_argument('--height', type=int, default=480)
    pub.add_argument('--width', type=int, default=640)
    pub.add_argument('--transport', default='raw', choices=CAMERA_TRANSPORTS)
    pub.add_argument('--jpeg-quality', type=int, default=JPEG_QUALITY)

    add = parser.add_argument
    add('--model', default='tiny', choices=sorted(PRESET_JOINTS), help='model preset')
    add('--device', default='cpu')
    add('--dtype', default='float32', choices=['float32', 'bfloat16'])
    add('--compile', action='store_true', help='torch.compile the query')
    add('--cuda-graphs', action='store_true', help='capture each bucket as a CUDA graph')
    add('--buckets', type=parse_buckets, default='auto',
        help="prompt padding buckets: 'auto' (the prompt length rounded up to 64, when "
             "--compile or --cuda-graphs), 'none', or e.g. 1664,1856")
    add('--quantize', default='none', choices=['none', 'fp8', 'fp8-rowwise', 'fp8-tensor'])
    add('--flow-steps', type=int, default=0, help="Euler steps (0: the model's)")
    add('--instruction', default='stack the red brick on the blue brick')
    add('--chunk-period', type=float, default=1.0, help='s between chunks')
    add('--control-period', type=float, default=0.2, help='s between actions of a chunk')
    add('--max-image-age', type=float, default=0.5, help='s')
    add('--max-state-age', type=float, default=0.5, help='s')
    add('--cameras', type=int, default=8)
    add('--camera-rate', type=float, default=30.0, help='Hz')
    add('--height', type=int, default=480)
    add('--width', type=int, default=640)
    add('--cameras-per-process', type=int, default=2)
    add('--camera-transport', default='raw', choices=CAMERA_TRANSPORTS,
        help="'raw': sensor_msgs/Image rgb8 on each camera topic; 'compressed': "
             'sensor_msgs/CompressedImage (jpeg of the same frames, encoded once) on '
             '<topic>/compressed, the node decoding them (camera_transports: [compressed])')
    add('--camera-receiver', default='auto', choices=CAMERA_RECEIVERS,
        help="the node's camera_receiver: 'auto' (its default: 'subprocess' on the system "
             "clock with room in /dev/shm), 'in_process' (its own subscriptions) or "
             "'subprocess' (a child process receives the cameras and passes the newest "
             'frames through shared memory)')
    add('--jpeg-quality', type=int, default=JPEG_QUALITY,
        help='jpeg quality 1..100 with --camera-transport compressed (OpenCV default 95)')
    add('--joint-rate', type=float, default=100.0, help='Hz')
    add('--joint-topic', default='/joint_states')
    add('--duration', type=float, default=60.0, help='measured seconds')
    add('--warmup', type=float, default=10.0,
        help='seconds after the first chunk excluded from the measurement')
    add('--startup-timeout', type=float, default=1800.0,
        help='s to wait for the first chunk (configure: build, warm-up, compile, capture)')
    add('--dds-profile', default=str(DDS_PROFILE),
        help="Fast DDS XML profile for every process (FASTDDS_DEFAULT_PROFILES_FILE; default "
             "config/fastdds_large_images.xml: a shared-memory segment that fits ~1 MB images, "
             "see README 'Large images over DDS'); 'env' keeps the environment's, 'none' unsets")
    add('--workdir', type=Path, default=None,
        help='parameter file and process logs (default: benchmarks/out/node_jitter_<time>)')
    add('--out', type=Path, default=None, help='JSON results (default: <workdir>/results.json)')
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == 'publish':
        return run_publisher(args)
    if not 1 <= args.jpeg_quality <= 100:
        raise SystemExit(f'--jpeg-quality: expected 1..100, got {args.jpeg_quality}')
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    if args.dds_profile == 'none':
        os.environ.pop('FASTDDS_DEFAULT_PROFILES_FILE', None)
    elif args.dds_profile != 'env':
        if not Path(args.dds_profile).is_file():
            raise SystemExit(f'--dds-profile: no such file {args.dds_profile!r}')
        os.environ['FASTDDS_DEFAULT_PROFILES_FILE'] = str(Path(args.dds_profile).resolve())
    stamp = time.strftime('%Y%m%d_%H%M%S')
    workdir = args.workdir or REPO / 'benchmarks' / 'out' / f'node_jitter_{stamp}'
    workdir.mkdir(parents=True, exist_ok=True)
    out = args.out or workdir / 'results.json'
    if args.buckets == 'auto':
        args.buckets = (auto_buckets(args.model, args.cameras, args.instruction)
                        if args.compile or args.cuda_graphs else [])
    elif args.buckets == 'none':
        args.buckets = []
    joints = PRESET_JOINTS[args.model]
    camera_topics = [f'/cam{k}/image_raw' for k in range(args.cameras)]
    params_file = workdir / 'policy_params.yaml'
    params_file.write_text(yaml.safe_dump(
        {NODE_NAME: {'ros__parameters': node_parameters(args, camera_topics, joints)}}))
    print(f"ROS_DOMAIN_ID={os.environ.get('ROS_DOMAIN_ID', '(unset)')}; "
          f"FASTDDS_DEFAULT_PROFILES_FILE={os.environ.get('FASTDDS_DEFAULT_PROFILES_FILE', '')}"
          f'; parameters {params_file}; logs in {workdir}', flush=True)

    recorder = Recorder()
    processes: dict[str, Process] = {}
    me = [sys.executable, str(Path(__file__).resolve()), 'publish']
    per = max(1, args.cameras_per_process)
    for i in range(0, args.cameras, per):
        group = camera_topics[i:i + per]
        name = f'cameras{i // per}'
        processes[name] = Process(name, me + [
            '--rate', str(args.camera_rate), '--height', str(args.height),
            '--width', str(args.width), '--transport', args.camera_transport,
            '--jpeg-quality', str(args.jpeg_quality), '--cameras', *group],
            workdir / f'{name}.log', stats=True)
    processes['joint_states'] = Process('joint_states', me + [
        '--rate', str(args.joint_rate), '--joint-topic', args.joint_topic,
        '--joints', *joints], workdir / 'joint_states.log', stats=True)
    processes['node'] = Process('node', [
        sys.executable, '-m', 'molmobot_policy.ros.node', '--ros-args', '--params-file',
        str(params_file)], workdir / 'node.log')

    status = 1
    try:
        status = run_benchmark(args, recorder, processes, out)
    finally:
        for name in sorted(processes, key=lambda n: n != 'node'):   # the node first
            processes[name].stop(timeout=30.0 if name == 'node' else 5.0)
        recorder.close()
    return status


def run_benchmark(args, recorder, processes, out) -> int:
    node = processes['node']
    started = time.monotonic()
    print(f'waiting for the first chunk (configure, warm-up; up to {args.startup_timeout:g} s)',
          flush=True)
    while recorder.chunk_count() == 0:
        if not node.running():
            print(f'node exited with {node.popen.returncode} before the first chunk; log: '
                  f'{node.log_path}\n' + node.log_path.read_text(errors='replace')[-3000:])
            return 1
        if time.monotonic() - started > args.startup_timeout:
            print(f'no chunk within {args.startup_timeout:g} s; log: {node.log_path}\n'
                  + node.log_path.read_text(errors='replace')[-3000:])
            return 1
        time.sleep(0.2)
    startup_s = time.monotonic() - started
    print(f'first chunk after {startup_s:.1f} s; warm-up {args.warmup:g} s, then measuring '
          f'{args.duration:g} s', flush=True)
    time.sleep(args.warmup)

    start = time.monotonic()
    cpu_before = cpu_snapshot(processes)
    while time.monotonic() - start < args.duration:
        time.sleep(min(30.0, args.duration - (time.monotonic() - start)))
        now = time.monotonic()
        chunks = recorder.chunks_between(start, now)
        jitter = summary([float(c['publish_jitter_ms']) for c in chunks])
        print(f'  {now - start:5.0f} s: {len(chunks)} chunks, jitter p99 {jitter["p99"]:.3f} '
              f'ms, max {jitter["max"]:.3f} ms', flush=True)
        if not node.running():
            print(f'node exited with {node.popen.returncode} while measuring; log: '
                  f'{node.log_path}')
            break
    end = time.monotonic()
    cpu_after = cpu_snapshot(processes)
    deadline = time.monotonic() + 3.0         # the node's first /diagnostics after the end
    while recorder.diagnostics_after(end) is None and time.monotonic() < deadline:
        time.sleep(0.1)

    results = measure(args, recorder, processes, start, end)
    results['cpu_percent'] = cpu_percent(cpu_before, cpu_after, end - start)
    results['startup_s'] = startup_s
    chunks = recorder.chunks_between(start, end)
    results['per_chunk'] = {key: [c.get(key) for c in chunks] for key in (
        'tick', 'publish_jitter_ms', 'observation_age_ms', 'inference_ms', 'dropped',
        'frames_decoded', 'decode_ms') + DELAY_KEYS + (ChunkInfo.STALLED_THREADS,
                                                       ChunkInfo.STALL_ACCOUNT)}
    run = {**common.provenance(), 'ros_domain_id': os.environ.get('ROS_DOMAIN_ID'),
           'fastdds_default_profiles_file': os.environ.get('FASTDDS_DEFAULT_PROFILES_FILE'),
           'config': {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                      if k != 'command'},
           'results': results}
    print_table(run)
    common.write_json(out, run)
    print(f'wrote {out}')
    for path in write_plots(out, chunks, run['config']):
        print(f'wrote {path}')
    return 0 if recorder.chunk_count() > 0 else 1


def write_plots(out: Path, chunks: list[dict], c: dict) -> list[Path]:
    """The latency timeline and jitter histogram of the measured chunks (their ~/chunk_info
    values) beside `out`; [] (said why) without matplotlib."""
    try:
        from molmobot_policy_demo.sim import plots
        import matplotlib  # noqa: F401
    except ImportError as error:
        print(f'no plots ({error}): pip install matplotlib (requirements/demo.txt)')
        return []
    what = (f"node jitter benchmark: {c['model']} on {c['device']} ({c['dtype']}, compile="
            f"{c['compile']}, cuda_graphs={c['cuda_graphs']}), {c['cameras']} cameras x "
            f"{c['camera_rate']:g} Hz {c['height']}x{c['width']}, chunk_period "
            f"{c['chunk_period']:g} s")
    targets = {f'target p99 {TARGET_P99_MS:g} ms': TARGET_P99_MS,
               f'target max {TARGET_MAX_MS:g} ms': TARGET_MAX_MS}
    period_ms = 1e3 * c['chunk_period']
    return [plots.latency_timeline(out.with_name(f'{out.stem}_latency_timeline.png'), chunks,
                                   what, {f'chunk_period {period_ms:g} ms': period_ms},
                                   targets),
            plots.jitter_histogram(out.with_name(f'{out.stem}_jitter_histogram.png'),
                                   [float(ch['publish_jitter_ms']) for ch in chunks],
                                   f'publish jitter per chunk: {what}', targets)]


if __name__ == '__main__':
    sys.exit(main())
