"""Whether action chunks still reach the robot: the rule behind the node's output status.

Safety model (DESIGN.md, "Safety model"): the node is never silent while nothing reaches the
arm. Whatever the cause (a stale camera, a NaN joint state, no /clock, a refused frame), the
output status says so: OK while chunks are published on schedule, WARN once no chunk came
for more than 1.5 periods (a missed tick), ERROR after `error_periods` periods; the message
names the last reason a tick was skipped. Before the first chunk of an activation the OK
message says that none came yet (how long since `start`), not that chunks flow. Plain
python; times are float seconds from the caller's clock.

Under sim time the caller's clock (ROS time) can stand still: before the first /clock message
it reads 0, and it stops when /clock does. Then no period passes on it and `check` alone would
stay OK; `check_clock` measures the standstill on a wall clock instead (WARN at once while
ROS time has not started, and after one period of standstill; ERROR after `error_periods`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from .validation import finite_seconds

OK, WARN, ERROR = 'OK', 'WARN', 'ERROR'
WARN_PERIODS = 1.5      # chunks come one period apart; half a period more is a missed tick,
                        # not publish jitter (a threshold of one period flickered WARN)


@dataclass(frozen=True)
class OutputState:
    """Attributes:
        level: OK, WARN or ERROR.
        message: one line for a monitor, naming the last skip reason when not OK.
        since_last: seconds since the last published chunk (or since `start`), None before.
    """

    level: str
    message: str
    since_last: float | None


class OutputWatchdog:
    """Tracks published chunks and skipped ticks; thread-safe.

    Args:
        period: seconds (> 0) between chunks (the node's chunk_period).
        error_periods: periods without a chunk before ERROR (> WARN_PERIODS).

    Raises:
        ValueError: period not > 0, error_periods not > 1.
    """

    def __init__(self, period: float, error_periods: float = 3.0) -> None:
        period = finite_seconds('period', period)
        if period <= 0.0:
            raise ValueError(f'period must be > 0 s, got {period!r}')
        if not (isinstance(error_periods, (int, float)) and error_periods > WARN_PERIODS):
            raise ValueError(f'error_periods must be a number > {WARN_PERIODS}, got '
                             f'{error_periods!r}')
        self.period = period
        self.error_periods = float(error_periods)
        self._lock = threading.Lock()
        self._since: float | None = None
        self._reason = ''
        self._published = 0
        self._clock_seen: float | None = None     # the last ROS time check_clock saw
        self._clock_since = 0.0                   # wall time it first read that value

    def start(self, now: float) -> None:
        """Begin watching at `now` (activation, or a time reset): the clock restarts."""
        with self._lock:
            self._since, self._reason = float(now), ''

    def stop(self) -> None:
        """Stop watching (deactivated): `check` reports that nothing is expected."""
        with self._lock:
            self._since = None
            self._clock_seen = None

    def published(self, now: float) -> None:
        """A chunk reached the output at `now`."""
        with self._lock:
            self._since, self._reason = float(now), ''
            self._published += 1

    def skipped(self, reason: str) -> None:
        """A tick published nothing, for `reason` (kept for the next messages)."""
        with self._lock:
            self._reason = reason

    def check(self, now: float) -> OutputState:
        """The output's state at `now`."""
        with self._lock:
            since, reason, published = self._since, self._reason, self._published
        if since is None:
            return OutputState(OK, 'not active: no output expected', None)
        gap = max(now - since, 0.0)
        what = 'no chunk published' if published == 0 else 'no chunk'
        why = f': {reason}' if reason else ''
        if gap > self.error_periods * self.period:
            return OutputState(ERROR, f'{what} for {gap:.1f} s, the robot gets no commands{why}',
                               gap)
        if gap > WARN_PERIODS * self.period:     # a tick missed, not a late publish
            return OutputState(WARN, f'{what} for {gap:.2f} s (> {WARN_PERIODS} x the period '
                                     f'{self.period:.3f} s: a tick missed){why}', gap)
        if published == 0:      # no chunk yet: "on schedule" would claim chunks that never came
            return OutputState(OK, f'active, no chunk yet (activated {gap:.1f} s ago)', gap)
        # on time or not is the 'schedule' status's: this one says the robot gets commands
        return OutputState(OK, f'chunks published, the last {gap:.2f} s ago', gap)

    def check_clock(self, now: float, wall: float) -> OutputState | None:
        """The output's state while the ROS clock stands still (sim time), else None.

        Args:
            now: the ROS time, s (0 before the first /clock message).
            wall: a wall clock that always runs (e.g. time.monotonic()), s.
        Returns:
            WARN / ERROR naming the clock while ROS time has not started (WARN at once) or
            has read the same value for more than one period of wall time; None while it
            advances (then `check(now)` gives the state).
        """
        with self._lock:
            if self._clock_seen is None or now != self._clock_seen:
                self._clock_seen, self._clock_since = float(now), float(wall)
            standstill = max(wall - self._clock_since, 0.0)
        if now > 0.0 and standstill <= self.period:
            return None
        if now > 0.0:
            what = (f'ROS time stopped at {now:.3f} s: no /clock message for {standstill:.1f} s '
                    '(use_sim_time is true), the robot gets no commands')
        else:
            what = (f'waiting for /clock for {standstill:.1f} s: use_sim_time is true and ROS '
                    'time has not started, the robot gets no commands')
        level = ERROR if standstill > self.error_periods * self.period else WARN
        return OutputState(level, what, standstill)
