"""The package as colcon installs it, in the layout `ros2 launch` and `ros2 run` rely on
(ament index entry, share/<pkg>/{package.xml, launch, config}, lib/<pkg>/<executables>), and
its installed entry points: the policy node serving a chunk to the simulated robot, both
started from lib/molmobot_policy/ outside the source tree. Skipped, saying why, where no
ament prefix holds the package (`make test` builds one: scripts/test_ros_install.sh)."""
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

pytest.importorskip('rclpy')

from _installed import PACKAGE, installed_prefix  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PREFIX = installed_prefix()
SHARE = PREFIX / 'share' / PACKAGE
EXECUTABLES = ('policy_node', 'sim_robot', 'demo')     # setup.py's console_scripts
SOURCE_FILES = ['package.xml'] + sorted(
    str(path.relative_to(REPO)) for pattern in ('launch/*.launch.py', 'config/*.yaml',
                                                'config/*.xml') for path in REPO.glob(pattern))
TINY = yaml.safe_load((REPO / 'config' / 'policy_tiny.yaml').read_text())
TINY_JOINTS = next(iter(TINY.values()))['ros__parameters']['action_joint_names']


def test_the_ament_index_entry_marks_the_prefix():
    assert (PREFIX / 'share' / 'ament_index' / 'resource_index' / 'packages' / PACKAGE).is_file()


@pytest.mark.parametrize('relative', SOURCE_FILES)
def test_share_holds_the_source_file(relative):
    """Every launch and config file of the source tree is installed (setup.py's data_files),
    unchanged, where get_package_share_directory and `ros2 launch` look."""
    installed = SHARE / relative
    assert installed.is_file(), f'{installed} is missing: add it to setup.py data_files'
    assert installed.read_bytes() == (REPO / relative).read_bytes()


@pytest.mark.parametrize('name', EXECUTABLES)
def test_executable_is_in_lib_package(name):
    """launch_ros' Node(package, executable) and `ros2 run` run <prefix>/lib/<pkg>/<name>."""
    path = PREFIX / 'lib' / PACKAGE / name
    assert path.is_file() and os.access(path, os.X_OK), f'{path} is not an executable file'


def test_the_installed_environment_imports_the_installed_copy(tmp_path):
    """Outside the source tree, the environment the install sets up (PYTHONPATH) imports the
    installed package, not the source tree's editable install."""
    found = subprocess.run([sys.executable, '-c', 'import molmobot_policy; '
                            'print(molmobot_policy.__file__)'], cwd=tmp_path, check=True,
                           capture_output=True, text=True).stdout.strip()
    assert Path(found).is_relative_to(PREFIX), found


def _start(executable: str, params_file: Path, log: Path) -> subprocess.Popen:
    with open(log, 'wb') as out:
        return subprocess.Popen(
            [str(PREFIX / 'lib' / PACKAGE / executable), '--ros-args', '--params-file',
             str(params_file)], stdout=out, stderr=subprocess.STDOUT, cwd=log.parent,
            env=dict(os.environ, PYTHONUNBUFFERED='1'))


def _stop(process: subprocess.Popen) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def test_installed_policy_node_serves_the_installed_sim_robot_a_chunk(tmp_path, ros):
    """lib/molmobot_policy/policy_node with the installed config/policy_tiny.yaml, fed by
    lib/molmobot_policy/sim_robot with config/sim.yaml: a JointTrajectory with the file's
    action joints arrives; both stop with status 0 on SIGINT."""
    from trajectory_msgs.msg import JointTrajectory
    chunks, arrived = [], threading.Event()

    def on_chunk(msg):
        chunks.append(msg)
        arrived.set()

    ros.node.create_subscription(JointTrajectory, '/molmobot_policy/joint_trajectory',
                                 on_chunk, 10)
    logs = {name: tmp_path / f'{name}.log' for name in ('sim_robot', 'policy_node')}
    sim = _start('sim_robot', SHARE / 'config' / 'sim.yaml', logs['sim_robot'])
    policy = _start('policy_node', SHARE / 'config' / 'policy_tiny.yaml', logs['policy_node'])
    try:
        came = arrived.wait(timeout=120.0)
    finally:
        codes = {'policy_node': _stop(policy), 'sim_robot': _stop(sim)}
    text = '\n'.join(f'--- {name}\n{log.read_text(errors="replace")[-3000:]}'
                     for name, log in logs.items())
    assert came, f'no JointTrajectory within 120 s\n{text}'
    assert list(chunks[0].joint_names) == TINY_JOINTS
    assert codes == {'policy_node': 0, 'sim_robot': 0}, text
