"""The values that flow between the layers (DESIGN.md: messages -> frames -> Observation ->
engine -> ActionChunk -> messages). Plain numpy, no torch, no rclpy."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Observation:
    """One synchronized robot observation, the single input of `PolicyEngine.predict`.

    Attributes:
        images: one uint8 RGB array of shape (H, W, 3) per camera of the robot contract
            (`preprocess.transforms.RobotContract.camera_names`), in that order (camera k
            becomes "Image k+1"). Cameras may differ in size.
        state: float32 array (n_joints,), raw robot units (rad for revolute joints), the
            positions of the contract's joint_names in that order (n_joints <= the model's
            state_dim: the engine zero-pads the normalized state to state_dim).
        instruction: the task text, e.g. "pick up the red cube".
        stamp: seconds, ROS time; the oldest sensor header stamp that went into this
            observation (the age of the observation is measured from it).
        image_stamps: seconds, ROS time; header stamp of each image, same order as images.
        state_stamp: seconds, ROS time; header stamp of the joint state.
        seq: monotonically increasing number given by the synchronizer (0 when unused).
    """

    images: tuple[np.ndarray, ...]
    state: np.ndarray
    instruction: str
    stamp: float = 0.0
    image_stamps: tuple[float, ...] = ()
    state_stamp: float = 0.0
    seq: int = 0


@dataclass(frozen=True)
class ActionChunk:
    """The engine's answer to one observation.

    Attributes:
        actions: float32 (horizon, action_dim), robot units (unnormalized).
        actions_normalized: float32 (horizon, action_dim), the model's output before
            unnormalization (quantile space, about [-1, 1]).
        observation_stamp: seconds, ROS time; `Observation.stamp` of the input.
        observation_seq: `Observation.seq` of the input.
        inference_ms: wall time of `predict`, milliseconds, preprocessing included.
        timings_ms: optional breakdown (e.g. {"preprocess": .., "model": ..}), milliseconds.
    """

    actions: np.ndarray
    actions_normalized: np.ndarray
    observation_stamp: float = 0.0
    observation_seq: int = 0
    inference_ms: float = 0.0
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def horizon(self) -> int:
        return int(self.actions.shape[0])

    @property
    def action_dim(self) -> int:
        return int(self.actions.shape[1])
