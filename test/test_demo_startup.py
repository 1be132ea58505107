"""`make demo`'s start-up: --duration counts from the policy node's first chunk; until then the
demo waits up to --startup-timeout, and when no chunk comes (or a process exits) it says why in
one line, with the node's ROS log file, instead of an empty summary."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from molmobot_policy_demo.demo import ros_log_file, startup_failure, startup_phase

REPO = Path(__file__).resolve().parents[1]


def test_no_chunk_within_the_startup_timeout_is_a_failure_naming_the_option():
    assert startup_failure(299.0, 300.0, 0, []) is None            # still starting
    assert startup_failure(301.0, 300.0, 0, []) == (
        'no chunk from the policy node within --startup-timeout 300 s')
    assert startup_failure(301.0, 300.0, 1, []) is None            # the run has begun


def test_a_process_that_exits_is_a_failure_naming_it_and_its_status():
    assert startup_failure(5.0, 300.0, 0, [('policy', 1)]) == (
        'policy exited with status 1 before the first chunk')
    assert startup_failure(50.0, 300.0, 7, [('sim_robot', -9)]) == (
        'sim_robot exited with status -9 after 7 chunks')


def test_the_startup_phase_says_what_is_awaited():
    assert 'not on the ROS graph yet' in startup_phase(False, True)
    assert 'configure' in startup_phase(True, True)
    assert 'no /joint_states from sim_robot' in startup_phase(True, False)
    assert 'sim_robot' not in startup_phase(True, True)


def test_the_node_log_is_found_by_process_id(tmp_path):
    (tmp_path / 'python_4242_100.log').write_text('old')
    (tmp_path / 'python_14242_200.log').write_text('another process')
    newest = tmp_path / 'python3_4242_300.log'
    newest.write_text('new')
    os.utime(tmp_path / 'python_4242_100.log', (1, 1))
    assert ros_log_file(4242, {'ROS_LOG_DIR': str(tmp_path)}) == newest
    assert ros_log_file(999, {'ROS_LOG_DIR': str(tmp_path)}) is None
    assert ros_log_file(4242, {'ROS_HOME': str(tmp_path / 'none')}) is None


@pytest.mark.timeout(120)
def test_a_startup_timeout_ends_the_demo_with_one_line_saying_why(tmp_path):
    pytest.importorskip('rclpy')
    pytest.importorskip('dm_control')
    env = dict(os.environ, MUJOCO_GL=os.environ.get('MUJOCO_GL', 'egl'), PYTHONUNBUFFERED='1',
               ROS_LOG_DIR=str(tmp_path / 'log'))
    done = subprocess.run([sys.executable, '-m', 'molmobot_policy_demo.demo', '--startup-timeout',
                           '0.5', '--no-plots'], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=100)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith('demo: FAILED: no chunk from the policy node within '
                           '--startup-timeout 0.5 s (the policy node '), out[-4000:]
    assert 'chunks published' not in out, out[-4000:]      # no summary of nothing
