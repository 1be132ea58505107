"""`make demo` with compressed cameras (`python -m molmobot_policy_demo.demo --compressed`): the
simulated Jaco publishes sensor_msgs/CompressedImage (jpeg) on `<camera topic>/compressed`,
the policy node subscribes there (camera_transports) and chunks arrive. The demo stops once
`--chunks` chunks came (event-driven; --duration is only the limit), then names the PNGs it
wrote to --plots-dir."""
import os
import re
import subprocess
import sys
from pathlib import Path

import cv2
import pytest

pytest.importorskip('rclpy')
pytest.importorskip('dm_control')

REPO = Path(__file__).resolve().parents[1]
CHUNKS = 2


@pytest.mark.timeout(400)
def test_the_demo_runs_end_to_end_on_compressed_cameras(tmp_path):
    env = dict(os.environ, MUJOCO_GL=os.environ.get('MUJOCO_GL', 'egl'), PYTHONUNBUFFERED='1')
    done = subprocess.run([sys.executable, '-m', 'molmobot_policy_demo.demo', '--compressed',
                           '--chunks', str(CHUNKS), '--duration', '300', '--verbose',
                           '--plots-dir', str(tmp_path / 'pictures')],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=380)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert '(compressed, on /cam0/image_raw/compressed' in out, out[-4000:]     # sim_robot
    active = re.search(r'active: 8 cameras \(([^)]*)\)', out)
    assert active and active.group(1).split(', ') == [
        f'/cam{k}/image_raw/compressed' for k in range(8)], out[-4000:]
    published = re.search(r'demo: chunks published: (\d+)', out)
    assert published and int(published.group(1)) >= CHUNKS, out[-4000:]
    assert 'newest frame refused' not in out, out[-4000:]    # every jpeg decoded
    named = re.findall(r'^demo:   (\S+\.png) \(', out, re.MULTILINE)
    assert sorted(Path(p).name for p in named) == sorted(
        ['latency_timeline.png', 'jitter_histogram.png', 'joint_trajectories.png',
         'camera_frames.png']), out[-4000:]
    for path in named:      # where --plots-dir said, each a PNG
        assert Path(path).parent == (tmp_path / 'pictures').resolve(), path
        assert cv2.imread(path) is not None, path
