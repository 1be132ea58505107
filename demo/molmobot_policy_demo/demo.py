"""`make demo`: the simulated Jaco robot and the policy node, end to end over ROS 2.

Starts two subprocesses, `molmobot_policy_demo.sim.robot_node` (demo/config/sim.yaml) and
`molmobot_policy.ros.node` (config/policy_tiny.yaml), on this machine only
(ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST, ROS_DOMAIN_ID from the environment, MUJOCO_GL=egl,
FASTDDS_DEFAULT_PROFILES_FILE=config/fastdds_large_images.xml unless set),
waits up to `--startup-timeout` s for the node's first chunk (a cold first start imports torch
and builds the engine), saying what it waits for, then runs `--duration` s from that chunk;
meanwhile it listens to the published chunks (`/molmobot_policy/joint_trajectory`, the per-chunk
`/molmobot_policy/chunk_info`), `/diagnostics`, `/joint_states` and the cameras, prints one
line per chunk, stops both processes (SIGINT, then SIGKILL after a timeout), prints a summary
and writes PNGs (`sim.plots`) to `--plots-dir` (default `demo_output/` in the current
directory), naming each path at the end:
- latency_timeline.png: inference, observation age and publish jitter of each chunk;
- jitter_histogram.png: the publish jitter's distribution (p50, p99, max);
- joint_trajectories.png: per joint, the published JointTrajectory points against the sim
  robot's /joint_states;
- camera_frames.png: the last frame of each camera, with the instruction.

    python -m molmobot_policy_demo.demo --duration 30 --startup-timeout 300
    python -m molmobot_policy_demo.demo --compressed --chunks 3  # jpeg cameras; stop after 3

With `--compressed` the simulator publishes sensor_msgs/CompressedImage (jpeg) on
`<camera topic>/compressed` and the node subscribes there (`camera_transports`).

Exit status: 0 when at least one chunk (with --chunks: that many) arrived, 1 otherwise. When no
chunk came within --startup-timeout, or a process exited, the demo stops both and prints one line
saying why (with the path of the policy node's ROS log file where there is one) before it exits 1.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from molmobot_policy.ros.messages import ChunkInfo, stamp_seconds

# The source tree: demo/ holds this package (molmobot_policy_demo), the repository root the
# policy package (molmobot_policy); each has its config/ folder.
SOURCE = {'molmobot_policy_demo': Path(__file__).resolve().parents[1],
          'molmobot_policy': Path(__file__).resolve().parents[2]}
STOP_TIMEOUT_S = 10.0
WAIT_REPORT_S = 30.0     # how often the demo says what it still waits for before the first chunk
NODE_FQN = '/molmobot_policy'
PLOTS = {   # file name: what it shows
    'latency_timeline.png': 'inference, observation age and publish jitter per chunk',
    'jitter_histogram.png': 'publish jitter distribution',
    'joint_trajectories.png': 'planned (JointTrajectory) vs executed (/joint_states) per joint',
    'camera_frames.png': 'the last frame of each camera, with the instruction'}
# Fast DDS profile with a shared-memory segment that holds ~1 MB camera images; without it
# rmw_fastrtps_cpp loses most of them (README "Large images over DDS")
DDS_PROFILE = 'fastdds_large_images.xml'


def _config(name: str, package: str = 'molmobot_policy') -> Path:
    """config/<name> of `package` in the source tree, else in its installed (colcon) share
    directory."""
    path = SOURCE[package] / 'config' / name
    if path.exists():
        return path
    from ament_index_python.packages import get_package_share_directory
    return Path(get_package_share_directory(package)) / 'config' / name


def _start(module: str, params_file: Path, env: dict, verbose: bool,
           parameters: tuple = ()) -> subprocess.Popen:
    """`python -m module --ros-args --params-file <file> [-p name:=value ...]`."""
    log_level = 'info' if verbose else 'warn'
    overrides = [arg for parameter in parameters for arg in ('-p', parameter)]
    return subprocess.Popen([sys.executable, '-m', module, '--ros-args', '--params-file',
                             str(params_file), *overrides, '--log-level', log_level], env=env,
                            start_new_session=True)   # Ctrl-C reaches them only through us


def _stop(process: subprocess.Popen, name: str) -> None:
    """SIGINT, then SIGKILL after STOP_TIMEOUT_S."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f'demo: {name} did not stop within {STOP_TIMEOUT_S:.0f} s; killing it')
        process.kill()
        process.wait()


def policy_settings(params_file: Path) -> dict:
    """The policy node's parameters that the pictures name, from its parameter file (every
    section ROS applies to /molmobot_policy, in order), else the node's defaults."""
    from molmobot_policy.ros.param_files import section_applies
    from molmobot_policy.ros.parameters import PARAMETERS
    names = ('instruction', 'camera_topics', 'camera_transports', 'chunk_period', 'model',
             'device', 'dtype', 'checkpoint_path', 'diag_inference_warn_ms',
             'diag_jitter_warn_ms')
    settings = {name: PARAMETERS[name][0] for name in names}
    with open(params_file) as f:
        sections = yaml.safe_load(f) or {}
    for section, body in sections.items():
        if section_applies(str(section), NODE_FQN) and isinstance(body, dict):
            given = body.get('ros__parameters') or {}
            settings.update({k: v for k, v in given.items() if k in settings})
    return settings


def startup_failure(elapsed_s: float, timeout_s: float, chunks: int,
                    exited: list[tuple[str, int]]) -> str | None:
    """Why the demo must stop before its run, or None while it may go on.

    Args:
        elapsed_s: s since both processes started. timeout_s: --startup-timeout, s.
        chunks: chunks received so far. exited: (process name, exit status) of each process
            that has ended.
    """
    if exited:
        name, status = exited[0]
        when = 'before the first chunk' if not chunks else f'after {chunks} chunks'
        return f'{name} exited with status {status} {when}'
    if not chunks and elapsed_s > timeout_s:
        return f'no chunk from the policy node within --startup-timeout {timeout_s:g} s'
    return None


def startup_phase(policy_on_graph: bool, joint_states: bool) -> str:
    """What the demo waits for before the first chunk, from what it sees on the ROS graph."""
    phase = ('the policy node is up, not yet publishing (configure: model and engine build; '
             'activate; warm-up)' if policy_on_graph else
             'the policy node is not on the ROS graph yet (Python start-up, imports)')
    return phase + ('' if joint_states else '; no /joint_states from sim_robot yet')


def ros_log_file(pid: int, env: dict) -> Path | None:
    """The newest ROS log file of process `pid` (rcl names it <executable>_<pid>_<ms>.log in
    ROS_LOG_DIR, else $ROS_HOME/log, else ~/.ros/log), or None."""
    folder = (Path(env['ROS_LOG_DIR']) if env.get('ROS_LOG_DIR') else
              Path(env.get('ROS_HOME') or Path.home() / '.ros') / 'log')
    try:
        files = sorted(folder.glob(f'*_{pid}_*.log'), key=lambda f: f.stat().st_mtime)
    except OSError:
        return None
    return files[-1] if files else None


def _percentiles(values: list[float]) -> str:
    if not values:
        return 'n/a'
    p50, p99 = np.percentile(values, [50, 99])
    return f'p50 {p50:.1f} ms, p99 {p99:.1f} ms'


class Monitor:
    """Subscribes to the policy's outputs, /diagnostics, /joint_states and the cameras
    (`camera_topics`: (topic, compressed?) each); prints one line per chunk and keeps what
    the pictures show."""

    def __init__(self, node, camera_topics: list[tuple[str, bool]] = ()) -> None:
        from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
        from rclpy.qos import qos_profile_sensor_data
        from sensor_msgs.msg import CompressedImage, Image, JointState
        from trajectory_msgs.msg import JointTrajectory
        self.lock = threading.Lock()
        self.trajectories = 0
        self.inference_ms: list[float] = []
        self.jitter_ms: list[float] = []
        self.diagnostics_levels: dict[str, int] = {}
        self.diagnostics_messages: dict[str, str] = {}
        self.chunks: list[dict] = []            # ~/chunk_info values
        self.planned: list[tuple[list[str], np.ndarray, np.ndarray]] = []
        self.joint_names: list[str] = []        # of the first /joint_states
        self.joint_times: list[float] = []
        self.joint_positions: list[list[float]] = []
        self.camera_topics = [topic for topic, _ in camera_topics]
        self.camera_messages: dict[str, object] = {}
        node.create_subscription(JointTrajectory, '/molmobot_policy/joint_trajectory',
                                 self._on_trajectory, 10)
        node.create_subscription(DiagnosticStatus, '/molmobot_policy/chunk_info',
                                 self._on_chunk_info, 10)
        node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diagnostics, 10)
        node.create_subscription(JointState, '/joint_states', self._on_joint_state,
                                 qos_profile_sensor_data)
        for topic, compressed in camera_topics:
            node.create_subscription(CompressedImage if compressed else Image, topic,
                                     lambda msg, topic=topic: self._on_image(topic, msg),
                                     qos_profile_sensor_data)

    def _on_trajectory(self, msg) -> None:
        start = stamp_seconds(msg.header.stamp)
        times = np.array([start + stamp_seconds(p.time_from_start) for p in msg.points])
        positions = np.array([list(p.positions) for p in msg.points], dtype=np.float64)
        with self.lock:
            self.trajectories += 1
            if len(times) and positions.shape == (len(times), len(msg.joint_names)):
                self.planned.append((list(msg.joint_names), times, positions))

    def _on_joint_state(self, msg) -> None:
        with self.lock:
            if not self.joint_names:
                self.joint_names = list(msg.name)
            by_name = dict(zip(msg.name, msg.position))
            if all(name in by_name for name in self.joint_names):
                self.joint_times.append(stamp_seconds(msg.header.stamp))
                self.joint_positions.append([by_name[name] for name in self.joint_names])

    def _on_image(self, topic: str, msg) -> None:
        with self.lock:
            self.camera_messages[topic] = msg       # decoded once, for the contact sheet

    def count(self) -> int:
        """Trajectories received so far."""
        with self.lock:
            return self.trajectories

    def _on_chunk_info(self, msg) -> None:
        values = {kv.key: kv.value for kv in msg.values}
        key = ChunkInfo
        inference, jitter = float(values[key.INFERENCE_MS]), float(values[key.PUBLISH_JITTER_MS])
        with self.lock:
            self.chunks.append(values)
            self.inference_ms.append(inference)
            self.jitter_ms.append(jitter)
            count = len(self.inference_ms)
        print(f'chunk {count:3d}: observation age '
              f'{float(values[key.OBSERVATION_AGE_MS]):6.0f} ms, inference {inference:6.0f} ms, '
              f'jitter {jitter:6.2f} ms, {values[key.POINTS]} points published '
              f'(+{values.get(key.DROPPED, "?")} actions already in the past at publish, '
              f'dropped), first action {values[key.FIRST_ACTION]}', flush=True)

    def _on_diagnostics(self, msg) -> None:
        with self.lock:
            for status in msg.status:
                self.diagnostics_levels[status.name] = int.from_bytes(status.level, 'little') \
                    if isinstance(status.level, bytes) else int(status.level)
                self.diagnostics_messages[status.name] = status.message

    def summary(self) -> str:
        with self.lock:
            not_ok = sorted(n for n, level in self.diagnostics_levels.items() if level != 0)
            reported = len(self.inference_ms)
            lines = [f'chunks published: {self.trajectories} (chunk lines above: {reported}; the '
                     'last ones may arrive after the stop)'
                     if reported != self.trajectories else f'chunks published: {reported}',
                     f'inference over all {reported} chunks: {_percentiles(self.inference_ms)}',
                     f'publish jitter over all {reported} chunks: {_percentiles(self.jitter_ms)} '
                     "(/diagnostics' schedule status: over the node's last chunks only)",
                     'diagnostics at WARN/ERROR at the end: ' + (
                         '(inference is WARN for the random weights the demo serves, ERROR '
                         'where the tiny model\'s p99 exceeds diag_inference_error_ms: on a '
                         'small, busy CPU it can exceed the latency and jitter thresholds of '
                         'config/policy_tiny.yaml)' if not_ok else 'none')]
            names = {1: 'WARN', 2: 'ERROR', 3: 'STALE'}     # diagnostic_msgs/DiagnosticStatus
            lines += [f'  {name} ({names.get(self.diagnostics_levels[name], "level ?")}): '
                      f'{self.diagnostics_messages.get(name, "")}' for name in not_ok]
        return '\n'.join('demo: ' + line for line in lines)

    def last_frames(self) -> list:
        """The newest frame of each camera, uint8 (H, W, 3) RGB, or None (none came, or it
        could not be decoded)."""
        from molmobot_policy.ros.codec import decode_image
        frames = []
        with self.lock:
            messages = [self.camera_messages.get(topic) for topic in self.camera_topics]
        for topic, msg in zip(self.camera_topics, messages):
            try:
                frames.append(None if msg is None else decode_image(msg, topic))
            except ValueError as error:
                print(f'demo: camera frame for the picture: {error}')
                frames.append(None)
        return frames

    def write_plots(self, folder: Path, settings: dict) -> list[Path]:
        """The `PLOTS` PNGs in `folder` (created) from what was received; returns their
        paths. Raises ImportError without matplotlib (requirements/demo.txt)."""
        from molmobot_policy_demo.sim import plots
        served = (f"checkpoint {settings['checkpoint_path']}" if settings['checkpoint_path']
                  else f"random weights, preset {settings['model']}")
        what = (f"make demo: {served} on {settings['device']} ({settings['dtype']}), "
                f"{len(self.camera_topics)} cameras, chunk_period {settings['chunk_period']} s")
        period_ms = 1e3 * float(settings['chunk_period'])
        frames = self.last_frames()
        with self.lock:
            chunks, planned = list(self.chunks), list(self.planned)
            names = list(self.joint_names)
            times = np.array(self.joint_times)
            positions = np.array(self.joint_positions).reshape(len(times), len(names))
        jitter = [float(c[ChunkInfo.PUBLISH_JITTER_MS]) for c in chunks]
        jitter_warn = {f"/diagnostics WARN (diag_jitter_warn_ms "
                       f"{settings['diag_jitter_warn_ms']:g} ms)":
                       float(settings['diag_jitter_warn_ms'])}
        folder = Path(folder)
        paths = [
            plots.latency_timeline(
                folder / 'latency_timeline.png', chunks, what,
                {f'chunk_period {period_ms:.0f} ms': period_ms,
                 f"/diagnostics WARN (diag_inference_warn_ms "
                 f"{settings['diag_inference_warn_ms']:g} ms)":
                 float(settings['diag_inference_warn_ms'])}, jitter_warn),
            plots.jitter_histogram(folder / 'jitter_histogram.png', jitter,
                                   f'publish jitter per chunk: {what}', jitter_warn),
            plots.joint_trajectories(
                folder / 'joint_trajectories.png', planned, names, times, positions,
                f'planned (published JointTrajectory points) vs executed (sim /joint_states): '
                f'{len(planned)} chunks'),
            plots.contact_sheet(folder / 'camera_frames.png', frames, self.camera_topics,
                                str(settings['instruction']),
                                f'the last frame of each camera: {what}')]
        return [path.resolve() for path in paths]


def _print_plots(monitor: Monitor, folder: Path, settings: dict) -> None:
    """Writes the pictures and names each one; says why when it cannot. Without a chunk
    received it writes none: empty plots would replace an earlier run's."""
    with monitor.lock:
        received = len(monitor.chunks)
    if not received:
        print(f'demo: no pictures (no chunk was received); {Path(folder).resolve()} is as it '
              'was')
        return
    try:
        paths = monitor.write_plots(folder, settings)
    except ImportError as error:
        print(f'demo: no pictures ({error}): pip install -r requirements/demo.txt')
        return
    except OSError as error:
        print(f'demo: no pictures: cannot write to {folder}: {error}')
        return
    print(f'demo: pictures in {Path(folder).resolve()}:')
    for path in paths:
        print(f'demo:   {path} ({PLOTS[path.name]})', flush=True)


def _run(args, processes: list, monitor: Monitor, node, executor) -> str | None:
    """Spins until the first chunk (saying what it waits for every WAIT_REPORT_S), then
    --duration s more (or --chunks chunks); returns why it stopped early, or None."""
    started = time.monotonic()
    end, next_report = None, started + WAIT_REPORT_S
    while end is None or time.monotonic() < end:
        executor.spin_once(timeout_sec=0.1)
        now, chunks = time.monotonic(), monitor.count()
        exited = [(name, p.returncode) for name, p in processes if p.poll() is not None]
        failure = startup_failure(now - started, args.startup_timeout, chunks, exited)
        if failure is not None:
            if not chunks:
                failure += f' ({_phase(node, monitor)})'
            return failure
        if args.chunks and chunks >= args.chunks:
            return None
        if end is None and chunks:
            end = now + args.duration
            print(f'demo: first chunk {now - started:.1f} s after the start; running '
                  f'{args.duration:g} s', flush=True)
        elif end is None and now >= next_report:
            next_report = now + WAIT_REPORT_S
            print(f'demo: {now - started:.0f} s, still waiting for the first chunk: '
                  f'{_phase(node, monitor)}', flush=True)
    return None


def _phase(node, monitor: Monitor) -> str:
    namespace, name = NODE_FQN.rsplit('/', 1)
    on_graph = (name, namespace or '/') in node.get_node_names_and_namespaces()
    with monitor.lock:
        joint_states = bool(monitor.joint_times)
    return startup_phase(on_graph, joint_states)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--duration', type=float, default=30.0,
                        help="seconds to run from the policy node's first chunk (default 30)")
    parser.add_argument('--startup-timeout', type=float, default=300.0,
                        help='seconds to wait for the first chunk after both processes '
                             'started: a cold first start imports torch and builds the '
                             'engine (default 300)')
    parser.add_argument('--policy-params', type=Path, default=None,
                        help='policy node parameter file (default config/policy_tiny.yaml)')
    parser.add_argument('--sim-params', type=Path, default=None,
                        help='sim robot parameter file (default demo/config/sim.yaml)')
    parser.add_argument('--verbose', action='store_true',
                        help="show the two nodes' INFO logs (default: warnings and errors)")
    parser.add_argument('--compressed', action='store_true',
                        help='cameras as sensor_msgs/CompressedImage (jpeg) on '
                             '<topic>/compressed')
    parser.add_argument('--chunks', type=int, default=0,
                        help='stop once this many chunks arrived (default 0: run --duration)')
    parser.add_argument('--plots-dir', type=Path, default=Path('demo_output'),
                        help='folder for the PNGs (default demo_output in the current '
                             'directory)')
    parser.add_argument('--no-plots', action='store_true', help='write no PNGs')
    args = parser.parse_args(argv)
    policy_params = args.policy_params or _config('policy_tiny.yaml')
    settings = policy_settings(policy_params)
    sim_parameters = ('camera_transport:=compressed',) if args.compressed else ()
    policy_parameters = ('camera_transports:=[compressed]',) if args.compressed else ()

    env = dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST', PYTHONUNBUFFERED='1')
    env.setdefault('ROS_DOMAIN_ID', '42')
    env.setdefault('MUJOCO_GL', 'egl')
    env.setdefault('PYOPENGL_PLATFORM', env['MUJOCO_GL'])
    dds_profile = _config(DDS_PROFILE)
    if dds_profile.exists():        # camera images whole over shared memory (README)
        env.setdefault('FASTDDS_DEFAULT_PROFILES_FILE', str(dds_profile))
    os.environ.update({key: env[key] for key in (
        'ROS_AUTOMATIC_DISCOVERY_RANGE', 'ROS_DOMAIN_ID', 'FASTDDS_DEFAULT_PROFILES_FILE')
        if key in env})
    print(f"demo: ROS_DOMAIN_ID={env['ROS_DOMAIN_ID']}, running {args.duration:g} s from the "
          f"first chunk", flush=True)

    import rclpy
    from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor

    processes, failure = [], None
    rclpy.init()
    node = rclpy.create_node('molmobot_demo')
    from molmobot_policy.ros.parameters import camera_subscriptions
    if args.compressed:
        settings['camera_transports'] = ['compressed']
    monitor = Monitor(node, camera_subscriptions(settings.__getitem__))
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        sim_params = args.sim_params or _config('sim.yaml', 'molmobot_policy_demo')
        processes.append(('sim_robot', _start('molmobot_policy_demo.sim.robot_node',
                                              sim_params, env, args.verbose, sim_parameters)))
        processes.append(('policy', _start('molmobot_policy.ros.node', policy_params,
                                           env, args.verbose, policy_parameters)))
        print(f'demo: started sim_robot and the policy node; waiting up to '
              f'{args.startup_timeout:g} s (--startup-timeout) for the first chunk', flush=True)
        failure = _run(args, processes, monitor, node, executor)
    except (KeyboardInterrupt, ExternalShutdownException):
        print('demo: interrupted')
    finally:
        for name, process in reversed(processes):
            _stop(process, name)
        if failure is None or monitor.count():
            print(monitor.summary(), flush=True)
            if not args.no_plots:
                _print_plots(monitor, args.plots_dir, settings)
        if failure is not None:
            policy = dict(processes).get('policy')
            log = policy and ros_log_file(policy.pid, env)
            print(f'demo: FAILED: {failure}' + (f'; policy node log: {log}' if log else ''),
                  flush=True)
        node.destroy_node()
        rclpy.try_shutdown()
    if failure is not None:
        return 1
    return 0 if monitor.trajectories >= max(args.chunks, 1) else 1


if __name__ == '__main__':
    raise SystemExit(main())
