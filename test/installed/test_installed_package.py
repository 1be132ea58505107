"""The two packages as colcon installs them, in the layout `ros2 launch` and `ros2 run` rely on
(ament index entry, share/<pkg>/{package.xml, launch, config}, lib/<pkg>/<executables>), and
their installed entry points: the policy node (lib/molmobot_policy/) serving a chunk to the
simulated robot (lib/molmobot_policy_demo/), both started outside the source tree. Skipped,
saying why, where no ament prefix holds the packages (`make test` builds one:
scripts/test_ros_install.sh)."""
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

pytest.importorskip('rclpy')

from _installed import DEMO_PACKAGE, PACKAGE, installed_prefix  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PREFIX = installed_prefix()
SHARE = PREFIX / 'share' / PACKAGE
DEMO_SHARE = installed_prefix(DEMO_PACKAGE) / 'share' / DEMO_PACKAGE
SOURCE = {PACKAGE: REPO, DEMO_PACKAGE: REPO / 'demo'}     # the folder of each package.xml
EXECUTABLES = {PACKAGE: ('policy_node',), DEMO_PACKAGE: ('sim_robot', 'demo')}  # console_scripts
SOURCE_FILES = [(package, relative) for package, folder in SOURCE.items()
                for relative in ['package.xml'] + sorted(
                    str(path.relative_to(folder)) for pattern in (
                        'launch/*.launch.py', 'config/*.yaml', 'config/*.xml')
                    for path in folder.glob(pattern))]
TINY = yaml.safe_load((REPO / 'config' / 'policy_tiny.yaml').read_text())
TINY_JOINTS = next(iter(TINY.values()))['ros__parameters']['action_joint_names']


@pytest.mark.parametrize('package', SOURCE)
def test_the_ament_index_entry_marks_the_prefix(package):
    assert (PREFIX / 'share' / 'ament_index' / 'resource_index' / 'packages' / package).is_file()


@pytest.mark.parametrize(('package', 'relative'), SOURCE_FILES)
def test_share_holds_the_source_file(package, relative):
    """Every launch and config file of each package's source folder is installed (its
    setup.py's data_files), unchanged, where get_package_share_directory and `ros2 launch`
    look."""
    installed = PREFIX / 'share' / package / relative
    assert installed.is_file(), f'{installed} is missing: add it to setup.py data_files'
    assert installed.read_bytes() == (SOURCE[package] / relative).read_bytes()


@pytest.mark.parametrize(('package', 'name'), [(package, name) for package, names in
                                               EXECUTABLES.items() for name in names])
def test_executable_is_in_lib_package(package, name):
    """launch_ros' Node(package, executable) and `ros2 run` run <prefix>/lib/<pkg>/<name>."""
    path = PREFIX / 'lib' / package / name
    assert path.is_file() and os.access(path, os.X_OK), f'{path} is not an executable file'


def test_the_policy_package_installs_no_demo_executable():
    """A robot's install (the policy package alone) lists no simulator in `ros2 pkg
    executables molmobot_policy`."""
    assert sorted(path.name for path in (PREFIX / 'lib' / PACKAGE).iterdir()) == ['policy_node']


@pytest.mark.parametrize('module', SOURCE)
def test_the_installed_environment_imports_the_installed_copy(tmp_path, module):
    """Outside the source tree, the environment the install sets up (PYTHONPATH) imports the
    installed packages, not the source tree's editable installs."""
    found = subprocess.run([sys.executable, '-c', f'import {module}; print({module}.__file__)'],
                           cwd=tmp_path, check=True, capture_output=True,
                           text=True).stdout.strip()
    assert Path(found).is_relative_to(PREFIX), found


def _start(package: str, executable: str, params_file: Path, log: Path) -> subprocess.Popen:
    with open(log, 'wb') as out:
        return subprocess.Popen(
            [str(PREFIX / 'lib' / package / executable), '--ros-args', '--params-file',
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
    lib/molmobot_policy_demo/sim_robot with its installed config/sim.yaml: a JointTrajectory
    with the file's action joints arrives; both stop with status 0 on SIGINT."""
    from trajectory_msgs.msg import JointTrajectory
    chunks, arrived = [], threading.Event()

    def on_chunk(msg):
        chunks.append(msg)
        arrived.set()

    ros.node.create_subscription(JointTrajectory, '/molmobot_policy/joint_trajectory',
                                 on_chunk, 10)
    logs = {name: tmp_path / f'{name}.log' for name in ('sim_robot', 'policy_node')}
    sim = _start(DEMO_PACKAGE, 'sim_robot', DEMO_SHARE / 'config' / 'sim.yaml',
                 logs['sim_robot'])
    policy = _start(PACKAGE, 'policy_node', SHARE / 'config' / 'policy_tiny.yaml',
                    logs['policy_node'])
    try:
        came = arrived.wait(timeout=120.0)
    finally:
        codes = {'policy_node': _stop(policy), 'sim_robot': _stop(sim)}
    text = '\n'.join(f'--- {name}\n{log.read_text(errors="replace")[-3000:]}'
                     for name, log in logs.items())
    assert came, f'no JointTrajectory within 120 s\n{text}'
    assert list(chunks[0].joint_names) == TINY_JOINTS
    assert codes == {'policy_node': 0, 'sim_robot': 0}, text
