"""The robot contract: which camera is which image, which joints make the state, which action
dimension drives which joint, and how actions go back to robot units (openpi-style: data
plus small transforms, apart from the model and the transport).

Conventions:
- `camera_names[k]` becomes "Image k+1" in the prompt.
- The state is the positions of `joint_names`, in that order, matched by NAME (never by
  index). `Observation.state` holds these n_joints raw values; the model receives them
  normalized and zero-padded to its state width in normalized space (zeros are also what
  the upstream action expert pads with).
- Action dimension i drives `action_joint_names[i]`; dimensions beyond that list (up to
  the model's action_dim) are computed but not sent to any joint.
- An optional gripper threshold turns one action dimension into an open/closed command.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.preprocess.normalize import QuantileNormalizer, normalizers_from_config


def _names(values: Sequence[str], what: str) -> tuple[str, ...]:
    if isinstance(values, str):
        raise TypeError(f'{what} must be a list of names, got the string {values!r}')
    names = tuple(values)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f'{what} must be non-empty strings, got {name!r} in {list(names)}')
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f'{what} must be unique, {duplicates} appear more than once')
    return names


@dataclass(frozen=True)
class GripperThreshold:
    """Binarize one action dimension (robot units): >= threshold -> closed, else open.

    Attributes:
        dim: action dimension index (e.g. 7 for DROID's gripper).
        threshold: robot units (e.g. 128 on a 0..255 gripper scale).
        open_value, closed_value: the commands written instead (e.g. 0.0 and 1.0).
    """

    dim: int
    threshold: float
    open_value: float = 0.0
    closed_value: float = 1.0

    def apply(self, actions: np.ndarray) -> np.ndarray:
        """float (H, A) robot units -> float32 copy with column `dim` binarized."""
        out = np.array(actions, dtype=np.float32, copy=True)
        column = out[:, self.dim]
        out[:, self.dim] = np.where(column >= self.threshold, self.closed_value, self.open_value)
        return out


@dataclass(frozen=True)
class RobotContract:
    """How one robot maps onto the model's inputs and outputs. Build with `from_config`.

    Attributes:
        camera_names: ordered; camera k -> image k (prompt "Image k+1").
        joint_names: ordered joints whose positions form the state (n_joints <= state_dim).
        action_joint_names: joint driven by action dimension i, i < len <= action_dim.
        state_dim, action_dim: the model's widths.
        state_normalizer: quantile stats over the state_dim state dimensions.
        action_normalizer: quantile stats over the action_dim action dimensions.
        gripper: optional threshold applied after unnormalization.
    """

    camera_names: tuple[str, ...]
    joint_names: tuple[str, ...]
    action_joint_names: tuple[str, ...]
    state_dim: int
    action_dim: int
    state_normalizer: QuantileNormalizer
    action_normalizer: QuantileNormalizer
    gripper: GripperThreshold | None = None

    @classmethod
    def from_config(cls, cfg: MolmoBotConfig, camera_names: Sequence[str] | None = None,
                    joint_names: Sequence[str] | None = None,
                    action_joint_names: Sequence[str] | None = None,
                    gripper: GripperThreshold | None = None) -> RobotContract:
        """Check the robot's names against the model config and build the contract.

        Args:
            cfg: model config (max_images, state_dim, action_dim, norm_stats).
            camera_names: default 'camera_0'.. for cfg.max_images cameras.
            joint_names: default 'joint_0'.. for cfg.state_dim joints.
            action_joint_names: default the first min(n_joints, action_dim) joint names.
            gripper: optional; its dim must be < cfg.action_dim.
        Raises:
            TypeError, ValueError: empty/duplicate names; fewer than 2 or more than
                cfg.max_images cameras (never dropped silently); more joints than
                cfg.state_dim; more action joints than cfg.action_dim; gripper dim out of
                range; missing or mis-sized norm_stats (see `normalizers_from_config`).
        """
        if camera_names is None:
            camera_names = [f'camera_{k}' for k in range(cfg.max_images)]
        if joint_names is None:
            joint_names = [f'joint_{i}' for i in range(cfg.state_dim)]
        cameras = _names(camera_names, 'camera_names')
        joints = _names(joint_names, 'joint_names')
        if action_joint_names is None:
            action_joint_names = joints[:cfg.action_dim]
        action_joints = _names(action_joint_names, 'action_joint_names')
        if not 2 <= len(cameras) <= cfg.max_images:
            raise ValueError(f'camera_names has {len(cameras)} cameras {list(cameras)}, the model '
                             f'takes 2..{cfg.max_images} (max_images); extra cameras are never '
                             'dropped silently, and a single image uses an upstream layout that '
                             'is not reproduced')
        if not 1 <= len(joints) <= cfg.state_dim:
            raise ValueError(f'joint_names has {len(joints)} joints, the model state width is '
                             f'{cfg.state_dim} (state_dim); expected 1..{cfg.state_dim}')
        if len(action_joints) > cfg.action_dim:
            raise ValueError(f'action_joint_names has {len(action_joints)} joints, the model '
                             f'outputs only {cfg.action_dim} action dimensions (action_dim)')
        if gripper is not None and not 0 <= gripper.dim < cfg.action_dim:
            raise ValueError(f'gripper dim {gripper.dim} is outside the action dimensions '
                             f'0..{cfg.action_dim - 1}')
        state_normalizer, action_normalizer = normalizers_from_config(cfg)
        return cls(camera_names=cameras, joint_names=joints, action_joint_names=action_joints,
                   state_dim=cfg.state_dim, action_dim=cfg.action_dim,
                   state_normalizer=state_normalizer, action_normalizer=action_normalizer,
                   gripper=gripper)

    # ------------------------------------------------------------------ inputs
    def order_images(self, images_by_camera: Mapping[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        """Frames keyed by camera name -> tuple in image order. Extra keys are ignored.

        Raises:
            KeyError: a configured camera is missing (the message names all missing ones).
        """
        missing = [name for name in self.camera_names if name not in images_by_camera]
        if missing:
            raise KeyError(f'no image for camera(s) {missing}; expected {list(self.camera_names)}')
        return tuple(images_by_camera[name] for name in self.camera_names)

    def state_from_joint_state(self, names: Sequence[str], positions: Sequence[float]
                               ) -> np.ndarray:
        """A JointState's (name, position) lists -> the state vector, matched by name.

        Args:
            names: joint names as in `sensor_msgs/JointState.name` (any order, may hold
                more joints than the contract uses).
            positions: same length as names; rad (or m) as the robot reports them.
        Returns:
            float32 (n_joints,) raw robot units, in `joint_names` order (`Observation.state`).
        Raises:
            ValueError: names and positions differ in length; a configured joint is
                missing (the message names all missing ones); a used position is not
                finite.
        """
        names = list(names)
        positions = np.asarray(positions, dtype=np.float64).reshape(-1)
        if len(names) != positions.size:
            raise ValueError(f'joint state has {len(names)} names but {positions.size} positions')
        index = {name: i for i, name in enumerate(names)}
        missing = [name for name in self.joint_names if name not in index]
        if missing:
            raise ValueError(f'joint state lacks joint(s) {missing}; it has {names}')
        state = positions[[index[name] for name in self.joint_names]].astype(np.float32)
        if not np.all(np.isfinite(state)):
            bad = [n for n, v in zip(self.joint_names, state) if not np.isfinite(v)]
            raise ValueError(f'joint state positions are not finite for {bad}')
        return state

    def normalize_state(self, state: np.ndarray | Sequence[float]) -> np.ndarray:
        """Raw state (n_joints,) -> float32 (state_dim,) normalized, zero-padded.

        Raises:
            ValueError: not n_joints values, or non-finite values.
        """
        state = np.asarray(state, dtype=np.float32)
        n = len(self.joint_names)
        if state.shape != (n,):
            raise ValueError(f'state must have shape ({n},) for joints {list(self.joint_names)}, '
                             f'got {state.shape}')
        if not np.all(np.isfinite(state)):
            raise ValueError(f'state must be finite, got {state.tolist()}')
        padded = np.zeros(self.state_dim, dtype=np.float32)
        padded[:n] = state
        normalized = self.state_normalizer.normalize(padded)
        normalized[n:] = 0.0
        return normalized

    # ------------------------------------------------------------------ outputs
    def postprocess(self, actions_normalized: np.ndarray) -> np.ndarray:
        """Model output -> robot units: quantile unnormalize, then the gripper threshold.

        Args:
            actions_normalized: float (H, action_dim), quantile space.
        Returns:
            float32 (H, action_dim), robot units.
        Raises:
            ValueError: not (H, action_dim).
        """
        actions_normalized = np.asarray(actions_normalized, dtype=np.float32)
        if actions_normalized.ndim != 2 or actions_normalized.shape[1] != self.action_dim:
            raise ValueError(f'actions must have shape (horizon, {self.action_dim}), got '
                             f'{actions_normalized.shape}')
        actions = self.action_normalizer.unnormalize(actions_normalized).astype(np.float32)
        if self.gripper is not None:
            actions = self.gripper.apply(actions)
        return actions

    def joint_positions(self, actions: np.ndarray) -> np.ndarray:
        """(H, action_dim) robot units -> (H, len(action_joint_names)) for those joints."""
        actions = np.asarray(actions)
        if actions.ndim != 2 or actions.shape[1] != self.action_dim:
            raise ValueError(f'actions must have shape (horizon, {self.action_dim}), got '
                             f'{actions.shape}')
        return actions[:, :len(self.action_joint_names)]
