"""Turning action chunks into one continuous executed trajectory.

Timing model (DESIGN.md, "Timing model"): each chunk's actions are meant to execute one
control period apart; action k of a chunk executes at `first_time + k * control_period`
(seconds, ROS time; the caller chooses `first_time`, e.g. from the observation stamp, so
that the measured inference latency is compensated). When a chunk is published at `now`,
actions whose time is already past are dropped from the front: the robot can no longer
execute them, and sending them would make the controller pause or jump back in time.
The published points therefore start at or after `now`, with increasing times (the loop
passes the publish time plus the controller's take-up margin as `now`, and cuts a chunk sent
late again at its send: `timing.loop`).

A new chunk replaces the previous one from its first kept time on. To avoid a step where
the two plans disagree:
  - smoothing='linear' cross-fades over the time overlap of the two chunks: at time t
    in the overlap [a, b] the published point is `(1 - w) * old(t) + w * new(t)` with
    `w = (t - a) / (b - a)` (old(t) is the previously stitched chunk, linearly
    interpolated per joint). So the first new point continues the old trajectory and
    the last overlapping point is the new plan's. A one-point overlap takes the new plan.
  - max_step limits the change per joint between consecutive published points, and
    between the last executed point of the previous chunk (its last point before the
    new chunk's first time) and the first new point; a rate limiter applied after the
    cross-fade, point by point.
Plain python + numpy; no rclpy. Not thread-safe: one worker owns a stitcher.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from .validation import finite_seconds

SMOOTHING = ('none', 'linear')


@dataclass(frozen=True)
class StitchedChunk:
    """A chunk ready to publish.

    Attributes:
        times: float64 (K,), seconds, ROS time; when each point executes; strictly
            increasing, all >= the `now` given to `stitch`.
        positions: float64 (K, A), robot units (rad for revolute joints); the points.
        dropped: actions dropped from the front of the input chunk because their time
            was < now.
        first_index: index in the input chunk of the first kept action (== dropped).
    """

    times: np.ndarray
    positions: np.ndarray
    dropped: int
    first_index: int

    def __len__(self) -> int:
        return int(self.times.shape[0])

    @property
    def time_from_start(self) -> np.ndarray:
        """float64 (K,), seconds; `times - times[0]` (JointTrajectoryPoint.time_from_start
        when the header stamp is `times[0]`). Empty when K == 0."""
        return self.times - self.times[0] if len(self) else self.times.copy()


class ChunkStitcher:
    """Drops past actions and joins successive chunks without pauses, jumps back or steps.

    Args:
        control_period: seconds (> 0, finite) between consecutive actions of a chunk.
        smoothing: 'none' (the new chunk replaces the old from its first kept time) or
            'linear' (cross-fade over the overlap, see the module docstring).
        max_step: None (no limit), a float > 0, or a float array (A,) of values > 0:
            the largest change per joint between consecutive published points, robot
            units (rad for revolute joints).

    Raises:
        ValueError: control_period not positive and finite, unknown smoothing, max_step
            not positive and finite or not a scalar / 1-D array.
    """

    def __init__(self, control_period: float, smoothing: str = 'none',
                 max_step: Union[None, float, np.ndarray] = None):
        control_period = finite_seconds('control_period', control_period)
        if control_period <= 0.0:
            raise ValueError(f'control_period must be > 0 seconds, got {control_period!r}')
        if smoothing not in SMOOTHING:
            raise ValueError(f'smoothing must be one of {SMOOTHING}, got {smoothing!r}')
        if max_step is not None:
            max_step = np.asarray(max_step, dtype=np.float64)
            if max_step.ndim > 1 or max_step.size == 0:
                raise ValueError(
                    f'max_step must be a float or a 1-D array (A,), got shape {max_step.shape}')
            if not (np.all(np.isfinite(max_step)) and np.all(max_step > 0.0)):
                raise ValueError(f'max_step must be finite and > 0, got {max_step!r}')
        self.control_period = control_period
        self.smoothing = smoothing
        self.max_step = max_step
        self.reset()

    def reset(self) -> None:
        """Forget the previous chunk and the last `now` (e.g. after a ROS time jump)."""
        self._previous: Optional[StitchedChunk] = None
        self._last_now: Optional[float] = None

    def commit(self, chunk: StitchedChunk) -> None:
        """Make `chunk`, the last `stitch` result as it is published (e.g. after
        `MotionLimiter` moved points, or with points due before a late publish dropped from
        its front), the previous chunk the next one is joined to.

        Raises:
            ValueError: `chunk`'s times are not the last stitched chunk's or a non-empty tail
                of them, or its joints differ.
        """
        previous = self._previous
        tail = None if previous is None else previous.times[len(previous.times)
                                                             - len(chunk.times):]
        if previous is None or len(chunk.times) == 0 \
                or len(chunk.times) > len(previous.times) \
                or not np.array_equal(tail, chunk.times) \
                or chunk.positions.shape[1:] != previous.positions.shape[1:]:
            raise ValueError('commit() takes the last stitched chunk (the same times, or a '
                             'tail of them, and joints), with its points changed')
        self._previous = chunk

    def withdraw(self, previous: Optional[StitchedChunk]) -> None:
        """The last stitched chunk was not sent: `previous` (what `previous` was before that
        `stitch`: the chunk the arm executes) is the reference of the next chunk again."""
        self._previous = previous

    @property
    def previous(self) -> Optional[StitchedChunk]:
        """The last non-empty stitched chunk, or None."""
        return self._previous

    def stitch(self, actions: np.ndarray, first_time: float, now: float) -> StitchedChunk:
        """Drop past actions, cross-fade with the previous chunk, limit the step size.

        Args:
            actions: float (H, A), H >= 1, A >= 1, finite, robot units; action k is meant
                to execute at `first_time + k * control_period`.
            first_time: seconds, ROS time, of action 0.
            now: seconds, ROS time, the publish time; actions with time < now are dropped.
        Returns:
            StitchedChunk; empty (K == 0, dropped == H) when every action is past, in
            which case the previous chunk stays the reference for the next call.
        Raises:
            ValueError: actions not a finite 2-D (H, A) array, A differing from the
                previous chunk or from max_step's length, first_time or now not finite,
                now earlier than the now of the previous call (call reset() after a
                clock jump).
        """
        actions = self._check_actions(actions)
        first_time = finite_seconds('first_time', first_time)
        now = finite_seconds('now', now)
        if self._last_now is not None and now < self._last_now:
            raise ValueError(f'now went backwards: {now!r} < previous now {self._last_now!r}; '
                             'call reset() after a clock jump')
        self._last_now = now

        horizon = actions.shape[0]
        all_times = first_time + np.arange(horizon, dtype=np.float64) * self.control_period
        dropped = int(np.searchsorted(all_times, now, side='left'))  # times < now
        times, positions = all_times[dropped:], actions[dropped:].copy()
        if times.size == 0:
            return StitchedChunk(times, positions, dropped, dropped)

        previous = self._previous
        if previous is not None and self.smoothing == 'linear':
            positions = self._cross_fade(previous, times, positions)
        if self.max_step is not None:
            positions = self._limit_steps(self._last_executed(previous, times[0]), positions)

        stitched = StitchedChunk(times, positions, dropped, dropped)
        self._previous = stitched
        return stitched

    def _check_actions(self, actions) -> np.ndarray:
        try:
            actions = np.array(actions, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError('actions must be a float array (H, A)') from None
        if actions.ndim != 2 or actions.shape[0] < 1 or actions.shape[1] < 1:
            raise ValueError(f'actions must have shape (H, A) with H, A >= 1, '
                             f'got shape {actions.shape}')
        if not np.all(np.isfinite(actions)):
            raise ValueError('actions must be finite (found nan or inf)')
        action_dim = actions.shape[1]
        if self._previous is not None and self._previous.positions.shape[1] != action_dim:
            raise ValueError(f'actions have A={action_dim} but the previous chunk had '
                             f'A={self._previous.positions.shape[1]}; call reset() first')
        if self.max_step is not None and self.max_step.ndim == 1 \
                and self.max_step.shape[0] != action_dim:
            raise ValueError(f'max_step has length {self.max_step.shape[0]} but actions '
                             f'have A={action_dim}')
        return actions

    @staticmethod
    def _cross_fade(previous: StitchedChunk, times: np.ndarray,
                    positions: np.ndarray) -> np.ndarray:
        start = max(times[0], previous.times[0])
        end = min(times[-1], previous.times[-1])
        overlap = (times >= start) & (times <= end)
        if end < start or not overlap.any():
            return positions
        t = times[overlap]
        old = np.stack([np.interp(t, previous.times, previous.positions[:, j])
                        for j in range(positions.shape[1])], axis=1)
        w = (t - start) / (end - start) if end > start else np.ones_like(t)
        positions = positions.copy()
        positions[overlap] = (1.0 - w)[:, None] * old + w[:, None] * positions[overlap]
        return positions

    @staticmethod
    def _last_executed(previous: Optional[StitchedChunk], first_time: float):
        # the previous chunk's last point before the new chunk takes over
        if previous is None:
            return None
        before = int(np.searchsorted(previous.times, first_time, side='left'))
        return previous.positions[before - 1] if before > 0 else None

    def _limit_steps(self, last: Optional[np.ndarray], positions: np.ndarray) -> np.ndarray:
        limited = positions.copy()
        for k in range(limited.shape[0]):
            reference = last if k == 0 else limited[k - 1]
            if reference is not None:
                limited[k] = np.clip(limited[k], reference - self.max_step,
                                     reference + self.max_step)
        return limited


def unpublishable_chunks(horizon: int, control_period: float, lead: float) -> str:
    """'' unless every action of every chunk is due before the chunk is sent, else why: a
    chunk holds `horizon` actions `control_period` s apart and is published about `lead` s
    after its observation, dropping the actions due by then; when horizon x control_period
    <= lead none is left and the node would skip every tick. s throughout."""
    if horizon <= 0 or horizon * control_period > lead:
        return ''
    return (f'no chunk can be published: its {horizon} actions x control_period '
            f'{control_period:g} s = {horizon * control_period:.2f} s are all in the past by '
            f'the time it is sent (the lead, ~{lead:.2f} s, is about 1.2 x the inference '
            f'time); make {horizon} x control_period >= chunk_period + the lead')


def chunk_gap(horizon: int, control_period: float, chunk_period: float, lead: float) -> str:
    """'' when a chunk's actions last until the next chunk arrives (or none is left at
    publish: `unpublishable_chunks`), else a warning: each chunk holds `horizon` actions
    `control_period` s apart, of which those due before its publish (about `lead` s of them)
    are dropped, and the next comes `chunk_period` s later; a shorter span leaves the arm
    still between chunks (stop and go). s throughout."""
    if horizon <= 0:
        return ''
    span = horizon * control_period - lead
    if span >= chunk_period or span <= 0.0:
        return ''
    return (f'each chunk moves the arm for ~{span:.2f} s ({horizon} actions x control_period '
            f'{control_period:g} s, less the ~{lead:.2f} s lead dropped at publish) but chunks '
            f'come every chunk_period {chunk_period:g} s: the arm stands still ~'
            f'{chunk_period - span:.2f} s between chunks (stop and go); make {horizon} x '
            'control_period >= chunk_period + the lead')
