"""What the policy loop reports: per-chunk reports, the event sink, the loop's counters.

`PolicyLoop` (timing/loop.py) calls a `LoopEvents` on its thread and keeps a `LoopStats`
that diagnostics read from other threads; a `ChunkReport` describes each published chunk.
Plain python + numpy; no rclpy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from molmobot_policy.timing.scheduler import MissedTicks
from molmobot_policy.timing.stats import RollingStats

STATS_WINDOW = 200          # samples kept for p50/p99/max


@dataclass(frozen=True)
class DelayClues:
    """Where a publish's delay went (debug_timing), seconds; None where not measured.

    Attributes:
        wake_late: how late the last timed wait before the deadline returned (None: no timed
            wait, i.e. inference ran into the polling tail, or sim time).
        runqueue_wait: the worker thread runnable without a CPU from before that wait to after
            the publish (None: no timed wait, or no schedstat on this system).
        publish_call: how long the send took.
        tail_stall: the longest gap between two clock reads while polling for the deadline
            (None: no polling tail, i.e. inference ran past the deadline).
        stalled_threads: where the process's other threads were when that gap ended, if it
            was longer than `timing.loop.STALL_TRACE_S` ('' otherwise; `loop.other_threads`).
        stall_account: the worker's own accounts over that gap, if it was longer than
            STALL_TRACE_S ('' otherwise; `timing.stats.account_difference`: on a CPU, on a run
            queue, context switches, page faults).
        The tick's earlier parts, for a publish late because the work overran its lead
        (start_at -> publish = start_late + observe + the inference + after_predict + the
        deadline wait + publish_call):
        start_late: the clock when the tick's work began - the tick's `start_at`.
        observe: building the observation (`observe`: the frames' copy or decode, the sync).
        preprocess, model: the engine's own split of the inference (`ActionChunk.timings_ms`
            'preprocess' / 'model'; None where the engine gives none): the host part before
            the model, and the model up to its actions on the host.
        after_predict: the inference's end -> the deadline wait (stitch, limits, message).
    """

    wake_late: Optional[float]
    runqueue_wait: Optional[float]
    publish_call: float
    tail_stall: Optional[float] = None
    stalled_threads: str = ''
    stall_account: str = ''
    start_late: Optional[float] = None
    observe: Optional[float] = None
    preprocess: Optional[float] = None
    model: Optional[float] = None
    after_predict: Optional[float] = None


@dataclass(frozen=True)
class ChunkReport:
    """One published chunk.

    Attributes:
        tick: the tick's index on the schedule.
        observation_seq, observation_stamp: `Observation.seq` / `.stamp` (s) of its input.
        observation_age_ms: publish time - observation stamp, ms.
        inference_ms: `ActionChunk.inference_ms` of the chunk.
        publish_jitter_ms: publish time - the tick's deadline, ms.
        positions: float64 (K, A), the published points, robot units.
        dropped: actions dropped from the front (in the past at publish time).
        count: chunks this loop has published, this one included.
        delay: the delay clues with debug_timing, else None.
        velocity_limited, position_clipped: (point, joint) values the `MotionLimiter` moved.
        start_offset: the largest |planned first point - measured position| over the
            anchored joints, robot units (nan: none anchored, or no limiter).
        outside_limits: indices of the action joints measured outside their position limits
            (`timing.motion.LimitedPoints`).
        not_following: indices of the action joints that did not follow the executing chunk
            (measured further than their tracking tolerance from it): anchored at the
            measurement (`timing.motion.anchor_at_publish`).
        instruction: the task text of its observation.
    """

    tick: int
    observation_seq: int
    observation_stamp: float
    observation_age_ms: float
    inference_ms: float
    publish_jitter_ms: float
    positions: np.ndarray
    dropped: int
    count: int
    delay: Optional[DelayClues] = None
    velocity_limited: int = 0
    position_clipped: int = 0
    start_offset: float = float('nan')
    outside_limits: tuple[int, ...] = ()
    not_following: tuple[int, ...] = ()
    instruction: str = ''


class LoopEvents:
    """What the loop reports, on its thread; these defaults ignore it (subclass to log)."""

    def skipped(self, tick: int, reason: str) -> None:
        """Tick `tick` published nothing, for `reason` (names the input or parameter)."""

    def failed(self, tick: int, error: Exception) -> None:
        """Tick `tick` raised `error` (observe/predict/publish bug); the loop goes on."""

    def clock_jumped(self, seconds: float) -> None:
        """The clock went back by `seconds`; the schedule restarts from the new time (called
        before the restart: inputs stored in the old time base are to be forgotten now)."""

    def started(self, now: float) -> None:
        """The schedule (re)started at `now` (s): at the first clock reading > 0 and after
        each clock jump back; the first chunk is due one period later."""

    def waiting_for_clock(self, seconds: float) -> None:
        """The clock has not started after `seconds` (timer time): nothing is published."""

    def clock_stopped(self, now: float, seconds: float) -> None:
        """Sim time has read `now` (s) for `seconds` of timer time: no /clock, nothing is
        published."""

    def clock_resumed(self, now: float, seconds: float) -> None:
        """Sim time moves again (now `now`, s) after a reported standstill of `seconds`."""

    def published(self, report: ChunkReport) -> None:
        """A chunk was sent."""


class LoopStats:
    """Counters and rolling statistics of one loop (read by diagnostics on other threads).

    Attributes:
        inference_ms, jitter_ms, age_ms: `RollingStats` of inference time, publish jitter and
            sensor-to-publish age, ms (every chunk).
        startup_jitter_ms: `RollingStats` of the publish jitter of the start-up chunks, ms:
            those whose tick was scheduled before the lead had seen a latency measured in
            this run (`LatencyEstimator.measured`; the warm-up's estimate on the first
            activation). They come first, and also are in `jitter_ms`; `.total` counts them.
        chunks_published, dropped_actions, skipped_ticks, failed_ticks: counts.
        velocity_limited, position_clipped: (point, joint) values moved by the motion
            limits, summed over the published chunks.
        deadline_misses: ticks skipped because their start time had passed, plus chunks
            published more than half a control period after their deadline.
        last_skip: the latest reason a tick published nothing, until a chunk is published
            again ('' then): the schedule diagnostic stays WARN while ticks are skipped.
    """

    def __init__(self, window: int = STATS_WINDOW) -> None:
        self.inference_ms = RollingStats(window)
        self.jitter_ms = RollingStats(window)
        self.startup_jitter_ms = RollingStats(window)
        self.age_ms = RollingStats(window)
        self.chunks_published = 0
        self.deadline_misses = 0
        self.dropped_actions = 0
        self.skipped_ticks = 0
        self.failed_ticks = 0
        self.velocity_limited = 0
        self.position_clipped = 0
        self.last_skip = ''

    def count_missed(self, miss: MissedTicks) -> None:
        """`DeadlineScheduler` on_miss callback."""
        self.deadline_misses += miss.count
