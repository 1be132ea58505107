"""The pictures of the demo and the node benchmark (`molmobot_policy_demo.sim.plots`), and the
demo's path from received messages to PNGs named in its summary (`demo.Monitor`), on small
synthetic data: each PNG exists, decodes, has its declared size and shows what it is for."""
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy')

from molmobot_policy_demo import demo  # noqa: E402
from molmobot_policy.ros.messages import ChunkInfo  # noqa: E402
from molmobot_policy_demo.sim import plots  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
JOINTS = [f'jaco_joint_{k}' for k in range(1, 7)] + ['jaco_finger_1']
COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (255, 0, 255),
           (0, 255, 255), (128, 0, 0), (0, 128, 0)]      # RGB, one per camera


def _chunks(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{ChunkInfo.TICK: str(k), ChunkInfo.OBSERVATION_STAMP: f'{100.0 + 1.5 * k:.6f}',
             ChunkInfo.OBSERVATION_AGE_MS: f'{600 + rng.normal(0, 30):.1f}',
             ChunkInfo.INFERENCE_MS: f'{400 + rng.normal(0, 30):.1f}',
             ChunkInfo.PUBLISH_JITTER_MS: f'{abs(rng.normal(0.5, 0.3)):.3f}'}
            for k in range(n)]


def _planned(n: int) -> list:
    rng = np.random.default_rng(1)
    return [(JOINTS, 101.0 + 1.5 * i + 0.2 * np.arange(16),
             np.cumsum(rng.normal(0, 0.05, (16, len(JOINTS))), axis=0)) for i in range(n)]


def _solid_frames() -> list[np.ndarray]:
    return [np.full((64, 80, 3), colour, dtype=np.uint8) for colour in COLOURS]


def _read(path, kind: str) -> np.ndarray:
    """The PNG as RGB, after checking it decodes to the size `plots` declares for `kind`."""
    assert path.is_file(), path
    image = cv2.imread(str(path), cv2.IMREAD_COLOR)
    assert image is not None, f'{path} does not decode as an image'
    width, height = plots.size_pixels(kind)
    assert image.shape == (height, width, 3), (path, image.shape)
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def _pixels_of(image: np.ndarray, colour) -> int:
    return int(np.all(image == np.array(colour, dtype=np.uint8), axis=-1).sum())


def test_latency_timeline_writes_a_png_of_its_declared_size(tmp_path):
    path = plots.latency_timeline(tmp_path / 'timeline.png', _chunks(12), 'synthetic run',
                                  {'chunk_period 1500 ms': 1500.0}, {'WARN 10 ms': 10.0})
    _read(path, 'timeline')


def test_jitter_histogram_writes_a_png_of_its_declared_size(tmp_path):
    jitter = [float(c[ChunkInfo.PUBLISH_JITTER_MS]) for c in _chunks(40)]
    _read(plots.jitter_histogram(tmp_path / 'sub' / 'hist.png', jitter, 'synthetic run',
                                 {'target p99 2 ms': 2.0}), 'histogram')


def test_joint_trajectories_writes_a_png_of_its_declared_size(tmp_path):
    times = np.arange(99.0, 120.0, 0.02)
    executed_names = JOINTS + ['jaco_finger_2', 'jaco_finger_3']
    positions = np.sin(times[:, None] + np.arange(len(executed_names)))
    _read(plots.joint_trajectories(tmp_path / 'traj.png', _planned(10), executed_names,
                                   times, positions, 'synthetic run'), 'trajectories')


def test_contact_sheet_shows_every_camera_frame(tmp_path):
    sheet = _read(plots.contact_sheet(tmp_path / 'sheet.png', _solid_frames(),
                                      [f'/cam{k}/image_raw' for k in range(8)],
                                      'stack the red brick on the blue brick', 'synthetic'),
                  'contact_sheet')
    for colour in COLOURS:      # each 80x64 frame is drawn some 290 x 230 pixels large
        assert _pixels_of(sheet, colour) > 20_000, colour


def test_every_picture_is_written_without_data(tmp_path):
    """A run in which nothing was published still gets its pictures, saying so."""
    _read(plots.latency_timeline(tmp_path / 't.png', [], 'nothing'), 'timeline')
    _read(plots.jitter_histogram(tmp_path / 'h.png', [], 'nothing'), 'histogram')
    _read(plots.joint_trajectories(tmp_path / 'j.png', [], [], np.zeros(0), np.zeros((0, 0)),
                                   'nothing'), 'trajectories')
    _read(plots.contact_sheet(tmp_path / 'c.png', [None, None], ['/a', '/b'], 'go', 'nothing'),
          'contact_sheet')


# ---------------------------------------------------------------- the demo's summary
def _feed(monitor: 'demo.Monitor') -> None:
    """What the demo receives from the sim robot and the policy node, as messages."""
    from diagnostic_msgs.msg import DiagnosticStatus
    from sensor_msgs.msg import Image, JointState
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    from molmobot_policy.ros.messages import key_values
    for values in _chunks(6):
        monitor._on_chunk_info(DiagnosticStatus(values=key_values(
            {**values, ChunkInfo.POINTS: '16', ChunkInfo.FIRST_ACTION: '[0.0]'})))
    for names, times, positions in _planned(6):
        msg = JointTrajectory(joint_names=list(names))
        msg.header.stamp.sec = int(times[0])
        msg.header.stamp.nanosec = int(round((times[0] % 1) * 1e9))
        for t, p in zip(times - times[0], positions):
            point = JointTrajectoryPoint(positions=[float(x) for x in p])
            point.time_from_start.sec, point.time_from_start.nanosec = int(t), int(
                round((t % 1) * 1e9))
            msg.points.append(point)
        monitor._on_trajectory(msg)
    for k in range(500):
        msg = JointState(name=JOINTS, position=[0.1 * np.sin(0.05 * k + j) for j in range(7)])
        msg.header.stamp.sec, msg.header.stamp.nanosec = 100 + k // 50, (k % 50) * 20_000_000
        monitor._on_joint_state(msg)
    for topic, frame in zip(monitor.camera_topics, _solid_frames()):
        monitor._on_image(topic, Image(height=64, width=80, encoding='rgb8', step=240,
                                       data=frame.tobytes()))


def _print_demo_plots(folder, feed: bool) -> None:
    """The demo's summary of pictures into `folder`, from a Monitor fed like a run
    (`_feed`) or given nothing (stopped before any chunk)."""
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node('demo_plots_test', context=context)
    try:
        settings = demo.policy_settings(demo._config('policy_tiny.yaml'))
        monitor = demo.Monitor(node, [(f'/cam{k}/image_raw', False) for k in range(8)])
        if feed:
            _feed(monitor)
        demo._print_plots(monitor, folder, settings)
    finally:
        node.destroy_node()
        rclpy.shutdown(context=context)


def test_the_demo_summary_names_each_picture_it_wrote(tmp_path, capsys):
    _print_demo_plots(tmp_path / 'demo_output', feed=True)
    out = capsys.readouterr().out
    folder = (tmp_path / 'demo_output').resolve()
    assert f'demo: pictures in {folder}:' in out, out
    kinds = {'latency_timeline.png': 'timeline', 'jitter_histogram.png': 'histogram',
             'joint_trajectories.png': 'trajectories', 'camera_frames.png': 'contact_sheet'}
    assert set(demo.PLOTS) == set(kinds)
    for name, kind in kinds.items():
        assert f'demo:   {folder / name} (' in out, (name, out)
        _read(folder / name, kind)
    sheet = _read(folder / 'camera_frames.png', 'contact_sheet')
    for colour in COLOURS:      # the frames received on the camera topics
        assert _pixels_of(sheet, colour) > 20_000, colour


def test_policy_settings_reads_the_section_ros_applies_to_the_node(tmp_path):
    params = tmp_path / 'p.yaml'
    params.write_text('other_node:\n  ros__parameters:\n    instruction: not this\n'
                      '/**:\n  ros__parameters:\n    instruction: open the drawer\n'
                      '    chunk_period: 0.5\n')
    settings = demo.policy_settings(params)
    assert settings['instruction'] == 'open the drawer' and settings['chunk_period'] == 0.5
    assert settings['device'] == 'cpu'        # not in the file: the node's default


def test_the_robot_runtime_neither_imports_nor_installs_matplotlib():
    """matplotlib is the demo's (requirements/demo.txt): the node runs without it."""
    code = ('import sys, molmobot_policy.ros.main, molmobot_policy.ros.node, '
            'molmobot_policy.runtime.engine, molmobot_policy_demo.demo, '
            'molmobot_policy_demo.sim.plots; '
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))")
    done = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == '[]', done.stdout
    runtime = (REPO / 'requirements' / 'runtime.txt').read_text()
    assert 'matplotlib' not in runtime
    assert 'matplotlib==' in (REPO / 'requirements' / 'demo.txt').read_text()


def test_the_demo_writes_no_pictures_without_a_chunk_and_keeps_the_earlier_ones(tmp_path,
                                                                                 capsys):
    """Stopped before the first chunk, the demo replaced the last run's pictures with empty
    ones (fourth fresh-user trial)."""
    folder = tmp_path / 'demo_output'
    folder.mkdir()
    earlier = folder / 'latency_timeline.png'
    earlier.write_bytes(b'the last run')
    _print_demo_plots(folder, feed=False)
    out = capsys.readouterr().out
    assert 'demo: no pictures (no chunk was received)' in out, out
    assert earlier.read_bytes() == b'the last run'
    assert sorted(p.name for p in folder.iterdir()) == ['latency_timeline.png']


def test_the_demo_summary_names_each_diagnostics_level():
    """Each status not OK at the end is listed with its level (WARN / ERROR), OK ones not."""
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node('demo_summary_test', context=context)
    try:
        monitor = demo.Monitor(node, [])
        statuses = [DiagnosticStatus(level=level, name=name, message=message)
                    for level, name, message in ((DiagnosticStatus.WARN, 'inference', 'slow'),
                                                 (DiagnosticStatus.ERROR, 'output', 'none'),
                                                 (DiagnosticStatus.OK, 'schedule', 'ok'))]
        monitor._on_diagnostics(DiagnosticArray(status=statuses))
        lines = monitor.summary().splitlines()
    finally:
        node.destroy_node()
        rclpy.shutdown(context=context)
    assert 'demo:   inference (WARN): slow' in lines, lines
    assert 'demo:   output (ERROR): none' in lines, lines
    assert not any('schedule' in line for line in lines if line.startswith('demo:   ')), lines
