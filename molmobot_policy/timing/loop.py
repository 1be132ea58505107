"""The policy's worker loop on an injected clock: tick, observe, predict, stitch, publish.

Timing model (DESIGN.md, "Timing model"): ticks come from a `DeadlineScheduler` with the
deadlines `t0 + k * chunk_period` (seconds, the injected clock: ROS time, so sim time
works). A tick's work (building the observation, decoding its frames, inference, and
stitching, limiting and building the messages) starts `lead` seconds before its deadline,
the lead being the measured p99 of that work's wall time times a margin
(`LatencyEstimator`, `latency_estimator`), capped at MAX_LEAD_FRACTION of the period;
until enough samples, the engine's measured warm-up inference time times the margin.
The worker takes the newest observation (`observe`), refuses one not newer than the last
used (`ObservationGate`), runs `predict`, drops the actions already in the past at publish
time and joins the chunk to the previous one (`ChunkStitcher`), anchors the points to the
measured joint state within the velocity and position limits (`MotionLimiter`,
`measured`), lets `publish` build its messages, waits for the deadline and sends them:
only the send runs after the wake-up. The controller is given PICKUP_MARGIN_S to take the
chunk (points due sooner are dropped, the first point is limited from the arm's predicted
position at the end of that margin); REANCHOR_S before the deadline the chunk is limited
again from a fresh measurement (and its messages built again); a send later than
LATE_RECUT_S (a stall) cuts and limits it again at the actual send, up to RECUTS times.
Action k of a chunk
executes at `observation.stamp + k * control_period`. A chunk whose tick was scheduled before
the lead had seen any of this run's own latencies (`LatencyEstimator.measured`: at most the
first SETTLE_SAMPLES + 1) is a start-up chunk; its jitter also goes to
`LoopStats.startup_jitter_ms`, so that the steady state can be rated without it.

Waiting (`wait_until`): slices of at most POLL_S on the stop event, re-reading the clock
after each (sim time follows /clock). On the system clock the last slice ends BUSY_WAIT_S
before the target and the worker then polls the clock, yielding the GIL and the CPU
(`os.sched_yield`, `yield_cpu`) between reads, so the wake-up is not late by a timed wait's
slack or a late timer. Not `time.sleep(0)`: that is a timed sleep in the kernel (a
voluntary context switch at every call) whose wake-up a virtual machine delivers as late as
any other timer's, 1-2.4 ms in the H200 runs (docs/decisions/node-worker-timing.md). While it
polls for a deadline and sends, its `QuietWindow` is open: threads that wait it out (the
node's executor, before each callback) leave it the GIL.

Clock jumps: every clock read is compared with the previous one. A clock that went back
(sim time restarted, the system clock set back) ends a wait at once, also the wait for a
deadline: the chunk built for the old time base is dropped, never published, and the
schedule, the stitcher and the observation gate restart from the new time
(`LoopEvents.clock_jumped` first: the caller forgets its stored inputs there). Before the
clock starts (sim time before the first /clock message reads 0) the loop waits and says so
every CLOCK_REPORT_S of `timer` time (`LoopEvents.waiting_for_clock`). Under sim time, a
clock that reads the same value for CLOCK_REPORT_S of `timer` time while the loop waits
(/clock stopped: a paused or crashed simulator) is reported then and every
STANDSTILL_REPEAT_S after (`LoopEvents.clock_stopped`), and once when it moves again
(`LoopEvents.clock_resumed`); nothing is published meanwhile, since no deadline comes.

Delay clues (`debug_timing`): how late the last timed wait before the deadline returned,
the worker's run-queue wait from before that wait to after the publish (Linux schedstat,
`runqueue_wait_s`: the operating system's share of a delay; the rest is the GIL or a lock)
the publish call's length, and the deadline poll's longest gap between two clock reads
(`tail_stall`: the GIL held elsewhere) with, past STALL_TRACE_S, where the other threads were
(`other_threads`), per chunk in `ChunkReport.delay`. Off: none of it is read.

No rclpy: clock, observe, predict, publish, the event sink and the stop event are injected
through the constructor, so tests drive the loop on a fake clock.
"""
from __future__ import annotations

import enum
import os
import sys
import threading
import time
from dataclasses import replace
from typing import Callable, Optional

import numpy as np

from molmobot_policy.timing.chunking import ChunkStitcher, StitchedChunk
from molmobot_policy.timing.latency import LatencyEstimator
from molmobot_policy.timing.motion import MotionLimiter
from molmobot_policy.timing.reports import ChunkReport, DelayClues, LoopEvents, LoopStats
from molmobot_policy.timing.scheduler import DeadlineScheduler, ObservationGate, Tick
from molmobot_policy.timing.stats import account_difference, runqueue_wait_s, thread_account
from molmobot_policy.types import ActionChunk, Observation

POLL_S = 0.05               # longest single wait (stop, sim time and clock jump checks)
BUSY_WAIT_S = 0.006         # system clock: poll (yielding) this long before a target. A
                            # timed wait can return milliseconds after its timeout with the
                            # thread never waiting for a CPU (timer expiry delivered late in a
                            # virtual machine, the GIL); this tail is wider than those wake-ups
                            # (docs/decisions/node-worker-timing.md), at the cost of polling it
                            # twice a tick (start of inference, deadline)
MAX_LEAD_FRACTION = 0.9     # lead <= this * chunk_period: one latency spike (a stalled
                            # machine) must not push the lead past the period (then at most
                            # every other tick runs) or past the chunk's span (then every
                            # action is in the past at publish time) for a whole window of
                            # latency samples; the rest of the period is left for the
                            # publish bookkeeping before the next tick starts
LATENCY_MARGIN = 1.2        # lead = latency quantile (or warm-up inference time) * this
SETTLE_SAMPLES = 2          # inferences after each activation left out of the lead: they
                            # run on cold caches and clocks after the pause
OUTLIER_FACTOR = 3.0        # a latency above this times the window's median is a spike, not
                            # the new steady state (LatencyEstimator)
QUIET_MAX_S = BUSY_WAIT_S + 0.004   # the longest another thread waits out a publish window
STALL_TRACE_S = 0.001      # debug_timing: a polling-tail gap longer than this names where the
                            # other threads were when it ended (`other_threads`)
PICKUP_MARGIN_S = 0.01      # a controller takes a chunk up to this long after its publish (a
                            # cycle of a 100 Hz controller, delivery): points due sooner are
                            # dropped, and the first point is limited from the arm's position
                            # predicted at publish + this, so the move to it stays within
                            # max_joint_velocity whenever in that window the controller
                            # switches (switch on arrival, as ros2_control's
                            # JointTrajectoryController does)
REANCHOR_S = 0.010          # this long before the deadline the chunk is limited again from a
                            # fresh joint-state measurement: the first limit read it at the
                            # chunk's preparation, up to the lead earlier, and an arm lagging
                            # its commands drifts from the prediction over that time
LATE_RECUT_S = 0.002        # a send later than this after its deadline (a stall) re-cuts and
                            # re-limits the chunk at the actual send time, so that the margin
                            # stays for delivery and the controller's cycle
RECUTS = 3                  # at most this many cuts in a row (a stall during the cut itself)
CLOCK_REPORT_S = 3.0        # say this often that the clock has not started (timer seconds),
                            # and after this long that sim time stopped
STANDSTILL_REPEAT_S = 30.0  # then say it again this often (timer seconds): a paused simulator
                            # is not an emergency to log every few seconds


class QuietWindow:
    """The worker's publish window, which the process's other Python threads stay out of.

    The worker's publish needs the GIL at its deadline; a thread running Python then (the
    ROS executor's callbacks, the diagnostics) keeps it until the worker's request for it
    times out (`sys.setswitchinterval`), and that timed wait can return milliseconds late on
    a virtual machine. The worker `enter()`s when it starts polling the clock for a deadline
    (BUSY_WAIT_S before it) and `leave()`s after the send; another thread calls
    `wait_out()` before running Python work: it blocks, without the GIL, while the window is
    open, at most `timeout` s (default QUIET_MAX_S: a worker that never leaves delays it
    by that much, no more). Thread-safe.
    """

    def __init__(self) -> None:
        self._clear = threading.Event()
        self._clear.set()

    def enter(self) -> None:
        self._clear.clear()

    def leave(self) -> None:
        self._clear.set()

    @property
    def open(self) -> bool:
        return not self._clear.is_set()

    def wait_out(self, timeout: Optional[float] = None) -> bool:
        """Block while the window is open, at most `timeout` s (None: QUIET_MAX_S); True if
        it is closed on return."""
        return self._clear.wait(QUIET_MAX_S if timeout is None else timeout)


def _short_path(path: str) -> str:
    """'package/module.py' of a source path: enough to tell rclpy's executors.py from ours."""
    folder, name = os.path.split(path)
    return f'{os.path.basename(folder)}/{name}' if folder else name


_SCHED_YIELD = getattr(os, 'sched_yield', None)


def yield_cpu() -> None:
    """Give the GIL and the CPU away for a moment without a timed sleep: `os.sched_yield`
    (it releases the GIL around the call and returns at once when no other thread waits for
    the CPU); `time.sleep(0)` where the platform has none."""
    if _SCHED_YIELD is not None:
        _SCHED_YIELD()
    else:
        time.sleep(0)


def _seconds(ms) -> Optional[float]:
    """Milliseconds (a number or None) -> seconds or None."""
    return None if ms is None else float(ms) / 1e3


def other_threads(frames: int = 3) -> str:
    """Where each other thread of this process is: 'name: function package/file.py:line <
    caller ...' (innermost first, `frames` deep), '; '-separated. Read right after the GIL
    came back from a long hold, the holder is usually still in (or just after) the code that
    held it; threads waiting show their wait."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        where = []
        while frame is not None and len(where) < frames:
            code = frame.f_code
            where.append(f'{code.co_name} {_short_path(code.co_filename)}:{frame.f_lineno}')
            frame = frame.f_back
        parts.append(f"{names.get(ident, ident)}: {' < '.join(where)}")
    return '; '.join(sorted(parts))


def latency_estimator(chunk_period: float,
                      inference_seconds: Optional[float] = None) -> LatencyEstimator:
    """The loop's lead estimate for `chunk_period` (s): the p99 of warm latencies times
    LATENCY_MARGIN, capped at MAX_LEAD_FRACTION * chunk_period, the first SETTLE_SAMPLES
    after each `restart()` and spikes above OUTLIER_FACTOR x the median left out. Until
    enough samples: `inference_seconds` (s, one warm query measured at the end of the
    engine's warm-up) times the margin, or min(0.5 * chunk_period, 1 s) when None.

    Raises:
        ValueError: chunk_period not > 0, inference_seconds negative or not finite.
    """
    if not chunk_period > 0.0:
        raise ValueError(f'chunk_period must be > 0 seconds, got {chunk_period!r}')
    if inference_seconds is None:
        initial = min(0.5 * chunk_period, 1.0)
    elif not (isinstance(inference_seconds, (int, float)) and np.isfinite(inference_seconds)
              and inference_seconds >= 0.0):
        raise ValueError(f'engine.inference_seconds must be None or a finite number of '
                         f'seconds >= 0, got {inference_seconds!r}')
    else:
        initial = float(inference_seconds) * LATENCY_MARGIN
    return LatencyEstimator(margin=LATENCY_MARGIN, initial=initial,
                            max_lead=MAX_LEAD_FRACTION * chunk_period, settle=SETTLE_SAMPLES,
                            outlier_factor=OUTLIER_FACTOR)


class Wait(enum.Enum):
    """How `PolicyLoop.wait_until` ended."""
    REACHED = 'reached'             # the clock reads >= the target
    STOPPED = 'stopped'             # `stop()` was called
    CLOCK_JUMPED = 'clock jumped'   # the clock went back: the target is in the old time base


class PolicyLoop:
    """The worker loop (see the module docstring). Not thread-safe: one thread runs it.

    Args:
        clock: () -> float, seconds; the time the schedule runs on (ROS time).
        observe: now (s) -> `types.Observation`, or anything else, whose str() says why no
            observation can be used (e.g. `ros.synchronizer.Skip`).
        predict: Observation -> `types.ActionChunk`; a ValueError refuses the observation
            (the tick is skipped with its message), any other error fails the tick.
        publish: StitchedChunk -> send, a () -> None callable: builds the messages of a chunk
            (before the deadline) and returns the call that sends them (at the deadline).
        stitcher: the `ChunkStitcher` (its control_period is the actions' spacing).
        chunk_period: seconds between ticks (> 0).
        to_joints: float (H, action_dim) robot units -> (H, joints): the action dims the
            published joints take (the robot contract's rule,
            `preprocess.transforms.RobotContract.joint_positions`).
        events: a `LoopEvents`; default: ignore.
        sim_time: () -> bool; True while the clock follows /clock (no polling tail, no
            delay clues).
        limiter: a `MotionLimiter` applied to every stitched chunk (None: none).
        measured: () -> (positions, stamp): float (joints,) the latest measured position of
            each published joint (nan: never measured, not anchored) and that measurement's
            header stamp (s; nan when none); read before stitching, for the limiter; a
            ValueError (a stale or non-finite measurement) skips the tick with its message.
        latency: the `LatencyEstimator` setting the lead (`restart()` at each `run`);
            default `latency_estimator(chunk_period)`.
        debug_timing: measure `DelayClues` per chunk.
        stop_event: the event `stop()` sets and the waits block on (`threading.Event`
            interface: set, is_set, wait(timeout) -> bool); default a new Event.
        timer: () -> float, seconds; wall clock timing the work before the deadline wait
            (`observe`, `predict`, stitching, limits, `publish`'s message) for the lead.
        runqueue_wait: () -> float | None, the thread's run-queue wait so far, s.
        account: () -> tuple | None, the thread's `stats.thread_account` (debug_timing: read
            at each clock read of a polling tail, to split its longest gap).
        quiet: the `QuietWindow` opened for each deadline poll and send (default a private
            one, which no other thread waits on).
    Raises:
        ValueError: chunk_period not > 0.
    """

    def __init__(self, clock: Callable[[], float],
                 observe: Callable[[float], object],
                 predict: Callable[[Observation], ActionChunk],
                 publish: Callable[[StitchedChunk], Callable[[], None]],
                 stitcher: ChunkStitcher, chunk_period: float,
                 to_joints: Callable[[np.ndarray], np.ndarray],
                 events: Optional[LoopEvents] = None,
                 sim_time: Callable[[], bool] = lambda: False, debug_timing: bool = False,
                 stop_event=None, timer: Callable[[], float] = time.perf_counter,
                 runqueue_wait: Callable[[], Optional[float]] = runqueue_wait_s,
                 account: Callable[[], Optional[tuple]] = thread_account,
                 limiter: Optional[MotionLimiter] = None,
                 measured: Optional[Callable[[], tuple]] = None,
                 latency: Optional[LatencyEstimator] = None,
                 quiet: Optional[QuietWindow] = None) -> None:
        if not chunk_period > 0.0:
            raise ValueError(f'chunk_period must be > 0 seconds, got {chunk_period!r}')
        self._clock, self._observe, self._predict = clock, observe, predict
        self._publish, self._stitcher = publish, stitcher
        self._period, self._to_joints = float(chunk_period), to_joints
        self._events = events or LoopEvents()
        self._sim_time, self._debug = sim_time, bool(debug_timing)
        self._stop = stop_event if stop_event is not None else threading.Event()
        self._timer, self._runqueue_wait, self._account = timer, runqueue_wait, account
        self.quiet = quiet if quiet is not None else QuietWindow()
        if limiter is not None and measured is None:
            raise ValueError('a limiter needs `measured`, the measured joint positions')
        self._limiter, self._measured = limiter, measured
        self.stats = LoopStats()
        self.latency = latency or latency_estimator(chunk_period)
        self._gate = ObservationGate()
        self._startup = True        # the current tick's lead is not from this run's latencies
        self.scheduler: Optional[DeadlineScheduler] = None     # once the clock runs
        self._last_now = -np.inf
        self._jumped: Optional[float] = None     # s the clock went back, until restarted
        self._clock_seen: Optional[float] = None     # sim time: the last value read, and
        self._clock_since = 0.0                      # the timer when it was first read
        self._standstill_said: Optional[float] = None    # timer of the last clock_stopped
        self.wake_late: Optional[float] = None   # s, the last timed wait's lateness
        self.tail_stall: Optional[float] = None  # s, the polling tail's longest gap
        self.stalled_threads = ''                # other_threads() after that gap
        self.stall_account = ''                  # the worker's accounts over that gap
        self.runqueue_mark: Optional[float] = None   # s, run-queue wait before that wait
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ thread
    def start(self, name: str = 'policy_worker') -> None:
        """Runs `run` in a new daemon thread."""
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ends `run` at its next check without waiting for it: a chunk still being built
        is never sent (its deadline wait returns at once). Safe from any thread."""
        self._stop.set()

    def stop(self) -> None:
        """Ends `run` at its next check (a wait returns at once) and joins its thread."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ clock
    def _now(self) -> float:
        """The clock, noting a jump back (kept until the schedule restarts)."""
        now = self._clock()
        if now < self._last_now:
            self._jumped = (self._jumped or 0.0) + (self._last_now - now)
        self._last_now = now
        return now

    def wait_until(self, t: float, quiet: bool = False) -> Wait:
        """Block until the clock reads >= t (s), `stop()` is called or the clock jumps back.
        quiet: enter the `QuietWindow` when the polling tail starts (the caller leaves it).

        Sets `wake_late` (s the last timed wait returned after its aim) and `runqueue_mark`
        (the thread's run-queue wait before the last timed wait before t) with debug_timing
        on the system clock; both None otherwise, or without a timed wait. Also, there,
        `tail_stall` (s): the longest gap between two clock reads of the polling tail (None:
        no tail), and `stalled_threads` (`other_threads()` at the end of that gap when it
        exceeds STALL_TRACE_S, else ''): a gap is the GIL held elsewhere or the CPU lost;
        with it `stall_account`, the worker's own accounts over that gap
        (`stats.account_difference` of `account()` read at each clock read of the tail:
        on a CPU, on a run queue, neither; context switches; page faults).
        """
        sim = self._sim_time()
        tail = 0.0 if sim else BUSY_WAIT_S
        measure = self._debug and not sim
        self.wake_late = self.runqueue_mark = None
        self.tail_stall, self.stalled_threads, self.stall_account = None, '', ''
        aim = polled = accounted = None
        while not self._stop.is_set():
            now = self._now()
            if sim:
                self._watch_standstill(now)
            if measure and polled is not None:      # in the polling tail
                gap = now - polled
                previous, accounted = accounted, self._account()
                if gap > (self.tail_stall or 0.0):
                    self.tail_stall = gap
                    if gap > STALL_TRACE_S:
                        self.stalled_threads = other_threads()
                        self.stall_account = account_difference(previous, accounted)
            if self._jumped is not None:
                return Wait.CLOCK_JUMPED
            if aim is not None and measure:
                self.wake_late = now - aim
            aim = polled = None
            remaining = t - now
            if remaining <= 0.0:
                return Wait.REACHED
            if remaining > tail:
                timeout = min(remaining - tail, POLL_S)
                if measure and timeout == remaining - tail:    # the last wait before t
                    self.runqueue_mark = self._runqueue_wait()
                if self._stop.wait(timeout):
                    break
                aim = now + timeout
            else:
                if quiet and not self.quiet.open:
                    self.quiet.enter()
                if measure and accounted is None:       # the tail's first clock read
                    accounted = self._account()
                polled = now
                yield_cpu()
        return Wait.STOPPED

    def _watch_standstill(self, now: float) -> None:
        """Sim time: `clock_stopped` once the clock has read `now` for CLOCK_REPORT_S of
        timer time, then every STANDSTILL_REPEAT_S; `clock_resumed` when it moves after that."""
        timer = self._timer()
        if now != self._clock_seen:
            if self._standstill_said is not None:
                self._events.clock_resumed(now, timer - self._clock_since)
            self._clock_seen, self._clock_since, self._standstill_said = now, timer, None
            return
        standstill = timer - self._clock_since
        if standstill >= CLOCK_REPORT_S and (self._standstill_said is None or
                                             timer - self._standstill_said >= STANDSTILL_REPEAT_S):
            self._standstill_said = timer
            self._events.clock_stopped(now, standstill)

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """Ticks until `stop()`. Never raises for a bad tick: each failure is counted and
        reported (`LoopEvents.failed`) and the next tick runs."""
        self.latency.restart()
        waiting_since = reported = self._timer()
        while self._now() <= 0.0:       # sim time before the first /clock message
            if self._stop.wait(POLL_S):
                return
            if self._timer() - reported >= CLOCK_REPORT_S:
                reported = self._timer()
                self._events.waiting_for_clock(reported - waiting_since)
        self._restart(self._now())
        while not self._stop.is_set():
            now = self._now()
            if self._jumped is not None:
                self._restart(now)
                continue
            self._startup = not self.latency.measured
            self.scheduler.set_lead(self.latency.lead())
            tick = self.scheduler.next_tick(now)
            waited = self.wait_until(tick.start_at)
            if waited is Wait.STOPPED:
                return
            if waited is Wait.CLOCK_JUMPED:
                continue
            try:
                self._tick(tick)
            except Exception as error:  # noqa: BLE001 - bad input never stops the worker
                self.stats.failed_ticks += 1
                self._events.failed(tick.index, error)

    def _restart(self, now: float) -> None:
        """(Re)start the schedule one period after `now`, forgetting the previous chunk
        and observation (their times are in the old time base after a jump back)."""
        if self._jumped is not None:
            self._events.clock_jumped(self._jumped)
            self._jumped = None
        self._last_now = now
        if self.scheduler is None:
            self.scheduler = DeadlineScheduler(self._period, t0=now + self._period,
                                               on_miss=self.stats.count_missed)
        else:
            self.scheduler.reset(now + self._period)
        self._stitcher.reset()
        self._gate.reset()
        self._events.started(now)

    def _skip(self, tick: Tick, reason: str, counted: bool = True) -> None:
        if counted:
            self.stats.skipped_ticks += 1
        self.stats.last_skip = reason
        self._events.skipped(tick.index, reason)

    def _tick(self, tick: Tick) -> None:
        # the lead covers building the observation (decoding its frames: ~6 ms per 480x640
        # jpeg), the inference and the chunk's preparation: all run between the tick's start
        # and its deadline
        started = self._timer()
        now = self._now()
        start_late = now - tick.start_at if self._debug and not self._sim_time() else None
        observation = self._observe(now)
        observed = self._timer()
        if isinstance(observation, Observation) and \
                not self._gate.accept_observation(observation):
            observation = 'observation is not newer than the last one used'
        if not isinstance(observation, Observation):
            return self._skip(tick, str(observation))
        try:
            chunk = self._predict(observation)
        except ValueError as error:
            return self._skip(tick, f'engine refused observation: {error}')
        predicted = self._timer()
        self.stats.inference_ms.add(chunk.inference_ms)
        try:    # the lead covers the work up to the deadline wait, skipped or not
            prepared_chunk = self._prepare(tick, observation, chunk)
        finally:
            prepared = self._timer()
            self.latency.record(prepared - started)
        if prepared_chunk is None:
            return
        send, stitched, limits, plan = prepared_chunk
        try:
            if self._limiter is not None and self._now() < tick.deadline - REANCHOR_S:
                if self.wait_until(tick.deadline - REANCHOR_S) is not Wait.REACHED:
                    return self._stitcher.withdraw(plan[1])     # stopped, or a jump back
                final = self._finalize(tick, plan, tick.deadline + PICKUP_MARGIN_S)
                if final is None:
                    return
                send, stitched, limits = final
            if self.wait_until(tick.deadline, quiet=True) is not Wait.REACHED:
                return  # stopped, or the clock went back: never publish into the new time
            now = self._now()
            past = now - stitched.times[0]
            if past > self._period:
                # ROS time moved on while the chunk waited (a /clock jump forward): its
                # points would be in the past, which a controller rejects
                self._stitcher.reset()
                return self._skip(tick, f'ROS time moved {past:.3f} s past the chunk\'s first '
                                        'point before its publish (a /clock jump forward?): '
                                        'not sent')
            cut_at = tick.deadline
            for _ in range(RECUTS):
                if now <= cut_at + LATE_RECUT_S:
                    break
                # a late send (a stall): the points due before it, and the limit from where
                # the arm was at the deadline, no longer hold; cut and limit them again now
                final = self._finalize(tick, plan, now + PICKUP_MARGIN_S)
                if final is None:
                    return
                send, stitched, limits = final
                cut_at, now = now, self._now()      # and again if the cut itself stalled
            wake_late, mark = self.wake_late, self.runqueue_mark
            called = self._now() if self._debug else None
            send()
            published = self._now()
        finally:
            self.quiet.leave()      # the other threads run again
        delay = None
        if self._debug:
            after = None if mark is None else self._runqueue_wait()
            parts = getattr(chunk, 'timings_ms', None) or {}
            delay = DelayClues(wake_late, None if after is None else after - mark,
                               published - called, self.tail_stall, self.stalled_threads,
                               stall_account=self.stall_account,
                               start_late=start_late, observe=observed - started,
                               preprocess=_seconds(parts.get('preprocess')),
                               model=_seconds(parts.get('model')),
                               after_predict=prepared - predicted)
        self._record(tick, observation, chunk, stitched, published, delay, limits)

    def _prepare(self, tick: Tick, observation: Observation, chunk: ActionChunk):
        """The chunk stitched, limited and made into its messages: (the send callable, the
        stitched chunk, the limiter's `LimitedPoints` or None, the plan for `_finalize`:
        (the stitched chunk before the limits, the chunk the arm executes)), or None where
        the tick was skipped (reported here)."""
        # actions due before the controller can take the chunk are dropped: the publish time
        # (the deadline unless inference overran it) + PICKUP_MARGIN_S
        publish_at = max(self._now(), tick.deadline)
        try:        # before stitching: a refused measurement leaves the stitcher as it was
            measured = self._measured() if self._limiter is not None else None
        except ValueError as error:
            self._skip(tick, str(error))
            return None
        actions = self._to_joints(np.asarray(chunk.actions, dtype=np.float64))
        executing = self._stitcher.previous     # what the arm runs until this one arrives
        stitched = self._stitcher.stitch(actions, first_time=observation.stamp,
                                         now=publish_at + PICKUP_MARGIN_S)
        self.stats.dropped_actions += stitched.dropped
        if len(stitched) == 0:
            self._skip(tick, f'all {stitched.dropped} actions were in the past at publish time',
                       counted=False)
            return None
        plan = (stitched, executing)
        final = self._limited(stitched, measured, publish_at + PICKUP_MARGIN_S, executing)
        return (*final, plan)

    def _limited(self, stitched: StitchedChunk, measured, taken_at: float,
                 executing: Optional[StitchedChunk]):
        """(send, the chunk as sent, `LimitedPoints` or None) of `stitched` limited from the
        arm's position predicted at `taken_at` (s, ROS time: when the controller takes it at
        the latest), committed as the stitcher's reference."""
        limits = self._limit(stitched, measured, taken_at, executing)
        if limits is not None:
            stitched = replace(stitched, positions=limits.positions)
        self._stitcher.commit(stitched)         # the next chunk joins what is published
        return self._publish(stitched), stitched, limits

    def _finalize(self, tick: Tick, plan, taken_at: float):
        """The plan's points due at or after `taken_at` (s, ROS time), limited again from a
        fresh measurement (`_limited`): (send, the chunk as sent, `LimitedPoints` or None), or
        None where the tick was skipped (reported; the stitcher keeps the executing chunk as
        its reference)."""
        stitched, executing = plan
        late = int(np.searchsorted(stitched.times, taken_at, side='left'))
        if late >= len(stitched):
            self._stitcher.withdraw(executing)
            self.stats.dropped_actions += late
            self._skip(tick, f'all {stitched.dropped + late} actions were in the past at '
                             'publish time (sent late)', counted=False)
            return None
        if late:
            self.stats.dropped_actions += late
            stitched = replace(stitched, times=stitched.times[late:],
                               positions=stitched.positions[late:],
                               dropped=stitched.dropped + late,
                               first_index=stitched.first_index + late)
        try:
            measured = self._measured() if self._limiter is not None else None
        except ValueError as error:
            self._stitcher.withdraw(executing)
            self._skip(tick, str(error))
            return None
        return self._limited(stitched, measured, taken_at, executing)

    def _limit(self, stitched: StitchedChunk, measured, taken_at: float,
               executing: Optional[StitchedChunk]):
        """The limiter's `LimitedPoints` for the stitched chunk taken by the controller at
        `taken_at` at the latest (None without a limiter); `measured` is what
        `self._measured()` returned, `executing` the chunk the arm runs until then
        (`MotionLimiter.anchor`: the measurement moved along it where the arm follows it)."""
        if self._limiter is None:
            return None
        positions, stamp = measured
        anchor = self._limiter.anchor(positions, stamp, taken_at, executing)
        limits = self._limiter.limit(stitched.times, stitched.positions, anchor.positions,
                                     taken_at)
        return replace(limits, not_following=anchor.not_following)

    def _record(self, tick: Tick, observation: Observation, chunk: ActionChunk,
                stitched: StitchedChunk, published: float, delay: Optional[DelayClues],
                limits) -> None:
        stats = self.stats
        limited = clipped = 0
        offset = float('nan')
        outside = not_following = ()
        if limits is not None:
            limited, clipped = limits.velocity_limited, limits.position_clipped
            outside, not_following = limits.outside_limits, limits.not_following
            anchored = limits.start_offset[np.isfinite(limits.start_offset)]
            offset = float(anchored.max()) if anchored.size else offset
            stats.velocity_limited += limited
            stats.position_clipped += clipped
        if published > tick.deadline + 0.5 * self._stitcher.control_period:
            stats.deadline_misses += 1           # inference overran its lead
        jitter_ms = (published - tick.deadline) * 1e3
        age_ms = (published - observation.stamp) * 1e3
        stats.jitter_ms.add(jitter_ms)
        if self._startup:
            stats.startup_jitter_ms.add(jitter_ms)
        stats.age_ms.add(age_ms)
        stats.chunks_published += 1
        stats.last_skip = ''           # skipping ended
        self._events.published(ChunkReport(
            tick=tick.index, observation_seq=observation.seq,
            observation_stamp=observation.stamp, observation_age_ms=age_ms,
            inference_ms=chunk.inference_ms, publish_jitter_ms=jitter_ms,
            positions=stitched.positions, dropped=stitched.dropped,
            count=stats.chunks_published, delay=delay, velocity_limited=limited,
            position_clipped=clipped, start_offset=offset, outside_limits=outside,
            not_following=not_following,
            instruction=observation.instruction))
