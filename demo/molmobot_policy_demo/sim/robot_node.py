"""sim_robot: the simulated Jaco arm as a ROS 2 node (8 cameras, joint states, trajectories).

Publishes
- `camera_topics` (8, the last one on the wrist): sensor_msgs/Image, rgb8, sensor-data QoS;
  header.stamp = ROS time of the simulation state the frame shows. With `camera_transport:
  compressed` instead sensor_msgs/CompressedImage on `<topic>/compressed` (image_transport's
  name), jpeg at `jpeg_quality`, format 'rgb8; jpeg compressed bgr8'.
- `joint_state_topic`: sensor_msgs/JointState with `JOINT_NAMES`, positions in rad.
Subscribes
- `trajectory_topic`: trajectory_msgs/JointTrajectory, followed as `sim.trajectory` describes
  (header stamp + time_from_start, linear interpolation, newer replaces older). Unknown joint
  names are ignored with a throttled warning; malformed messages are logged and ignored.

Threads: physics, joint states and the subscription share one single-threaded executor;
rendering (tens of ms per camera on a CPU) runs in its own thread on an absolute-deadline
schedule so that it never delays joint states.

Run: python -m molmobot_policy_demo.sim.robot_node --ros-args --params-file demo/config/sim.yaml
"""
from __future__ import annotations

import math
import threading
import time

import rclpy
from rclpy._rclpy_pybind11 import RCLError
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from trajectory_msgs.msg import JointTrajectory

from molmobot_policy.ros import codec
from molmobot_policy.ros.parameters import CAMERA_TRANSPORTS, descriptor
from molmobot_policy_demo.sim import trajectory
try:
    from molmobot_policy_demo.sim.scene import NUM_CAMERAS, JacoScene
except ModuleNotFoundError as missing:     # a robot's install: requirements/runtime.txt only
    raise SystemExit(f'sim_robot: the simulated robot needs {missing.name}, which a robot '
                     'install leaves out: pip install -r requirements/demo.txt') from None

NODE_NAME = 'sim_robot'
DEFAULT_CAMERA_TOPICS = [f'/cam{k}/image_raw' for k in range(NUM_CAMERAS)]
DEFAULT_CAMERA_FRAME_IDS = [f'cam{k}_optical_frame' for k in range(NUM_CAMERAS)]
WARN_THROTTLE_S = 2.0   # at most one warning per call site per this many seconds
MAX_PHYSICS_DT_S = 0.1  # a late physics tick advances at most this much simulated time


def _seconds(msg_time) -> float:
    """builtin_interfaces/Time or Duration -> float seconds."""
    return msg_time.sec + msg_time.nanosec * 1e-9


class SimRobotNode(Node):
    """The simulated robot: wiring between `JacoScene`, `sim.trajectory` and ROS topics.

    Raises:
        ValueError: camera_topics / camera_frame_ids do not have 8 entries.
    """

    def __init__(self):
        super().__init__(NODE_NAME)
        width = self.declare_parameter(
            'width', 128, descriptor('image width, pixels', int_range=(16, 4096))).value
        height = self.declare_parameter(
            'height', 96, descriptor('image height, pixels', int_range=(16, 4096))).value
        camera_rate = self.declare_parameter(
            'camera_rate', 5.0,
            descriptor('Hz; all 8 cameras are rendered per tick',
                       float_range=(0.1, 100.0))).value
        joint_state_rate = self.declare_parameter(
            'joint_state_rate', 50.0, descriptor('Hz of /joint_states',
                                                 float_range=(1.0, 1000.0))).value
        physics_rate = self.declare_parameter(
            'physics_rate', 100.0,
            descriptor('Hz of simulation steps (trajectory sampling + physics)',
                       float_range=(1.0, 1000.0))).value
        camera_topics = list(self.declare_parameter(
            'camera_topics', DEFAULT_CAMERA_TOPICS,
            descriptor('8 sensor_msgs/Image topics: cam0..cam6 fixed, the last on the '
                        'wrist')).value)
        frame_ids = list(self.declare_parameter(
            'camera_frame_ids', DEFAULT_CAMERA_FRAME_IDS,
            descriptor('header.frame_id of each camera topic, same order')).value)
        joint_state_topic = self.declare_parameter(
            'joint_state_topic', '/joint_states',
            descriptor('sensor_msgs/JointState output topic')).value
        trajectory_topic = self.declare_parameter(
            'trajectory_topic', '/molmobot_policy/joint_trajectory',
            descriptor('trajectory_msgs/JointTrajectory input topic')).value
        max_joint_velocity = self.declare_parameter(
            'max_joint_velocity', 0.0,
            descriptor('rad/s speed limit for every joint; 0 = the Jaco actuator limits '
                       '(0.63 rad/s joints 1-3, 0.84 rad/s joints 4-6, 5 rad/s fingers)',
                       float_range=(0.0, 100.0))).value
        transport = self.declare_parameter(
            'camera_transport', 'raw', descriptor(
                "'raw' (sensor_msgs/Image on each camera topic) or 'compressed' "
                '(sensor_msgs/CompressedImage, jpeg, on <topic>/compressed)')).value
        self._jpeg_quality = self.declare_parameter(
            'jpeg_quality', 90, descriptor('jpeg quality of compressed images',
                                           int_range=(1, 100))).value
        seed = self.declare_parameter(
            'seed', 0, descriptor('seed of the cubes\' start positions',
                                  int_range=(0, 2**31 - 1))).value
        if len(camera_topics) != NUM_CAMERAS or len(frame_ids) != NUM_CAMERAS:
            raise ValueError(f'camera_topics and camera_frame_ids need {NUM_CAMERAS} entries, '
                             f'got {len(camera_topics)} and {len(frame_ids)}')
        if transport not in CAMERA_TRANSPORTS:
            raise ValueError(f"camera_transport must be one of {list(CAMERA_TRANSPORTS)}, got "
                             f'{transport!r}')
        self._compressed = transport == 'compressed'
        if self._compressed:
            camera_topics = [f"{t.rstrip('/')}/compressed" for t in camera_topics]

        self._scene = JacoScene(width, height, seed=seed,
                                max_velocity=max_joint_velocity or None)
        self._frame_ids = frame_ids
        self._trajectory: trajectory.Trajectory | None = None
        self._last_physics_time: float | None = None

        message_type = CompressedImage if self._compressed else Image
        self._image_publishers = [
            self.create_publisher(message_type, topic, qos_profile_sensor_data)
            for topic in camera_topics]
        self._joint_state_publisher = self.create_publisher(JointState, joint_state_topic, 10)
        self._trajectory_subscription = self.create_subscription(
            JointTrajectory, trajectory_topic, self._on_trajectory, 10)
        self._physics_timer = self.create_timer(1.0 / physics_rate, self._on_physics_tick)
        self._joint_state_timer = self.create_timer(
            1.0 / joint_state_rate, self._publish_joint_state)

        self._stop = threading.Event()
        self._render_thread = threading.Thread(
            target=self._render_loop, args=(1.0 / camera_rate,), name='sim_render', daemon=True)
        self._render_thread.start()
        self.get_logger().info(
            f'{NUM_CAMERAS} cameras {width}x{height} at {camera_rate} Hz ({transport}, on '
            f'{camera_topics[0]}, ...), joint states at {joint_state_rate} Hz, following '
            f'{trajectory_topic}')

    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _on_trajectory(self, msg: JointTrajectory) -> None:
        now = self._now()
        try:
            received = trajectory.from_message_values(
                msg.joint_names, _seconds(msg.header.stamp),
                [_seconds(point.time_from_start) for point in msg.points],
                [point.positions for point in msg.points], now)
        except ValueError as error:
            self.get_logger().error(f'ignoring malformed trajectory: {error}',
                                    throttle_duration_sec=WARN_THROTTLE_S)
            return
        known = [k for k, name in enumerate(received.joint_names)
                 if name in self._scene.joint_names]
        if len(known) < len(received.joint_names):
            unknown = [name for name in received.joint_names if name not in self._scene.joint_names]
            self.get_logger().warning(f'ignoring unknown joints {unknown}',
                                      throttle_duration_sec=WARN_THROTTLE_S)
        if not known:
            return
        names = tuple(received.joint_names[k] for k in known)
        received = trajectory.Trajectory(names, received.times, received.positions[:, known])
        positions = self._scene.joint_positions()
        current = [positions[self._scene.joint_names.index(name)] for name in names]
        self._trajectory = trajectory.replace(self._trajectory, received, now, current)

    def _on_physics_tick(self) -> None:
        now = self._now()
        if self._trajectory is not None:
            self._scene.set_position_targets(self._trajectory.joint_names,
                                             self._trajectory.sample(now))
        if self._last_physics_time is not None:
            dt = min(max(now - self._last_physics_time, 0.0), MAX_PHYSICS_DT_S)
            self._scene.step(dt)
        self._last_physics_time = now

    def _publish_joint_state(self) -> None:
        msg = JointState()
        msg.header.stamp = self.get_clock().now().to_msg()
        msg.name = list(self._scene.joint_names)
        msg.position = self._scene.joint_positions().tolist()
        self._joint_state_publisher.publish(msg)

    def _render_loop(self, period: float) -> None:
        """Render and publish all cameras every `period` s on absolute deadlines (own thread)."""
        try:
            next_deadline = time.monotonic()
            while not self._stop.is_set():
                stamp = self.get_clock().now().to_msg()
                frames = self._scene.render_cameras()
                build = self._compressed_message if self._compressed else self._image_message
                for publisher, frame_id, frame in zip(
                        self._image_publishers, self._frame_ids, frames):
                    publisher.publish(build(frame, stamp, frame_id))
                next_deadline += period
                late = time.monotonic() - next_deadline
                if late > 0.0:  # skip the ticks we missed instead of bursting
                    next_deadline += math.ceil(late / period) * period
                self._stop.wait(next_deadline - time.monotonic())
        except Exception as error:  # noqa: BLE001 - report, never die silently
            if not self._stop.is_set() and rclpy.ok():   # not a Ctrl-C shutdown
                self.get_logger().error(f'camera rendering stopped: {error!r}')
        finally:
            self._scene.close()

    @staticmethod
    def _image_message(frame, stamp, frame_id: str) -> Image:
        msg = Image()
        msg.header.stamp = stamp
        msg.header.frame_id = frame_id
        msg.height, msg.width = int(frame.shape[0]), int(frame.shape[1])
        msg.encoding = 'rgb8'
        msg.is_bigendian = 0
        msg.step = msg.width * 3
        msg.data = frame.tobytes()
        return msg

    def _compressed_message(self, frame, stamp, frame_id: str) -> CompressedImage:
        msg = CompressedImage(format=codec.JPEG_FORMAT,
                              data=codec.rgb_to_jpeg(frame, self._jpeg_quality))
        msg.header.stamp = stamp
        msg.header.frame_id = frame_id
        return msg

    def destroy_node(self):
        self._stop.set()
        if self._render_thread.is_alive():
            self._render_thread.join(timeout=5.0)
        return super().destroy_node()


def main(args=None):
    rclpy.init(args=args)
    node = None
    try:
        node = SimRobotNode()
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except RCLError:
        if rclpy.ok():          # a real error; with Ctrl-C the context is already shut down
            raise
    finally:
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()


if __name__ == '__main__':
    main()
