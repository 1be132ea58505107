"""package.xml: every dependency key is one rosdep resolves for Jazzy and Kilted (checked
against test/data/rosdep_keys.yaml, which names each key's source), and the robot install
pulls no simulator."""
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
KEYS = yaml.safe_load((REPO / 'test' / 'data' / 'rosdep_keys.yaml').read_text())
DEPEND_TAGS = ('depend', 'build_depend', 'build_export_depend', 'exec_depend', 'test_depend',
               'buildtool_depend', 'doc_depend')


def _keys():
    root = ET.parse(REPO / 'package.xml').getroot()
    return [(e.tag, e.text.strip()) for tag in DEPEND_TAGS for e in root.iter(tag)]


def test_package_xml_is_format_3_named_molmobot_policy():
    root = ET.parse(REPO / 'package.xml').getroot()
    assert root.get('format') == '3'
    assert root.findtext('name') == 'molmobot_policy'
    assert root.find('export').findtext('build_type') == 'ament_python'


def test_every_dependency_key_resolves():
    known = set(KEYS['ros_packages']) | set(KEYS['system'])
    unknown = [key for _, key in _keys() if key not in known]
    assert not unknown, f'keys not in test/data/rosdep_keys.yaml (check rosdistro first): {unknown}'


def test_no_key_known_not_to_resolve():
    assert not [key for _, key in _keys() if key in KEYS['not_keys']]


def test_robot_install_pulls_no_simulator():
    assert not [key for _, key in _keys() if 'mujoco' in key or 'dm-control' in key
                or 'dm_control' in key]


def test_the_runtime_imports_are_declared():
    # the ROS packages the node imports at run time are exec dependencies
    exec_keys = {key for tag, key in _keys() if tag in ('exec_depend', 'depend')}
    for key in ('rclpy', 'sensor_msgs', 'trajectory_msgs', 'diagnostic_msgs', 'lifecycle_msgs',
                'python3-numpy', 'python3-opencv', 'python3-yaml'):
        assert key in exec_keys, key
