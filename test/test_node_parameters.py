"""The node refuses parameter files it would otherwise misread."""
from __future__ import annotations

import re

import pytest

rclpy = pytest.importorskip('rclpy')
from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from molmobot_policy.model.checkpoint import load_config  # noqa: E402
from molmobot_policy.ros.node import (PolicyNode, format_action,  # noqa: E402
                                     unmatched_parameter_files)


class _Refuse:
    """Engine factory that must never be reached in these tests."""

    def __call__(self, config):
        raise AssertionError('the engine must not be built')


def _node(context, overrides, name):
    return PolicyNode(engine_factory=_Refuse(), node_name=name, context=context,
                      parameter_overrides=overrides)


def test_misspelled_parameter_fails_configure_with_a_suggestion(ros_context):
    node = _node(ros_context, [Parameter('autostart', value=False),
                               Parameter('checkpont_path', value='/tmp/x')], 'param_typo')
    try:
        errors = []
        node.get_logger().error = lambda msg, **kw: errors.append(msg)
        assert node.trigger_configure() == TransitionCallbackReturn.FAILURE
        assert any("'checkpont_path'" in e and "did you mean 'checkpoint_path'" in e
                   for e in errors)
    finally:
        node.destroy_node()


def test_engine_options_are_node_parameters(ros_context):
    node = _node(ros_context, [Parameter('autostart', value=False),
                               Parameter('overlong', value='truncate'),
                               Parameter('vit_fp32_attention', value=True)], 'param_engine')
    try:
        assert node.get_parameter('overlong').value == 'truncate'
        assert node.get_parameter('vit_fp32_attention').value is True
        assert node.get_parameter('kv_cache').value is True
    finally:
        node.destroy_node()


def test_missing_checkpoint_path_is_named():
    with pytest.raises(FileNotFoundError, match='does not exist'):
        load_config('/nonexistent/molmobot_tinyy')


def test_integer_for_a_float_parameter_is_one_clear_error(ros_context):
    with pytest.raises(ValueError, match=r"parameter 'gripper_threshold': 0 is not a valid "
                                         r'float.*decimal point'):
        _node(ros_context, [Parameter('autostart', value=False),
                            Parameter('gripper_threshold', value=0)], 'param_int_float')


def test_parameter_file_without_a_section_for_the_node_is_reported(tmp_path):
    typo = tmp_path / 'typo.yaml'
    typo.write_text('molmobot_polcy:\n  ros__parameters:\n    chunk_period: 0.5\n')
    good = tmp_path / 'good.yaml'
    good.write_text('/molmobot_policy:\n  ros__parameters:\n    chunk_period: 0.5\n')
    wildcard = tmp_path / 'wildcard.yaml'
    wildcard.write_text('/**:\n  ros__parameters:\n    use_sim_time: true\n')
    argv = ['node', '--ros-args', '--params-file', str(typo), '--params-file', str(good),
            '--params-file', str(wildcard)]
    errors = unmatched_parameter_files(argv, 'molmobot_policy')
    assert len(errors) == 1
    assert str(typo) in errors[0] and "'molmobot_polcy'" in errors[0]
    assert unmatched_parameter_files(argv[:2] + argv[4:], 'molmobot_policy') == []


def _configure(context, name: str, **parameters) -> tuple[dict | None, list[str]]:
    """Configure a node (autostart off) with `parameters` and an engine factory that records
    its engine config and fails. Returns (that config or None, the error log lines)."""
    capture = _Capture()
    node = PolicyNode(engine_factory=capture, node_name=name, context=context,
                      parameter_overrides=[Parameter('autostart', value=False)]
                      + [Parameter(k, value=v) for k, v in parameters.items()])
    try:
        errors = []
        node.get_logger().error = lambda msg, **kw: errors.append(msg)
        assert node.trigger_configure() == TransitionCallbackReturn.FAILURE
        return capture.config, errors
    finally:
        node.destroy_node()


class _Capture:
    """Engine factory that records the engine config it is given, then fails configure."""

    def __init__(self):
        self.config = None

    def __call__(self, config):
        self.config = config
        raise ValueError('captured')


@pytest.mark.parametrize('value, expected', [(True, 'on'), (False, 'off'), ('auto', 'auto'),
                                             ('off', 'off')])
def test_unquoted_on_off_reach_the_engine_as_on_off(ros_context, value, expected):
    """YAML and `-p fused_action_expert:=on` turn on/off into booleans; the node maps them."""
    config, _ = _configure(ros_context, f'param_fused_{expected}_{value is True}',
                           fused_action_expert=value)
    assert config['fused_action_expert'] == expected


def test_boolean_for_a_string_parameter_suggests_quoting(ros_context):
    with pytest.raises(ValueError, match=r"parameter 'quantize': False is not a valid str.*"
                                         r"write one of the values listed"):
        _node(ros_context, [Parameter('autostart', value=False),
                            Parameter('quantize', value=False)], 'param_bool_str')


@pytest.mark.parametrize('value, ok', [('42', True), ('0', True), ('232', True), ('', True),
                                       ('233', False), ('300', False), ('abc', False),
                                       ('-1', False)])
def test_ros_domain_id_is_checked_before_dds_starts(value, ok):
    from molmobot_policy.ros.node import ros_domain_id_problem

    problem = ros_domain_id_problem({'ROS_DOMAIN_ID': value})
    assert (problem is None) == ok
    if not ok:
        assert 'ROS_DOMAIN_ID must be an integer from 0 to 232' in problem and value in problem


def test_node_main_refuses_an_unusable_domain_id_with_a_clear_message(monkeypatch, capsys):
    from molmobot_policy.ros import node as node_module

    monkeypatch.setenv('ROS_DOMAIN_ID', '300')
    monkeypatch.setattr(node_module.rclpy, 'init', lambda **_: pytest.fail('DDS was started'))
    assert node_module.main([]) == 1
    assert "ROS_DOMAIN_ID must be an integer from 0 to 232, got '300'" in capsys.readouterr().err


def test_out_of_range_value_names_the_allowed_range(ros_context):
    with pytest.raises(ValueError, match=r"parameter 'chunk_period': -1.0 is out of range "
                                         r"\(.*allowed: 0.01 to 60.0\)$") as info:
        _node(ros_context, [Parameter('autostart', value=False),
                            Parameter('chunk_period', value=-1.0)], 'param_range')
    assert 'decimal point' not in str(info.value)


def test_malformed_params_file_is_one_fatal_line_not_a_traceback(tmp_path):
    import os
    import subprocess
    import sys

    bad = tmp_path / 'bad.yaml'
    bad.write_text('/molmobot_policy:\n  ros__parameters:\n    max_step: [0.5\n')
    env = dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST')
    env.setdefault('ROS_DOMAIN_ID', '0')
    done = subprocess.run([sys.executable, '-m', 'molmobot_policy.ros.node', '--ros-args',
                           '--params-file', str(bad)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 1
    assert re.search(r'\[FATAL\] \[[\d.]+\] \[molmobot_policy\]: ROS 2 could not start',
                     done.stderr), done.stderr     # the ROS console format, with a timestamp
    assert 'Traceback' not in done.stderr


def test_chunk_log_action_is_fixed_point_on_one_line():
    """14 joints mixing tiny and large values: no scientific notation, no line break."""
    import numpy as np
    values = np.array([1e-5, -0.25, 3.14159, 120.0] + [0.001] * 10, dtype=np.float32)
    text = format_action(values)
    assert '\n' not in text and 'e-' not in text and 'e+' not in text
    assert text.startswith('[0.000, -0.250, 3.142, 120.000, 0.001,') and text.count(',') == 13


@pytest.mark.parametrize('value, expected', [('none', ()), ('None', ()), ([448, 512], (448, 512))])
def test_buckets_none_means_no_padding(ros_context, value, expected):
    """README: `buckets: none` (a YAML file cannot write an empty list rcl can type)."""
    name = f'param_buckets_{value if isinstance(value, str) else "list"}'
    config, _ = _configure(ros_context, name, buckets=value)
    assert config['buckets'] == expected


def test_a_bucket_word_other_than_none_is_one_clear_error(ros_context):
    config, errors = _configure(ros_context, 'param_buckets_auto', buckets='auto')
    assert config is None                   # refused before the engine is built
    assert any("parameter 'buckets': expected a list of prompt lengths" in e
               and "got 'auto'" in e for e in errors), errors


def test_a_quoted_number_for_a_float_parameter_says_to_drop_the_quotes(ros_context):
    with pytest.raises(ValueError, match=r"parameter 'chunk_period': '1.5' is not a valid "
                                         r'float.*a quoted number is a string: write 1.5'):
        _node(ros_context, [Parameter('autostart', value=False),
                            Parameter('chunk_period', value='1.5')], 'param_quoted_float')


def test_the_decimal_point_example_is_the_default_not_an_out_of_range_value(ros_context):
    with pytest.raises(ValueError, match=r"parameter 'chunk_period': 0 is not a valid float.*"
                                         r'decimal point, e\.g\. 1\.0 \(the default\); '
                                         r'allowed: 0\.01 to 60\.0'):
        _node(ros_context, [Parameter('autostart', value=False),
                            Parameter('chunk_period', value=0)], 'param_int_period')


@pytest.mark.parametrize('forget', [False, True])
def test_a_handled_keyboard_interrupt_does_not_make_the_exit_a_sigint_death(forget):
    """A KeyboardInterrupt that left embedded Python (PyRun_*, as C extensions run it) marks
    CPython's exit as a Ctrl-C death even when caught; main() clears that mark after handling
    a Ctrl-C, so an interrupted start-up exits 0 (it died of SIGINT in 3 of 10 tries)."""
    import signal
    import subprocess
    import sys
    code = ('import ctypes\n'
            "ctypes.pythonapi.PyRun_SimpleString(b'raise KeyboardInterrupt')\n"
            + ('from molmobot_policy.ros.node import _forget_keyboard_interrupt\n'
               '_forget_keyboard_interrupt()\n' if forget else ''))
    status = subprocess.run([sys.executable, '-c', code], capture_output=True).returncode
    if forget:
        assert status == 0
    else:       # the mark the test relies on: CPython kills itself with SIGINT at exit
        assert status in (-signal.SIGINT, 128 + signal.SIGINT)
