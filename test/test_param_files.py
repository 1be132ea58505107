"""Parameter file sections are matched as rcl matches them (the table below was read off
rclpy 9.1 / Kilted: a node 'molmobot_policy' started with and without `-r __ns:=/robot1`
and a file with one section), and a file with no applicable section is an error."""
from pathlib import Path

import pytest

from molmobot_policy.ros.param_files import (near_miss_sections, section_applies,
                                             unmatched_parameter_files)

ROOT, NAMESPACED = '/molmobot_policy', '/robot1/molmobot_policy'

# section -> (applies without namespace, applies under /robot1), as rclpy did
RCL_TABLE = {
    'molmobot_policy': (True, False),
    '/molmobot_policy': (True, False),
    '/robot1/molmobot_policy': (False, True),
    'robot1/molmobot_policy': (False, True),
    '/**': (True, True),
    '/robot1/*': (False, True),
    '/*': (True, False),
    '/**/molmobot_policy': (True, True),
    '/*/molmobot_policy': (False, True),
    '/**/other': (False, False),
}


@pytest.mark.parametrize('section', RCL_TABLE)
def test_section_matching_agrees_with_rcl(section):
    assert (section_applies(section, ROOT), section_applies(section, NAMESPACED)) \
        == RCL_TABLE[section]


def test_remapped_node_name_is_matched_by_its_new_name():
    assert section_applies('/robot1/policy_left', '/robot1/policy_left')
    assert not section_applies('molmobot_policy', '/policy_left')


def _file(tmp_path, text):
    path = tmp_path / 'params.yaml'
    path.write_text(text)
    return ['--ros-args', '--params-file', str(path)]


def test_plain_section_under_a_namespace_is_an_error_naming_the_expected_section(tmp_path):
    argv = _file(tmp_path, 'molmobot_policy:\n  ros__parameters:\n    x: 1\n')
    [error] = unmatched_parameter_files(argv, NAMESPACED)
    assert "no section for node '/robot1/molmobot_policy'" in error
    assert "['molmobot_policy']" in error
    assert '/robot1/molmobot_policy:' in error and '/**:' in error


def test_plain_section_without_namespace_applies(tmp_path):
    argv = _file(tmp_path, 'molmobot_policy:\n  ros__parameters:\n    x: 1\n')
    assert unmatched_parameter_files(argv, ROOT) == []


def test_typo_is_suggested(tmp_path):
    argv = _file(tmp_path, 'molmobot_polcy:\n  ros__parameters:\n    x: 1\n')
    [error] = unmatched_parameter_files(argv, ROOT)
    assert "did you mean 'molmobot_policy' for 'molmobot_polcy'" in error


def test_a_misspelled_second_section_is_warned_about_naming_its_parameters(tmp_path):
    # a fresh-user trial: motion limits in a second, misspelled section were ignored silently
    argv = _file(tmp_path, 'molmobot_policy:\n  ros__parameters:\n    x: 1\n'
                           '/**/molmobot_polcy:\n  ros__parameters:\n'
                           '    max_joint_velocity: [0.2]\n    joint_position_max: [0.5]\n')
    assert unmatched_parameter_files(argv, ROOT) == []         # one section applies
    [warning] = near_miss_sections(argv, ROOT)
    assert "section '/**/molmobot_polcy' does not apply" in warning
    assert "did you mean 'molmobot_policy'" in warning
    assert "['joint_position_max', 'max_joint_velocity'] are NOT applied" in warning


def test_other_nodes_and_other_robots_sections_are_not_warned_about(tmp_path):
    argv = _file(tmp_path, '/robot1/molmobot_policy:\n  ros__parameters:\n    x: 1\n'
                           '/robot2/molmobot_policy:\n  ros__parameters:\n    x: 2\n'
                           'arm_controller:\n  ros__parameters:\n    joints: [a]\n'
                           '/**:\n  ros__parameters:\n    use_sim_time: false\n')
    assert near_miss_sections(argv, NAMESPACED) == []


def test_wildcard_sections_apply_everywhere(tmp_path):
    argv = _file(tmp_path, '/**:\n  ros__parameters:\n    x: 1\n')
    assert unmatched_parameter_files(argv, NAMESPACED) == []


def test_one_error_per_file_without_an_applicable_section(tmp_path):
    good = tmp_path / 'good.yaml'
    good.write_text('/**/molmobot_policy:\n  ros__parameters:\n    x: 1\n')
    bad = tmp_path / 'bad.yaml'
    bad.write_text('other_node:\n  ros__parameters:\n    x: 1\n')
    argv = ['--ros-args', '--params-file', str(good), '--params-file', str(bad)]
    errors = unmatched_parameter_files(argv, NAMESPACED)
    assert len(errors) == 1 and str(bad) in errors[0]


def test_a_file_among_several_with_a_misspelled_section_is_the_one_reported(tmp_path):
    """(Moved from test_node_parameters: the check of ros/parameters.py it tested is gone.)"""
    typo = tmp_path / 'typo.yaml'
    typo.write_text('molmobot_polcy:\n  ros__parameters:\n    chunk_period: 0.5\n')
    good = tmp_path / 'good.yaml'
    good.write_text('/molmobot_policy:\n  ros__parameters:\n    chunk_period: 0.5\n')
    wildcard = tmp_path / 'wildcard.yaml'
    wildcard.write_text('/**:\n  ros__parameters:\n    use_sim_time: true\n')
    argv = ['node', '--ros-args', '--params-file', str(typo), '--params-file', str(good),
            '--params-file', str(wildcard)]
    errors = unmatched_parameter_files(argv, ROOT)
    assert len(errors) == 1
    assert str(typo) in errors[0] and "'molmobot_polcy'" in errors[0]
    assert unmatched_parameter_files(argv[:2] + argv[4:], ROOT) == []


@pytest.mark.parametrize('name', ['policy_tiny.yaml', 'policy_droid.yaml'])
@pytest.mark.parametrize('node', [ROOT, NAMESPACED])
def test_packaged_policy_files_apply_with_and_without_a_namespace(name, node):
    """policy.launch.py namespace:=robot1 passes them as they are."""
    repo = Path(__file__).resolve().parents[1]
    argv = ['--ros-args', '--params-file', str(repo / 'config' / name)]
    assert unmatched_parameter_files(argv, node) == []


def _given_by_rclpy(argv: list[str]) -> dict:
    """What rclpy gives a node 'molmobot_policy' for `argv` (its parameter overrides)."""
    rclpy = pytest.importorskip('rclpy')
    from rclpy.context import Context

    from molmobot_policy.ros.parameters import given_parameters
    context = Context()
    rclpy.init(args=argv, context=context)
    try:
        node = rclpy.create_node('molmobot_policy', context=context)
        try:
            return {name: p.value for name, p in given_parameters(node).items()}
        finally:
            node.destroy_node()
    finally:
        rclpy.shutdown(context=context)


@pytest.mark.parametrize('override, dropped', [
    ('max_image_age:=abc', True),           # rcl keeps the file's 0.5: a str for a float
    ('max_image_age:=[1.0]', True),         # a list
    ('molmobot_policy:max_image_age:=abc', False),     # its own section: 'abc' arrives,
                                                    # and the declaration refuses it
    ('max_image_age:=0.7', False),          # the same type: taken
    ('max_image_age:=1e3', False),          # a float to rcl, a string to PyYAML: taken
    ('other_node:max_image_age:=abc', False),      # not for this node
])
def test_a_p_override_rcl_drops_for_the_files_value_is_named(tmp_path, override, dropped):
    """rcl (rclpy 9.1 / Kilted) keeps a '/**' file section's value when a later -p of the
    same parameter has another type, and says nothing (second trial of 2026-12-07: a
    safety limit's override silently ignored)."""
    from molmobot_policy.ros.param_files import dropped_overrides
    path = tmp_path / 'p.yaml'
    path.write_text('/**:\n  ros__parameters:\n    max_image_age: 0.5\n')
    argv = ['x', '--ros-args', '--params-file', str(path), '-p', override]
    problems = dropped_overrides(argv, 'molmobot_policy', _given_by_rclpy(argv))
    assert bool(problems) == dropped, problems
    if dropped:
        assert f'-p {override} did not take effect' in problems[0] and '0.5' in problems[0]


def test_a_p_override_before_a_file_is_left_to_the_file():
    """ROS documents that the later argument wins: a file after the -p overrides it."""
    from molmobot_policy.ros.param_files import dropped_overrides
    argv = ['x', '--ros-args', '-p', 'max_image_age:=abc', '--params-file', 'f.yaml']
    assert dropped_overrides(argv, 'molmobot_policy', {'max_image_age': 0.5}) == []
