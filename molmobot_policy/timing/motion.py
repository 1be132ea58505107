"""Commanded motion continuous with the measured joint state, inside velocity and position limits.

Safety model (DESIGN.md, "Safety model"): the first point after a start or a gap must not
command a jump from where the arm is. `ChunkStitcher` joins a chunk to the previous one;
`MotionLimiter` then anchors the published points to the MEASURED joint positions (the latest
/joint_states of the commanded joints) and rate-limits them:

    |p_0 - measured| <= min(v_max * max(t_0 - t_publish, 0), max_step)
    |p_k - p_(k-1)|  <= min(v_max * (t_k - t_(k-1)), max_step)         k >= 1

per joint (max_step: the optional largest change per point, as the stitcher's; applied here
too, so that the ramp toward the arm never takes larger steps), so a plan that starts far from
the arm is reached along a ramp at v_max instead of in one step, and a plan within reach passes unchanged. The first point's allowance is the time
the controller has to get there: a JointTrajectoryController moves from where the arm is when
the trajectory arrives (t_publish) to the first point at its time t_0; a first point due at
once must be where the arm is. (Counting from the measurement's stamp instead let an old
measurement or a long lead grant a step of up to 2 rad to be made in milliseconds.) The plan is clipped to the optional per-joint position limits BEFORE the rate
limit, so the limits hold for every point, except while an arm measured outside them is ramped
back in (never a step into the range).
A joint without a measured position (NaN: e.g. a gripper command that is no joint position)
is not anchored; its points are still rate-limited among themselves and clipped.

`measured` is where the arm is at the publish time. A chunk is prepared up to its lead (the
inference time and more) before it is published, and meanwhile the arm runs the chunk it is
executing; `anchor_at_publish` moves the latest measurement along that chunk from the
measurement's stamp to the publish time (exact while the arm tracks the published chunks;
anchoring to the measurement itself let the first point lag the arm by up to v_max x the
lead, a fresh-user trial measured 3.6 rad/s against a 1.5 rad/s limit). It does so only for
the joints that follow the chunk: a joint measured further than its tracking tolerance from
where the chunk had it at the measurement's stamp (its controller rejected the chunks, an
emergency stop holds it, it is blocked) stays at its measurement, since moving it along a
chunk it does not run put the first point up to v_max x the measurement's age beyond its
allowance from the real arm (fresh-user trial: 0.449 rad against 0.065). Either judgement,
when wrong, costs at most the motion over the measurement's age (a lagging arm judged stuck
gets a first point that far behind it), so the tolerance only decides which arm that bound
applies to.

Plain python + numpy; no rclpy; not thread-safe (the worker owns it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from .validation import finite_seconds

Limit = Union[None, float, Sequence[float], np.ndarray]


@dataclass(frozen=True)
class LimitedPoints:
    """Points after `MotionLimiter.limit`.

    Attributes:
        positions: float64 (K, A), robot units; the points to publish.
        velocity_limited: number of (point, joint) values moved by the velocity limit (or
            max_step).
        position_clipped: number of (point, joint) values moved by the position limits.
        start_offset: float64 (A,), |p_0 - measured| of the INPUT's first point per joint
            (nan where not measured): how far the plan began from the arm.
        outside_limits: indices of the joints MEASURED outside their position limits: their
            points are ramped back in at the velocity limit, outside the limits until then.
        not_following: indices of the joints anchored at their measurement because they did
            not follow the executing chunk (`Anchor.not_following`; set by the caller that
            anchored them).
    """

    positions: np.ndarray
    velocity_limited: int
    position_clipped: int
    start_offset: np.ndarray
    outside_limits: tuple[int, ...] = ()
    not_following: tuple[int, ...] = ()


# the default tracking tolerance of a joint: the distance its velocity limit covers in this time
TRACKING_WINDOW_S = 0.1


@dataclass(frozen=True)
class Anchor:
    """Where the arm is expected at the publish time (`anchor_at_publish`).

    Attributes:
        positions: float64 (A,), robot units; nan where not measured.
        not_following: indices of the joints measured further than their tracking tolerance
            from the executing chunk at the measurement's stamp: anchored at the measurement.
        tracking_error: float64 (A,), |measured - the executing chunk at the stamp|, robot
            units; nan where not measured or not judged (a stamp before the chunk's first
            point); None without an executing chunk.
    """

    positions: np.ndarray
    not_following: tuple[int, ...] = ()
    tracking_error: Optional[np.ndarray] = None


def anchor_at_publish(measured: np.ndarray, stamp: float, publish_time: float, executing,
                      tolerance: Limit = None) -> Anchor:
    """Where the arm is expected at `publish_time`: `measured` (float (A,), robot units, nan
    where not measured), taken at `stamp` (s, ROS time), plus the motion of the chunk it is
    executing between `stamp` and `publish_time`, for the joints that follow it.

    `executing`: the last published chunk (`times` (K,) s, `positions` (K, A)), or None (none:
    the arm holds). Its points are linearly interpolated and held before the first and after
    the last. A joint measured at or after the chunk's first point further than `tolerance`
    (robot units, one float or (A,); None: no check) from the chunk at `stamp` does not
    follow it and stays at its measurement. A measurement before the first point is not
    judged: until then the arm is on its way from where the chunk took it up, and controllers
    differ there (ros2_control's moves to the first point, ROS 1's and the demo's robot keep
    the previous chunk's points due before it).

    Returns:
        Anchor; its positions are `measured` unchanged without a chunk, with a non-finite
        stamp, publish_time <= stamp, or a chunk of other joints.
    """
    measured = np.asarray(measured, dtype=np.float64)
    if executing is None or len(executing.times) == 0 or not np.isfinite(stamp) \
            or not publish_time > stamp:
        return Anchor(measured)
    times, positions = executing.times, np.asarray(executing.positions, dtype=np.float64)
    if positions.shape[1] != measured.shape[0]:
        return Anchor(measured)

    def at(t: float) -> np.ndarray:      # the chunk at time t, per joint
        return np.array([np.interp(t, times, positions[:, j]) for j in range(positions.shape[1])])
    at_stamp = at(stamp)
    motion = at(publish_time) - at_stamp
    error = np.abs(measured - at_stamp) if stamp >= times[0] \
        else np.full(measured.shape, np.nan)
    following = np.ones(measured.shape, dtype=bool)
    if tolerance is not None:
        with np.errstate(invalid='ignore'):         # nan: not measured, or not judged
            following = ~(error > np.asarray(tolerance, dtype=np.float64))
    return Anchor(np.where(following, measured + motion, measured),
                  tuple(int(j) for j in np.flatnonzero(~following)), error)


def _per_joint(name: str, value: Limit) -> Optional[np.ndarray]:
    if value is None:
        return None
    array = np.asarray(value, dtype=np.float64)
    if array.ndim > 1 or array.size == 0:
        raise ValueError(f'{name} must be a float or a 1-D list (one value per commanded '
                         f'joint), got shape {array.shape}')
    if np.isnan(array).any():
        raise ValueError(f'{name} must not contain nan, got {array.tolist()}')
    return array


class MotionLimiter:
    """Anchors published points to the measured joint state; velocity and position limits.

    Args:
        max_velocity: per joint, robot units per second (rad/s for revolute joints): a float
            for every joint or a 1-D sequence (A,); each > 0; inf (or None for all) = no
            limit.
        position_min, position_max: None, or per joint limits (float or (A,)); -inf / inf
            for joints without a limit; min <= max.
        max_step: None, or the largest change per joint between consecutive points (and
            from the measured position to the first), robot units (float or (A,)); each > 0;
            inf for a joint without one.
        tracking_tolerance: None, or per joint the largest |measured - the executing chunk
            at the measurement's stamp| of a joint that follows the chunk (`anchor_at_publish`),
            robot units (float or (A,)); each > 0; inf: always judged following. None:
            max_velocity x TRACKING_WINDOW_S (inf where max_velocity is).

    Raises:
        ValueError: max_velocity, max_step or tracking_tolerance not > 0; limits of
            the wrong shape, nan, or min > max.
    """

    def __init__(self, max_velocity: Limit = np.inf, position_min: Limit = None,
                 position_max: Limit = None, max_step: Limit = None,
                 tracking_tolerance: Limit = None) -> None:
        velocity = _per_joint('max_velocity', np.inf if max_velocity is None else max_velocity)
        if not np.all(velocity > 0.0):
            raise ValueError(f'max_velocity must be > 0 (inf: no limit), got {velocity.tolist()}')
        step = _per_joint('max_step', max_step)
        if step is not None and not np.all(step > 0.0):
            raise ValueError(f'max_step must be > 0 (inf: no limit), got {step.tolist()}')
        tolerance = _per_joint('tracking_tolerance', tracking_tolerance)
        if tolerance is not None and not np.all(tolerance > 0.0):
            raise ValueError(f'tracking_tolerance must be > 0 (inf: no check), got '
                             f'{tolerance.tolist()}')
        self.tracking_tolerance = velocity * TRACKING_WINDOW_S if tolerance is None \
            else tolerance
        self.max_step = step
        lower = _per_joint('position_min', position_min)
        upper = _per_joint('position_max', position_max)
        if lower is not None and upper is not None and lower.shape == upper.shape \
                and np.any(lower > upper):
            raise ValueError(f'position_min must be <= position_max per joint, got '
                             f'{lower.tolist()} > {upper.tolist()}')
        self.max_velocity = velocity
        self.position_min = lower
        self.position_max = upper

    def _check(self, name: str, array: Optional[np.ndarray], joints: int) -> None:
        if array is not None and array.ndim == 1 and array.shape[0] != joints:
            raise ValueError(f'{name} has {array.shape[0]} values but the chunk commands '
                             f'{joints} joints; give one value per commanded joint')

    def anchor(self, measured: np.ndarray, stamp: float, publish_time: float,
               executing) -> Anchor:
        """`anchor_at_publish` with this limiter's tracking tolerance.

        Raises:
            ValueError: tracking_tolerance has not one value per joint of `measured`.
        """
        measured = np.asarray(measured, dtype=np.float64)
        self._check('tracking_tolerance', self.tracking_tolerance, measured.shape[0])
        return anchor_at_publish(measured, stamp, publish_time, executing,
                                 self.tracking_tolerance)

    def limit(self, times: np.ndarray, positions: np.ndarray, measured: np.ndarray,
              publish_time: float) -> LimitedPoints:
        """Limit the points of one chunk.

        Args:
            times: float (K,), seconds (ROS time), strictly increasing: when each point runs.
            positions: float (K, A), robot units: the stitched plan.
            measured: float (A,), the latest measured position of each commanded joint;
                nan for a joint that has none (not anchored).
            publish_time: seconds (ROS time), when the chunk is sent (the controller starts
                from the arm's position then).

        Returns:
            LimitedPoints (K == 0 passes through).

        Raises:
            ValueError: shapes disagree (with each other or with the limits), non-finite
                times or positions, publish_time not finite.
        """
        times = np.asarray(times, dtype=np.float64)
        positions = np.array(positions, dtype=np.float64)
        measured = np.asarray(measured, dtype=np.float64)
        publish_time = finite_seconds('publish_time', publish_time)
        if positions.ndim != 2 or times.shape != (positions.shape[0],):
            raise ValueError(f'times (K,) and positions (K, A) expected, got {times.shape} and '
                             f'{positions.shape}')
        joints = positions.shape[1]
        if measured.shape != (joints,):
            raise ValueError(f'measured must have one value per commanded joint ({joints}), '
                             f'got shape {measured.shape}')
        for name in ('max_velocity', 'position_min', 'position_max', 'max_step',
                     'tracking_tolerance'):
            self._check(name, getattr(self, name), joints)
        if not (np.all(np.isfinite(times)) and np.all(np.isfinite(positions))):
            raise ValueError('times and positions must be finite')
        offset = np.abs(positions[0] - measured) if len(times) else np.full(joints, np.nan)
        if len(times) == 0:
            return LimitedPoints(positions, 0, 0, offset)

        planned = positions.copy()
        if self.position_min is not None:
            positions = np.maximum(positions, self.position_min)
        if self.position_max is not None:
            positions = np.minimum(positions, self.position_max)
        position_clipped = int(np.count_nonzero(positions != planned))

        clipped = positions.copy()
        first_dt = max(times[0] - publish_time, 0.0)
        unlimited = np.isinf(self.max_velocity)
        reference = measured
        for k in range(len(times)):
            dt = first_dt if k == 0 else times[k] - times[k - 1]
            with np.errstate(invalid='ignore'):                  # inf * 0 is nan ...
                step = np.where(unlimited, np.inf, self.max_velocity * dt)  # ... made inf
            if self.max_step is not None:
                step = np.minimum(step, self.max_step)
            anchored = np.isfinite(reference)
            lo = np.where(anchored, reference - step, -np.inf)
            hi = np.where(anchored, reference + step, np.inf)
            positions[k] = np.clip(positions[k], lo, hi)
            reference = positions[k]
        velocity_limited = int(np.count_nonzero(positions != clipped))
        outside = np.zeros(joints, dtype=bool)
        with np.errstate(invalid='ignore'):                      # nan: not measured
            if self.position_min is not None:
                outside |= measured < self.position_min
            if self.position_max is not None:
                outside |= measured > self.position_max
        return LimitedPoints(positions, velocity_limited, position_clipped, offset,
                             tuple(int(j) for j in np.flatnonzero(outside)))
