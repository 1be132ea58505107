"""Test-wide settings. DDS traffic stays on this machine, and every pytest run picks its own
random ROS domain so that parallel runs (and the demo) never cross-talk
(../shared/docs/DESIGN.md, "Environment facts"). Set here, at import time, before any test
module imports rclpy; subprocesses started by tests inherit the environment."""
import os
import random

os.environ['ROS_AUTOMATIC_DISCOVERY_RANGE'] = 'LOCALHOST'
os.environ.setdefault('RMW_IMPLEMENTATION', 'rmw_fastrtps_cpp')
if 'MOLMOBOT_TEST_DOMAIN_ID' in os.environ:
    os.environ['ROS_DOMAIN_ID'] = os.environ['MOLMOBOT_TEST_DOMAIN_ID']
else:
    os.environ['ROS_DOMAIN_ID'] = str(random.SystemRandom().randint(150, 230))

import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import yaml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data):
        return True


class NodeProcess:
    """The policy node as a separate process (`python <launcher: -m molmobot_policy.ros.node>
    --ros-args <ros_args> --params-file <yaml>`), its stdout+stderr captured to a log file;
    the file's one section is `section` (e.g. '/robot1/molmobot_policy' with
    ros_args=['-r', '__ns:=/robot1'])."""

    def __init__(self, parameters: dict, directory: Path, name: str,
                 sigint_ignored: bool = False, section: str = 'molmobot_policy',
                 ros_args=(), launcher=('-m', 'molmobot_policy.ros.node')) -> None:
        self.params_file = directory / f'{name}.yaml'
        self.params_file.write_text(yaml.dump(      # rcl's parser rejects YAML aliases
            {section: {'ros__parameters': parameters}}, Dumper=_NoAliasDumper))
        self.log_file = directory / f'{name}.log'
        env = dict(os.environ, PYTHONUNBUFFERED='1', RCUTILS_LOGGING_BUFFERED_STREAM='0')
        with open(self.log_file, 'wb') as log:
            self.process = subprocess.Popen(
                [sys.executable, *launcher, '--ros-args', *ros_args,
                 '--params-file', str(self.params_file)],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                # as a shell script's background job starts it: Python then raises no
                # KeyboardInterrupt on SIGINT unless the node installs its own handler
                preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
                if sigint_ignored else None)

    def log(self) -> str:
        return self.log_file.read_text(errors='replace')

    def running(self) -> bool:
        return self.process.poll() is None

    def wait_for_log(self, text: str, timeout: float, start: int = 0) -> bool:
        """True once `text` appears in the log after character `start`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log()[start:]:
                return True
            if not self.running():
                return text in self.log()[start:]
            time.sleep(0.1)
        return False

    def stop(self, timeout: float = 10.0) -> int:
        """SIGINT, then SIGKILL after `timeout` s. Returns the exit status."""
        if self.running():
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@pytest.fixture(autouse=True)
def _no_discovery_settle(monkeypatch):
    """The tests' in-process nodes configure at once, beside nodes of their own making: the
    same-name check's wait for discovery (`ros.graph.DISCOVERY_SETTLE_S`) would add its 2 s
    to every configure. A test of that wait calls `monkeypatch.undo()` to get it back."""
    import sys
    graph = sys.modules.get('molmobot_policy.ros.graph')
    if graph is not None:
        monkeypatch.setattr(graph, 'DISCOVERY_SETTLE_S', 0.0)


@pytest.fixture
def ros_context():
    """A fresh rclpy context for nodes built in this test process (shut down afterwards)."""
    rclpy = pytest.importorskip('rclpy')
    context = rclpy.Context()
    rclpy.init(context=context)
    yield context
    rclpy.try_shutdown(context=context)


@pytest.fixture(scope='module')
def start_policy_node(tmp_path_factory):
    """Factory: start_policy_node(parameters, **NodeProcess keywords) -> NodeProcess; every
    process is stopped (SIGINT, then SIGKILL) when the module's tests are done."""
    processes = []
    directory = tmp_path_factory.mktemp('policy_node')

    def start(parameters: dict, **kwargs) -> NodeProcess:
        processes.append(NodeProcess(parameters, directory, f'node{len(processes)}', **kwargs))
        return processes[-1]

    yield start
    for process in processes:
        process.stop()


class RosHarness:
    """An rclpy context + node for the test process, spun in a background thread."""

    def __init__(self, name: str) -> None:
        import rclpy
        from rclpy.context import Context
        from rclpy.executors import SingleThreadedExecutor
        self.context = Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node(name, context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        from rclpy.executors import ExternalShutdownException
        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    @staticmethod
    def wait_for(predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.05)
        return bool(predicate())

    def close(self) -> None:
        import rclpy
        self.executor.shutdown(timeout_sec=2.0)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)
        self._thread.join(timeout=5.0)


@pytest.fixture(scope='module')
def ros():
    """A RosHarness for the module (its own rclpy context, spinning in a thread)."""
    harness = RosHarness('molmobot_policy_test')
    yield harness
    harness.close()
