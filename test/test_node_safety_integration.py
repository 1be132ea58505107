"""The policy node as a separate process over real DDS, started as a robot would start it:
under a namespace (`-r __ns:=/robot1 --params-file`) on sim time, with the test process
publishing /clock, two cameras and the joint state (stamped on that clock). In order:
a plain `molmobot_policy:` section under the namespace is refused; without /clock the node
says it waits and /diagnostics (on the steady clock) says ERROR; once /clock runs, the first
point is within the velocity limit of the measured joint state (2 rad from any plan);
future-stamped and unset-stamp frames are refused and named, never used; a /clock jump back
by 10 s is detected at once and publishing resumes in the new time base.

Every wait is for an event with a timeout; nothing asserts that something did not arrive
after a fixed sleep.
"""
import re
import threading
import time

import numpy as np
import pytest

pytest.importorskip('rclpy')

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from rosgraph_msgs.msg import Clock  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

from molmobot_policy.ros.messages import ChunkInfo, stamp_seconds  # noqa: E402

from conftest import RosHarness  # noqa: E402  (test/conftest.py: its wait_for)

pytestmark = pytest.mark.timeout(180)

NAMESPACE, FQN = '/robot1', '/robot1/molmobot_policy'
CAMERAS = ['/safety_cam0', '/safety_cam1']
JOINT_STATES = '/safety_joint_states'
JOINTS = [f'jaco_joint_{k}' for k in range(1, 7)] + ['jaco_finger_1']
MEASURED = 2.0               # rad, every joint: far from any plan of the random tiny model
VELOCITY = 0.5               # max_joint_velocity, rad/s
CONTROL_PERIOD = 0.2
SIM_START = 1000.0           # s of sim time when /clock starts
PARAMETERS = {
    'use_sim_time': True,
    'camera_topics': CAMERAS, 'joint_state_topic': JOINT_STATES,
    'joint_names': JOINTS, 'action_joint_names': JOINTS,
    'instruction': 'stack the red brick on the blue brick',
    'chunk_period': 1.0, 'control_period': CONTROL_PERIOD,
    'max_image_age': 0.6, 'max_state_age': 0.6,
    # the node's clock follows /clock messages sent every 10 ms from this process; on a busy
    # machine one can arrive late, so frames stamped now may read slightly ahead of it
    'max_future_stamp': 0.3,
    'max_joint_velocity': [VELOCITY], 'output_error_periods': 2,
    'model': 'tiny', 'allow_random_weights': True, 'device': 'cpu',
    'diagnostics_period': 0.5,
}
STARTUP_TIMEOUT = 90.0       # import torch + build + warm up the tiny model on 2 busy cores


class SimClock:
    """Sim time published on /clock every 10 ms once started: SIM_START + wall seconds since
    start + `shift` (s; lower it to jump back). `paused` stops the messages (a paused
    simulator); `resume()` goes on from where it stood."""

    def __init__(self, node) -> None:
        self._publisher = node.create_publisher(Clock, '/clock', 10)
        self._started = None
        self.shift = 0.0
        self.paused = None          # sim time it stands at, while paused
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def start(self) -> None:
        self._started = time.monotonic()

    def now(self):
        """Sim time, s, or None before start."""
        if self._started is None:
            return None
        if self.paused is not None:
            return self.paused
        return SIM_START + time.monotonic() - self._started + self.shift

    def pause(self) -> None:
        self.paused = self.now()

    def resume(self) -> None:
        stood, self.paused = self.paused, None
        self.shift -= self.now() - stood

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            now = self.now()
            if now is not None and self.paused is None:
                msg = Clock()
                msg.clock.sec, msg.clock.nanosec = int(now), int(now % 1 * 1e9)
                self._publisher.publish(msg)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


def _time_msg(seconds: float):
    from builtin_interfaces.msg import Time
    return Time(sec=int(seconds), nanosec=int(round(seconds % 1 * 1e9)) % 10**9)


class Robot:
    """Publishes the cameras and the joint state stamped in sim time (once /clock runs);
    `stamp_offset[topic]` shifts a camera's stamps (s), `unset` sends stamp 0; records the
    node's trajectories (with the sim time received), chunk infos and /diagnostics."""

    def __init__(self, ros) -> None:
        node = ros.node
        self.clock = SimClock(node)
        self.lock = threading.Lock()
        self.stamp_offset: dict[str, float] = {}
        self.unset: set[str] = set()
        self.trajectories: list[tuple[float, JointTrajectory]] = []
        self.chunk_infos: list[dict] = []
        self.diagnostics: list[DiagnosticArray] = []
        self.camera_pubs = {t: node.create_publisher(Image, t, qos_profile_sensor_data)
                            for t in CAMERAS}
        self.joint_pub = node.create_publisher(JointState, JOINT_STATES, 10)
        node.create_subscription(JointTrajectory, f'{FQN}/joint_trajectory',
                                 self._on_trajectory, 10)
        node.create_subscription(DiagnosticStatus, f'{FQN}/chunk_info', self._on_info, 10)
        node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diagnostics, 10)
        self.timer = node.create_timer(0.1, self._publish)
        self.pixels = np.random.default_rng(0).integers(0, 256, (48, 64, 3), np.uint8).tobytes()

    def _publish(self) -> None:
        now = self.clock.now()
        if now is None:
            return
        for topic, publisher in self.camera_pubs.items():
            msg = Image(height=48, width=64, encoding='rgb8', step=192, data=self.pixels)
            stamp = 0.0 if topic in self.unset else now + self.stamp_offset.get(topic, 0.0)
            msg.header.stamp = _time_msg(stamp)
            publisher.publish(msg)
        state = JointState(name=list(JOINTS), position=[MEASURED] * len(JOINTS))
        state.header.stamp = _time_msg(now)
        self.joint_pub.publish(state)

    def _on_trajectory(self, msg) -> None:
        with self.lock:
            self.trajectories.append((self.clock.now(), msg))

    def _on_info(self, msg) -> None:
        with self.lock:
            self.chunk_infos.append({kv.key: kv.value for kv in msg.values})

    def _on_diagnostics(self, msg) -> None:
        with self.lock:
            self.diagnostics.append(msg)

    def status(self, task: str):
        """The latest /diagnostics status 'robot1/molmobot_policy: <task>' (None before one)."""
        with self.lock:
            arrays = list(self.diagnostics)
        for array in reversed(arrays):
            for status in array.status:
                if status.name == f"{FQN.lstrip('/')}: {task}":
                    return status
        return None

    def info_of(self, msg):
        """The ~/chunk_info of trajectory `msg` (by its first point's time), or None."""
        stamp = stamp_seconds(msg.header.stamp)
        with self.lock:
            infos = list(self.chunk_infos)
        for info in infos:
            first = (float(info[ChunkInfo.OBSERVATION_STAMP])
                     + int(info[ChunkInfo.DROPPED]) * CONTROL_PERIOD)
            if abs(first - stamp) < 1e-4:
                return info
        return None


@pytest.fixture(scope='module')
def robot(ros):
    robot = Robot(ros)
    yield robot
    robot.clock.close()


@pytest.fixture(scope='module')
def policy(start_policy_node, robot):
    return start_policy_node(PARAMETERS, section=FQN, ros_args=['-r', f'__ns:={NAMESPACE}'])


def _status_is(robot, task, level, words):
    status = robot.status(task)
    return status is not None and status.level == level and words in status.message


# ------------------------------------------------------------------ namespace + params file
def test_a_plain_section_under_a_namespace_is_refused_at_configure(start_policy_node):
    """ROS would not apply `molmobot_policy:` to /robot1/molmobot_policy: the node would run
    on its defaults. It refuses to configure, naming the sections and the one expected."""
    node = start_policy_node(PARAMETERS, section='molmobot_policy',
                             ros_args=['-r', f'__ns:={NAMESPACE}'])
    node.process.wait(STARTUP_TIMEOUT)
    log = node.log()
    assert node.process.returncode == 1, log
    assert f"has no section for node '{FQN}'" in log and "['molmobot_policy']" in log, log
    assert f'expected {FQN}:, /**/molmobot_policy: or /**:' in log, log


# ------------------------------------------------------------------ no /clock
def test_without_clock_the_node_says_it_waits_and_the_output_status_is_error(policy, robot):
    assert policy.wait_for_log('waiting for /clock', STARTUP_TIMEOUT), policy.log()
    assert RosHarness.wait_for(lambda: _status_is(robot, 'output', DiagnosticStatus.ERROR,
                                            'waiting for /clock'), 15.0), policy.log()
    assert robot.trajectories == []        # the error state was reached with nothing sent


# ------------------------------------------------------------------ first point
def test_the_first_point_is_within_the_velocity_limit_of_the_measured_state(policy, robot):
    robot.clock.start()
    assert RosHarness.wait_for(lambda: robot.trajectories, 30.0), policy.log()[-3000:]
    _, msg = robot.trajectories[0]
    assert list(msg.joint_names) == JOINTS
    assert RosHarness.wait_for(lambda: robot.info_of(msg) is not None, 5.0)
    info = robot.info_of(msg)
    points = np.array([p.positions for p in msg.points])
    # the limiter's measurement is not older than the observation's joint state
    allowance = VELOCITY * max(stamp_seconds(msg.header.stamp)
                               - float(info[ChunkInfo.OBSERVATION_STAMP]), CONTROL_PERIOD)
    assert float(info[ChunkInfo.START_OFFSET]) > allowance    # the plan was out of reach
    assert np.all(np.abs(points[0] - MEASURED) <= allowance + 1e-6), (points[0], allowance)
    steps = np.abs(np.diff(points, axis=0))
    assert np.all(steps <= VELOCITY * CONTROL_PERIOD + 1e-6)
    assert int(info[ChunkInfo.VELOCITY_LIMITED]) > 0


# ------------------------------------------------------------------ only the present
def test_an_unset_stamp_is_refused_and_named_as_unset(policy, robot):
    start = len(policy.log())
    robot.unset.add(CAMERAS[0])
    try:
        assert policy.wait_for_log(f'camera {CAMERAS[0]}: newest frame refused: header stamp '
                                   'unset (0)', 10.0, start=start), policy.log()[start:]
    finally:
        robot.unset.discard(CAMERAS[0])
    assert not re.search(r'age \d{3,}', policy.log()[start:])   # no 'age 1000 s' from 0


def test_a_future_stamped_camera_is_refused_named_and_never_used(policy, robot):
    start, chunks = len(policy.log()), len(robot.trajectories)
    robot.stamp_offset[CAMERAS[1]] = 5.0
    try:
        assert policy.wait_for_log(f'camera {CAMERAS[1]}: newest frame refused: stamped ',
                                   10.0, start=start), policy.log()[start:]
        line = re.search(rf'camera {CAMERAS[1]}: newest frame refused: stamped ([\d.]+) s in '
                         r'the future.*are the clocks synchronized\?', policy.log()[start:])
        assert line and 4.5 < float(line.group(1)) < 5.5, policy.log()[start:]
        camera = f'camera {CAMERAS[1]}'
        assert RosHarness.wait_for(lambda: _status_is(robot, camera, DiagnosticStatus.ERROR,
                                                'in the future'), 10.0), robot.status(camera)
        assert RosHarness.wait_for(lambda: _status_is(robot, 'output', DiagnosticStatus.ERROR,
                                                CAMERAS[1]), 10.0), robot.status('output')
    finally:
        robot.stamp_offset.pop(CAMERAS[1])
    with robot.lock:
        received = list(robot.trajectories[chunks:])
    for at, msg in received:          # nothing scheduled seconds ahead from a future frame
        assert stamp_seconds(msg.header.stamp) < at + 1.0
    resumed = robot.clock.now()
    assert RosHarness.wait_for(lambda: any(at > resumed for at, _ in robot.trajectories), 15.0)


# ------------------------------------------------------------------ clock jump back
def test_a_clock_jump_back_is_detected_at_once_and_publishing_resumes(policy, robot):
    """10 s back: the stored inputs and schedule belong to the old time base. The jump is
    logged within seconds and chunks come again long before the old time is reached."""
    assert RosHarness.wait_for(lambda: robot.trajectories, 15.0)
    start, before = len(policy.log()), robot.clock.now()
    with robot.lock:
        chunks = len(robot.trajectories)
    robot.clock.shift -= 10.0
    jumped_at = time.monotonic()
    assert policy.wait_for_log('ROS time jumped back by', 5.0, start=start), \
        policy.log()[start:]

    def new_timeline():     # chunks received since, stamped in the new time base
        with robot.lock:
            return [msg for _, msg in robot.trajectories[chunks:]
                    if stamp_seconds(msg.header.stamp) < before - 5.0]
    assert RosHarness.wait_for(new_timeline, 8.0), policy.log()[start:]
    assert time.monotonic() - jumped_at < 9.0      # the old time base would take 10 s
    assert policy.running()


# ------------------------------------------------------------------ /clock stops
def test_sim_time_standing_still_is_logged_and_its_resumption_too(policy, robot):
    """/clock stops for ~5 s mid-run (a paused simulator): the node logs it, sends nothing
    meanwhile, says when ROS time moves again, and chunks come again."""
    assert RosHarness.wait_for(lambda: robot.trajectories, 15.0)
    start = len(policy.log())
    robot.clock.pause()
    stood = robot.clock.now()
    try:
        assert policy.wait_for_log('ROS time has stood at', 8.0, start=start), \
            policy.log()[start:]
        with robot.lock:
            chunks = len(robot.trajectories)
        time.sleep(1.0)
        with robot.lock:
            assert len(robot.trajectories) == chunks       # nothing sent while it stands
    finally:
        robot.clock.resume()
    assert policy.wait_for_log('ROS time moves again', 5.0, start=start), policy.log()[start:]
    assert RosHarness.wait_for(lambda: any(stamp_seconds(msg.header.stamp) > stood
                                           for _, msg in robot.trajectories[chunks:]), 10.0)
    assert policy.running()


def test_node_exits_cleanly_on_sigint(policy):
    assert policy.stop(timeout=15.0) == 0, policy.log()[-2000:]
    # its stop line names the node with its namespace, like every other line of it
    assert '[robot1.molmobot_policy]: SIGINT: stopping after the current step' in policy.log(), \
        policy.log()[-2000:]
