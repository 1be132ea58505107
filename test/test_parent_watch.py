"""The node stops when the process that started it exits without stopping it (`ros2 launch`
on SIGTERM), unless stop_with_parent is false (ros/main.py ParentWatch)."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip('rclpy')
from molmobot_policy.ros.main import ParentWatch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_the_watch_fires_once_when_the_parent_pid_changes():
    parent = [100]
    fired = threading.Event()
    watch = ParentWatch('test', period=0.01, getppid=lambda: parent[0], kill=fired.set).start()
    try:
        assert not fired.wait(0.1)          # same parent: nothing
        parent[0] = 1                        # re-parented to init
        assert fired.wait(2.0) and watch.fired
    finally:
        watch.stop()


def _orphan(tmp_path, stop_with_parent: bool, nohup: bool = False) -> tuple[int, Path]:
    """Start the node (autostart off: no engine) from a parent that exits at once without
    stopping it (`nohup`: with SIGHUP ignored, as nohup starts it); returns the node's pid
    and its log."""
    log = tmp_path / 'node.log'
    script = textwrap.dedent(f'''
        import signal, subprocess, sys
        if {nohup!r}:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)     # inherited by the node
        log = open({str(log)!r}, 'w')
        node = subprocess.Popen([sys.executable, '-m', 'molmobot_policy.ros.node', '--ros-args',
                                 '-p', 'autostart:=false',
                                 '-p', 'stop_with_parent:={str(stop_with_parent).lower()}',
                                 '-r', '__node:=orphan_test'],
                                cwd={str(REPO)!r}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        print(node.pid, flush=True)
        import time
        end = time.monotonic() + 30          # exit once the node runs (as launch would)
        while time.monotonic() < end and 'autostart is off' not in open({str(log)!r}).read():
            time.sleep(0.05)
    ''')
    env = dict(os.environ, ROS_DOMAIN_ID=str(150 + os.getpid() % 50),
               ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST')
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                         env=env, timeout=60, check=True).stdout
    return int(out.split()[0]), log


def _wait_exit(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie is gone for our purpose: its parent (init) reaps it
        try:
            if Path(f'/proc/{pid}/stat').read_text().split()[2] == 'Z':
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _wait_log(log: Path, text: str, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if log.exists() and text in log.read_text():
            return True
        time.sleep(0.05)
    return False


def test_an_orphaned_node_stops_and_says_why(tmp_path):
    pid, log = _orphan(tmp_path, stop_with_parent=True)
    try:
        assert _wait_exit(pid, 30.0), log.read_text()
        text = log.read_text()
        assert 'the process that started this node' in text and 'has exited' in text
        assert 'shutting down after 0 chunks' in text
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_stop_with_parent_false_keeps_an_orphaned_node_running(tmp_path):
    pid, log = _orphan(tmp_path, stop_with_parent=False)
    try:
        assert _wait_log(log, 'autostart is off', 30.0), log.read_text()
        time.sleep(0.5)     # five watch periods after the parent is gone
        assert not _wait_exit(pid, 0.0), log.read_text()
    finally:
        os.kill(pid, signal.SIGINT)
        _wait_exit(pid, 10.0)


def test_a_node_started_under_nohup_outlives_its_parent_and_says_why(tmp_path):
    # a fresh-user trial started the node with `nohup ... &` from a script: it stopped when
    # the script ended
    pid, log = _orphan(tmp_path, stop_with_parent=True, nohup=True)
    try:
        assert _wait_log(log, 'autostart is off', 30.0), log.read_text()
        time.sleep(0.5)     # five watch periods after the parent is gone
        assert not _wait_exit(pid, 0.0), log.read_text()
        assert 'started with SIGHUP ignored (nohup)' in log.read_text()
    finally:
        os.kill(pid, signal.SIGINT)
        _wait_exit(pid, 10.0)
