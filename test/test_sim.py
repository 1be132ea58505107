"""Specification of the simulated robot: the Jaco scene, trajectory following, the sim_robot node.

Renders at 48x64 to stay quick on 2-core CI machines (MUJOCO_GL=egl, Mesa on the CPU).
"""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

os.environ.setdefault('MUJOCO_GL', 'egl')

from molmobot_policy_demo.sim import trajectory  # noqa: E402
from molmobot_policy_demo.sim.scene import (CAMERA_NAMES, CONTINUOUS_JOINT_RANGE,  # noqa: E402
                                       HOME_POSITIONS, JOINT_NAMES, JacoScene)

WIDTH, HEIGHT = 64, 48
ROS_JOINT_NAMES = [f'jaco_joint_{k}' for k in range(1, 7)] + [
    'jaco_finger_1', 'jaco_finger_2', 'jaco_finger_3']


@pytest.fixture
def scene():
    with JacoScene(WIDTH, HEIGHT) as scene:
        yield scene


def _mean_abs_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(np.abs(a.astype(np.int16) - b.astype(np.int16))))


# --- scene ----------------------------------------------------------------------------------

def test_scene_names_the_nine_jaco_joints_in_ros_order(scene):
    assert scene.joint_names == ROS_JOINT_NAMES
    assert list(JOINT_NAMES) == ROS_JOINT_NAMES


def test_scene_starts_at_the_home_pose_within_joint_ranges(scene):
    positions = scene.joint_positions()
    assert positions.shape == (9,) and positions.dtype == np.float64
    np.testing.assert_allclose(positions, HOME_POSITIONS)
    assert np.all(positions >= scene.joint_ranges[:, 0])
    assert np.all(positions <= scene.joint_ranges[:, 1])


def test_render_cameras_returns_eight_uint8_rgb_frames_of_the_requested_size(scene):
    frames = scene.render_cameras()
    assert len(frames) == 8 == len(CAMERA_NAMES)
    for frame in frames:
        assert frame.shape == (HEIGHT, WIDTH, 3)
        assert frame.dtype == np.uint8


def test_every_camera_shows_a_different_view(scene):
    frames = scene.render_cameras()
    for i in range(8):
        for j in range(i + 1, 8):
            assert _mean_abs_difference(frames[i], frames[j]) > 5.0, (i, j)


def test_wrist_and_fixed_cameras_change_when_the_arm_moves(scene):
    before = scene.render_cameras()
    scene.set_position_targets(['jaco_joint_1', 'jaco_joint_6'], HOME_POSITIONS[[0, 5]] + 0.5)
    scene.step(1.0)
    after = scene.render_cameras()
    assert _mean_abs_difference(before[7], after[7]) > 5.0  # wrist camera
    assert _mean_abs_difference(before[0], after[0]) > 0.1  # a fixed camera sees the arm move


def test_targets_are_reached_without_exceeding_the_velocity_limit(scene):
    target = HOME_POSITIONS + np.array([0.3, -0.2, 0.2, -0.3, 0.3, -0.3, 0.5, 0.6, 0.7])
    scene.set_position_targets(ROS_JOINT_NAMES, target)
    dt = 0.01
    previous = scene.joint_positions()
    for _ in range(100):
        scene.step(dt)
        current = scene.joint_positions()
        assert np.all(np.abs(current - previous) <= scene.max_velocity * dt + 1e-9)
        previous = current
    np.testing.assert_allclose(scene.joint_positions(), target, atol=1e-9)


def test_default_velocity_limits_are_the_jaco_actuator_limits(scene):
    expected = [np.deg2rad(36.0)] * 3 + [np.deg2rad(48.0)] * 3 + [5.0] * 3
    np.testing.assert_allclose(scene.max_velocity, expected, rtol=1e-6)


def test_targets_outside_the_joint_ranges_are_clamped(scene):
    scene.set_position_targets(['jaco_joint_1', 'jaco_joint_2', 'jaco_finger_1'],
                               [100.0, 100.0, -100.0])
    scene.step(20.0)
    positions = scene.joint_positions()
    assert positions[0] == pytest.approx(CONTINUOUS_JOINT_RANGE[1])
    assert positions[1] == pytest.approx(scene.joint_ranges[1, 1])
    assert positions[6] == pytest.approx(scene.joint_ranges[6, 0])
    assert np.all(positions >= scene.joint_ranges[:, 0])
    assert np.all(positions <= scene.joint_ranges[:, 1])


def test_commanding_only_finger_1_moves_all_three_fingers(scene):
    scene.set_position_targets(['jaco_finger_1'], [1.0])
    scene.step(1.0)
    np.testing.assert_allclose(scene.joint_positions()[6:], [1.0, 1.0, 1.0])


def test_fingers_commanded_separately_are_not_mirrored(scene):
    scene.set_position_targets(['jaco_finger_1', 'jaco_finger_2'], [1.0, 0.5])
    scene.step(1.0)
    np.testing.assert_allclose(scene.joint_positions()[6:], [1.0, 0.5, HOME_POSITIONS[8]])


def test_step_advances_simulated_time(scene):
    start = scene.time
    scene.step(0.05)
    assert scene.time == pytest.approx(start + 0.05)


@pytest.mark.parametrize('names, positions', [
    (['jaco_joint_7'], [0.0]),
    (['jaco_joint_1', 'jaco_joint_2'], [0.0]),
    (['jaco_joint_1', 'jaco_joint_1'], [0.0, 0.1]),
    (['jaco_joint_1'], [float('nan')]),
], ids=['unknown-name', 'length-mismatch', 'duplicate-name', 'nan'])
def test_set_position_targets_rejects_bad_input(scene, names, positions):
    with pytest.raises(ValueError, match='set_position_targets'):
        scene.set_position_targets(names, positions)


def test_step_rejects_a_negative_dt(scene):
    with pytest.raises(ValueError, match='dt'):
        scene.step(-0.1)


def test_scene_rejects_a_non_positive_image_size():
    with pytest.raises(ValueError, match='width and height'):
        JacoScene(0, HEIGHT)


# --- trajectory following -------------------------------------------------------------------

def _trajectory(times, positions, names=('a', 'b')):
    return trajectory.Trajectory(tuple(names), np.asarray(times, dtype=np.float64),
                                 np.asarray(positions, dtype=np.float64))


def test_trajectory_interpolates_linearly_between_points():
    traj = _trajectory([10.0, 11.0, 13.0], [[0.0, 1.0], [1.0, 1.0], [3.0, -1.0]])
    np.testing.assert_allclose(traj.sample(10.25), [0.25, 1.0])
    np.testing.assert_allclose(traj.sample(12.0), [2.0, 0.0])


def test_trajectory_holds_its_first_and_last_points_outside_its_time_range():
    traj = _trajectory([10.0, 11.0], [[0.0, 1.0], [1.0, 2.0]])
    np.testing.assert_allclose(traj.sample(9.0), [0.0, 1.0])
    np.testing.assert_allclose(traj.sample(20.0), [1.0, 2.0])


def test_point_times_are_header_stamp_plus_time_from_start():
    traj = trajectory.from_message_values(['a'], 100.0, [0.5, 1.0], [[0.0], [1.0]], now=90.0)
    np.testing.assert_allclose(traj.times, [100.5, 101.0])


def test_zero_header_stamp_means_now():
    traj = trajectory.from_message_values(['a'], 0.0, [0.5, 1.0], [[0.0], [1.0]], now=90.0)
    np.testing.assert_allclose(traj.times, [90.5, 91.0])


def test_a_trajectory_starting_in_the_future_begins_from_the_current_positions():
    new = _trajectory([11.0, 12.0], [[1.0, 1.0], [2.0, 2.0]])
    merged = trajectory.replace(None, new, now=10.0, current_positions=[0.0, -1.0])
    np.testing.assert_allclose(merged.sample(10.0), [0.0, -1.0])
    np.testing.assert_allclose(merged.sample(10.5), [0.5, 0.0])
    np.testing.assert_allclose(merged.sample(12.0), [2.0, 2.0])


def test_a_newer_trajectory_replaces_the_older_one_from_its_first_point_time():
    old = _trajectory([10.0, 11.0, 12.0, 13.0], [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    new = _trajectory([11.5, 12.5], [[5.0, 5.0], [6.0, 6.0]])
    merged = trajectory.replace(old, new, now=10.5, current_positions=[9.0, 9.0])
    np.testing.assert_allclose(merged.sample(10.5), [0.5, 0.5])  # old's command at now
    np.testing.assert_allclose(merged.sample(11.0), [1.0, 1.0])  # old point before 11.5 kept
    np.testing.assert_allclose(merged.sample(11.5), [5.0, 5.0])  # new from its first point
    np.testing.assert_allclose(merged.sample(12.0), [5.5, 5.5])  # old's 12.0 point is gone
    assert merged.end_time == 12.5


def test_a_newer_trajectory_that_already_started_is_followed_as_is():
    old = _trajectory([10.0, 13.0], [[0.0, 0.0], [3.0, 3.0]])
    new = _trajectory([9.0, 11.0], [[5.0, 5.0], [7.0, 7.0]])
    merged = trajectory.replace(old, new, now=10.0, current_positions=[0.0, 0.0])
    np.testing.assert_allclose(merged.sample(10.0), [6.0, 6.0])


def test_a_newer_trajectory_for_other_joints_starts_from_the_current_positions():
    old = _trajectory([10.0, 13.0], [[0.0, 0.0], [3.0, 3.0]], names=('a', 'b'))
    new = _trajectory([11.0], [[1.0]], names=('c',))
    merged = trajectory.replace(old, new, now=10.0, current_positions=[-1.0])
    assert merged.joint_names == ('c',)
    np.testing.assert_allclose(merged.sample(10.0), [-1.0])


@pytest.mark.parametrize('names, times, positions', [
    ([], [1.0], [[]]),
    (['a', 'a'], [1.0], [[0.0, 0.0]]),
    (['a'], [], []),
    (['a', 'b'], [1.0], [[0.0]]),
    (['a'], [1.0, 1.0], [[0.0], [1.0]]),
    (['a'], [-1.0], [[0.0]]),
    (['a'], [1.0], [[float('inf')]]),
], ids=['no-names', 'duplicate-names', 'no-points', 'short-point', 'time-not-increasing',
        'negative-time', 'non-finite'])
def test_malformed_trajectory_values_raise_value_error(names, times, positions):
    with pytest.raises(ValueError, match='joint trajectory'):
        trajectory.from_message_values(names, 0.0, times, positions, now=5.0)


# --- the sim_robot node over real DDS -------------------------------------------------------

rclpy = pytest.importorskip('rclpy', reason='rclpy is not installed')


class _Probe:
    """A test-side node that records what sim_robot publishes and sends it trajectories."""

    def __init__(self):
        import rclpy.executors
        from rclpy.qos import qos_profile_sensor_data
        from sensor_msgs.msg import Image, JointState
        from trajectory_msgs.msg import JointTrajectory

        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node('sim_test_probe', context=self.context)
        self.executor = rclpy.executors.SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.images = {}
        self.joint_states = []
        for k in range(8):
            self.node.create_subscription(
                Image, f'/cam{k}/image_raw',
                lambda msg, k=k: self.images.setdefault(k, []).append(msg),
                qos_profile_sensor_data)
        self.node.create_subscription(JointState, '/joint_states', self.joint_states.append, 10)
        self.trajectory_publisher = self.node.create_publisher(
            JointTrajectory, '/molmobot_policy/joint_trajectory', 10)

    def spin_until(self, condition, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return True
            self.executor.spin_once(timeout_sec=0.05)
        return condition()

    def close(self):
        self.executor.shutdown()
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)


@pytest.fixture(scope='module')
def sim_robot(tmp_path_factory):
    """sim_robot started as its own process (48x64 images, 5 Hz cameras) + a probe node.

    Yields (process, probe, log_path); the process's stdout/stderr go to log_path.
    """
    env = dict(os.environ, MUJOCO_GL='egl', RCUTILS_LOGGING_BUFFERED_STREAM='0')
    log_path = tmp_path_factory.mktemp('sim_robot') / 'sim_robot.log'
    with open(log_path, 'w') as log:
        process = subprocess.Popen(
            [sys.executable, '-m', 'molmobot_policy_demo.sim.robot_node', '--ros-args',
             '-p', f'width:={WIDTH}', '-p', f'height:={HEIGHT}', '-p', 'camera_rate:=5.0'],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    probe = _Probe()
    try:
        yield process, probe, log_path
    finally:
        probe.close()
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _point(positions, seconds):
    from builtin_interfaces.msg import Duration
    from trajectory_msgs.msg import JointTrajectoryPoint

    return JointTrajectoryPoint(positions=list(positions),
                                time_from_start=Duration(sec=int(seconds),
                                                         nanosec=int(seconds % 1 * 1e9)))


def test_node_publishes_eight_rgb8_image_topics_and_joint_states(sim_robot):
    _, probe, log_path = sim_robot
    assert probe.spin_until(lambda: len(probe.images) == 8 and probe.joint_states, 30.0), \
        (f'got images from cameras {sorted(probe.images)}, {len(probe.joint_states)} joint '
         f'states; sim_robot log:\n{log_path.read_text()}')
    for k in range(8):
        image = probe.images[k][-1]
        assert (image.height, image.width, image.encoding) == (HEIGHT, WIDTH, 'rgb8')
        assert image.step == WIDTH * 3 and len(image.data) == HEIGHT * WIDTH * 3
        assert image.header.stamp.sec > 0
    joint_state = probe.joint_states[-1]
    assert list(joint_state.name) == ROS_JOINT_NAMES
    assert len(joint_state.position) == 9


def test_node_follows_a_trajectory_and_ignores_unknown_joints(sim_robot):
    from trajectory_msgs.msg import JointTrajectory

    _, probe, _ = sim_robot
    assert probe.spin_until(lambda: probe.trajectory_publisher.get_subscription_count() > 0
                            and probe.joint_states, 30.0)
    target = HOME_POSITIONS[0] + 0.2
    msg = JointTrajectory(joint_names=['jaco_joint_1', 'not_a_joint', 'jaco_finger_1'])
    msg.points = [_point([target, 0.0, 0.8], 0.2), _point([target, 0.0, 0.8], 0.4)]
    probe.trajectory_publisher.publish(msg)

    def reached():
        position = probe.joint_states[-1].position
        return abs(position[0] - target) < 1e-3 and abs(position[8] - 0.8) < 1e-3

    assert probe.spin_until(reached, 10.0), list(probe.joint_states[-1].position)


def test_node_survives_a_malformed_trajectory(sim_robot):
    from trajectory_msgs.msg import JointTrajectory

    process, probe, log_path = sim_robot
    assert probe.spin_until(lambda: probe.trajectory_publisher.get_subscription_count() > 0,
                            30.0)
    bad = JointTrajectory(joint_names=['jaco_joint_2'])
    bad.points = [_point([1.0, 2.0], 0.1)]  # two positions for one joint
    probe.trajectory_publisher.publish(bad)
    probe.joint_states.clear()
    assert probe.spin_until(lambda: len(probe.joint_states) >= 10, 10.0)
    assert process.poll() is None, 'sim_robot exited after a malformed trajectory'
    assert 'ignoring malformed trajectory' in log_path.read_text()


def test_sim_robot_without_the_simulator_says_which_requirements_file_brings_it():
    """A robot's install (requirements/runtime.txt) has no mujoco: `sim_robot` says what to
    install instead of a traceback."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['mujoco'] = None; "
            "import molmobot_policy_demo.sim.robot_node")
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert 'needs mujoco' in done.stderr and 'requirements/demo.txt' in done.stderr
    assert 'Traceback' not in done.stderr
