"""A MuJoCo table-top scene with the Kinova Jaco arm and eight cameras (no rclpy).

The arm (6 joints) and 3-finger hand are the models dm_control ships
(`dm_control.entities.manipulators.kinova`, meshes included). We put them on a table with a
few coloured cubes, add 7 fixed cameras around the table and 1 camera on the hand, and render
all 8 headless (set `MUJOCO_GL=egl` before importing; Mesa renders on the CPU).

The arm follows position targets kinematically: each physics step moves every joint towards
its target by at most `max_velocity * dt` (rad), clamped to the joint's range, and writes it
into `qpos`; the cubes are simulated by MuJoCo (gravity, contacts, pushed by the arm). A random
policy therefore cannot make the arm unstable, only slow to follow.

    scene = JacoScene(width=128, height=96)
    frames = scene.render_cameras()           # 8 x uint8 (96, 128, 3), RGB
    scene.set_position_targets(['jaco_joint_1'], [0.5])
    scene.step(0.02)                          # 20 ms of simulated time
    q = scene.joint_positions()               # float64 (9,), rad
"""
from __future__ import annotations

import math
import os
import threading
from typing import Sequence

os.environ.setdefault('MUJOCO_GL', 'egl')

import mujoco  # noqa: E402
import numpy as np  # noqa: E402
from dm_control import mjcf  # noqa: E402
from dm_control.entities.manipulators import kinova  # noqa: E402

# ROS names of the model's joints, in state order: arm joints 1..6, then the three fingers.
JOINT_NAMES = (
    'jaco_joint_1', 'jaco_joint_2', 'jaco_joint_3',
    'jaco_joint_4', 'jaco_joint_5', 'jaco_joint_6',
    'jaco_finger_1', 'jaco_finger_2', 'jaco_finger_3',
)
# The same joints as dm_control names them inside the compiled model.
_MJCF_JOINT_NAMES = (
    'jaco_arm/joint_1', 'jaco_arm/joint_2', 'jaco_arm/joint_3',
    'jaco_arm/joint_4', 'jaco_arm/joint_5', 'jaco_arm/joint_6',
    'jaco_arm/jaco_hand/finger_1', 'jaco_arm/jaco_hand/finger_2', 'jaco_arm/jaco_hand/finger_3',
)
_FINGERS = ('jaco_finger_1', 'jaco_finger_2', 'jaco_finger_3')

# Camera names in image order: cam0..cam6 fixed around the table, cam7 on the wrist.
CAMERA_NAMES = ('cam0', 'cam1', 'cam2', 'cam3', 'cam4', 'cam5', 'cam6', 'wrist')
NUM_CAMERAS = len(CAMERA_NAMES)

# Home pose, rad: pinch point of the open hand about 0.3 m above the table centre, fingers
# pointing down (found once by least squares on the forward kinematics of this model).
HOME_POSITIONS = np.array([-1.716, 3.247, 1.244, -0.378, 1.343, 1.046, 0.2, 0.2, 0.2])

# Joints 1, 4, 5, 6 of the Jaco are continuous (no range in the model). We keep them within one
# turn either way of zero so the state stays bounded; this bound is our choice.
CONTINUOUS_JOINT_RANGE = (-2.0 * math.pi, 2.0 * math.pi)

# Fixed cameras: (azimuth deg, elevation deg, distance m) around _LOOK_AT, in world frame.
_ARM_BASE = (0.0, 0.45, 0.0)
_LOOK_AT = np.array([0.0, 0.1, 0.15])
_FIXED_CAMERAS = (
    (-90.0, 35.0, 1.4), (-40.0, 50.0, 1.3), (10.0, 25.0, 1.5), (60.0, 60.0, 1.2),
    (110.0, 30.0, 1.4), (160.0, 45.0, 1.3), (210.0, 40.0, 1.4),
)
_CUBES = (  # (name, rgba, position on the table)
    ('red_cube', (0.85, 0.1, 0.1, 1.0), (0.10, 0.0, 0.025)),
    ('green_cube', (0.1, 0.7, 0.1, 1.0), (-0.15, 0.05, 0.025)),
    ('blue_cube', (0.1, 0.2, 0.9, 1.0), (0.0, -0.15, 0.025)),
)


def _look_at_axes(position: np.ndarray, target: np.ndarray) -> np.ndarray:
    """MJCF `xyaxes` (6,) of a camera at `position` looking at `target`, world z up."""
    forward = target - position
    forward /= np.linalg.norm(forward)
    x_axis = np.cross(forward, (0.0, 0.0, 1.0))
    x_axis /= np.linalg.norm(x_axis)
    y_axis = np.cross(x_axis, forward)
    return np.concatenate([x_axis, y_axis])


def _build_mjcf(width: int, height: int, shadows: bool) -> mjcf.RootElement:
    """The scene as an MJCF model: ground, table, Jaco arm + hand, cubes, 8 cameras."""
    root = mjcf.RootElement(model='molmobot_jaco_table')
    root.visual.__getattr__('global').offwidth = max(width, 640)
    root.visual.__getattr__('global').offheight = max(height, 480)
    root.visual.headlight.ambient = (0.35, 0.35, 0.35)
    root.visual.headlight.diffuse = (0.5, 0.5, 0.5)
    root.asset.add('texture', type='skybox', builtin='gradient', rgb1=(0.55, 0.65, 0.8),
                   rgb2=(0.15, 0.15, 0.2), width=64, height=64)
    root.worldbody.add('light', pos=(0.0, 0.0, 2.0), dir=(0.0, 0.0, -1.0),
                       castshadow=str(shadows).lower())
    root.worldbody.add('geom', name='floor', type='plane', size=(3.0, 3.0, 0.1),
                       pos=(0.0, 0.0, -0.75), rgba=(0.3, 0.35, 0.4, 1.0))
    # Table top surface at z = 0; the arm is bolted onto it near the back edge.
    root.worldbody.add('geom', name='table', type='box', size=(0.5, 0.6, 0.02),
                       pos=(0.0, 0.1, -0.02), rgba=(0.6, 0.45, 0.3, 1.0))
    for x in (-0.45, 0.45):
        for y in (-0.45, 0.65):
            root.worldbody.add('geom', type='box', size=(0.03, 0.03, 0.365),
                               pos=(x, y, -0.405), rgba=(0.4, 0.3, 0.2, 1.0))

    arm = kinova.JacoArm()
    hand = kinova.JacoHand()
    hand.mjcf_model.find('body', 'hand').add(
        'camera', name='wrist', pos=(0.0, 0.08, -0.05), euler=(-0.35, 0.0, 0.0), fovy=75)
    arm.attach(hand)
    root.attach(arm.mjcf_model).pos = _ARM_BASE

    for name, rgba, position in _CUBES:
        body = root.worldbody.add('body', name=name, pos=position)
        body.add('freejoint')
        body.add('geom', type='box', size=(0.025, 0.025, 0.025), rgba=rgba, mass=0.05)

    for k, (azimuth, elevation, distance) in enumerate(_FIXED_CAMERAS):
        az, el = math.radians(azimuth), math.radians(elevation)
        offset = distance * np.array(
            [math.cos(el) * math.cos(az), math.cos(el) * math.sin(az), math.sin(el)])
        position = _LOOK_AT + offset
        root.worldbody.add('camera', name=f'cam{k}', pos=position,
                           xyaxes=_look_at_axes(position, _LOOK_AT), fovy=50)
    return root


class JacoScene:
    """The Jaco table-top scene: kinematic position following, 8-camera rendering.

    Thread safety: `step`, `set_position_targets`, `joint_positions` and `render_cameras`
    may be called from different threads (one lock guards the simulation state), but
    `render_cameras` must always be called from the same thread, because the EGL context is
    bound to the thread that first renders. Call `close` (or use `with`) when done rendering.

    Args:
        width: image width, pixels (> 0).
        height: image height, pixels (> 0).
        seed: seeds the small random offsets of the cubes' start positions.
        max_velocity: per-joint speed limit, rad/s: a scalar for all 9 joints, a (9,) array,
            or None for the Jaco actuator limits dm_control uses (36 deg/s for joints 1-3,
            48 deg/s for joints 4-6 from Kinova's actuator datasheet, 5 rad/s for the
            fingers from Kinova's URDF).
        shadows: let the light cast shadows. Off by default: on Mesa's CPU renderer the
            shadow map makes a frame 3-6x slower (measured 7 -> 21 ms at 96x128).

    Attributes:
        joint_names: the 9 ROS joint names, state order (`JOINT_NAMES`).
        camera_names: the 8 camera names, image order (`CAMERA_NAMES`, the wrist last).
        joint_ranges: float64 (9, 2), rad: [lower, upper] each joint is kept in (the model's
            range; `CONTINUOUS_JOINT_RANGE` for the continuous joints 1, 4, 5, 6).
        max_velocity: float64 (9,), rad/s: per-joint speed limit.

    Raises:
        ValueError: non-positive width/height or max_velocity, wrong max_velocity shape.
    """

    def __init__(self, width: int, height: int, seed: int = 0,
                 max_velocity: float | Sequence[float] | None = None, shadows: bool = False):
        if int(width) <= 0 or int(height) <= 0:
            raise ValueError(f'width and height must be positive pixels, got {width}x{height}')
        self.width, self.height = int(width), int(height)
        self.joint_names = list(JOINT_NAMES)
        self.camera_names = list(CAMERA_NAMES)

        self._physics = mjcf.Physics.from_mjcf_model(_build_mjcf(self.width, self.height, shadows))
        self._model = self._physics.model.ptr
        self._timestep = float(self._model.opt.timestep)
        self._data = self._physics.data.ptr
        joints = [self._model.joint(name) for name in _MJCF_JOINT_NAMES]
        self._qpos_index = np.array([int(j.qposadr[0]) for j in joints])
        self._dof_index = np.array([int(j.dofadr[0]) for j in joints])
        self._camera_ids = [self._camera_id(name) for name in CAMERA_NAMES]

        limited = np.array([bool(self._model.jnt_limited[j.id]) for j in joints])
        model_range = np.array([self._model.jnt_range[j.id] for j in joints])
        self.joint_ranges = np.where(limited[:, None], model_range, CONTINUOUS_JOINT_RANGE)
        self.max_velocity = self._resolve_max_velocity(max_velocity)

        rng = np.random.default_rng(seed)
        for name, _, position in _CUBES:
            cube = self._model.body(name)
            qpos_adr = int(self._model.jnt_qposadr[cube.jntadr[0]])
            xy = np.asarray(position[:2]) + rng.uniform(-0.03, 0.03, size=2)
            self._data.qpos[qpos_adr:qpos_adr + 3] = (*xy, position[2])

        self._lock = threading.Lock()
        self._positions = np.clip(HOME_POSITIONS, *self.joint_ranges.T)
        self._targets = self._positions.copy()
        self._write_arm(self._positions, np.zeros(len(JOINT_NAMES)))
        mujoco.mj_forward(self._model, self._data)

        self._render_data = mujoco.MjData(self._model)
        self._renderer: mujoco.Renderer | None = None

    def _camera_id(self, name: str) -> int:
        for k in range(self._model.ncam):
            full_name = self._model.camera(k).name
            if full_name == name or full_name.endswith('/' + name):
                return k
        raise KeyError(f'camera {name!r} is missing from the scene model')

    def _resolve_max_velocity(self, max_velocity) -> np.ndarray:
        if max_velocity is None:
            actuators = [self._model.actuator(name) for name in _MJCF_JOINT_NAMES]
            return np.array([float(a.ctrlrange[1]) for a in actuators])
        limit = np.broadcast_to(np.asarray(max_velocity, dtype=np.float64), (len(JOINT_NAMES),))
        if not np.all(np.isfinite(limit)) or np.any(limit <= 0.0):
            raise ValueError(f'max_velocity must be positive rad/s, got {max_velocity!r}')
        return limit.copy()

    @property
    def time(self) -> float:
        """Simulated time, seconds since the scene was built."""
        return float(self._data.time)

    @property
    def timestep(self) -> float:
        """MuJoCo integration step, seconds (`step` splits its dt into steps of at most this)."""
        return self._timestep

    def joint_positions(self) -> np.ndarray:
        """float64 (9,), rad: current positions in `joint_names` order."""
        with self._lock:
            return self._positions.copy()

    def position_targets(self) -> np.ndarray:
        """float64 (9,), rad: current position targets in `joint_names` order."""
        with self._lock:
            return self._targets.copy()

    def set_position_targets(self, names: Sequence[str], positions: Sequence[float]) -> None:
        """Set position targets (rad) of the named joints; the others keep theirs.

        Targets are clamped to `joint_ranges`. When `jaco_finger_1` is given and neither
        `jaco_finger_2` nor `jaco_finger_3` is, fingers 2 and 3 get finger 1's target (one
        gripper command closes the whole hand).

        Raises:
            ValueError: a name not in `joint_names`, duplicate names, a length mismatch, or a
                non-finite position.
        """
        names = list(names)
        positions = np.asarray(positions, dtype=np.float64).reshape(-1)
        if len(names) != positions.shape[0]:
            raise ValueError(f'set_position_targets: {len(names)} names but '
                             f'{positions.shape[0]} positions')
        if len(set(names)) != len(names):
            raise ValueError(f'set_position_targets: duplicate joint names in {names}')
        unknown = [name for name in names if name not in self.joint_names]
        if unknown:
            raise ValueError(f'set_position_targets: unknown joints {unknown}, '
                             f'expected names from {self.joint_names}')
        if not np.all(np.isfinite(positions)):
            raise ValueError(f'set_position_targets: positions must be finite, got {positions}')
        targets = dict(zip(names, positions))
        if _FINGERS[0] in targets and not any(f in targets for f in _FINGERS[1:]):
            for finger in _FINGERS[1:]:
                targets[finger] = targets[_FINGERS[0]]
        index = [self.joint_names.index(name) for name in targets]
        values = np.clip(list(targets.values()), *self.joint_ranges[index].T)
        with self._lock:
            self._targets[index] = values

    def step(self, dt: float) -> None:
        """Advance the simulation by `dt` seconds (>= 0) in steps of at most `timestep`.

        Each step moves every joint towards its target by at most `max_velocity * h` rad
        (h = step length), writes it into the arm's qpos and velocity into its qvel, then
        lets MuJoCo integrate the free objects (the arm's own dynamics are overwritten).

        Raises:
            ValueError: negative or non-finite dt.
        """
        if not math.isfinite(dt) or dt < 0.0:
            raise ValueError(f'step: dt must be a finite number of seconds >= 0, got {dt}')
        if dt == 0.0:
            return
        n_steps = max(1, math.ceil(dt / self._timestep - 1e-9))
        h = dt / n_steps
        with self._lock:
            self._model.opt.timestep = h
            for _ in range(n_steps):
                max_move = self.max_velocity * h
                move = np.clip(self._targets - self._positions, -max_move, max_move)
                self._positions = np.clip(self._positions + move, *self.joint_ranges.T)
                self._write_arm(self._positions, move / h)
                mujoco.mj_step(self._model, self._data)
            self._write_arm(self._positions, np.zeros(len(JOINT_NAMES)))
            mujoco.mj_forward(self._model, self._data)

    def _write_arm(self, positions: np.ndarray, velocities: np.ndarray) -> None:
        self._data.qpos[self._qpos_index] = positions
        self._data.qvel[self._dof_index] = velocities

    def render_cameras(self) -> list[np.ndarray]:
        """Render all 8 cameras of the current state.

        Returns:
            8 uint8 arrays (height, width, 3), RGB, in `camera_names` order (cam0..cam6
            fixed, the last one on the wrist). All 8 show the same simulation instant.
        """
        with self._lock:
            self._render_data.qpos[:] = self._data.qpos
            self._render_data.time = self._data.time
        mujoco.mj_kinematics(self._model, self._render_data)
        mujoco.mj_camlight(self._model, self._render_data)
        if self._renderer is None:
            self._renderer = mujoco.Renderer(self._model, self.height, self.width)
        frames = []
        for camera_id in self._camera_ids:
            self._renderer.update_scene(self._render_data, camera=camera_id)
            frames.append(self._renderer.render())
        return frames

    def close(self) -> None:
        """Free the renderer's GL context (call from the rendering thread; idempotent)."""
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None

    def __enter__(self) -> JacoScene:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
