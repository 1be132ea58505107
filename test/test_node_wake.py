"""The worker's wait for a deadline measures how late its last timed wait returned
(`PolicyNode.wake_late`, reported per chunk on ~/chunk_info as wake_late_ms) and marks the
thread's run-queue count before that wait (`runqueue_mark`): clues to a late publish.

A fake clock drives the node (`_now`) and its stop event's timed waits, so nothing here
depends on how busy the machine is."""
from __future__ import annotations

import sys

import pytest

pytest.importorskip('rclpy')
from rclpy.parameter import Parameter  # noqa: E402

from molmobot_policy.ros.node import BUSY_WAIT_S, POLL_S, PolicyNode  # noqa: E402
from molmobot_policy.timing import runqueue_wait_s  # noqa: E402

TICK = 1e-5     # every clock read advances the fake clock this much (s), as real reads take time


class _FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        self.t += TICK
        return self.t


class _StopEvent:
    """The worker's stop event on the fake clock: each timed wait returns `extra` s late
    and records the run-queue mark the node had set when it began."""

    def __init__(self, clock: _FakeClock, node: PolicyNode, extra: float = 0.0) -> None:
        self.clock, self.node, self.extra = clock, node, extra
        self.timeouts: list[float] = []
        self.marks: list[float | None] = []

    def is_set(self) -> bool:
        return False

    def wait(self, timeout: float) -> bool:
        self.timeouts.append(timeout)
        self.marks.append(self.node.runqueue_mark)
        self.clock.t += timeout + self.extra
        return False


@pytest.fixture
def node(ros_context):
    node = PolicyNode(node_name='wake_test', context=ros_context, parameter_overrides=[
        Parameter('autostart', value=False), Parameter('model', value='tiny')])
    clock = _FakeClock()
    node._now = clock.now
    node.clock = clock
    yield node
    node.destroy_node()


def test_a_late_timed_wait_is_measured(node):
    node._stop = _StopEvent(node.clock, node, extra=0.02)
    assert node._sleep_until(node._now() + 0.03)
    assert node.wake_late == pytest.approx(0.02, abs=5 * TICK)


def test_an_on_time_wait_is_not_late(node):
    node._stop = _StopEvent(node.clock, node)
    assert node._sleep_until(node._now() + 0.03)
    assert node.wake_late == pytest.approx(0.0, abs=5 * TICK)


def test_only_the_last_wait_before_the_deadline_is_marked(node):
    """A long sleep waits in POLL_S pieces; the run-queue mark is taken before the last one
    only, so that the earlier wake-ups' waiting for a CPU (harmless) is not counted."""
    stop = node._stop = _StopEvent(node.clock, node)
    assert node._sleep_until(node._now() + 3.5 * POLL_S)
    assert stop.timeouts[:3] == [POLL_S] * 3 and len(stop.timeouts) == 4
    assert stop.marks[:3] == [None] * 3
    if sys.platform.startswith('linux'):
        assert stop.marks[3] is not None and 0.0 <= stop.marks[3] <= runqueue_wait_s()


def test_no_timed_wait_no_lateness(node):
    node._stop = _StopEvent(node.clock, node)
    node.wake_late = 1.0
    assert node._sleep_until(node._now() - 1.0)               # deadline already passed
    assert node.wake_late is None and node.runqueue_mark is None
    assert node._sleep_until(node._now() + 0.5 * BUSY_WAIT_S)   # inside the polling tail
    assert node.wake_late is None and node.runqueue_mark is None
    assert node._stop.timeouts == []


def test_a_stop_during_the_wait_returns_false_without_lateness(node):
    node._stop.set()
    assert not node._sleep_until(node._now() + 1.0)
    assert node.wake_late is None
