"""`ros2 launch molmobot_policy policy.launch.py ...` as a user runs it from a shell: its
arguments listed with descriptions (`-s`), a run to the first chunk on topics set by the
launch arguments under a namespace, stopped by SIGINT as a terminal's Ctrl-C sends it (to
the process group; launch, reading a tty, leaves the node the one it got) and as a supervisor
without a tty does (to `ros2 launch` alone, which passes it on), every process finishing
cleanly; the default (no parameter file, no
checkpoint) refused by the node rather than served random weights; a malformed argument
named. Skipped, saying why, where `ros2` (ros2launch) or the installed package is missing
(`make test` provides both: scripts/test_ros_install.sh)."""
import os
import pty
import re
import shutil
import signal
import subprocess
import threading

import pytest

from _installed import NO_LAUNCH, PACKAGE, installed_prefix

pytest.importorskip('rclpy')
ROS2 = shutil.which('ros2')
if ROS2 is None:
    pytest.skip(NO_LAUNCH.format(error='no `ros2` on PATH'), allow_module_level=True)
pytest.importorskip('ros2launch', reason=NO_LAUNCH.format(error='no ros2launch'))

from _robot_inputs import publish_robot_inputs  # noqa: E402

SHARE = installed_prefix() / 'share' / PACKAGE
TINY = SHARE / 'config' / 'policy_tiny.yaml'
JOINTS = [f'jaco_joint_{k}' for k in range(1, 7)] + ['jaco_finger_1']   # policy_tiny.yaml's
ARGUMENTS = ('params_file', 'namespace', 'checkpoint_path', 'instruction', 'use_sim_time',
             'autostart', 'log_level', 'camera_topics', 'joint_state_topic', 'output_topic')
TIMEOUT = 90.0      # s: the node imports torch and builds the tiny model


def ros2_launch(log, *arguments: str, tty: bool = False) -> subprocess.Popen:
    """`ros2 launch molmobot_policy policy.launch.py ARGUMENTS` in a session of its own, its
    output in the file `log`; `tty`: stdin a terminal, as in a shell (then launch is
    interactive: it leaves SIGINT to the terminal, which sends it to the process group)."""
    terminal, stdin = pty.openpty() if tty else (None, subprocess.DEVNULL)
    with open(log, 'wb') as out:
        process = subprocess.Popen([ROS2, 'launch', PACKAGE, 'policy.launch.py', *arguments],
                                   stdin=stdin, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True,
                                   env=dict(os.environ, PYTHONUNBUFFERED='1'))
    if tty:
        os.close(stdin)
    process.terminal = terminal     # closed by finish()
    return process


def finish(process: subprocess.Popen, timeout: float = TIMEOUT) -> int:
    """Wait for the exit; SIGKILL to the group after `timeout` s. Returns the exit status."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f'ros2 launch did not exit within {timeout} s')
    finally:
        if process.terminal is not None:
            os.close(process.terminal)


def test_show_arguments_describes_every_launch_argument():
    out = subprocess.run([ROS2, 'launch', PACKAGE, 'policy.launch.py', '-s'], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    for name in ARGUMENTS:
        match = re.search(rf"^\s+'{name}':\n\s+(\S.*)$", out, re.MULTILINE)
        assert match and 'no description given' not in match.group(1), (name, out)
    assert 'RANDOM WEIGHTS' in out      # params_file's description names what the tiny file is


@pytest.mark.parametrize('ctrl_c', ['terminal', 'supervisor'])
def test_run_to_the_first_chunk_on_the_argument_topics_then_sigint_exits_cleanly(
        tmp_path, ros, ctrl_c):
    from trajectory_msgs.msg import JointTrajectory
    cameras = ['/ros2_launch_cam0/image_raw', '/ros2_launch_cam1/image_raw']
    chunks, arrived = [], threading.Event()

    def on_chunk(msg):
        chunks.append(msg)
        arrived.set()

    ros.node.create_subscription(JointTrajectory, '/ros2_launch/chunks', on_chunk, 10)
    publish_robot_inputs(ros.node, cameras, '/ros2_launch_joint_states', JOINTS)
    log = tmp_path / 'ros2_launch.log'
    process = ros2_launch(log, f'params_file:={TINY}', 'namespace:=ros2_launch',
                          f"camera_topics:=[{', '.join(cameras)}]",
                          'joint_state_topic:=/ros2_launch_joint_states',
                          'output_topic:=chunks',       # relative: in the namespace
                          tty=ctrl_c == 'terminal')
    try:
        came = arrived.wait(TIMEOUT)
    finally:
        if ctrl_c == 'terminal':
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signal.SIGINT)
        status = finish(process, timeout=30.0)
    text = log.read_text(errors='replace')
    assert came, f'no chunk on /ros2_launch/chunks within {TIMEOUT} s\n{text[-4000:]}'
    assert list(chunks[0].joint_names) == JOINTS
    assert re.search(r'\[policy_node-\d+\]: process has finished cleanly', text), text[-4000:]
    # ros2 launch exits 0, except where a terminal's SIGINT reaches its own event loop while it
    # processes an event: asyncio then drops the task ('Task was destroyed but it is pending!
    # ... LaunchService._process_one_event') and launch exits 1 after the node finished
    # cleanly: a race inside launch, not the node's exit; seen once in CI on 9236c0c
    launch_race = ctrl_c == 'terminal' and 'Task was destroyed but it is pending' in text \
        and 'LaunchService._process_one_event' in text
    assert status == 0 or (status == 1 and launch_race), text[-4000:]
    # no traceback from the node (launch prefixes each of its lines with its name); ros2 launch's
    # own Python may print one when the SIGINT sent to it lands inside a weakref callback
    # ('Exception ignored in: <function WeakSet...>: KeyboardInterrupt'), which is launch's
    node_lines = [line for line in text.splitlines() if re.match(r'\[policy_node-\d+\] ', line)]
    assert node_lines and not any('Traceback' in line for line in node_lines), text[-4000:]
    # the node got one SIGINT: the terminal's, or the one launch passed on
    passed_on = "sending signal 'SIGINT' to process[policy_node" in text
    assert passed_on == (ctrl_c == 'supervisor'), text[-4000:]


def test_the_default_is_refused_by_the_node_not_served_random_weights(tmp_path):
    log = tmp_path / 'ros2_launch.log'
    finish(ros2_launch(log, 'namespace:=ros2_launch_default'))
    text = log.read_text(errors='replace')
    assert 'neither params_file nor checkpoint_path given' in text, text[-4000:]
    assert 'checkpoint_path is empty' in text, text[-4000:]
    assert re.search(r'\[policy_node-\d+\]: process has died \[pid \d+, exit code 1', text), \
        text[-4000:]
    assert 'RANDOM WEIGHTS' not in text, text[-4000:]


def test_log_level_sets_the_nodes_logger_not_every_ros_logger(tmp_path):
    """A bare --log-level debug turned on the DEBUG lines of rcl and rmw as well (a fresh-user
    trial); the argument sets the node's logger, under the namespace."""
    log = tmp_path / 'ros2_launch.log'
    finish(ros2_launch(log, 'namespace:=ros2_launch_quiet', 'log_level:=debug'))
    text = log.read_text(errors='replace')
    assert 'checkpoint_path is empty' in text, text[-4000:]       # the node's ERROR line
    assert not re.search(r'\[DEBUG\] \[[\d.]+\] \[(rcl|rmw|rcl_lifecycle)[^\]]*\]', text), \
        text[-4000:]
    log = tmp_path / 'ros2_launch_fatal.log'
    finish(ros2_launch(log, 'namespace:=ros2_launch_quiet', 'log_level:=fatal'))
    text = log.read_text(errors='replace')
    assert 'checkpoint_path is empty' not in text, text[-4000:]   # below fatal: not printed


def test_a_camera_topics_argument_that_is_no_list_is_named(tmp_path):
    log = tmp_path / 'ros2_launch.log'
    status = finish(ros2_launch(log, f'params_file:={TINY}', 'camera_topics:=/just/one/topic'),
                    timeout=60.0)
    text = log.read_text(errors='replace')
    assert status != 0
    assert "camera_topics:='/just/one/topic': expected a YAML list of topic names" in text, text
    assert 'policy_node' not in text, text      # no node started


def test_a_params_file_that_does_not_exist_is_refused_before_any_node_starts(tmp_path):
    """launch_ros alone only warns and starts the node with its defaults (fourth fresh-user
    trial)."""
    log = tmp_path / 'ros2_launch.log'
    missing = tmp_path / 'my_robot_typo.yaml'
    status = finish(ros2_launch(log, f'params_file:={missing}'), timeout=60.0)
    text = log.read_text(errors='replace')
    assert status != 0
    assert f"params_file:='{missing}': no such file" in text, text
    assert 'policy_node' not in text, text      # no node started
