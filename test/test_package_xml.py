"""The two package.xml files (molmobot_policy at the root, molmobot_policy_demo in demo/): every
dependency key is one rosdep resolves for Jazzy and Kilted (checked against
test/data/rosdep_keys.yaml, which names each key's source) or the other package of this
repository, and the robot install (the policy package) pulls no simulator."""
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
KEYS = yaml.safe_load((REPO / 'test' / 'data' / 'rosdep_keys.yaml').read_text())
DEPEND_TAGS = ('depend', 'build_depend', 'build_export_depend', 'exec_depend', 'test_depend',
               'buildtool_depend', 'doc_depend')
PACKAGES = {'molmobot_policy': REPO / 'package.xml',
            'molmobot_policy_demo': REPO / 'demo' / 'package.xml'}
SIMULATOR = ('mujoco', 'dm-control', 'dm_control', 'matplotlib')


def _keys(package: str) -> list[tuple[str, str]]:
    root = ET.parse(PACKAGES[package]).getroot()
    return [(e.tag, e.text.strip()) for tag in DEPEND_TAGS for e in root.iter(tag)]


def _exec_keys(package: str) -> set[str]:
    return {key for tag, key in _keys(package) if tag in ('exec_depend', 'depend')}


@pytest.mark.parametrize('package', PACKAGES)
def test_package_xml_is_format_3_named_after_its_package(package):
    root = ET.parse(PACKAGES[package]).getroot()
    assert root.get('format') == '3'
    assert root.findtext('name') == package
    assert root.find('export').findtext('build_type') == 'ament_python'


@pytest.mark.parametrize('package', PACKAGES)
def test_every_dependency_key_resolves(package):
    """A key is a rosdep key or the other package of this repository (a workspace package
    colcon and rosdep find in the source tree)."""
    known = set(KEYS['ros_packages']) | set(KEYS['system']) | (set(PACKAGES) - {package})
    unknown = [key for _, key in _keys(package) if key not in known]
    assert not unknown, f'keys not in test/data/rosdep_keys.yaml (check rosdistro first): {unknown}'


@pytest.mark.parametrize('package', PACKAGES)
def test_no_key_known_not_to_resolve(package):
    assert not [key for _, key in _keys(package) if key in KEYS['not_keys']]


@pytest.mark.parametrize('package', PACKAGES)
def test_no_package_declares_the_simulator_as_a_key(package):
    """The simulator and the plots have no rosdep key: a pip step (requirements/demo.txt)."""
    assert not [key for _, key in _keys(package) if any(s in key for s in SIMULATOR)]


def test_robot_install_pulls_no_simulator():
    """The policy package depends on nothing of the demo, not even on its package."""
    assert not [key for _, key in _keys('molmobot_policy') if key == 'molmobot_policy_demo']


def test_the_runtime_imports_are_declared():
    # the ROS packages the node imports at run time are exec dependencies
    exec_keys = _exec_keys('molmobot_policy')
    for key in ('rclpy', 'sensor_msgs', 'trajectory_msgs', 'diagnostic_msgs', 'lifecycle_msgs',
                'python3-numpy', 'python3-opencv', 'python3-yaml'):
        assert key in exec_keys, key


def test_the_demo_declares_the_policy_package_and_the_sim_robots_imports():
    # sim_robot (rclpy, sensor_msgs, trajectory_msgs), the demo runner (diagnostic_msgs) and
    # sim_demo.launch.py (launch, launch_ros, ament_index_python) run on these
    exec_keys = _exec_keys('molmobot_policy_demo')
    for key in ('molmobot_policy', 'rclpy', 'sensor_msgs', 'trajectory_msgs', 'diagnostic_msgs',
                'ament_index_python', 'launch', 'launch_ros', 'python3-numpy', 'python3-yaml'):
        assert key in exec_keys, key
