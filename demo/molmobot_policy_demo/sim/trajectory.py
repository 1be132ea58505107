"""Joint trajectories as the simulated robot follows them (pure numpy, no rclpy).

Semantics follow ros2_control's JointTrajectoryController for `trajectory_msgs/JointTrajectory`:
- point k is due at `header.stamp + points[k].time_from_start`; a zero header stamp means
  "start now" (the time the message is received);
- between points, positions are interpolated linearly in time; before the first point the
  robot moves linearly from where it was when the trajectory arrived; after the last point
  it holds the last positions;
- a newer trajectory replaces what is left of the older one from the newer one's first
  point time on (older points due before that are kept).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Trajectory:
    """A piecewise-linear joint trajectory in absolute time.

    Attributes:
        joint_names: names of the J joints the columns of `positions` belong to.
        times: float64 (K,), seconds (ROS time), strictly increasing, K >= 1.
        positions: float64 (K, J), rad (joint units).
    """

    joint_names: tuple[str, ...]
    times: np.ndarray
    positions: np.ndarray

    @property
    def end_time(self) -> float:
        """Seconds (ROS time) of the last point; from then on the trajectory holds still."""
        return float(self.times[-1])

    def sample(self, t: float) -> np.ndarray:
        """Positions at time `t` (s): float64 (J,), linear between points, clamped at both ends."""
        k = int(np.searchsorted(self.times, t, side='right'))
        if k == 0:
            return self.positions[0].copy()
        if k == len(self.times):
            return self.positions[-1].copy()
        t0, t1 = self.times[k - 1], self.times[k]
        alpha = (t - t0) / (t1 - t0)
        return (1.0 - alpha) * self.positions[k - 1] + alpha * self.positions[k]


def from_message_values(joint_names: Sequence[str], header_stamp: float,
                        times_from_start: Sequence[float], positions: Sequence[Sequence[float]],
                        now: float) -> Trajectory:
    """Build a `Trajectory` from the values of a `trajectory_msgs/JointTrajectory`.

    Args:
        joint_names: J unique joint names.
        header_stamp: seconds (ROS time) of `header.stamp`; 0.0 means "now".
        times_from_start: K values of `points[k].time_from_start`, seconds, >= 0, strictly
            increasing.
        positions: K rows of J positions (`points[k].positions`), rad.
        now: seconds (ROS time) when the message was received.

    Returns:
        Trajectory with times = (now if header_stamp == 0 else header_stamp) + times_from_start.

    Raises:
        ValueError: no joint names, duplicate names, no points, a row whose length is not J,
            non-finite values, negative or not strictly increasing times_from_start.
    """
    names = tuple(joint_names)
    if not names:
        raise ValueError('joint trajectory: joint_names is empty')
    if len(set(names)) != len(names):
        raise ValueError(f'joint trajectory: duplicate joint names in {list(names)}')
    rows = [np.asarray(row, dtype=np.float64).reshape(-1) for row in positions]
    if not rows:
        raise ValueError('joint trajectory: no points')
    bad = [k for k, row in enumerate(rows) if row.shape[0] != len(names)]
    if bad:
        raise ValueError(f'joint trajectory: point {bad[0]} has {rows[bad[0]].shape[0]} '
                         f'positions, expected one per joint name ({len(names)})')
    points = np.stack(rows)
    offsets = np.asarray(times_from_start, dtype=np.float64).reshape(-1)
    if offsets.shape[0] != points.shape[0]:
        raise ValueError(f'joint trajectory: {offsets.shape[0]} times_from_start for '
                         f'{points.shape[0]} points')
    if not (np.all(np.isfinite(points)) and np.all(np.isfinite(offsets))
            and np.isfinite(header_stamp) and np.isfinite(now)):
        raise ValueError('joint trajectory: positions, stamps and times must be finite')
    if np.any(offsets < 0.0) or np.any(np.diff(offsets) <= 0.0):
        raise ValueError(f'joint trajectory: time_from_start must be >= 0 and strictly '
                         f'increasing, got {offsets.tolist()}')
    start = now if header_stamp == 0.0 else float(header_stamp)
    return Trajectory(names, start + offsets, points)


def replace(old: Trajectory | None, new: Trajectory, now: float,
            current_positions: Sequence[float]) -> Trajectory:
    """The trajectory to follow after `new` arrives at time `now` while `old` is active.

    When `new` starts in the future, the result starts with a point at `now` (the position
    `old` commands at `now` if it has the same joints, else `current_positions`), keeps the
    points of `old` due strictly between `now` and `new`'s first point, and then follows
    `new`; everything of `old` from `new.times[0]` on is dropped. When `new` has already
    started (`now >= new.times[0]`) it is returned unchanged and sampled mid-way.

    Args:
        old: the trajectory being followed, or None.
        new: the trajectory just received.
        now: seconds, ROS time.
        current_positions: (J,) rad, the robot's positions of `new.joint_names`.

    Returns:
        The merged Trajectory (joints of `new`).

    Raises:
        ValueError: current_positions does not have one value per joint of `new`.
    """
    current = np.asarray(current_positions, dtype=np.float64).reshape(-1)
    if current.shape[0] != len(new.joint_names):
        raise ValueError(f'replace: current_positions has {current.shape[0]} values, '
                         f'expected {len(new.joint_names)} (one per joint of the new trajectory)')
    start = float(new.times[0])
    if now >= start:
        return new
    same_joints = old is not None and old.joint_names == new.joint_names
    anchor = old.sample(now) if same_joints else current
    times, positions = [np.array([now])], [anchor[None, :]]
    if same_joints:
        keep = (old.times > now) & (old.times < start)
        times.append(old.times[keep])
        positions.append(old.positions[keep])
    times.append(new.times)
    positions.append(new.positions)
    return Trajectory(new.joint_names, np.concatenate(times), np.concatenate(positions))
