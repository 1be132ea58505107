"""`make demo`: the simulated Jaco robot and the policy node, end to end over ROS 2.

Starts two subprocesses, `molmobot_policy.sim.robot_node` (config/sim.yaml) and
`molmobot_policy.ros.node` (config/policy_tiny.yaml), on this machine only
(ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST, ROS_DOMAIN_ID from the environment, MUJOCO_GL=egl,
FASTDDS_DEFAULT_PROFILES_FILE=config/fastdds_large_images.xml unless set),
listens to the published chunks (`/molmobot_policy/joint_trajectory`, the per-chunk
`/molmobot_policy/chunk_info`) and `/diagnostics`, prints one line per chunk and a summary,
then stops both processes (SIGINT, then SIGKILL after a timeout).

    python -m molmobot_policy.demo --duration 30
    python -m molmobot_policy.demo --compressed --chunks 3   # jpeg cameras; stop after 3 chunks

With `--compressed` the simulator publishes sensor_msgs/CompressedImage (jpeg) on
`<camera topic>/compressed` and the node subscribes there (`camera_transports`).

Exit status: 0 when at least one chunk (with --chunks: that many) arrived, 1 otherwise.
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

from molmobot_policy.ros.messages import ChunkInfo

REPO = Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 10.0
# Fast DDS profile with a shared-memory segment that holds ~1 MB camera images; without it
# rmw_fastrtps_cpp loses most of them (README "Large images over DDS")
DDS_PROFILE = 'fastdds_large_images.xml'


def _config(name: str) -> Path:
    """config/<name> of the source tree, else of an installed (colcon) share directory."""
    path = REPO / 'config' / name
    if path.exists():
        return path
    from ament_index_python.packages import get_package_share_directory
    return Path(get_package_share_directory('molmobot_policy')) / 'config' / name


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


def _percentiles(values: list[float]) -> str:
    if not values:
        return 'n/a'
    p50, p99 = np.percentile(values, [50, 99])
    return f'p50 {p50:.1f} ms, p99 {p99:.1f} ms'


class Monitor:
    """Subscribes to the policy's outputs and /diagnostics; prints one line per chunk."""

    def __init__(self, node) -> None:
        from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
        from trajectory_msgs.msg import JointTrajectory
        self.lock = threading.Lock()
        self.trajectories = 0
        self.inference_ms: list[float] = []
        self.jitter_ms: list[float] = []
        self.diagnostics_levels: dict[str, int] = {}
        node.create_subscription(JointTrajectory, '/molmobot_policy/joint_trajectory',
                                 self._on_trajectory, 10)
        node.create_subscription(DiagnosticStatus, '/molmobot_policy/chunk_info',
                                 self._on_chunk_info, 10)
        node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diagnostics, 10)

    def _on_trajectory(self, msg) -> None:
        with self.lock:
            self.trajectories += 1

    def count(self) -> int:
        """Trajectories received so far."""
        with self.lock:
            return self.trajectories

    def _on_chunk_info(self, msg) -> None:
        values = {kv.key: kv.value for kv in msg.values}
        key = ChunkInfo
        inference, jitter = float(values[key.INFERENCE_MS]), float(values[key.PUBLISH_JITTER_MS])
        with self.lock:
            self.inference_ms.append(inference)
            self.jitter_ms.append(jitter)
            count = len(self.inference_ms)
        print(f'chunk {count:3d}: observation age '
              f'{float(values[key.OBSERVATION_AGE_MS]):6.0f} ms, inference {inference:6.0f} ms, '
              f'jitter {jitter:6.2f} ms, {values[key.POINTS]} points, first action '
              f'{values[key.FIRST_ACTION]}', flush=True)

    def _on_diagnostics(self, msg) -> None:
        with self.lock:
            for status in msg.status:
                self.diagnostics_levels[status.name] = int.from_bytes(status.level, 'little') \
                    if isinstance(status.level, bytes) else int(status.level)

    def summary(self) -> str:
        with self.lock:
            not_ok = sorted(n for n, level in self.diagnostics_levels.items() if level != 0)
            lines = [f'chunks published: {self.trajectories}',
                     f'inference: {_percentiles(self.inference_ms)}',
                     f'publish jitter: {_percentiles(self.jitter_ms)}',
                     'diagnostics at WARN/ERROR at the end: ' + (
                         f'{not_ok} (on a small, busy CPU the tiny model can exceed the '
                         f'latency and jitter thresholds of the policy parameter file, e.g. '
                         f'config/policy_tiny.yaml; /diagnostics names the values)'
                         if not_ok else 'none')]
        return '\n'.join('demo: ' + line for line in lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--duration', type=float, default=30.0,
                        help='seconds to run after both processes started (default 30)')
    parser.add_argument('--policy-params', type=Path, default=None,
                        help='policy node parameter file (default config/policy_tiny.yaml)')
    parser.add_argument('--sim-params', type=Path, default=None,
                        help='sim robot parameter file (default config/sim.yaml)')
    parser.add_argument('--verbose', action='store_true',
                        help="show the two nodes' INFO logs (default: warnings and errors)")
    parser.add_argument('--compressed', action='store_true',
                        help='cameras as sensor_msgs/CompressedImage (jpeg) on '
                             '<topic>/compressed')
    parser.add_argument('--chunks', type=int, default=0,
                        help='stop once this many chunks arrived (default 0: run --duration)')
    args = parser.parse_args(argv)
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
    print(f"demo: ROS_DOMAIN_ID={env['ROS_DOMAIN_ID']}, running {args.duration:.0f} s",
          flush=True)

    import rclpy
    from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor

    processes = []
    rclpy.init()
    node = rclpy.create_node('molmobot_demo')
    monitor = Monitor(node)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        processes.append(('sim_robot', _start('molmobot_policy.sim.robot_node',
                                              args.sim_params or _config('sim.yaml'), env,
                                              args.verbose, sim_parameters)))
        processes.append(('policy', _start('molmobot_policy.ros.node',
                                           args.policy_params or _config('policy_tiny.yaml'),
                                           env, args.verbose, policy_parameters)))
        print('demo: started sim_robot and the policy node; the first chunk follows the '
              'engine warm-up', flush=True)
        end = time.monotonic() + args.duration
        while time.monotonic() < end:
            executor.spin_once(timeout_sec=0.1)
            if args.chunks and monitor.count() >= args.chunks:
                break
            for name, process in processes:
                if process.poll() is not None:
                    print(f'demo: {name} exited with status {process.returncode}')
                    end = 0.0
    except (KeyboardInterrupt, ExternalShutdownException):
        print('demo: interrupted')
    finally:
        for name, process in reversed(processes):
            _stop(process, name)
        print(monitor.summary(), flush=True)
        node.destroy_node()
        rclpy.try_shutdown()
    return 0 if monitor.trajectories >= max(args.chunks, 1) else 1


if __name__ == '__main__':
    raise SystemExit(main())
