"""The policy node as a separate process over real DDS (what the launch_testing test checks
on a full ROS 2 install): 8 camera streams + joint state in, JointTrajectory chunks out.

The node runs the tiny random-weight model on the CPU. The test process publishes small
images (64x80, mixed encodings) at 10 Hz and the joint state at 20 Hz, stamped with the
current time.
"""
import math
import threading

import numpy as np
import pytest

pytest.importorskip('rclpy')

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

from molmobot_policy.ros.messages import ChunkInfo  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CAMERAS = [f'/cam{k}/image_raw' for k in range(8)]
ENCODINGS = ['rgb8', 'bgr8', 'rgba8', 'bgra8', 'mono8', 'rgb8', 'bgr8', 'rgb8']
CHANNELS = {'rgb8': 3, 'bgr8': 3, 'rgba8': 4, 'bgra8': 4, 'mono8': 1}
JOINTS = [f'jaco_joint_{k}' for k in range(1, 7)] + ['jaco_finger_1']
HEIGHT, WIDTH = 64, 80
HORIZON = 16                 # the tiny model's action_horizon
CONTROL_PERIOD = 0.2
PARAMETERS = {
    'camera_topics': CAMERAS,
    'joint_state_topic': '/joint_states',
    'joint_names': JOINTS,
    'action_joint_names': JOINTS,
    'instruction': 'stack the red brick on the blue brick',
    'chunk_period': 1.0,
    'control_period': CONTROL_PERIOD,
    'max_image_age': 0.6,
    'max_state_age': 0.6,
    'model': 'tiny',
    'allow_random_weights': True,
    'device': 'cpu',
    'diagnostics_period': 0.5,
}
STARTUP_TIMEOUT = 60.0       # import torch + build + warm up the tiny model on 2 cores


def _seconds(stamp) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


class Robot:
    """Publishes the 8 cameras and the joint state; records what the node sends back."""

    def __init__(self, ros) -> None:
        node = ros.node
        self.clock = node.get_clock()
        self.paused: set[str] = set()
        self.broken: set[str] = set()
        self.lock = threading.Lock()
        self.trajectories: list[tuple[float, JointTrajectory]] = []
        self.chunk_infos: list[dict] = []
        self.diagnostics: list[DiagnosticArray] = []
        rng = np.random.default_rng(0)
        self.images = {t: rng.integers(0, 256, (HEIGHT, WIDTH, CHANNELS[e]), np.uint8)
                       for t, e in zip(CAMERAS, ENCODINGS)}
        self.camera_pubs = {t: node.create_publisher(Image, t, qos_profile_sensor_data)
                            for t in CAMERAS}
        self.joint_pub = node.create_publisher(JointState, '/joint_states', 10)
        node.create_subscription(JointTrajectory, '/molmobot_policy/joint_trajectory',
                                 self._on_trajectory, 10)
        node.create_subscription(DiagnosticStatus, '/molmobot_policy/chunk_info',
                                 self._on_chunk_info, 10)
        node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diagnostics, 10)
        self.timers = [node.create_timer(0.1, self._publish_cameras),
                       node.create_timer(0.05, self._publish_joint_state)]

    def _publish_cameras(self) -> None:
        stamp = self.clock.now().to_msg()
        for (topic, pixels), encoding in zip(self.images.items(), ENCODINGS):
            if topic in self.paused:
                continue
            msg = Image(height=HEIGHT, width=WIDTH, encoding=encoding,
                        step=WIDTH * CHANNELS[encoding], data=pixels.tobytes())
            if topic in self.broken:
                msg.data = pixels.tobytes()[:-7]
            msg.header.stamp = stamp
            self.camera_pubs[topic].publish(msg)

    def _publish_joint_state(self) -> None:
        # names in a different order than the parameter, plus a joint the policy ignores
        names = ['jaco_finger_2'] + JOINTS[::-1]
        msg = JointState(name=names, position=[0.0] + [0.1 * k for k in range(len(JOINTS))])
        msg.header.stamp = self.clock.now().to_msg()
        self.joint_pub.publish(msg)

    def _on_trajectory(self, msg: JointTrajectory) -> None:
        with self.lock:
            self.trajectories.append((self.clock.now().nanoseconds * 1e-9, msg))

    def _on_chunk_info(self, msg: DiagnosticStatus) -> None:
        with self.lock:
            self.chunk_infos.append({kv.key: kv.value for kv in msg.values})

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        with self.lock:
            self.diagnostics.append(msg)

    def chunks_after(self, t: float) -> list[JointTrajectory]:
        with self.lock:
            return [m for received, m in self.trajectories if received > t]

    def schedule(self) -> dict:
        """The latest /diagnostics schedule status's values ({} before any)."""
        with self.lock:
            arrays = list(self.diagnostics)
        for array in reversed(arrays):
            for status in array.status:
                if status.name == 'molmobot_policy: schedule':
                    return {kv.key: kv.value for kv in status.values}
        return {}


@pytest.fixture(scope='module')
def robot(ros):
    return Robot(ros)


@pytest.fixture(scope='module')
def policy(start_policy_node, robot, ros):
    node = start_policy_node(PARAMETERS)
    if not ros.wait_for(lambda: robot.chunks_after(0.0) or not node.running(), STARTUP_TIMEOUT):
        pytest.fail(f'no JointTrajectory within {STARTUP_TIMEOUT} s; node log:\n{node.log()}')
    assert node.running(), f'node exited:\n{node.log()}'
    return node


def _now(robot) -> float:
    return robot.clock.now().nanoseconds * 1e-9


def test_chunks_are_well_formed_joint_trajectories(policy, robot, ros):
    start = _now(robot)
    assert ros.wait_for(lambda: len(robot.chunks_after(start)) >= 2, 15.0), policy.log()
    chunks = robot.chunks_after(start)

    def info_of(msg):
        """The ~/chunk_info whose first action time is this trajectory's header stamp."""
        stamp = _seconds(msg.header.stamp)
        with robot.lock:
            infos = list(robot.chunk_infos)
        for info in infos:
            first = (float(info[ChunkInfo.OBSERVATION_STAMP])
                     + int(info[ChunkInfo.DROPPED]) * CONTROL_PERIOD)
            if abs(first - stamp) < 1e-4:       # chunks are >= 0.2 s apart
                return info
        return None

    # the node publishes a trajectory, then its chunk_info: wait for the latest one's
    assert ros.wait_for(lambda: all(info_of(msg) is not None for msg in chunks), 5.0), \
        policy.log()
    for msg in chunks:
        assert list(msg.joint_names) == JOINTS
        info = info_of(msg)
        assert len(msg.points) == HORIZON - int(info[ChunkInfo.DROPPED]) \
            == int(info[ChunkInfo.POINTS])
        assert len(msg.points) >= 1
        offsets = [p.time_from_start.sec * 10**9 + p.time_from_start.nanosec
                   for p in msg.points]
        assert offsets == [round(j * CONTROL_PERIOD * 1e9) for j in range(len(msg.points))]
        assert _seconds(msg.header.stamp) > float(info[ChunkInfo.OBSERVATION_STAMP])
        for point in msg.points:
            assert len(point.positions) == len(JOINTS)
            assert np.all(np.isfinite(point.positions))


def test_chunk_info_has_no_delay_clues_without_debug_timing(policy, robot, ros):
    start = _now(robot)
    assert ros.wait_for(lambda: len(robot.chunks_after(start)) >= 1, 15.0), policy.log()
    with robot.lock:
        infos = list(robot.chunk_infos)
    assert infos and all(not set(ChunkInfo.DELAY) & set(info) for info in infos), infos[-1]


def test_chunks_are_published_once_per_chunk_period(policy, robot, ros):
    start = _now(robot)
    assert ros.wait_for(lambda: len(robot.chunks_after(start)) >= 3, 20.0), policy.log()
    with robot.lock:
        infos = list(robot.chunk_infos)
    ticks = [int(info[ChunkInfo.TICK]) for info in infos]
    assert ticks == sorted(set(ticks))      # one chunk per tick, in tick order


def test_observations_are_never_reused_or_older(policy, robot, ros):
    start = _now(robot)
    assert ros.wait_for(lambda: len(robot.chunks_after(start)) >= 2, 15.0), policy.log()
    with robot.lock:
        stamps = [float(info[ChunkInfo.OBSERVATION_STAMP]) for info in robot.chunk_infos]
        seqs = [int(info[ChunkInfo.OBSERVATION_SEQ]) for info in robot.chunk_infos]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    assert seqs == sorted(set(seqs))


def test_diagnostics_report_cameras_inference_and_schedule(policy, robot, ros):
    start = len(robot.diagnostics)
    assert ros.wait_for(lambda: len(robot.diagnostics) > start + 1, 10.0)
    statuses = {s.name: s for s in robot.diagnostics[-1].status}
    for topic in CAMERAS:
        camera = statuses[f'molmobot_policy: camera {topic}']
        values = {kv.key: kv.value for kv in camera.values}
        assert float(values['rate_hz']) > 5.0 and float(values['age_ms']) < 600.0
    assert 'molmobot_policy: joint state /joint_states' in statuses
    inference = {kv.key: kv.value for kv in statuses['molmobot_policy: inference'].values}
    assert math.isfinite(float(inference['inference_p50_ms']))     # inference was timed
    assert inference['engine_model'] == 'tiny'
    schedule = {kv.key: kv.value for kv in statuses['molmobot_policy: schedule'].values}
    for key in ('publish_jitter_p50_ms', 'publish_jitter_p99_ms', 'publish_jitter_max_ms',
                'sensor_to_publish_age_p99_ms', 'deadline_misses', 'dropped_actions',
                'skipped_ticks'):
        assert key in schedule
    assert int(schedule['chunks_published']) >= 1
    assert math.isfinite(float(schedule['gc_pause_max_since_activate_ms']))
    assert len(schedule['gc_collections'].split('/')) == 3     # generations 0/1/2


def test_stopped_camera_is_warned_about_and_publishing_resumes(policy, robot, ros):
    log_start = len(policy.log())
    robot.paused.add('/cam3/image_raw')
    paused_at = _now(robot)
    try:
        assert policy.wait_for_log('/cam3/image_raw is stale', 10.0, start=log_start), \
            policy.log()[log_start:]
        assert ros.wait_for(robot.schedule, 10.0)          # a /diagnostics schedule status
        skipped = int(robot.schedule()['skipped_ticks'])
        # two more ticks decided without cam3 (reported on /diagnostics)
        assert ros.wait_for(lambda: int(robot.schedule()['skipped_ticks']) >= skipped + 2,
                            10.0), policy.log()[log_start:]
        assert policy.running()
        with robot.lock:      # nothing was built without cam3: every observation predates it
            assert all(float(info[ChunkInfo.OBSERVATION_STAMP]) <= paused_at
                       for info in robot.chunk_infos)
    finally:
        robot.paused.discard('/cam3/image_raw')
    resumed = _now(robot)
    assert ros.wait_for(lambda: robot.chunks_after(resumed), 15.0), policy.log()[log_start:]
    assert policy.running()


def test_bad_image_is_reported_and_the_node_keeps_running(policy, robot, ros):
    log_start = len(policy.log())
    robot.broken.add('/cam1/image_raw')
    try:
        assert policy.wait_for_log("image on '/cam1/image_raw'", 10.0, start=log_start), \
            policy.log()[log_start:]
        assert policy.running()
    finally:
        robot.broken.discard('/cam1/image_raw')
    resumed = _now(robot)
    assert ros.wait_for(lambda: robot.chunks_after(resumed), 15.0), policy.log()[log_start:]


def test_node_exits_cleanly_on_sigint(policy):
    assert policy.stop(timeout=15.0) == 0, policy.log()[-2000:]
