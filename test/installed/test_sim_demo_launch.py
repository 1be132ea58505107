"""launch_testing test of molmobot_policy_demo's installed launch/sim_demo.launch.py (and so
molmobot_policy's policy.launch.py): the simulated robot and the policy node under
`namespace:=launch_test` with `autostart:=false` and an `instruction` argument. Checks that the launch arguments reach the node's parameters,
that lifecycle transitions (configure, activate) through the node's services start the
chunks, that a chunk carries the configured joint names, that /diagnostics is published, and
that every process exits with status 0 when the launch shuts down.

Skipped, saying why, where the launch stack is not importable or no ament prefix holds the
packages (`make test` provides both: scripts/test_ros_install.sh).
"""
import threading
import unittest

import pytest

from _installed import DEMO_PACKAGE, NO_LAUNCH, PACKAGE, installed_prefix

try:
    import launch
    import launch_testing.actions
    import launch_testing.asserts
    from launch.actions import IncludeLaunchDescription
    from launch.launch_description_sources import PythonLaunchDescriptionSource
except ImportError as error:
    pytest.skip(NO_LAUNCH.format(error=error), allow_module_level=True)

import rclpy  # noqa: E402
import yaml  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from lifecycle_msgs.msg import State, Transition  # noqa: E402
from lifecycle_msgs.srv import ChangeState, GetState  # noqa: E402
from rcl_interfaces.srv import GetParameters  # noqa: E402
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

SHARE = installed_prefix() / 'share' / PACKAGE
DEMO_SHARE = installed_prefix(DEMO_PACKAGE) / 'share' / DEMO_PACKAGE
NODE = '/launch_test/molmobot_policy'
# with ': ' a YAML mapping: the launch file must hand it over as the string it is
INSTRUCTION = 'stack: the red brick on the blue brick'
TINY = yaml.safe_load((SHARE / 'config' / 'policy_tiny.yaml').read_text())
TINY_JOINTS = next(iter(TINY.values()))['ros__parameters']['action_joint_names']
TIMEOUT = 90.0      # s: the node imports torch and builds the tiny model; the sim loads MuJoCo


@pytest.mark.launch_test
def generate_test_description():
    sim_demo = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(str(DEMO_SHARE / 'launch' / 'sim_demo.launch.py')),
        launch_arguments={'namespace': 'launch_test', 'autostart': 'false',
                          'instruction': INSTRUCTION}.items())
    return launch.LaunchDescription([sim_demo, launch_testing.actions.ReadyToTest()])


class Observer:
    """An rclpy node of the test, spun in a thread, holding what arrived."""

    def __init__(self) -> None:
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node('launch_test_observer', context=self.context)
        self.chunks, self.chunk_arrived = [], threading.Event()
        self.diagnostics, self.diagnostics_arrived = [], threading.Event()
        self.node.create_subscription(JointTrajectory, f'{NODE}/joint_trajectory',
                                      self._on_chunk, 10)
        self.node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diagnostics, 10)
        self.change_state = self.node.create_client(ChangeState, f'{NODE}/change_state')
        self.get_state = self.node.create_client(GetState, f'{NODE}/get_state')
        self.get_parameters = self.node.create_client(GetParameters, f'{NODE}/get_parameters')
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def _spin(self) -> None:
        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    def _on_chunk(self, msg) -> None:
        self.chunks.append(msg)
        self.chunk_arrived.set()

    def _on_diagnostics(self, msg) -> None:
        # status names carry the node's namespace: 'launch_test/molmobot_policy: output'
        if any(status.name.startswith(f"{NODE.lstrip('/')}: ") for status in msg.status):
            self.diagnostics.append(msg)
            self.diagnostics_arrived.set()

    def call(self, client, request):
        assert client.wait_for_service(timeout_sec=TIMEOUT), f'{client.srv_name} not offered'
        future = client.call_async(request)
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        assert done.wait(TIMEOUT), f'{client.srv_name} did not answer within {TIMEOUT} s'
        return future.result()

    def state(self) -> int:
        return self.call(self.get_state, GetState.Request()).current_state.id

    def transition(self, transition_id: int) -> bool:
        request = ChangeState.Request(transition=Transition(id=transition_id))
        return self.call(self.change_state, request).success

    def activate(self) -> None:
        """The first call: configure (-> inactive), then activate (-> active), each through
        the node's change_state service and checked with get_state; later calls: checks the
        node is active."""
        if self.state() == State.PRIMARY_STATE_UNCONFIGURED:
            assert self.transition(Transition.TRANSITION_CONFIGURE), 'configure failed'
            assert self.state() == State.PRIMARY_STATE_INACTIVE
            assert self.transition(Transition.TRANSITION_ACTIVATE), 'activate failed'
        assert self.state() == State.PRIMARY_STATE_ACTIVE

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=2.0)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)
        self.thread.join(timeout=5.0)


class TestPolicyNodeUnderLaunch(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.ros = Observer()
        cls.initial_state = cls.ros.state()     # before any test's transitions

    @classmethod
    def tearDownClass(cls):
        cls.ros.close()

    def test_autostart_false_leaves_the_node_unconfigured(self):
        self.assertEqual(self.initial_state, State.PRIMARY_STATE_UNCONFIGURED)

    def test_launch_arguments_reach_the_node_parameters(self):
        names = ['instruction', 'autostart', 'camera_topics']
        reply = self.ros.call(self.ros.get_parameters, GetParameters.Request(names=names))
        values = [reply.values[0].string_value, reply.values[1].bool_value,
                  list(reply.values[2].string_array_value)]
        expected_cameras = next(iter(TINY.values()))['ros__parameters']['camera_topics']
        self.assertEqual(values, [INSTRUCTION, False, expected_cameras])

    def test_configure_then_activate_starts_the_chunks(self):
        self.ros.activate()
        self.assertTrue(self.ros.chunk_arrived.wait(TIMEOUT), f'no chunk on {NODE}/'
                        f'joint_trajectory within {TIMEOUT} s of activation')

    def test_a_chunk_carries_the_configured_joint_names(self):
        self.ros.activate()
        self.assertTrue(self.ros.chunk_arrived.wait(TIMEOUT))
        self.assertEqual(list(self.ros.chunks[0].joint_names), TINY_JOINTS)
        self.assertGreater(len(self.ros.chunks[0].points), 0)

    def test_diagnostics_are_published(self):
        self.ros.activate()
        self.assertTrue(self.ros.diagnostics_arrived.wait(TIMEOUT),
                        f'no molmobot_policy status on /diagnostics within {TIMEOUT} s')


@launch_testing.post_shutdown_test()
class TestShutdown(unittest.TestCase):

    def test_every_process_exits_with_status_0(self, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info)

    def test_the_policy_node_stopped_after_serving_chunks(self, proc_output):
        text = ''.join(output.text.decode(errors='replace') for output in proc_output
                       if output.process_name.startswith('policy_node'))
        self.assertRegex(text, r'shutting down after [1-9]\d* chunks?')
