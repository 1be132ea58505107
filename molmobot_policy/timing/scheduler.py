"""Absolute-deadline tick schedule and the observation freshness gate.

Timing model (DESIGN.md, "Timing model"): the policy runs on a fixed period. Tick k has
the absolute deadline `t0 + k * period` (seconds, ROS time): the moment its action chunk
is published. Deadlines are computed by multiplication from `t0`, never by adding the
period to the previous deadline and never by sleeping `period` after the work, so the
schedule does not drift however long it runs and whatever the float period.

Inference for tick k must start `lead` seconds before its deadline (`start_at =
deadline - lead`); `lead` comes from the measured inference latency
(`latency.LatencyEstimator`). The worker loop is:

    tick = scheduler.next_tick(now())        # the next tick that can still start on time
    scheduler.wait(tick, sleep_until)        # sleep (ROS clock) until tick.start_at
    ... take the newest observation, run inference ...
    scheduler.wait(tick, sleep_until, target='deadline')
    ... publish the chunk, stamped for when its actions execute ...

If the start time of the next tick has already passed when `next_tick` is called (the
previous inference was slow), that tick is skipped and counted once as missed; the
schedule resumes at the next grid tick whose start time is still ahead. It never issues
extra ticks back to back to catch up, so a slow inference costs ticks, not a burst.

Every time is a plain float in seconds supplied by the caller (`now`), so the same code
runs on the wall clock, the ROS clock or simulated time, and tests use a fake clock.
No rclpy here.
"""
from __future__ import annotations

import math

from .validation import finite_seconds
import operator
from dataclasses import dataclass
from typing import Callable, Optional


def _integer(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f'{name} must be an int, got {value!r}')
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f'{name} must be an int, got {value!r}') from None


@dataclass(frozen=True)
class Tick:
    """One slot of the schedule.

    Attributes:
        index: k, the tick's position on the grid (int, >= 0).
        deadline: seconds, ROS time; `t0 + k * period`, when the chunk is published.
        start_at: seconds, ROS time; `deadline - lead`, when inference should start.
        skipped: number of grid ticks skipped (missed) just before this one (int, >= 0).
    """

    index: int
    deadline: float
    start_at: float
    skipped: int = 0


@dataclass(frozen=True)
class MissedTicks:
    """Event: ticks skipped because their start time had passed.

    Attributes:
        first_index: index of the first skipped tick.
        count: number of consecutive skipped ticks (>= 1).
        now: seconds, ROS time; the `now` passed to the `next_tick` call that skipped them.
    """

    first_index: int
    count: int
    now: float


class DeadlineScheduler:
    """Fixed-period schedule with absolute deadlines `t0 + k * period`.

    Args:
        period: seconds (> 0, finite), the policy period.
        t0: seconds, ROS time; the deadline of tick 0.
        lead: seconds (>= 0, finite); inference starts this long before the deadline.
            May exceed the period (then at most every other tick can run).
        on_miss: optional callback called with a `MissedTicks` each time ticks are
            skipped (from inside `next_tick`, on the caller's thread).

    Attributes:
        missed: total number of ticks skipped since construction (or `reset`).
        last_missed_count: ticks skipped by the most recent `next_tick` call.
        last_miss: the most recent `MissedTicks` event, or None.

    Raises:
        ValueError: period not a positive finite number, t0 or lead not finite, lead < 0.
    """

    def __init__(self, period: float, t0: float, lead: float = 0.0,
                 on_miss: Optional[Callable[[MissedTicks], None]] = None):
        period = finite_seconds('period', period)
        if period <= 0.0:
            raise ValueError(f'period must be > 0 seconds, got {period!r}')
        self._period = period
        self._on_miss = on_miss
        self.set_lead(lead)
        self.reset(t0)

    @property
    def period(self) -> float:
        """Seconds between consecutive deadlines."""
        return self._period

    @property
    def t0(self) -> float:
        """Seconds, ROS time; the deadline of tick 0."""
        return self._t0

    @property
    def lead(self) -> float:
        """Seconds between a tick's start_at and its deadline."""
        return self._lead

    def set_lead(self, seconds: float) -> None:
        """Set the lead (seconds, >= 0, finite); applies to ticks issued from now on.

        Raises:
            ValueError: seconds negative or not finite.
        """
        seconds = finite_seconds('lead', seconds)
        if seconds < 0.0:
            raise ValueError(f'lead must be >= 0 seconds, got {seconds!r}')
        self._lead = seconds

    def reset(self, t0: float) -> None:
        """Restart the grid at a new `t0` (e.g. after a ROS time jump) and zero the counters.

        Raises:
            ValueError: t0 not finite.
        """
        self._t0 = finite_seconds('t0', t0)
        self._next_index: Optional[int] = None  # None until the first tick is issued
        self.missed = 0
        self.last_missed_count = 0
        self.last_miss: Optional[MissedTicks] = None

    def deadline(self, index: int) -> float:
        """Deadline of tick `index`: `t0 + index * period`, seconds (never accumulated)."""
        return self._t0 + index * self._period

    def start_at(self, index: int) -> float:
        """Start time of tick `index`: `deadline(index) - lead`, seconds."""
        return self.deadline(index) - self._lead

    def next_tick(self, now: float) -> Tick:
        """The next tick whose start time has not passed at `now`.

        The first call joins the grid at the first tick that can still start on time
        (ticks before the first call are not misses: nothing was running). Later calls
        return the tick after the previous one, unless its start time is already behind
        `now`; then it and any further passed ticks are skipped and counted once each in
        `missed` (and reported through `last_missed_count`, `last_miss` and `on_miss`).
        A start time equal to `now` has not passed.

        Args:
            now: seconds, ROS time (the caller's clock).
        Returns:
            Tick with index strictly greater than the previous tick's.
        Raises:
            ValueError: now not finite.
        """
        now = finite_seconds('now', now)
        earliest = self._first_startable(now)
        if self._next_index is None:
            index, skipped = earliest, 0
        else:
            index = max(self._next_index, earliest)
            skipped = index - self._next_index
        self.last_missed_count = skipped
        if skipped:
            self.missed += skipped
            self.last_miss = MissedTicks(index - skipped, skipped, now)
            if self._on_miss is not None:
                self._on_miss(self.last_miss)
        self._next_index = index + 1
        return Tick(index, self.deadline(index), self.start_at(index), skipped)

    def _first_startable(self, now: float) -> int:
        # smallest k >= 0 with start_at(k) >= now; the estimate is corrected for rounding
        k = max(0, math.ceil((now + self._lead - self._t0) / self._period))
        while k > 0 and self.start_at(k - 1) >= now:
            k -= 1
        while self.start_at(k) < now:
            k += 1
        return k

    def wait(self, tick: Tick, sleep_until: Callable[[float], object],
             now: Optional[Callable[[], float]] = None, target: str = 'start_at') -> bool:
        """Sleep until the tick's start_at (or deadline) with an injected sleep function.

        Args:
            tick: a tick from `next_tick`.
            sleep_until: called with the target time (seconds, ROS time); should block
                until then (the node passes a ROS-clock sleep, which follows sim time).
                Returning False means "interrupted" (shutdown, clock jump).
            now: optional clock (seconds). When given, `sleep_until` is called again
                while `now() < target` (an early wake-up), at most 100 times.
            target: 'start_at' or 'deadline'.
        Returns:
            False if `sleep_until` returned False or the target was not reached after
            100 calls; True otherwise.
        Raises:
            ValueError: target not 'start_at' or 'deadline'.
        """
        if target not in ('start_at', 'deadline'):
            raise ValueError(f"target must be 'start_at' or 'deadline', got {target!r}")
        until = tick.start_at if target == 'start_at' else tick.deadline
        for _ in range(100):
            if sleep_until(until) is False:
                return False
            if now is None or now() >= until:
                return True
        return False


class ObservationGate:
    """Refuses any observation not newer than the last one used.

    DESIGN.md: "never acting on an older observation than one already used". An
    observation is newer when its stamp is later, or its stamp is equal and its seq is
    larger (seq as given by the synchronizer; 0 when unused, so then only the stamp counts).

    Attributes:
        last_stamp: seconds, ROS time, of the last accepted observation (None before any).
        last_seq: seq of the last accepted observation (None before any).
        refused: number of observations refused so far.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget the last used observation (e.g. after a ROS time jump back)."""
        self.last_stamp: Optional[float] = None
        self.last_seq: Optional[int] = None
        self.refused = 0

    def is_newer(self, stamp: float, seq: int = 0) -> bool:
        """True if (stamp, seq) is newer than the last accepted observation; records nothing.

        Raises:
            ValueError: stamp not finite, seq not an integer.
        """
        stamp = finite_seconds('stamp', stamp)
        seq = _integer('seq', seq)
        if self.last_stamp is None:
            return True
        return (stamp, seq) > (self.last_stamp, self.last_seq)

    def accept(self, stamp: float, seq: int = 0) -> bool:
        """Use the observation if it is newer: record it and return True; else count a refusal.

        Args:
            stamp: seconds, ROS time (`Observation.stamp`).
            seq: `Observation.seq`.
        Returns:
            True if the caller may act on this observation.
        Raises:
            ValueError: stamp not finite, seq not an integer.
        """
        if not self.is_newer(stamp, seq):
            self.refused += 1
            return False
        self.last_stamp, self.last_seq = float(stamp), _integer('seq', seq)
        return True

    def accept_observation(self, observation) -> bool:
        """`accept(observation.stamp, observation.seq)` for a `types.Observation`."""
        return self.accept(observation.stamp, observation.seq)
