"""timing.PolicyLoop, the node's worker, on a fake clock: every wait advances the clock by
its timeout, so nothing here depends on how busy the machine is.

The waits: the delay clues of debug_timing (how late the last timed wait returned, the
run-queue mark before it), stop, and a clock that jumps back while waiting. The loop: each
chunk built before and sent at its deadline, skips named, failures counted without stopping,
deadline misses, waiting for sim time to start, and a restart after a clock jump back."""
from __future__ import annotations

import itertools
import os
import resource
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from molmobot_policy.timing import ChunkStitcher, LoopEvents, PolicyLoop, Wait
from molmobot_policy.timing.loop import BUSY_WAIT_S, POLL_S, STALL_TRACE_S
from molmobot_policy.types import ActionChunk, Observation

TICK = 1e-5             # every clock read advances the fake clock this much (s)
PERIOD = 1.0            # chunk_period, s
CONTROL_PERIOD = 0.1    # s between actions
HORIZON = 16
JOINTS = 2


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        self.t += TICK
        return self.t


class FakeEvent:
    """The loop's stop event on the fake clock: a timed wait returns `late` s after its
    timeout; `on_wait(k)` runs before the k-th wait (from 0)."""

    def __init__(self, clock: FakeClock, late: float = 0.0, on_wait=None) -> None:
        self.clock, self.late, self.on_wait = clock, late, on_wait
        self.timeouts: list[float] = []
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True

    def clear(self) -> None:
        self._set = False

    def wait(self, timeout: float) -> bool:
        if self.on_wait is not None:
            self.on_wait(len(self.timeouts))
        self.timeouts.append(timeout)
        self.clock.t += timeout + self.late
        return self._set


class Recorder(LoopEvents):
    """Keeps every event; stops the loop (through `event`) after `chunks` chunks."""

    def __init__(self, event: FakeEvent, chunks: int) -> None:
        self.event, self.chunks = event, chunks
        self.skips, self.failures, self.jumps, self.reports = [], [], [], []

    def skipped(self, tick, reason):
        self.skips.append((tick, reason))
        self._stop_after_ticks()

    def failed(self, tick, error):
        self.failures.append((tick, error))
        self._stop_after_ticks()

    def clock_jumped(self, seconds):
        self.jumps.append(seconds)

    def published(self, report):
        self.reports.append(report)
        self._stop_after_ticks()

    def _stop_after_ticks(self):
        if len(self.reports) + len(self.skips) + len(self.failures) >= self.chunks:
            self.event.set()


class Robot:
    """observe / predict / publish of the loop: a fresh observation stamped 10 ms before
    `now` at each tick, actions = seq, sends recorded with the clock's time."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.seq = itertools.count(1)
        self.prepared: list[float] = []         # clock when publish() built the messages
        self.sent: list[tuple[float, object]] = []   # (clock at send, StitchedChunk)
        self.observations: list[Observation] = []

    def observe(self, now: float):
        observation = Observation(images=(), state=np.zeros(JOINTS, np.float32),
                                  instruction='x', stamp=now - 0.01, seq=next(self.seq))
        self.observations.append(observation)
        return observation

    def predict(self, observation: Observation) -> ActionChunk:
        actions = np.full((HORIZON, JOINTS + 1), float(observation.seq), np.float32)
        return ActionChunk(actions=actions, actions_normalized=actions,
                           observation_stamp=observation.stamp,
                           observation_seq=observation.seq, inference_ms=5.0)

    def publish(self, chunk):
        self.prepared.append(self.clock.t)
        return lambda: self.sent.append((self.clock.t, chunk))


def first_joints(actions):
    """The published joints' action dims (the robot contract's rule: the first JOINTS)."""
    return actions[:, :JOINTS]


def make_loop(clock, event, robot=None, events=None, **kwargs) -> PolicyLoop:
    robot = robot or Robot(clock)
    arguments = dict(clock=clock, observe=robot.observe, predict=robot.predict,
                     publish=robot.publish, stitcher=ChunkStitcher(CONTROL_PERIOD),
                     chunk_period=PERIOD, to_joints=first_joints, events=events,
                     stop_event=event, timer=clock)
    return PolicyLoop(**{**arguments, **kwargs})


def slowed(method: str, seconds: float):
    """A `run(robot_changes=...)` entry: the `Robot` method after the fake clock advanced
    `seconds` (the work took that long)."""
    def change(robot):
        def call(*args):
            robot.clock.t += seconds
            return getattr(Robot, method)(robot, *args)
        return call
    return change


def run(chunks: int, robot_changes=None, **kwargs):
    """Runs a loop until `chunks` ticks ended (published, skipped or failed)."""
    clock = FakeClock()
    event = FakeEvent(clock, **kwargs.pop('event', {}))
    robot = Robot(clock)
    for name, function in (robot_changes or {}).items():
        setattr(robot, name, function(robot))
    recorder = Recorder(event, chunks)
    loop = make_loop(clock, event, robot, recorder, **kwargs)
    loop.run()
    return loop, robot, recorder


# ------------------------------------------------------------------ waits
def test_a_late_timed_wait_is_measured_with_debug_timing():
    clock = FakeClock()
    loop = make_loop(clock, FakeEvent(clock, late=0.02), debug_timing=True)
    assert loop.wait_until(clock() + 0.03) is Wait.REACHED
    assert loop.wake_late == pytest.approx(0.02, abs=5 * TICK)


def test_an_on_time_wait_is_not_late():
    clock = FakeClock()
    loop = make_loop(clock, FakeEvent(clock), debug_timing=True)
    assert loop.wait_until(clock() + 0.03) is Wait.REACHED
    assert loop.wake_late == pytest.approx(0.0, abs=5 * TICK)


def test_only_the_last_wait_before_the_target_is_marked():
    """A long wait runs in POLL_S slices; the run-queue mark is read before the last one
    only, so the earlier wake-ups' waiting for a CPU (harmless) is not counted."""
    clock = FakeClock()
    reads = itertools.count(7)
    marks = []
    event = FakeEvent(clock, on_wait=lambda k: marks.append(loop.runqueue_mark))
    loop = make_loop(clock, event, debug_timing=True, runqueue_wait=lambda: float(next(reads)))
    assert loop.wait_until(clock() + 3.5 * POLL_S) is Wait.REACHED
    assert event.timeouts[:3] == [POLL_S] * 3 and len(event.timeouts) == 4
    assert marks == [None, None, None, 7.0]       # one read, before the last wait


def test_without_a_timed_wait_nothing_is_measured():
    clock = FakeClock()
    event = FakeEvent(clock)
    loop = make_loop(clock, event, debug_timing=True, runqueue_wait=lambda: 1.0)
    assert loop.wait_until(clock() - 1.0) is Wait.REACHED             # already passed
    assert (loop.wake_late, loop.runqueue_mark) == (None, None)
    assert loop.wait_until(clock() + 0.5 * BUSY_WAIT_S) is Wait.REACHED   # the polling tail
    assert (loop.wake_late, loop.runqueue_mark) == (None, None)
    assert event.timeouts == []


class StallingClock(FakeClock):
    """A FakeClock whose first read past `at` (s) jumps `stall` s ahead: the GIL held by
    another thread while the worker polls for its deadline."""

    def __init__(self, at: float, stall: float) -> None:
        super().__init__()
        self.at, self.stall = self.t + at, stall

    def __call__(self) -> float:
        if self.stall and self.t >= self.at:
            self.t, self.stall = self.t + self.stall, 0.0
        return super().__call__()


def test_a_stalled_deadline_poll_is_measured_and_names_the_other_threads():
    """A 3 ms gap between two clock reads of the polling tail is the tail's stall, and the
    other threads' places at its end are named (here one waiting on an event)."""
    clock = StallingClock(at=0.03 - 0.5 * BUSY_WAIT_S, stall=0.003)
    loop = make_loop(clock, FakeEvent(clock), debug_timing=True)
    release = threading.Event()
    holder = threading.Thread(target=release.wait, name='holder', daemon=True)
    holder.start()
    try:
        assert loop.wait_until(clock.t + 0.03) is Wait.REACHED
    finally:
        release.set()
        holder.join()
    assert loop.tail_stall == pytest.approx(0.003, abs=5 * TICK)
    assert 'holder: wait ' in loop.stalled_threads
    assert loop.stall_account.startswith('on_cpu_ms=')    # the worker's own accounts
    assert '/threading.py:' in loop.stalled_threads      # package/module, not a bare name


def test_a_smooth_deadline_poll_names_no_threads():
    clock = FakeClock()
    loop = make_loop(clock, FakeEvent(clock), debug_timing=True)
    assert loop.wait_until(clock() + 0.03) is Wait.REACHED
    assert 0.0 < loop.tail_stall < STALL_TRACE_S
    assert loop.stalled_threads == '' and loop.stall_account == ''


def test_a_stalls_account_is_the_difference_of_the_reads_around_the_gap():
    """The account read at each clock read of the tail: the stall's is the difference of
    the reads just before and just after its gap."""
    clock = StallingClock(at=0.03 - 0.5 * BUSY_WAIT_S, stall=0.003)
    reads = []

    def account():
        reads.append(clock.t)
        return (clock.t, 0.0, len(reads), 0, 0, 0)
    loop = make_loop(clock, FakeEvent(clock), debug_timing=True, account=account)
    assert loop.wait_until(clock.t + 0.03) is Wait.REACHED
    on_cpu_ms = float(loop.stall_account.split()[0].split('=')[1])
    assert on_cpu_ms == pytest.approx(3.0, abs=0.05)        # the fake: time on a CPU = clock
    assert 'csw_voluntary=1 ' in loop.stall_account         # consecutive reads


def test_without_debug_timing_the_waits_measure_nothing():
    clock = FakeClock()
    loop = make_loop(clock, FakeEvent(clock, late=0.02),
                     runqueue_wait=lambda: pytest.fail('schedstat read without debug_timing'))
    assert loop.wait_until(clock() + 0.03) is Wait.REACHED
    assert (loop.wake_late, loop.runqueue_mark, loop.tail_stall) == (None, None, None)


def test_on_sim_time_the_wait_ends_on_the_target_without_polling_or_clues():
    clock = FakeClock()
    event = FakeEvent(clock)
    loop = make_loop(clock, event, debug_timing=True, sim_time=lambda: True,
                     runqueue_wait=lambda: pytest.fail('schedstat read on sim time'))
    target = clock() + 0.03
    assert loop.wait_until(target) is Wait.REACHED
    assert sum(event.timeouts) == pytest.approx(0.03, abs=5 * TICK)   # no tail left to poll
    assert loop.wake_late is None


def test_a_stop_ends_the_wait():
    clock = FakeClock()
    event = FakeEvent(clock)
    loop = make_loop(clock, event, debug_timing=True)
    event.set()
    assert loop.wait_until(clock() + 1.0) is Wait.STOPPED
    assert loop.wake_late is None


def test_a_clock_jump_back_ends_the_wait_at_once():
    """The clock goes back 5 s during the second slice: the wait ends after that slice
    instead of waiting the 5 s again."""
    clock = FakeClock()

    def jump(k):
        if k == 1:
            clock.t -= 5.0
    event = FakeEvent(clock, on_wait=jump)
    loop = make_loop(clock, event)
    assert loop.wait_until(clock() + 10 * POLL_S) is Wait.CLOCK_JUMPED
    assert len(event.timeouts) == 2


# ------------------------------------------------------------------ the loop
def test_each_chunk_is_built_before_and_sent_at_its_deadline():
    loop, robot, recorder = run(chunks=3)
    assert [r.tick for r in recorder.reports] == [0, 1, 2]
    for report, prepared, (sent, _) in zip(recorder.reports, robot.prepared, robot.sent):
        deadline = loop.scheduler.deadline(report.tick)
        assert prepared < deadline <= sent < deadline + 10 * TICK
        assert report.publish_jitter_ms == pytest.approx((sent - deadline) * 1e3, abs=0.1)
    deadlines = [loop.scheduler.deadline(r.tick) for r in recorder.reports]
    assert np.allclose(np.diff(deadlines), PERIOD)


def test_actions_execute_one_control_period_apart_from_the_observation_stamp():
    loop, robot, recorder = run(chunks=2)
    for report, (sent, chunk), observation in zip(recorder.reports, robot.sent,
                                                  robot.observations):
        expected = observation.stamp + CONTROL_PERIOD * (report.dropped + np.arange(len(chunk)))
        assert np.allclose(chunk.times, expected)
        assert chunk.times[0] >= sent - 10 * TICK and report.dropped == chunk.dropped
        assert chunk.positions.shape == (HORIZON - chunk.dropped, JOINTS)   # first JOINTS dims
        assert np.all(chunk.positions == observation.seq)
        assert report.observation_seq == observation.seq


def test_an_unusable_observation_skips_the_tick_with_its_reason():
    loop, robot, recorder = run(chunks=2, robot_changes={
        'observe': lambda robot: lambda now: 'camera /cam3 is stale'})
    assert recorder.skips == [(0, 'camera /cam3 is stale'), (1, 'camera /cam3 is stale')]
    assert loop.stats.skipped_ticks == 2 and loop.stats.last_skip == 'camera /cam3 is stale'
    assert robot.sent == []


def test_a_published_chunk_ends_the_reported_skip():
    def first_stale(robot):
        observe, calls = robot.observe, []

        def changed(now):
            calls.append(now)
            return 'camera /cam3 is stale' if len(calls) == 1 else observe(now)
        return changed
    loop, robot, recorder = run(chunks=2, robot_changes={'observe': first_stale})
    assert recorder.skips == [(0, 'camera /cam3 is stale')] and len(robot.sent) == 1
    assert loop.stats.last_skip == ''


def test_an_observation_not_newer_than_the_last_one_used_is_refused():
    def same(robot):
        observation = Observation(images=(), state=np.zeros(JOINTS, np.float32),
                                  instruction='x', stamp=1000.4, seq=1)
        return lambda now: observation
    loop, robot, recorder = run(chunks=2, robot_changes={'observe': same})
    assert len(robot.sent) == 1
    assert recorder.skips == [(1, 'observation is not newer than the last one used')]


def test_an_engine_refusal_skips_an_error_fails_and_the_loop_goes_on():
    errors = iter([ValueError('prompt too long'), RuntimeError('bug')])

    def predict(robot):
        def call(observation):
            error = next(errors, None)
            if error is not None:
                raise error
            return Robot.predict(robot, observation)
        return call
    loop, robot, recorder = run(chunks=3, robot_changes={'predict': predict})
    assert recorder.skips == [(0, 'engine refused observation: prompt too long')]
    assert [(tick, str(error)) for tick, error in recorder.failures] == [(1, 'bug')]
    assert (loop.stats.skipped_ticks, loop.stats.failed_ticks) == (1, 1)
    assert [r.tick for r in recorder.reports] == [2]


def test_a_chunk_whose_actions_are_all_past_is_not_sent():
    def slow(robot):
        def call(observation):
            robot.clock.t += HORIZON * CONTROL_PERIOD + 0.1      # past the chunk's span
            return Robot.predict(robot, observation)
        return call
    loop, robot, recorder = run(chunks=1, robot_changes={'predict': slow})
    assert robot.sent == [] and loop.stats.dropped_actions == HORIZON
    assert 'in the past at publish time' in recorder.skips[0][1]
    assert loop.stats.skipped_ticks == 0           # counted as dropped actions


def test_a_chunk_published_late_is_a_deadline_miss():
    def late(robot):
        def call(observation):
            robot.clock.t += loop_lead[0] + 0.8 * CONTROL_PERIOD    # past deadline + period/2
            return Robot.predict(robot, observation)
        return call
    loop_lead = [PERIOD * 0.5]      # the loop's initial lead: min(0.5 * period, 1 s)
    loop, robot, recorder = run(chunks=1, robot_changes={'predict': late})
    assert loop.stats.deadline_misses == 1 and len(robot.sent) == 1
    assert recorder.reports[0].publish_jitter_ms == pytest.approx(80.0, abs=1.0)


def test_ticks_whose_start_passed_are_missed_not_made_up():
    calls = itertools.count()

    def once_slow(robot):
        def call(observation):
            if next(calls) == 0:
                robot.clock.t += 2.6 * PERIOD
            return Robot.predict(robot, observation)
        return call
    loop, robot, recorder = run(chunks=2, robot_changes={'predict': once_slow})
    ticks = [tick for tick, _ in recorder.skips] + [r.tick for r in recorder.reports]
    assert ticks[-1] - ticks[0] == 3        # ticks 1 and 2 never ran
    assert loop.stats.deadline_misses == 2


def test_the_loop_waits_for_the_clock_to_start():
    """Sim time reads 0 until the first /clock message."""
    clock = FakeClock(t=0.0)
    zeros = iter(range(5))

    def sim_clock():
        return 0.0 if next(zeros, None) is not None else clock()
    event = FakeEvent(clock)
    robot = Robot(clock)
    recorder = Recorder(event, chunks=1)
    loop = make_loop(sim_clock, event, robot, recorder, sim_time=lambda: True)
    loop.run()
    assert event.timeouts[:4] == [POLL_S] * 4
    assert len(robot.sent) == 1 and robot.observations[0].stamp > 0.0


def test_a_clock_jump_back_while_waiting_for_the_deadline_drops_the_chunk_and_restarts():
    """The chunk built for the old time base is never sent; the schedule, the stitcher
    and the observation gate restart from the new time (an observation stamped before the
    last one used is accepted)."""
    clock = FakeClock()
    jumped = []

    def jump_once_while_waiting(k):
        if robot.prepared and not jumped:       # waiting for the first chunk's deadline
            clock.t -= 100.0
            jumped.append(clock.t)
    event = FakeEvent(clock, on_wait=jump_once_while_waiting)
    robot = Robot(clock)
    recorder = Recorder(event, chunks=1)
    loop = make_loop(clock, event, robot, recorder)
    loop.run()
    assert len(robot.prepared) == 2 and len(robot.sent) == 1      # the first never sent
    assert recorder.jumps == [pytest.approx(100.0, abs=1.0)]
    sent, chunk = robot.sent[0]
    assert jumped[0] < sent < jumped[0] + 2 * PERIOD              # in the new time base
    assert robot.observations[1].stamp < robot.observations[0].stamp
    assert recorder.reports[0].tick == 0                          # the schedule restarted


def test_debug_timing_reports_the_delay_clues_and_is_off_by_default():
    reads = itertools.count(0.5, 0.25)
    loop, robot, recorder = run(chunks=1, debug_timing=True, event={'late': 0.004},
                                runqueue_wait=lambda: next(reads))
    delay = recorder.reports[0].delay
    assert delay.wake_late == pytest.approx(0.004, abs=5 * TICK)
    assert delay.runqueue_wait == pytest.approx(0.25)      # the read after the send - mark
    assert delay.publish_call == pytest.approx(TICK)       # one clock read apart
    loop, robot, recorder = run(chunks=1)
    assert recorder.reports[0].delay is None


def test_debug_timing_splits_a_ticks_work_into_its_parts():
    """start_late, observe, the engine's preprocess / model split and after_predict: what a
    publish late because the work overran its lead spent its time on."""
    clock = FakeClock()
    event = FakeEvent(clock, late=BUSY_WAIT_S + 0.004)   # every timed wait 4 ms past the tail
    robot = Robot(clock)
    observe, predict = robot.observe, robot.predict

    def slow_observe(now):
        clock.t += 0.02
        return observe(now)

    def slow_predict(observation):
        clock.t += 0.03
        return replace(predict(observation), timings_ms={'preprocess': 3.0, 'model': 26.5})
    robot.observe, robot.predict = slow_observe, slow_predict
    recorder = Recorder(event, chunks=1)
    make_loop(clock, event, robot, recorder, debug_timing=True).run()
    delay = recorder.reports[0].delay
    assert delay.start_late == pytest.approx(0.004, abs=20 * TICK)
    assert delay.observe == pytest.approx(0.02, abs=20 * TICK)
    assert (delay.preprocess, delay.model) == (pytest.approx(0.003), pytest.approx(0.0265))
    assert 0.0 < delay.after_predict < 0.001          # stitching, limits, the message


def test_stop_ends_and_joins_the_worker_thread():
    import threading
    import time
    robot = Robot(FakeClock())
    loop = PolicyLoop(clock=time.monotonic, observe=lambda now: 'no input yet',
                      predict=robot.predict, publish=robot.publish,
                      stitcher=ChunkStitcher(CONTROL_PERIOD), chunk_period=0.05,
                      to_joints=first_joints)
    loop.start(name='test_worker')
    assert any(t.name == 'test_worker' for t in threading.enumerate())
    loop.stop()
    assert not any(t.name == 'test_worker' for t in threading.enumerate())


def test_a_stop_request_during_inference_sends_nothing_more():
    """A stop requested (SIGINT / SIGTERM) while a chunk is being inferred: that chunk is
    never sent and the loop ends, before any `stop()` joins it."""
    clock = FakeClock()
    event = FakeEvent(clock)
    robot = Robot(clock)
    recorder = Recorder(event, chunks=10)
    loops = []

    def predict(observation):
        if observation.seq == 2:
            loops[0].request_stop()
        return robot.predict(observation)
    loops.append(make_loop(clock, event, robot, recorder, predict=predict))
    loops[0].run()
    assert len(robot.prepared) == 2        # the second chunk was built ...
    assert len(robot.sent) == 1 and len(recorder.reports) == 1     # ... and never sent
    assert event.is_set()


def test_a_clock_jump_forward_before_the_publish_sends_nothing_and_says_why():
    """A fresh-user trial: /clock jumped 20 s forward while a chunk waited for its deadline,
    and the chunk went out with every point 20 s in the past."""
    def publish(robot):
        def call(chunk):
            if not robot.prepared:
                robot.clock.t += 20.0           # the jump, between preparing and sending
            return Robot.publish(robot, chunk)
        return call
    loop, robot, recorder = run(chunks=2, robot_changes={'publish': publish})
    reasons = [reason for _, reason in recorder.skips]
    assert len(reasons) == 1 and 'ROS time moved 19.' in reasons[0], reasons
    assert 'a /clock jump forward?' in reasons[0]
    assert len(robot.prepared) == 2 and len(robot.sent) == 1      # the first was not sent
    sent, chunk = robot.sent[0]              # the next starts at or after its send
    assert chunk.times[0] >= sent - 1e-3


# ------------------------------------------------------------------ safety (issue 17)
def run_limited(chunks: int, measured, velocity: float, **kwargs):
    """`run` with a MotionLimiter; the arm is measured at `measured` (A,) when the loop asks,
    stamped 0.2 s before (recorded in robot.measured_stamps)."""
    from molmobot_policy.timing import MotionLimiter
    clock = FakeClock()
    event = FakeEvent(clock)
    robot = Robot(clock)
    robot.measured_stamps = []

    def measure():
        robot.measured_stamps.append(clock.t - 0.2)
        return np.asarray(measured, float), robot.measured_stamps[-1]
    recorder = Recorder(event, chunks)
    loop = make_loop(clock, event, robot, recorder,
                     limiter=MotionLimiter(max_velocity=velocity),
                     measured=measure, **kwargs)
    loop.run()
    return loop, robot, recorder


def test_the_first_point_starts_at_the_measured_state_and_ramps_to_the_plan():
    """The measured arm is 2 rad from the policy's plan (every action = seq = 1): the first
    published point is within max_velocity * (its time - (the publish time +
    PICKUP_MARGIN_S)) of the measurement (what a JointTrajectoryController taking the chunk
    up to that margin after its publish has to reach it), each later point within
    max_velocity * control_period of the one before, and once the ramp reaches the plan the
    points are the plan."""
    from molmobot_policy.timing.loop import PICKUP_MARGIN_S
    velocity = 2.5                              # rad/s: 0.25 rad per control period
    measured = np.array([-1.0, 3.0])            # 2 rad below / above the plan (1.0)
    loop, robot, recorder = run_limited(1, measured, velocity)
    sent, chunk = robot.sent[0]
    step = velocity * CONTROL_PERIOD
    first = chunk.positions[0]
    allowance = velocity * max(chunk.times[0] - sent - PICKUP_MARGIN_S, 0.0)
    assert allowance < 2.0                                  # the plan is out of reach
    # limited, towards it (the limit uses the deadline; `sent` is read a fake-clock tick later)
    assert np.allclose(first, measured + [allowance, -allowance], atol=1e-3)
    steps = np.abs(np.diff(chunk.positions, axis=0))
    assert np.all(steps <= step + 1e-9)
    reached = int(np.argmax(np.all(np.isclose(chunk.positions, 1.0), axis=1)))
    assert reached > 0 and np.allclose(chunk.positions[reached:], 1.0)   # then the plan itself
    report = recorder.reports[0]
    assert report.start_offset == pytest.approx(2.0)
    assert report.velocity_limited > 0
    assert loop.stats.velocity_limited == report.velocity_limited


def test_the_first_point_is_anchored_where_the_arm_is_at_the_publish_not_where_measured():
    """A fresh-user trial: the arm runs the previous chunk during the next one's lead, so the
    measurement taken when the chunk is prepared lags the arm; the first point must be within
    max_velocity * (its time - the publish time) of the arm AT THE PUBLISH."""
    from molmobot_policy.timing import MotionLimiter, latency_estimator
    clock = FakeClock()
    event = FakeEvent(clock)
    robot = Robot(clock)
    velocity = 0.5

    def arm_at(t, sent):       # the arm tracks the last chunk sent (at rest before any)
        if not sent:
            return np.zeros(JOINTS)
        chunk = sent[-1][1]
        return np.array([np.interp(t, chunk.times, chunk.positions[:, j])
                         for j in range(JOINTS)])

    def measure():             # a joint state 0.3 s old when the chunk is prepared
        stamp = clock.t - 0.3
        return arm_at(stamp, robot.sent), stamp
    recorder = Recorder(event, 2)
    loop = make_loop(clock, event, robot, recorder, measured=measure,
                     limiter=MotionLimiter(max_velocity=velocity),
                     latency=latency_estimator(PERIOD, inference_seconds=0.08))
    loop.run()
    (_, first), (sent, second) = robot.sent
    arm = arm_at(sent, [(None, first)])
    assert first.positions[-1, 0] > arm[0] > first.positions[0, 0]    # the arm is moving
    allowance = velocity * max(second.times[0] - sent, 0.0)
    assert np.all(np.abs(second.positions[0] - arm) <= allowance + 1e-3), (
        second.positions[0], arm, allowance)
    assert recorder.reports[1].not_following == ()          # judged to follow its chunk


def test_anchor_at_publish_moves_the_measurement_along_the_executing_chunk():
    from molmobot_policy.timing.chunking import StitchedChunk
    from molmobot_policy.timing.motion import anchor_at_publish
    chunk = StitchedChunk(np.array([10.0, 11.0]), np.array([[0.0, 5.0], [1.0, 5.0]]), 0, 0)
    measured = np.array([0.2, np.nan])
    moved = anchor_at_publish(measured, 10.25, 10.75, chunk).positions
    assert moved[0] == pytest.approx(0.7) and np.isnan(moved[1])
    assert anchor_at_publish(measured, 12.0, 13.0, chunk).positions[0] == 0.2   # over: holds
    assert anchor_at_publish(measured, 10.5, 10.5, chunk).positions[0] == 0.2
    assert anchor_at_publish(measured, 10.0, 11.0, None).positions[0] == 0.2


def test_a_joint_that_does_not_follow_the_executing_chunk_stays_at_its_measurement():
    """Joint 0 is measured 0.3 from where the chunk had it at the stamp (tolerance 0.1): it
    is not moved along the chunk and is named; joint 1, 0.05 off, is."""
    from molmobot_policy.timing.chunking import StitchedChunk
    from molmobot_policy.timing.motion import anchor_at_publish
    chunk = StitchedChunk(np.array([10.0, 11.0]), np.array([[0.0, 0.0], [1.0, 1.0]]), 0, 0)
    measured = np.array([0.55, 0.3])            # the chunk has 0.25 for both at 10.25
    anchor = anchor_at_publish(measured, 10.25, 10.75, chunk, tolerance=0.1)
    np.testing.assert_allclose(anchor.positions, [0.55, 0.8])
    assert anchor.not_following == (0,)
    np.testing.assert_allclose(anchor.tracking_error, [0.3, 0.05])
    unchecked = anchor_at_publish(measured, 10.25, 10.75, chunk)        # no tolerance
    np.testing.assert_allclose(unchecked.positions, [1.05, 0.8])
    assert unchecked.not_following == ()


def test_a_measurement_before_the_chunks_first_point_is_not_judged():
    """Until the executing chunk's first point the arm is on its way from where the chunk
    took it up, and controllers differ there (ROS 1's and the demo's robot keep the previous
    chunk's points due before it: a first version judged such arms stuck)."""
    from molmobot_policy.timing.chunking import StitchedChunk
    from molmobot_policy.timing.motion import anchor_at_publish
    chunk = StitchedChunk(np.array([10.0, 11.0]), np.array([[1.0], [2.0]]), 0, 0)
    anchor = anchor_at_publish(np.array([0.0]), 9.5, 10.5, chunk, tolerance=0.1)
    assert anchor.not_following == () and np.isnan(anchor.tracking_error[0])
    assert anchor.positions[0] == pytest.approx(0.5)         # moved along the chunk
    late = anchor_at_publish(np.array([0.0]), 10.0, 10.5, chunk, tolerance=0.1)
    assert late.not_following == (0,) and late.positions[0] == 0.0


def test_an_arm_that_does_not_move_gets_first_points_within_reach_of_where_it_is():
    """A fresh-user trial: an arm that does not follow the chunks (its controller rejected
    them; stopped), measured 0.3 s before each publish, got first points predicted along the
    chunk it never ran, up to max_velocity x 0.3 s beyond their allowance from the real arm.
    With the tracking check every first point is within its allowance of the arm, the joints
    named; without it (tolerance inf) the same run is not."""
    from molmobot_policy.timing import MotionLimiter
    velocity = 0.5

    def run_stuck(tolerance):
        clock = FakeClock()
        event = FakeEvent(clock)
        robot = Robot(clock)
        recorder = Recorder(event, 4)
        loop = make_loop(clock, event, robot, recorder,
                         limiter=MotionLimiter(max_velocity=velocity,
                                               tracking_tolerance=tolerance),
                         measured=lambda: (np.zeros(JOINTS), clock.t - 0.3))
        loop.run()
        beyond = [np.abs(chunk.positions[0]).max()
                  - velocity * max(chunk.times[0] - sent, 0.0) for sent, chunk in robot.sent]
        return beyond, recorder.reports
    beyond, reports = run_stuck(None)           # the default: velocity x 0.1 s
    assert len(beyond) == 4 and max(beyond) <= 1e-3, beyond
    assert [r.not_following for r in reports[1:]] == [(0, 1)] * 3
    unchecked, _ = run_stuck(np.inf)
    assert max(unchecked) > 0.1, unchecked


def test_the_next_chunk_is_joined_to_the_published_points_not_the_unlimited_plan():
    """The stitcher's previous chunk (what the next one is joined to) is the chunk as sent,
    after the motion limits moved its points."""
    stitcher = ChunkStitcher(CONTROL_PERIOD)
    loop, robot, recorder = run_limited(1, [-1.0, -1.0], 1.0, stitcher=stitcher)
    _, sent = robot.sent[0]
    assert recorder.reports[0].velocity_limited > 0
    np.testing.assert_array_equal(stitcher.previous.positions, sent.positions)


def _limited_loop(measure, publish_hook=None, velocity=1.0):
    """A loop with a MotionLimiter of `velocity`, `measure(clock)` -> (positions, stamp), and
    `publish_hook(clock, k)` run before the k-th message build (from 0). Runs one chunk;
    returns the loop, the Robot, the Recorder and the chunks built."""
    from molmobot_policy.timing import MotionLimiter
    clock = FakeClock()
    event = FakeEvent(clock)
    robot = Robot(clock)
    builds = []

    def publish(chunk):
        if publish_hook is not None:
            publish_hook(clock, len(builds))
        builds.append(chunk)
        return Robot.publish(robot, chunk)
    recorder = Recorder(event, 1)
    loop = make_loop(clock, event, robot, recorder, publish=publish,
                     limiter=MotionLimiter(max_velocity=velocity),
                     measured=lambda: measure(clock))
    loop.run()
    return loop, robot, recorder, builds


def test_a_chunk_sent_late_is_cut_and_limited_again_at_its_send():
    """A stall of 0.15 s just before the deadline (fifth fresh-user trial: a chunk 47 ms late
    went out with its first point 34 ms in the past, a 0.14 rad jump): the chunk sent starts
    at least PICKUP_MARGIN_S after the actual send, its first point within max_velocity of
    the arm from then."""
    from molmobot_policy.timing.loop import PICKUP_MARGIN_S
    measured = np.array([-1.0, 3.0])

    def stall(clock, k):
        if k == 1:                  # the last build before the deadline (the re-anchor)
            clock.t += 0.15
    loop, robot, recorder, builds = _limited_loop(lambda clock: (measured, clock.t - 0.01),
                                                  publish_hook=stall)
    assert len(builds) == 3                 # prepared, re-anchored, cut again after the stall
    sent, chunk = robot.sent[0]
    assert chunk.times[0] >= sent + PICKUP_MARGIN_S - 1e-3, (chunk.times[0], sent)
    assert builds[1].times[0] < sent        # what the stall left in the past
    reach = 1.0 * (chunk.times[0] - sent)
    assert np.all(np.abs(chunk.positions[0] - measured) <= reach + 1e-6)
    assert recorder.reports[0].dropped == builds[0].dropped + (len(builds[0].times)
                                                               - len(chunk.times))


def test_a_stall_during_the_late_cut_itself_cuts_again():
    """A second stall while the late chunk was being cut (re-check: its first point came
    4.4 ms after the send): the chunk is cut again, so that it still starts at least
    PICKUP_MARGIN_S after the send."""
    from molmobot_policy.timing.loop import PICKUP_MARGIN_S
    measured = np.array([-1.0, 3.0])

    def stall(clock, k):
        if k in (1, 2):             # the re-anchor's build, then the late cut's build
            clock.t += 0.15
    loop, robot, recorder, builds = _limited_loop(lambda clock: (measured, clock.t - 0.01),
                                                  publish_hook=stall)
    assert len(builds) == 4
    sent, chunk = robot.sent[0]
    assert builds[2].times[0] < sent + PICKUP_MARGIN_S      # what the second stall spoiled
    assert chunk.times[0] >= sent + PICKUP_MARGIN_S - 1e-3, (chunk.times[0], sent)


def test_the_first_point_is_limited_from_a_measurement_read_just_before_the_deadline():
    """The arm lags its commands (fifth fresh-user trial: 0.3 s behind, the prediction from
    a measurement read a lead earlier was 0.4-0.6 rad off): the chunk is limited again from
    the measurement read REANCHOR_S before the deadline, not from the one at preparation."""
    from molmobot_policy.timing.loop import PICKUP_MARGIN_S, REANCHOR_S
    reads = []

    def measure(clock):
        reads.append(clock.t)
        positions = np.array([-1.0, 3.0]) if len(reads) == 1 else np.array([0.9, 1.1])
        return positions, clock.t - 0.001
    loop, robot, recorder, builds = _limited_loop(measure)
    sent, chunk = robot.sent[0]
    deadline = loop.scheduler.deadline(recorder.reports[0].tick)
    assert len(reads) == 2 and deadline - reads[1] <= REANCHOR_S + 1e-3   # read just before
    reach = 1.0 * (chunk.times[0] - deadline - PICKUP_MARGIN_S)
    assert np.all(np.abs(chunk.positions[0] - [0.9, 1.1]) <= reach + 1e-3), chunk.positions[0]
    assert np.all(np.abs(chunk.positions[0] - [-1.0, 3.0]) > 0.5)     # not the first read


def test_a_joint_without_a_measurement_is_not_anchored():
    loop, robot, recorder = run_limited(1, [np.nan, 0.0], 1.0)
    sent, chunk = robot.sent[0]
    assert chunk.positions[0, 0] == 1.0                      # the plan, not anchored
    from molmobot_policy.timing.loop import PICKUP_MARGIN_S
    reach = 1.0 * (chunk.times[0] - sent - PICKUP_MARGIN_S)   # 1 rad/s from 0, from the latest
                                                              # take-up by the controller on
    assert reach < 1.0 and chunk.positions[0, 1] == pytest.approx(reach, abs=1e-3)
    assert recorder.reports[0].start_offset == pytest.approx(1.0)


def test_the_first_lead_is_the_engines_warm_inference_time_times_the_margin():
    """Inference for the first tick starts inference_seconds * LATENCY_MARGIN before its
    deadline (not a fixed fraction of the period)."""
    from molmobot_policy.timing import latency_estimator
    from molmobot_policy.timing.loop import LATENCY_MARGIN
    started = []

    def predict(robot):
        def call(observation):
            started.append(robot.clock.t)
            return Robot.predict(robot, observation)
        return call
    loop, robot, recorder = run(chunks=1, robot_changes={'predict': predict},
                                latency=latency_estimator(PERIOD, inference_seconds=0.08))
    deadline = loop.scheduler.deadline(recorder.reports[0].tick)
    assert deadline - started[0] == pytest.approx(0.08 * LATENCY_MARGIN, abs=1e-3)


def test_without_a_measured_warm_up_the_first_lead_falls_back_to_half_a_period():
    from molmobot_policy.timing import latency_estimator
    assert latency_estimator(PERIOD, None).lead() == pytest.approx(0.5 * PERIOD)
    with pytest.raises(ValueError, match='inference_seconds'):
        latency_estimator(PERIOD, float('nan'))


def test_slow_first_inferences_after_activation_do_not_hold_the_lead_at_its_cap():
    """The first inference after activation takes 2.5 s longer (cold caches); the lead
    follows the steady 50 ms, not the cap, once enough samples came."""
    from molmobot_policy.timing.loop import LATENCY_MARGIN, SETTLE_SAMPLES
    calls = itertools.count()

    def timer_predict(robot):
        def call(observation):
            if next(calls) == 0:
                robot.clock.t += 2.5         # also skips ticks: their start passed
            robot.clock.t += 0.05
            return Robot.predict(robot, observation)
        return call
    loop, robot, recorder = run(chunks=SETTLE_SAMPLES + 8,
                                robot_changes={'predict': timer_predict})
    assert loop.latency.estimate() == pytest.approx(0.05, abs=1e-3)
    assert loop.latency.lead() == pytest.approx(0.05 * LATENCY_MARGIN, abs=1e-3)
    assert loop.latency.ignored == SETTLE_SAMPLES


def test_chunks_scheduled_before_a_measured_latency_are_start_up_chunks_and_misses_count():
    """The warm-up measured 50 ms, every tick's work takes 200 ms: the first SETTLE_SAMPLES + 1
    chunks run on the warm-up's lead and are late (deadline misses, counted), the next ones on
    the measured lead; only the first are start-up chunks; every chunk is in `jitter_ms`."""
    from molmobot_policy.timing import latency_estimator
    from molmobot_policy.timing.loop import SETTLE_SAMPLES
    startup = SETTLE_SAMPLES + 1
    loop, _, recorder = run(chunks=startup + 3, robot_changes={'predict': slowed('predict', 0.2)},
                            latency=latency_estimator(PERIOD, inference_seconds=0.05))
    jitter = [report.publish_jitter_ms for report in recorder.reports]
    assert all(j > 100.0 for j in jitter[:startup]) and all(j < 1.0 for j in jitter[startup:])
    assert loop.stats.startup_jitter_ms.values().tolist() == pytest.approx(jitter[:startup])
    assert loop.stats.jitter_ms.total == len(jitter)
    assert loop.stats.deadline_misses == startup


def test_a_clock_jump_back_while_waiting_for_the_tick_restarts_at_once_and_reports_first():
    """The jump is seen while waiting for the tick's start (not after waiting out the old
    time base): `clock_jumped` comes before the restart's `started` and before the next
    observation, whose stamp is then in the new time base."""
    clock = FakeClock()
    order, waits_at_jump = [], []

    class Events(Recorder):
        def clock_jumped(self, seconds):
            order.append(('jumped', round(seconds)))
            waits_at_jump.append(len(event.timeouts))

        def started(self, now):
            order.append(('started', now))

    def jump_on_second_wait(k):
        if k == 1:
            clock.t -= 10.0
    event = FakeEvent(clock, on_wait=jump_on_second_wait)
    robot = Robot(clock)
    observe = robot.observe
    robot.observe = lambda now: (order.append(('observe', now)), observe(now))[1]
    events = Events(event, chunks=1)
    loop = make_loop(clock, event, robot, events)
    loop.run()
    kinds = [o[0] for o in order]
    assert kinds[:4] == ['started', 'jumped', 'started', 'observe']
    assert order[1] == ('jumped', 10)
    assert order[2][1] < order[0][1]                 # restarted in the new time base
    assert waits_at_jump == [2]         # seen after the slice it happened in


def test_waiting_for_the_clock_is_reported_every_few_seconds():
    from molmobot_policy.timing.loop import CLOCK_REPORT_S
    clock = FakeClock(t=0.0)
    waits = []

    class Events(Recorder):
        def waiting_for_clock(self, seconds):
            waits.append(seconds)
            if len(waits) == 3:
                self.event.set()
    event = FakeEvent(clock)
    events = Events(event, chunks=1)
    loop = make_loop(lambda: 0.0, event, Robot(clock), events, sim_time=lambda: True,
                     timer=clock)
    loop.run()
    assert waits == pytest.approx([CLOCK_REPORT_S, 2 * CLOCK_REPORT_S, 3 * CLOCK_REPORT_S],
                                  abs=2 * POLL_S)


def test_sim_time_standing_still_is_reported_then_repeated_rarely_then_its_resumption():
    """/clock stops mid-run (sim time reads 1002 s from timer 1002 to 1080 s): the loop says so
    after CLOCK_REPORT_S, again every STANDSTILL_REPEAT_S, publishes nothing meanwhile, and
    says once that the clock moves again; then chunks come again."""
    from molmobot_policy.timing.loop import CLOCK_REPORT_S, STANDSTILL_REPEAT_S
    clock = FakeClock()
    stop_at, resume_at = 1002.0, 1080.0

    def sim():
        t = clock()
        return t if t < stop_at else stop_at if t < resume_at else t - (resume_at - stop_at)
    stopped, resumed = [], []

    class Events(Recorder):
        def clock_stopped(self, now, seconds):
            stopped.append((now, seconds, len(self.reports)))

        def clock_resumed(self, now, seconds):
            resumed.append((now, seconds, len(self.reports)))
    event = FakeEvent(clock)
    robot = Robot(clock)
    events = Events(event, chunks=4)
    loop = make_loop(sim, event, robot, events, sim_time=lambda: True, timer=clock)
    loop.run()
    standstill = resume_at - stop_at
    assert [round(s[1]) for s in stopped] == [round(CLOCK_REPORT_S + k * STANDSTILL_REPEAT_S)
                                              for k in range(3)]
    assert all(now == stop_at for now, _, _ in stopped)
    assert len({count for _, _, count in stopped}) == 1          # nothing published meanwhile
    assert len(resumed) == 1 and resumed[0][1] == pytest.approx(standstill, abs=2 * POLL_S)
    assert len(events.reports) > resumed[0][2]                  # chunks again after it


def test_a_refused_measurement_skips_the_tick_before_stitching():
    """`measured` raising ValueError (a non-finite or stale action-joint position) skips the
    tick with its message: nothing is sent and the stitcher keeps no unpublished chunk."""
    from molmobot_policy.timing import MotionLimiter
    clock = FakeClock()
    event = FakeEvent(clock)
    robot = Robot(clock)
    stitcher = ChunkStitcher(CONTROL_PERIOD)

    def measure():
        raise ValueError("joint state /joint_states has non-finite positions for action "
                         "joints ['j3']")
    recorder = Recorder(event, 1)
    loop = make_loop(clock, event, robot, recorder, limiter=MotionLimiter(max_velocity=1.0),
                     measured=measure, stitcher=stitcher)
    loop.run()
    assert robot.sent == []
    assert recorder.skips and "['j3']" in recorder.skips[0][1]
    assert stitcher.previous is None


def test_the_lead_covers_the_chunks_preparation_after_inference():
    """Building the messages (publish's preparation, 20 ms here) runs between inference and
    the deadline wait: the lead is measured over it too."""
    from molmobot_policy.timing.loop import LATENCY_MARGIN, SETTLE_SAMPLES
    loop, robot, recorder = run(chunks=SETTLE_SAMPLES + 8,
                                robot_changes={'predict': slowed('predict', 0.05),
                                               'publish': slowed('publish', 0.02)})
    assert loop.latency.estimate() == pytest.approx(0.07, abs=1e-3)
    assert loop.latency.lead() == pytest.approx(0.07 * LATENCY_MARGIN, abs=1e-3)


def test_the_lead_covers_building_the_observation_as_well_as_inference():
    """Decoding the frames (observe, 30 ms here: 8 jpeg frames decode in ~50 ms on one core)
    runs before inference (50 ms) between the tick's start and its deadline: the lead is
    measured over both, else every chunk is late by the decode time."""
    from molmobot_policy.timing.loop import LATENCY_MARGIN, SETTLE_SAMPLES
    loop, robot, recorder = run(chunks=SETTLE_SAMPLES + 8,
                                robot_changes={'observe': slowed('observe', 0.03),
                                               'predict': slowed('predict', 0.05)})
    assert loop.latency.estimate() == pytest.approx(0.08, abs=1e-3)
    assert loop.latency.lead() == pytest.approx(0.08 * LATENCY_MARGIN, abs=1e-3)
    sent = [t for t, _ in robot.sent[SETTLE_SAMPLES + 2:]]
    deadlines = [loop.scheduler.deadline(r.tick) for r in recorder.reports[SETTLE_SAMPLES + 2:]]
    assert all(abs(t - d) < 0.005 for t, d in zip(sent, deadlines))


@pytest.mark.skipif(not hasattr(os, 'sched_yield') or
                    not hasattr(resource, 'RUSAGE_THREAD'), reason='Linux only')
def test_the_polling_tail_yields_without_sleeping_in_the_kernel():
    """4 ms of polling on the real clock (all inside the BUSY_WAIT_S tail): the worker
    thread never blocks (`time.sleep(0)`, a timed sleep a virtual machine wakes late, would
    be one voluntary context switch per poll: thousands here)."""
    loop = make_loop(time.monotonic, threading.Event(), timer=time.monotonic)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
    assert loop.wait_until(time.monotonic() + 0.004) is Wait.REACHED
    assert resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before < 20


def test_the_polling_tail_gives_the_gil_to_a_waiting_thread():
    """With a 1 s switch interval, a thread woken while the worker polls runs within the
    poll (a poll that kept the GIL would make it wait out the interval)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    lock, ran = threading.Lock(), []
    lock.acquire()
    waiter = threading.Thread(target=lambda: (lock.acquire(), ran.append(time.monotonic())))
    waiter.start()
    try:
        time.sleep(0.05)                      # the waiter blocks on the lock
        loop = make_loop(time.monotonic, threading.Event(), timer=time.monotonic)
        released = time.monotonic()
        lock.release()
        loop.wait_until(released + 0.005)     # polling only
        waiter.join(timeout=2.0)
    finally:
        sys.setswitchinterval(interval)
    assert ran and ran[0] - released < 0.005
