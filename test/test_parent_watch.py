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


def test_the_watch_stops_the_node_even_when_its_log_line_cannot_be_written(monkeypatch):
    def dead_terminal(*args):
        raise OSError(5, 'Input/output error')     # the pty of a `ros2 launch` that exited
    monkeypatch.setattr('molmobot_policy.ros.main.print_log', dead_terminal)
    monkeypatch.setattr(threading, 'excepthook', lambda args: None)  # its OSError, unprinted
    fired = threading.Event()
    watch = ParentWatch('test', period=0.01, getppid=lambda: 1, kill=fired.set).start(100)
    try:
        assert fired.wait(2.0)
    finally:
        watch.stop()


def test_a_failing_parent_check_stops_the_node(monkeypatch):
    def broken():
        raise RuntimeError('no parent pid')
    monkeypatch.setattr(threading, 'excepthook', lambda args: None)  # the re-raise, unprinted
    fired = threading.Event()
    watch = ParentWatch('test', period=0.01, getppid=broken, kill=fired.set).start(100)
    try:
        assert fired.wait(2.0) and watch.fired
    finally:
        watch.stop()


def _orphan(tmp_path, stop_with_parent: bool, nohup: bool = False,
            terminal: bool = False, at_once: bool = False,
            namespace: str = '/') -> tuple[int, Path]:
    """Start the node (autostart off: no engine) from a parent that exits at once without
    stopping it (`nohup`: with SIGHUP ignored, as nohup starts it; otherwise with SIGHUP at
    its default whatever this test runs under, e.g. `nohup make test`); returns the node's
    pid and its log. `terminal`: the node's stdout and stderr are a pty that the parent
    reads into the log and that is gone with the parent, as `ros2 launch`'s
    (`emulate_tty=True`): the node's writes to it then fail (EIO). `at_once`: the parent
    exits right after starting it (a shell's `node &` that ends), while the node still
    imports. `namespace`: the node's."""
    log = tmp_path / 'node.log'
    script = textwrap.dedent(f'''
        import os, pty, select, signal, subprocess, sys, time
        # inherited by the node
        signal.signal(signal.SIGHUP, signal.SIG_IGN if {nohup!r} else signal.SIG_DFL)
        log = open({str(log)!r}, 'w')
        if {terminal!r}:
            master, output = pty.openpty()
        else:
            output = log
        node = subprocess.Popen([sys.executable, '-m', 'molmobot_policy.ros.node', '--ros-args',
                                 '-p', 'autostart:=false',
                                 '-p', 'stop_with_parent:={str(stop_with_parent).lower()}',
                                 '-r', '__node:=orphan_test', '-r', '__ns:={namespace}'],
                                cwd={str(REPO)!r}, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)
        print(node.pid, flush=True)
        end = time.monotonic() + (0 if {at_once!r} else 30)   # exit once the node runs
        if {terminal!r}:
            os.close(output)
            text = ''
            while time.monotonic() < end and 'autostart is off' not in text:
                if select.select([master], [], [], 0.05)[0]:
                    text += os.read(master, 65536).decode(errors='replace')
            log.write(text)
            log.flush()
        while time.monotonic() < end and 'autostart is off' not in open({str(log)!r}).read():
            time.sleep(0.05)
    ''')
    env = dict(os.environ, ROS_DOMAIN_ID=str(150 + os.getpid() % 50),
               ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST')
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                         env=env, timeout=60, check=True).stdout
    return int(out.split()[0]), log


def _kill(pid: int) -> None:
    """SIGKILL `pid` if it still runs (a test's cleanup)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
        assert 'SIGINT' not in text, text        # no signal was sent: none is named
    finally:
        _kill(pid)


def test_the_stop_line_names_the_node_with_its_namespace(tmp_path):
    # a fresh-user trial: under namespace:=robot1 this one line read [orphan_test]
    pid, log = _orphan(tmp_path, stop_with_parent=True, namespace='/robot1')
    try:
        assert _wait_exit(pid, 30.0), log.read_text()
        line = next(line for line in log.read_text().splitlines() if 'has exited' in line)
        assert '[robot1.orphan_test]' in line, line
    finally:
        _kill(pid)


def test_a_node_orphaned_before_it_starts_says_so_at_warn(tmp_path):
    # a fresh-user trial: `bash -c "policy_node ... &"` exits before the node's interpreter is
    # up; its parent is init from the start, there is nothing to watch, and it said nothing
    pid, log = _orphan(tmp_path, stop_with_parent=True, at_once=True)
    try:
        assert _wait_log(log, 'autostart is off', 30.0), log.read_text()
        text = log.read_text()
        assert '[WARN]' in text and 'this node was orphaned before it started' in text, text
    finally:
        _kill(pid)


def test_orphan_note_is_info_under_systemd_and_in_a_container():
    from rclpy.logging import LoggingSeverity

    from molmobot_policy.ros.main import orphan_note
    assert orphan_note(1, {})[1] == LoggingSeverity.WARN
    assert orphan_note(1, {'INVOCATION_ID': 'abc'})[1] == LoggingSeverity.INFO
    assert orphan_note(0, {})[1] == LoggingSeverity.INFO


def test_the_stop_reason_is_logged_before_shutting_down(tmp_path):
    pid, log = _orphan(tmp_path, stop_with_parent=True)
    try:
        assert _wait_exit(pid, 30.0), log.read_text()
        text = log.read_text()
        assert text.index('has exited') < text.index('shutting down'), text
        assert 'Failed to publish log message to rosout' not in text, text
    finally:
        _kill(pid)


def test_an_orphaned_node_stops_when_its_terminal_is_gone(tmp_path):
    # a fresh-user trial: SIGTERM to `ros2 launch` (emulate_tty=True) closed the node's pty;
    # the watch's log line then raised OSError (EIO), its thread died and the node ran on
    pid, log = _orphan(tmp_path, stop_with_parent=True, terminal=True)
    try:
        assert 'autostart is off' in log.read_text()
        assert _wait_exit(pid, 30.0), 'the node outlived its parent and its terminal'
    finally:
        _kill(pid)


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
