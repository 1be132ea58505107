"""How reliably and how fresh large camera images arrive over DDS (rmw_fastrtps_cpp).

For each variant (a Fast DDS transport setting x a camera QoS) this starts, as separate
processes on one fresh ROS_DOMAIN_ID: one subscriber (one `sensor_msgs/Image` subscription
per camera topic, a single-threaded executor, like the policy node's camera inputs) and
`--processes` publishers (`--cameras` topics in all, rgb8 H x W at `--rate` Hz each, on an
absolute schedule, header stamp = wall-clock time of publishing). After `--warmup` s
(discovery) it measures `--duration` s, waits `--grace` s for messages in flight, stops
everything (SIGINT, then SIGKILL) and compares, per topic, the messages whose header stamp
lies in the window:
- receive ratio = received / published (subscriber side; 1.0 = nothing lost);
- age = receive time - header.stamp, ms, p50 / p99 (both wall clock, one machine);
- gap = time between consecutive received messages of a topic, ms, p99 / max (how stale a
  camera gets between frames; the period when nothing is lost);
- CPU of the publishers and the subscriber, percent of one core (/proc/<pid>/stat).

Transports. Fast DDS (>= 2.13; 3.2 here) reads FASTDDS_BUILTIN_TRANSPORTS when a participant
is created, but under ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST rmw_fastrtps_cpp (Kilted)
turns the builtin transports off and installs its own UDPv4 + shared memory (SHM, default
512 KiB segment), so that variable only takes effect with '@subnet':
  default         rmw_fastrtps_cpp's transports (LOCALHOST: SHM + UDPv4)
  large_data      FASTDDS_BUILTIN_TRANSPORTS=LARGE_DATA: UDPv4 for participant discovery,
                  user data over SHM (same host) or TCPv4
  udpv4 / shm     FASTDDS_BUILTIN_TRANSPORTS=UDPv4 / SHM
  builtin:<v>     FASTDDS_BUILTIN_TRANSPORTS=<v> (e.g. 'LARGE_DATA?max_msg_size=4MB')
  xml:<file>      FASTDDS_DEFAULT_PROFILES_FILE=<file> (a participant profile marked default;
                  its user transports are kept next to rmw_fastrtps_cpp's)
  xml-pub:<file>  the same for the publishers only (the subscriber keeps the default)
A suffix '@subnet' / '@localhost' sets ROS_AUTOMATIC_DISCOVERY_RANGE for the variant
(default: the environment's, else LOCALHOST).
Whether a setting was honoured is checked, not assumed: the JSON records, per process, the
TCP listening sockets, UDP sockets and Fast DDS shared-memory segments it holds (/proc).

QoS variants (subscriber = publisher, as the node's `camera_qos` needs a matching driver):
  best_effort:5  best effort, keep last 5 (the node's 'sensor_data')
  reliable:1     reliable, keep last 1 (the node's 'reliable')
  reliable:5     reliable, keep last 5

On this project's 2-core machines use few, slow streams and read ratios only, e.g.:
    ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST .venv/bin/python \\
        benchmarks/benchmark_image_transport.py --cameras 4 --rate 15 --duration 12
On the GPU machine: --cameras 8 --rate 30 --processes 4 --duration 30.
Domain ids: --domain-id D uses D, D+1, ... (one per variant run), wrapping inside
[--domain-id, --domain-id-max]. Writes JSON to --out; prints a table.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

import common
from common import REPO, cpu_seconds

READY = 'READY'
TRANSPORT_ENV = ('FASTDDS_BUILTIN_TRANSPORTS', 'FASTDDS_DEFAULT_PROFILES_FILE',
                 'FASTRTPS_DEFAULT_PROFILES_FILE', 'RMW_FASTRTPS_USE_QOS_FROM_XML')
BUILTIN = {'default': None, 'large_data': 'LARGE_DATA', 'udpv4': 'UDPv4', 'shm': 'SHM'}


# ------------------------------------------------------------------------------- children
def make_qos(spec: str):
    """'best_effort:5' / 'reliable:1' -> an rclpy QoSProfile (keep last, volatile)."""
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
    reliability, depth = parse_qos(spec)
    return QoSProfile(depth=depth, history=HistoryPolicy.KEEP_LAST,
                      reliability=(ReliabilityPolicy.RELIABLE if reliability == 'reliable'
                                   else ReliabilityPolicy.BEST_EFFORT))


def run_publisher(args) -> int:
    """`publish`: rgb8 frames on each topic at args.rate; writes {topic: [stamp ns]} JSON."""
    import rclpy
    from sensor_msgs.msg import Image

    rclpy.init()
    node = rclpy.create_node(f'image_transport_publisher_{os.getpid()}')
    rng = np.random.default_rng(os.getpid())
    streams = []
    for topic in args.topics:
        msg = common.random_rgb8_image(topic, args.height, args.width, rng)
        streams.append((topic, node.create_publisher(Image, topic, make_qos(args.qos)), msg))
    stamps: dict[str, list[int]] = {topic: [] for topic in args.topics}
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(READY, flush=True)
    period = 1.0 / args.rate
    t0, k = time.monotonic(), 0
    while not stop.is_set():
        k += 1
        delay = t0 + k * period - time.monotonic()
        if delay > 0:
            stop.wait(delay)
        elif -delay > period:                   # a whole period behind: drop, do not burst
            k += int(-delay // period)
        for topic, publisher, msg in streams:
            now = time.time_ns()
            msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(now, 1_000_000_000)
            publisher.publish(msg)
            stamps[topic].append(now)
    Path(args.record).write_text(json.dumps({'published': stamps}))
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


def run_subscriber(args) -> int:
    """`subscribe`: one subscription per topic; writes {topic: [[stamp ns, receive ns]]}."""
    import rclpy
    from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
    from sensor_msgs.msg import Image

    rclpy.init()
    node = rclpy.create_node(f'image_transport_subscriber_{os.getpid()}')
    received: dict[str, list[tuple[int, int]]] = {topic: [] for topic in args.topics}

    def on_image(topic, msg):
        received[topic].append((msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec,
                                time.time_ns()))

    for topic in args.topics:
        node.create_subscription(Image, topic, lambda msg, t=topic: on_image(t, msg),
                                 make_qos(args.qos))
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(READY, flush=True)
    try:
        while not stop.is_set():
            executor.spin_once(timeout_sec=0.1)
    except ExternalShutdownException:
        pass
    Path(args.record).write_text(json.dumps({'received': received}))
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


# ----------------------------------------------------------------------------- inspection
def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f'/proc/{pid}/fd'):
            try:
                target = os.readlink(f'/proc/{pid}/fd/{fd}')
            except OSError:
                continue
            if target.startswith('socket:['):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def transport_evidence(pid: int) -> dict:
    """What the process really uses: its TCP listening / connected sockets, UDP sockets and
    the Fast DDS shared-memory segments it maps (name -> size in bytes)."""
    inodes = socket_inodes(pid)
    counts = {'tcp_listen': 0, 'tcp_connected': 0, 'udp': 0}
    for table, kind in (('tcp', 'tcp'), ('tcp6', 'tcp'), ('udp', 'udp'), ('udp6', 'udp')):
        try:
            lines = Path(f'/proc/{pid}/net/{table}').read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] not in inodes:
                continue
            if kind == 'udp':
                counts['udp'] += 1
            elif fields[3] == '0A':             # TCP_LISTEN
                counts['tcp_listen'] += 1
            elif fields[3] == '01':             # TCP_ESTABLISHED
                counts['tcp_connected'] += 1
    segments = {}
    try:
        for line in Path(f'/proc/{pid}/maps').read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith('/dev/shm/fastdds_'):
                name = fields[5].rsplit('/', 1)[1]
                if name.endswith('_el') or 'port' in name:
                    continue                    # locks and port queues, not data segments
                start, end = (int(v, 16) for v in fields[0].split('-'))
                segments[name] = segments.get(name, 0) + end - start
    except OSError:
        pass
    counts['shm_segments'] = len(segments)
    counts['shm_segment_bytes'] = sorted(segments.values())
    return counts


# ---------------------------------------------------------------------------- the variant
class Child:
    def __init__(self, argv: list[str], env: dict, log: Path):
        self._log = open(log, 'w')
        self.popen = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=self._log, text=True)

    def wait_ready(self, timeout: float) -> bool:
        result = []
        reader = threading.Thread(target=lambda: result.append(self.popen.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        return bool(result) and result[0].strip() == READY

    def stop(self, timeout: float = 5.0) -> int:
        status = common.interrupt_then_kill(self.popen, timeout)
        self._log.close()
        return status


def transport_env(transport: str) -> dict:
    """The environment of every process of a variant: Fast DDS transport settings cleared,
    then the variant's set."""
    env = {k: v for k, v in os.environ.items() if k not in TRANSPORT_ENV}
    env.update(PYTHONUNBUFFERED='1', RMW_IMPLEMENTATION='rmw_fastrtps_cpp')
    env.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    transport, _, discovery_range = transport.partition('@')
    if discovery_range:
        env['ROS_AUTOMATIC_DISCOVERY_RANGE'] = discovery_range.upper()
    if transport.startswith(('xml:', 'xml-pub:')):
        path = Path(transport.partition(':')[2])
        env['FASTDDS_DEFAULT_PROFILES_FILE'] = str(path if path.is_absolute() else REPO / path)
    elif transport.startswith('builtin:'):
        env['FASTDDS_BUILTIN_TRANSPORTS'] = transport[8:]
    elif BUILTIN[transport] is not None:
        env['FASTDDS_BUILTIN_TRANSPORTS'] = BUILTIN[transport]
    return env


def percentile(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def run_variant(args, transport: str, qos: str, domain_id: int, workdir: Path) -> dict:
    env = transport_env(transport)
    env['ROS_DOMAIN_ID'] = str(domain_id)
    sub_env = dict(env)
    if transport.startswith('xml-pub:'):        # the profile for the publishers only
        sub_env.pop('FASTDDS_DEFAULT_PROFILES_FILE')
    topics = [f'/camera_{i}/image_raw' for i in range(args.cameras)]
    groups = [topics[i::args.processes] for i in range(args.processes)]
    groups = [g for g in groups if g]
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ['--qos', qos, '--rate', str(args.rate), '--height', str(args.height),
              '--width', str(args.width)]
    tag = re.sub(r'[^A-Za-z0-9_.-]+', '_', f'{transport}_{qos}')
    sub_record = workdir / f'{tag}_subscriber.json'
    pub_records = [workdir / f'{tag}_publisher{i}.json' for i in range(len(groups))]
    for record in [sub_record] + pub_records:   # never read an earlier run's record
        record.unlink(missing_ok=True)
    subscriber = Child(me + ['subscribe', '--record', str(sub_record), '--topics', *topics]
                       + common, sub_env, workdir / f'{tag}_subscriber.log')
    children = [subscriber]
    result = {'transport': transport, 'qos': qos, 'domain_id': domain_id,
              'env': {k: env[k] for k in TRANSPORT_ENV if k in env}}
    try:
        if not subscriber.wait_ready(30.0):
            raise RuntimeError('subscriber did not start (see its log)')
        publishers = [Child(me + ['publish', '--record', str(record), '--topics', *group]
                            + common, env, workdir / f'{tag}_publisher{i}.log')
                      for i, (group, record) in enumerate(zip(groups, pub_records))]
        children += publishers
        for p in publishers:
            if not p.wait_ready(30.0):
                raise RuntimeError('a publisher did not start (see its log)')
        time.sleep(args.warmup)
        cpu0 = {c.popen.pid: cpu_seconds(c.popen.pid) for c in children}
        start = time.time_ns()
        time.sleep(args.duration)
        end = time.time_ns()
        cpu1 = {c.popen.pid: cpu_seconds(c.popen.pid) for c in children}
        result['evidence'] = {'subscriber': transport_evidence(subscriber.popen.pid),
                              'publisher0': transport_evidence(publishers[0].popen.pid)}
        time.sleep(args.grace)
    finally:
        for child in reversed(children):
            child.stop()
    seconds = (end - start) / 1e9
    result['cpu_percent'] = {
        'subscriber': 100.0 * (cpu1[subscriber.popen.pid] - cpu0[subscriber.popen.pid])
        / seconds,
        'publishers': 100.0 * sum(cpu1[p.popen.pid] - cpu0[p.popen.pid] for p in publishers)
        / seconds}
    published = {}
    for record in pub_records:
        published.update(json.loads(record.read_text())['published'])
    received = json.loads(sub_record.read_text())['received']
    per_topic, ages, gaps = {}, [], []
    for topic in topics:
        sent = [s for s in published[topic] if start <= s < end]
        got = sorted((s, r) for s, r in received.get(topic, []) if start <= s < end)
        unique = {s for s, _ in got}
        per_topic[topic] = {'published': len(sent), 'received': len(unique)}
        ages += [(r - s) / 1e6 for s, r in got]
        arrivals = sorted(r for _, r in got)
        gaps += [(b - a) / 1e6 for a, b in zip(arrivals, arrivals[1:])]
    n_pub = sum(t['published'] for t in per_topic.values())
    n_got = sum(t['received'] for t in per_topic.values())
    result.update(
        window_s=seconds, per_topic=per_topic, published=n_pub, received=n_got,
        published_hz=n_pub / seconds, received_hz=n_got / seconds,
        receive_ratio=n_got / n_pub if n_pub else math.nan,
        min_topic_ratio=min((t['received'] / t['published'] if t['published'] else math.nan)
                            for t in per_topic.values()),
        age_ms={'p50': percentile(ages, 50), 'p99': percentile(ages, 99),
                'max': max(ages, default=math.nan)},
        gap_ms={'p50': percentile(gaps, 50), 'p99': percentile(gaps, 99),
                'max': max(gaps, default=math.nan)})
    return result


# ---------------------------------------------------------------------------------- main
def parse_qos(spec: str) -> tuple[str, int]:
    reliability, _, depth = spec.partition(':')
    if reliability not in ('best_effort', 'reliable') or not depth.isdigit() or int(depth) < 1:
        raise argparse.ArgumentTypeError(
            f"QoS {spec!r}: expected 'best_effort:<depth>' or 'reliable:<depth>', depth >= 1")
    return reliability, int(depth)


def label(transport: str) -> str:
    """A transport spec for the table: 'xml:<dir>/<file>' shown as 'xml:<file>'."""
    if transport.startswith(('xml:', 'xml-pub:')):
        kind, _, path = transport.partition(':')
        return f'{kind}:{Path(path).name}'
    return transport


def print_table(run: dict) -> None:
    c = run['config']
    print(f"\nimage transport: {c['cameras']} cameras x {c['rate']:g} Hz x {c['height']}x"
          f"{c['width']} rgb8 ({c['message_bytes'] / 1e6:.2f} MB), {c['processes']} publisher "
          f"processes, {c['duration']:g} s per variant; {run['cpus']} CPUs")
    width = max([len(label(r['transport'])) for r in run['results']] + [10]) + 2
    header = (f"{'transport':<{width}}{'qos':<15}{'pub/s':>7}{'recv/s':>8}{'ratio':>7}{'min':>6}"
              f"{'age p50':>9}{'age p99':>9}{'gap p99':>9}{'gap max':>9}{'sub CPU':>8}"
              f"{'pub CPU':>8}  publisher: TCP listen / UDP / SHM MiB mapped")
    print(header)
    for r in run['results']:
        name = f"{label(r['transport']):<{width}}{r['qos']:<15}"
        if 'error' in r:
            print(f"{name}  error: {r['error']}")
            continue
        e = r['evidence']['publisher0']
        segments = '+'.join(f'{b / 2**20:.1f}' for b in e['shm_segment_bytes']) or '-'
        print(f"{name}{r['published_hz']:7.1f}{r['received_hz']:8.1f}{r['receive_ratio']:7.3f}"
              f"{r['min_topic_ratio']:6.2f}{r['age_ms']['p50']:9.1f}{r['age_ms']['p99']:9.1f}"
              f"{r['gap_ms']['p99']:9.0f}{r['gap_ms']['max']:9.0f}"
              f"{r['cpu_percent']['subscriber']:7.0f}%{r['cpu_percent']['publishers']:7.0f}%"
              f"  {e['tcp_listen']} / {e['udp']} / {segments}")
    print('ratio = received / published (header stamps inside the window); age = receive - '
          'stamp; gap = time between frames of one topic')


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('command', nargs='?', default='run',
                        choices=('run', 'publish', 'subscribe'))
    parser.add_argument('--cameras', type=int, default=4)
    parser.add_argument('--rate', type=float, default=15.0, help='Hz per camera')
    parser.add_argument('--height', type=int, default=480)
    parser.add_argument('--width', type=int, default=640)
    parser.add_argument('--processes', type=int, default=2, help='publisher processes')
    parser.add_argument('--transports', default='default,large_data,udpv4,shm',
                        help="comma-separated: default, large_data, udpv4, shm, "
                        "builtin:<FASTDDS_BUILTIN_TRANSPORTS value>, xml:<profiles file>")
    parser.add_argument('--qos', default='best_effort:5,reliable:1,reliable:5',
                        help='comma-separated QoS variants (children: exactly one)')
    parser.add_argument('--repeat', type=int, default=1, help='rounds over all variants')
    parser.add_argument('--duration', type=float, default=12.0, help='s measured per variant')
    parser.add_argument('--warmup', type=float, default=3.0, help='s for discovery')
    parser.add_argument('--grace', type=float, default=1.0, help='s for messages in flight')
    parser.add_argument('--domain-id', type=int, default=201)
    parser.add_argument('--domain-id-max', type=int, default=232)
    parser.add_argument('--workdir', type=Path, default=REPO / 'benchmarks' / 'out'
                        / 'image_transport')
    parser.add_argument('--out', type=Path, default=REPO / 'benchmarks' / 'out'
                        / 'image_transport.json')
    parser.add_argument('--topics', nargs='*', default=[], help=argparse.SUPPRESS)
    parser.add_argument('--record', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command == 'publish':
        return run_publisher(args)
    if args.command == 'subscribe':
        return run_subscriber(args)

    transports = [t for t in args.transports.split(',') if t]
    for t in transports:
        t, _, discovery_range = t.partition('@')
        if discovery_range.upper() not in ('', 'LOCALHOST', 'SUBNET', 'SYSTEM_DEFAULT'):
            parser.error(f'--transports: unknown discovery range {discovery_range!r}')
        if t not in BUILTIN and not t.startswith(('xml:', 'xml-pub:', 'builtin:')):
            parser.error(f'--transports: unknown {t!r}; expected one of {list(BUILTIN)}, '
                         "'builtin:<value>' or 'xml:<file>'")
    qos_variants = [q for q in args.qos.split(',') if q]
    for q in qos_variants:
        try:
            parse_qos(q)
        except argparse.ArgumentTypeError as error:
            parser.error(f'--qos: {error}')
    if not 0 <= args.domain_id <= args.domain_id_max <= 232:
        parser.error('--domain-id / --domain-id-max: expected 0 <= id <= max <= 232')
    args.workdir.mkdir(parents=True, exist_ok=True)
    domains = itertools.cycle(range(args.domain_id, args.domain_id_max + 1))
    run = {
        **common.provenance(),
        'config': {k: v for k, v in vars(args).items()
                   if k in ('cameras', 'rate', 'height', 'width', 'processes', 'duration',
                            'warmup', 'grace', 'repeat')}
        | {'message_bytes': args.height * args.width * 3, 'transports': transports,
           'qos': qos_variants},
        'results': [],
    }
    for round_ in range(args.repeat):
        for transport in transports:
            for qos in qos_variants:
                domain_id = next(domains)
                print(f'round {round_ + 1}/{args.repeat}: {transport} {qos} '
                      f'(ROS_DOMAIN_ID={domain_id})', flush=True)
                try:
                    result = run_variant(args, transport, qos, domain_id, args.workdir)
                except (RuntimeError, OSError, KeyError, ValueError) as error:
                    result = {'transport': transport, 'qos': qos, 'domain_id': domain_id,
                              'error': str(error)}
                result['round'] = round_
                run['results'].append(result)
                if 'error' not in result:
                    print(f"  ratio {result['receive_ratio']:.3f}, age p50/p99 "
                          f"{result['age_ms']['p50']:.1f}/{result['age_ms']['p99']:.1f} ms",
                          flush=True)
    print_table(run)
    common.write_json(args.out, run)
    print(f'wrote {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
