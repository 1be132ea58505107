"""After Ctrl-C shut the ROS context down, the worker's last reports are printed in the ROS
console format instead of going to the ROS logger (which would print rclpy's 'Failed to
publish log message to rosout'; ros/report.py LoopReport)."""
from types import SimpleNamespace

import pytest

pytest.importorskip('rclpy')
from molmobot_policy.ros.report import LoopReport, print_log  # noqa: E402


class _Logger:
    name = 'robot1.molmobot_policy'

    def __init__(self):
        self.lines = []

    def warning(self, message, **kwargs):
        self.lines.append(('WARN', message))

    def error(self, message, **kwargs):
        self.lines.append(('ERROR', message))


def _report(context_ok: bool):
    logger = _Logger()
    node = SimpleNamespace(context=SimpleNamespace(ok=lambda: context_ok),
                           get_name=lambda: 'molmobot_policy', get_logger=lambda: logger)
    watchdog = SimpleNamespace(skipped=lambda reason: None)
    return LoopReport(node, chunk_info=None, sync=None, watchdog=watchdog, now=lambda: 0.0), logger


def test_a_skip_after_shutdown_is_printed_not_logged(capsys):
    report, logger = _report(context_ok=False)
    report.skipped(3, 'camera /cam0 has no image yet')
    report.failed(4, RuntimeError('boom'))
    err = capsys.readouterr().err
    assert logger.lines == []
    assert '[WARN]' in err and ('[robot1.molmobot_policy]: skipping tick 3: camera /cam0 has no '
                                'image') in err      # the logger's name, with its namespace
    assert "[ERROR]" in err and "tick 4 failed: RuntimeError('boom')" in err


def test_a_skip_while_running_goes_to_the_ros_logger(capsys):
    report, logger = _report(context_ok=True)
    report.skipped(3, 'camera /cam0 has no image yet')
    assert logger.lines == [('WARN', 'skipping tick 3: camera /cam0 has no image yet')]
    assert capsys.readouterr().err == ''


class _DeadTerminal:
    """stderr on the pty of a `ros2 launch` that exited (emulate_tty): every write fails."""

    def write(self, text):
        raise OSError(5, 'Input/output error')

    def flush(self):
        raise OSError(5, 'Input/output error')


def test_a_line_printed_to_a_dead_terminal_is_lost_without_raising(monkeypatch):
    monkeypatch.setattr('sys.stderr', _DeadTerminal())
    print_log('molmobot_policy', 'INFO', 'shutting down after 3 chunks')     # no OSError


def test_a_line_printed_to_a_closed_stderr_is_lost_without_raising(monkeypatch, tmp_path):
    closed = open(tmp_path / 'stderr', 'w')
    closed.close()
    monkeypatch.setattr('sys.stderr', closed)
    print_log('molmobot_policy', 'INFO', 'shutting down after 3 chunks')     # no ValueError
