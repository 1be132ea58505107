"""The worker's wait for a deadline measures how late its timed wait returned
(`PolicyNode.wake_late`, reported per chunk on ~/chunk_info as wake_late_ms): the first
piece of a late publish, told apart from the run-queue wait and the publish call."""
from __future__ import annotations

import sys
import threading
import time

import pytest

pytest.importorskip('rclpy')
from rclpy.parameter import Parameter  # noqa: E402

from molmobot_policy.ros.node import BUSY_WAIT_S, POLL_S, PolicyNode  # noqa: E402
from molmobot_policy.timing import runqueue_wait_s  # noqa: E402


class _OversleepingStop:
    """Stands in for the worker's stop event: every timed wait returns `extra` s late."""

    def __init__(self, extra: float) -> None:
        self.extra = extra
        self._event = threading.Event()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        time.sleep(timeout + self.extra)
        return False


@pytest.fixture
def node(ros_context):
    node = PolicyNode(node_name='wake_test', context=ros_context, parameter_overrides=[
        Parameter('autostart', value=False), Parameter('model', value='tiny')])
    yield node
    node.destroy_node()


def test_a_late_timed_wait_is_measured(node):
    node._stop = _OversleepingStop(extra=0.02)
    assert node._sleep_until(node._now() + 0.05)
    assert node.wake_late is not None and node.wake_late >= 0.02 - 1e-4
    if sys.platform.startswith('linux'):    # the run-queue count before the last wait
        assert 0.0 <= node.runqueue_mark <= runqueue_wait_s()


def test_only_the_last_wait_before_the_deadline_is_measured(node):
    """A long sleep waits in POLL_S pieces; the run-queue mark is taken before the last
    one, so that the earlier wake-ups' waiting for a CPU (harmless) is not counted."""
    marks = []
    stop = _OversleepingStop(extra=0.0)
    wait = stop.wait
    stop.wait = lambda timeout: (marks.append(node.runqueue_mark), wait(timeout))[1]
    node._stop = stop
    assert node._sleep_until(node._now() + 3.5 * POLL_S)
    assert len(marks) >= 4
    assert all(mark is None for mark in marks[:-1])
    if sys.platform.startswith('linux'):
        assert marks[-1] is not None


def test_an_on_time_wait_is_not_called_late_by_the_oversleep_margin(node):
    node._stop = _OversleepingStop(extra=0.0)
    assert node._sleep_until(node._now() + 0.05)
    assert node.wake_late is not None and node.wake_late < 0.04


def test_no_timed_wait_no_lateness(node):
    node.wake_late = 1.0
    assert node._sleep_until(node._now() - 1.0)           # deadline already passed
    assert node.wake_late is None
    assert node._sleep_until(node._now() + 0.5 * BUSY_WAIT_S)   # inside the polling tail
    assert node.wake_late is None and node.runqueue_mark is None


def test_a_stop_during_the_wait_returns_false_without_lateness(node):
    node._stop.set()
    assert not node._sleep_until(node._now() + 1.0)
    assert node.wake_late is None
