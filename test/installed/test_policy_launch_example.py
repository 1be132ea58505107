"""An example to copy: a launch_testing test of your robot's configuration of the policy node.

It starts the installed `policy.launch.py` with a parameter file (here the tiny random-weight
model's, `config/policy_tiny.yaml`), its topics under a namespace of its own, feeds it camera
frames and joint states from the test process, and checks that a `JointTrajectory` with the
configured joints arrives and that every process exits cleanly at the end. Replace PARAMS_FILE
with yours (a checkpoint needs a GPU or a slow CPU start: raise TIMEOUT), CAMERAS / JOINTS with
what that file lists, and the checks with your own.

Run it as the project's tests run (`make test`), or by hand in a sourced colcon install with
the launch stack (docs/ROBOT.md, "Launch"): `python -m pytest test_policy_launch_example.py`.
Here it is skipped, saying why, without that stack or install (`_installed`); a copy of it
needs neither helper.
"""
import threading
import unittest

import pytest

from _installed import NO_LAUNCH, PACKAGE, installed_prefix

try:
    import launch
    import launch_testing.actions
    import launch_testing.asserts
    from launch.actions import IncludeLaunchDescription
    from launch.launch_description_sources import PythonLaunchDescriptionSource
except ImportError as error:
    pytest.skip(NO_LAUNCH.format(error=error), allow_module_level=True)

import rclpy  # noqa: E402
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

SHARE = installed_prefix() / 'share' / PACKAGE     # a copy: get_package_share_directory(...)
PARAMS_FILE = SHARE / 'config' / 'policy_tiny.yaml'
NAMESPACE = 'example'
CAMERAS = [f'/{NAMESPACE}/front/image_raw', f'/{NAMESPACE}/wrist/image_raw']
JOINTS = ['jaco_joint_1', 'jaco_joint_2', 'jaco_joint_3', 'jaco_joint_4', 'jaco_joint_5',
          'jaco_joint_6', 'jaco_finger_1']      # PARAMS_FILE's joint_names
TIMEOUT = 90.0      # s: the node imports torch and builds the model before the first chunk


@pytest.mark.launch_test
def generate_test_description():
    policy = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(str(SHARE / 'launch' / 'policy.launch.py')),
        launch_arguments={
            'params_file': str(PARAMS_FILE), 'namespace': NAMESPACE,
            'camera_topics': '[' + ', '.join(CAMERAS) + ']',     # a YAML list
            'joint_state_topic': f'/{NAMESPACE}/joint_states'}.items())
    return launch.LaunchDescription([policy, launch_testing.actions.ReadyToTest()])


class TestTheNodeServesChunks(unittest.TestCase):
    def setUp(self):
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node('example_robot', context=self.context)
        self.chunks, self.arrived = [], threading.Event()
        self.node.create_subscription(
            JointTrajectory, f'/{NAMESPACE}/molmobot_policy/joint_trajectory',
            lambda msg: (self.chunks.append(msg), self.arrived.set()), 10)
        cameras = [self.node.create_publisher(Image, topic, qos_profile_sensor_data)
                   for topic in CAMERAS]
        joints = self.node.create_publisher(JointState, f'/{NAMESPACE}/joint_states', 10)

        def publish():      # what the robot's drivers publish, stamped now
            stamp = self.node.get_clock().now().to_msg()
            for camera in cameras:
                frame = Image(height=48, width=64, encoding='rgb8', step=64 * 3,
                              data=bytes(48 * 64 * 3))
                frame.header.stamp = stamp
                camera.publish(frame)
            state = JointState(name=JOINTS, position=[0.0] * len(JOINTS))
            state.header.stamp = stamp
            joints.publish(state)
        self.node.create_timer(0.1, publish)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def _spin(self):
        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    def tearDown(self):
        rclpy.try_shutdown(context=self.context)
        self.thread.join(timeout=5.0)

    def test_a_chunk_arrives_for_the_configured_joints(self):
        self.assertTrue(self.arrived.wait(TIMEOUT), f'no chunk within {TIMEOUT:.0f} s')
        chunk = self.chunks[0]
        self.assertEqual(list(chunk.joint_names), JOINTS)
        self.assertGreater(len(chunk.points), 0)


@launch_testing.post_shutdown_test()
class TestEveryProcessExitsCleanly(unittest.TestCase):
    def test_exit_codes(self, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info)
