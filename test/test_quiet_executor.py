"""The publish window: the worker opens it while it polls the clock for a deadline and sends
(timing.QuietWindow, on the loop's fake clock), and the node's executor runs no callback
while a window is open (ros.main.QuietExecutor, a real rclpy timer)."""
from __future__ import annotations

import threading

import pytest

from molmobot_policy.timing import QuietWindow

from test_loop import FakeClock, FakeEvent, Recorder, Robot, make_loop


def test_the_window_is_open_from_the_deadline_poll_to_the_send_only():
    clock = FakeClock()
    event = FakeEvent(clock)
    robot = Robot(clock)
    seen = {'observe': [], 'send': []}
    quiet = QuietWindow()
    observe, publish = robot.observe, robot.publish

    def observing(now):
        seen['observe'].append(quiet.open)
        return observe(now)

    def publishing(chunk):
        send = publish(chunk)

        def sending():
            seen['send'].append(quiet.open)
            send()
        return sending

    robot.observe, robot.publish = observing, publishing
    loop = make_loop(clock, event, robot, Recorder(event, 3), quiet=quiet)
    loop.run()
    assert seen['observe'] == [False] * 3       # building and inference: others may run
    assert seen['send'] == [True] * 3           # the poll and the send: the window is open
    assert not quiet.open                       # left after every send


class StopWhenQuiet(FakeClock):
    """Sets the loop's stop event at the first clock read inside the publish window."""
    loop = event = None

    def __call__(self) -> float:
        if self.loop is not None and self.loop.quiet.open:
            self.event.set()
        return super().__call__()


def test_a_tick_stopped_in_the_window_leaves_it_and_sends_nothing():
    clock = StopWhenQuiet()
    clock.event = event = FakeEvent(clock)
    robot = Robot(clock)
    clock.loop = loop = make_loop(clock, event, robot)
    loop.run()
    assert event.is_set() and robot.sent == []
    assert not loop.quiet.open


def test_a_window_never_left_delays_a_waiter_by_its_bound_only():
    quiet = QuietWindow()
    assert quiet.wait_out(0.0) is True          # closed: no wait
    quiet.enter()
    assert quiet.wait_out(0.01) is False        # open: returns after the bound
    quiet.leave()
    assert quiet.wait_out(0.0) is True


class HeldGate:
    """Stands in for the node's QuietWindow: `wait_out` blocks until the test releases it."""

    def __init__(self) -> None:
        self.release, self.calls = threading.Event(), 0

    def wait_out(self) -> bool:
        self.calls += 1
        return self.release.wait(10.0)


def test_the_executor_runs_a_ready_callback_only_after_the_window(ros_context):
    rclpy = pytest.importorskip('rclpy')
    from molmobot_policy.ros.main import QuietExecutor
    gate = HeldGate()
    node = rclpy.create_node('quiet_executor_test', context=ros_context)
    ran = []
    timer = node.create_timer(0.001, lambda: ran.append(1))
    executor = QuietExecutor(gate, context=ros_context)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin_once, kwargs={'timeout_sec': 5.0})
    try:
        spinner.start()
        for _ in range(500):        # the timer is ready within ms; the gate holds it
            if gate.calls:
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.1)
        assert gate.calls == 1 and ran == []
        gate.release.set()
        spinner.join(10.0)
        assert ran == [1]
    finally:
        gate.release.set()
        spinner.join(10.0)
        node.destroy_timer(timer)
        executor.shutdown()
        node.destroy_node()
