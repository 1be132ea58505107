"""The robot contract: which camera is which image, which joints make the state, which action
dimension drives which joint, and the gripper command (openpi-style: data plus small
transforms, apart from the model and the transport). The node builds a `RobotContract` from its
parameters; the engine binds it to its model (`RobotTransforms`) and runs it on every query:
    observation -> [camera count, state pad + normalize] -> model
                -> [unnormalize, gripper threshold] -> ActionChunk -> [action -> joint slicing]

Conventions:
- Camera k of an observation (`Observation.images[k]`, in `camera_names` order: the
  synchronizer assembles them so) becomes "Image k+1" in the prompt.
- The state is the positions of `joint_names`, in that order, matched by NAME (the
  synchronizer does the matching). The model receives them normalized and zero-padded to its
  state width in normalized space (zeros are also what the upstream action expert pads with).
- Action dimension i drives `action_joint_names[i]`; dimensions beyond that list (up to the
  model's action_dim) are computed but not sent to any joint.
- An optional gripper threshold turns one action dimension into an open/closed command.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.preprocess.normalize import normalizers_from_config


def repeated(names: Sequence[str]) -> list[str]:
    """The names that appear more than once in `names`, sorted (empty when all are unique)."""
    names = list(names)
    return sorted({n for n in names if names.count(n) > 1})


def _names(values: Sequence[str], what: str) -> tuple[str, ...]:
    if isinstance(values, str):
        raise TypeError(f'{what} must be a list of names, got the string {values!r}')
    names = tuple(values)
    if not names:
        raise ValueError(f'{what} is empty; expected at least one name')
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f'{what} must be non-empty strings, got {name!r} in {list(names)}')
    duplicates = repeated(names)
    if duplicates:
        raise ValueError(f'{what} must be unique, {duplicates} appear more than once')
    return names


# what a gripper joint's name holds (RobotContract.notes); 'knuckle': Robotiq's 2F grippers
GRIPPER_WORDS = ('grip', 'finger', 'hand', 'jaw', 'claw', 'effector', 'knuckle')


@dataclass(frozen=True)
class RobotContract:
    """How one robot maps onto a model's inputs and outputs (plain data, checked against a
    model by `check`).

    Attributes:
        camera_names: ordered (e.g. the node's camera topics); camera k -> image k.
        joint_names: ordered joints whose positions form `Observation.state`.
        action_joint_names: joint driven by action dimension i; default: joint_names.
        gripper_index: action dimension binarized as the gripper command, -1 = off.
        gripper_threshold: robot units; an action >= threshold -> gripper_closed, else
            gripper_open (e.g. 128 on a 0..255 gripper scale, open 0, closed 1).
    Raises:
        TypeError, ValueError: a list of names that is a string, empty, holds an empty or
            non-string name, or repeats a name.
    """

    camera_names: tuple[str, ...]
    joint_names: tuple[str, ...]
    action_joint_names: tuple[str, ...] | None = None
    gripper_index: int = -1
    gripper_threshold: float = 0.0
    gripper_open: float = 0.0
    gripper_closed: float = 1.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__   # frozen: normalize the fields once, here
        set_(self, 'camera_names', _names(self.camera_names, 'camera_names'))
        set_(self, 'joint_names', _names(self.joint_names, 'joint_names'))
        set_(self, 'action_joint_names', _names(
            self.joint_names if self.action_joint_names is None else self.action_joint_names,
            'action_joint_names'))

    @classmethod
    def numbered(cls, num_cameras: int, num_joints: int, **gripper) -> RobotContract:
        """Cameras 'camera_0'.. and joints 'joint_0'.. (each joint driven by its action
        dimension): the engine's default (the model's max_images and state_dim), and for
        tests and notebooks. gripper: the gripper_* fields."""
        return cls(camera_names=tuple(f'camera_{k}' for k in range(num_cameras)),
                   joint_names=tuple(f'joint_{k}' for k in range(num_joints)), **gripper)

    def check(self, model: MolmoBotConfig) -> None:
        """The contract against the model it drives.

        Raises:
            ValueError naming the field: fewer than 2 or more than max_images cameras
                (upstream would silently drop the extra ones; a single image uses an upstream
                layout that is not reproduced), more joint_names than state_dim, more
                action_joint_names than action_dim, a gripper_index outside -1..action_dim-1.
        """
        n = len(self.camera_names)
        if not 2 <= n <= model.max_images:
            raise ValueError(f'{n} camera{"s" if n != 1 else ""} {list(self.camera_names)}: the '
                             f'model takes 2 to max_images={model.max_images} images; list 2 to '
                             f'{model.max_images} cameras (extra cameras are never dropped '
                             'silently; a single image uses an upstream layout that is not '
                             'reproduced)')
        if len(self.joint_names) > model.state_dim:
            raise ValueError(f'joint_names has {len(self.joint_names)} joints but the model '
                             f'state has state_dim={model.state_dim}')
        if len(self.action_joint_names) > model.action_dim:
            raise ValueError(f'action_joint_names has {len(self.action_joint_names)} joints but '
                             f'the model acts in action_dim={model.action_dim}')
        if not -1 <= self.gripper_index < model.action_dim:
            raise ValueError(f'gripper_index={self.gripper_index} is not an action dimension of '
                             f'the model (0..{model.action_dim - 1}, or -1 for off)')

    def notes(self, model, trained: bool = False) -> list[tuple[str, str]]:
        """What this valid contract (`check` passed) does that a user may not mean, as
        (level, line) pairs for the configure log, level 'INFO' or 'WARN': state dimensions
        fed as zeros (fewer joint_names than state_dim: upstream pads so too), action
        dimensions not published (fewer action_joint_names than action_dim), which joint
        `gripper_index` drives with its commands and the motion limits it is exempt from, and
        a WARN where that joint's name does not look like a gripper (GRIPPER_WORDS): a
        one-digit slip in gripper_index would turn an arm joint into an open / closed
        command. model: the `MolmoBotConfig` it was checked against; trained: it serves a
        checkpoint (then the padding and the unpublished dimensions are WARN: a joint, e.g. the
        gripper, is likely missing from the lists; with random weights they are INFO)."""
        notes = []
        level, missing = ('WARN', ': is a joint (e.g. the gripper) missing?') if trained \
            else ('INFO', '')
        joints, actions = len(self.joint_names), len(self.action_joint_names)
        if joints < model.state_dim:
            notes.append((level, f'joint_names has {joints} joints, the model state '
                                 f'state_dim={model.state_dim}: state dimensions {joints}..'
                                 f'{model.state_dim - 1} are fed as 0 (normalized){missing}'))
        if actions < model.action_dim:
            notes.append((level, f'action_joint_names has {actions} joints, the model acts in '
                                 f'action_dim={model.action_dim}: action dimensions '
                                 f'{actions}..{model.action_dim - 1} are not published{missing}'))
        g = self.gripper_index
        if 0 <= g < actions:
            name = self.action_joint_names[g]
            notes.append(('INFO', f'gripper_index {g}: action joint {name!r} is commanded as a '
                                  f'gripper, {self.gripper_open} (open) or '
                                  f'{self.gripper_closed} (closed: action >= '
                                  f'{self.gripper_threshold}), exempt from max_joint_velocity '
                                  'and max_step'))
            if not any(word in name.lower() for word in GRIPPER_WORDS):
                notes.append(('WARN', f'gripper_index {g} points at {name!r}, whose name does '
                                      f'not look like a gripper\'s ({", ".join(GRIPPER_WORDS)}):'
                                      ' if it is an arm joint, its commands jump between the '
                                      'open and closed values with no velocity limit. Check '
                                      'gripper_index (0-based; -1: off)'))
        elif g >= actions:
            notes.append(('WARN', f'gripper_index {g} is an action dimension no action joint '
                                  f'receives (action_joint_names has {actions}): no gripper '
                                  'command is published'))
        return notes

    def check_camera_count(self, n_images: int) -> None:
        """ValueError unless an observation carries one image per camera."""
        if n_images != len(self.camera_names):
            raise ValueError(f'observation has {n_images} images, the robot contract has '
                             f'{len(self.camera_names)} cameras {list(self.camera_names)}')

    def threshold_gripper(self, actions: np.ndarray) -> np.ndarray:
        """float32 (H, action_dim) robot units -> the same, column gripper_index binarized
        (>= gripper_threshold -> gripper_closed, else gripper_open); unchanged when off."""
        if self.gripper_index < 0:
            return actions
        out = np.array(actions, dtype=np.float32, copy=True)
        column = out[:, self.gripper_index]
        out[:, self.gripper_index] = np.where(column >= self.gripper_threshold,
                                              self.gripper_closed, self.gripper_open)
        return out

    def joint_positions(self, actions: np.ndarray) -> np.ndarray:
        """(H, action_dim) robot units -> (H, len(action_joint_names)): the first dimensions,
        one per action joint, in action_joint_names order.

        Raises:
            ValueError: not 2-D, or fewer action dimensions than action joints.
        """
        actions = np.asarray(actions)
        n = len(self.action_joint_names)
        if actions.ndim != 2 or actions.shape[1] < n:
            raise ValueError(f'actions must have shape (horizon, >= {n}) for action joints '
                             f'{list(self.action_joint_names)}, got {actions.shape}')
        return actions[:, :n]


class RobotTransforms:
    """A `RobotContract` bound to one model: the serving path's state transform (in) and
    action transform (out), with the model's quantile statistics (`normalizers_from_config`).

    Args:
        contract: the robot's contract.
        model: the model config (max_images, state_dim, action_dim, norm_stats).
    Raises:
        ValueError: `contract.check(model)`; missing or mis-sized norm_stats.
    """

    def __init__(self, contract: RobotContract, model: MolmoBotConfig) -> None:
        contract.check(model)
        self.contract = contract
        self.state_dim, self.action_dim = model.state_dim, model.action_dim
        self.state_normalizer, self.action_normalizer = normalizers_from_config(model)

    def normalize_state(self, state: np.ndarray | Sequence[float]) -> np.ndarray:
        """Raw state (n_joints,), robot units, joint_names order -> float32 (state_dim,):
        quantile-normalized, zero-padded in normalized space.

        Raises:
            ValueError: not n_joints values, or non-finite values.
        """
        state = np.asarray(state, dtype=np.float32)
        joints = self.contract.joint_names
        n = len(joints)
        if state.shape != (n,):
            raise ValueError(f'state must have shape ({n},) for joints {list(joints)}, got '
                             f'{state.shape}')
        if not np.all(np.isfinite(state)):
            raise ValueError(f'state has non-finite values {state.tolist()} (joints '
                             f'{list(joints)})')
        padded = np.zeros(self.state_dim, dtype=np.float32)
        padded[:n] = state
        normalized = self.state_normalizer.normalize(padded)
        normalized[n:] = 0.0
        return normalized

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
        return self.contract.threshold_gripper(actions)
