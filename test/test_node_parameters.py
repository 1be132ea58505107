"""The node refuses parameter files it would otherwise misread."""
from __future__ import annotations

import re
import time

import pytest

rclpy = pytest.importorskip('rclpy')
from rclpy.exceptions import ParameterNotDeclaredException  # noqa: E402
from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from molmobot_policy.model.checkpoint import load_config  # noqa: E402
from molmobot_policy.ros.messages import format_action  # noqa: E402
from molmobot_policy.ros.node import PolicyNode  # noqa: E402
from molmobot_policy.ros.parameters import PARAMETERS, ParameterError  # noqa: E402


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
    finally:
        node.destroy_node()


def test_kv_cache_is_an_engine_option_not_a_node_parameter(ros_context):
    """The engine's K/V cache switch is for benchmarks; a node always serves with it, and a
    parameter file that sets it is refused like any unknown parameter."""
    config, errors = _configure(ros_context, 'param_kv_cache', kv_cache=False)
    assert config is None and 'kv_cache' not in PARAMETERS
    assert any("unknown parameter(s)" in e and "'kv_cache'" in e for e in errors), errors


def test_missing_checkpoint_path_is_named():
    with pytest.raises(FileNotFoundError, match='does not exist'):
        load_config('/nonexistent/molmobot_tinyy')


def _refused(context, name: str, value, node_name: str) -> ParameterError:
    """The ParameterError of a node given `name` = `value`, checked to name both."""
    with pytest.raises(ParameterError) as info:
        _node(context, [Parameter('autostart', value=False), Parameter(name, value=value)],
              node_name)
    error = info.value
    assert (error.name, error.value) == (name, value)
    assert f"'{name}'" in str(error) and repr(value) in str(error)
    return error


def _left_the_graph_at_once(context, name: str, end_node) -> bool:
    """With the garbage collector off (no collection may release the node for us): after
    `end_node()` ends the PolicyNode `name`, True once it is gone from the graph (which
    hears of it asynchronously; 5 s at most)."""
    import gc
    gc.disable()
    try:
        checker = rclpy.create_node(f'{name}_checker', context=context)
        end_node()
        deadline = time.monotonic() + 5.0
        while name in checker.get_node_names() and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = name not in checker.get_node_names()
        checker.destroy_node()
        return gone
    finally:
        gc.enable()


def test_a_node_whose_parameters_are_refused_is_destroyed_at_once(ros_context):
    """Its rcl node is released when the constructor raises, not later by the garbage
    collector (which could run it after the context's shutdown, in any allocation: the DDS
    participant's teardown spun there with the GIL held and hung the test run)."""
    assert _left_the_graph_at_once(ros_context, 'param_refused_node', lambda: _refused(
        ros_context, 'chunk_period', -1.0, 'param_refused_node'))


def test_destroy_node_releases_the_rcl_node_at_once(ros_context):
    """destroy_node releases the rcl node itself (rclpy's LifecycleNode leaves it to the
    garbage collector through its state machine)."""
    assert _left_the_graph_at_once(ros_context, 'param_destroyed', lambda: _node(
        ros_context, [Parameter('autostart', value=False)], 'param_destroyed').destroy_node())


def test_integer_for_a_float_parameter_is_one_clear_error(ros_context):
    error = _refused(ros_context, 'gripper_threshold', 0, 'param_int_float')
    assert 'not a valid float' in error.expected and 'decimal point' in error.expected


def _configure(context, name: str, **parameters) -> tuple[dict | None, list[str]]:
    """Configure a node (autostart off) with `parameters` and an engine factory that records
    its engine config and fails. Returns (that config or None, the error log lines)."""
    return _configure_capturing(
        context, name, parameter_overrides=[Parameter('autostart', value=False),
                                            Parameter('allow_random_weights', value=True)]
        + [Parameter(k, value=v) for k, v in parameters.items()])


def _configure_capturing(context, name: str, **node_kwargs) -> tuple[dict | None, list[str]]:
    """Configure a PolicyNode(**node_kwargs) whose engine factory records its engine config
    and fails; returns (that config or None, the error log lines)."""
    config, lines = _configure_logged(context, name, **node_kwargs)
    return config, lines['error']


def _configure_logged(context, name: str, **node_kwargs) -> tuple[dict | None, dict]:
    """As `_configure_capturing`, returning (that config or None, {'error' / 'warning' /
    'info': the lines logged at that level})."""
    capture = _Capture()
    node = PolicyNode(engine_factory=capture, node_name=name, context=context, **node_kwargs)
    lines = {'error': [], 'warning': [], 'info': []}
    try:
        for level, logged in lines.items():
            setattr(node.get_logger(), level, lambda msg, logged=logged, **kw: logged.append(msg))
        assert node.trigger_configure() == TransitionCallbackReturn.FAILURE
    finally:
        node.destroy_node()
    return capture.config, lines


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


@pytest.mark.parametrize('name', ['fused_action_expert', 'llm_attention', 'quantize', 'dtype',
                                  'tokenizer', 'overlong'])
def test_a_misspelled_engine_option_is_refused_before_any_engine_is_built(ros_context, name):
    """The value domains need no device: the node refuses 'banana' before it logs that it
    builds an engine (which would say RANDOM WEIGHTS are loading) or calls the factory."""
    config, lines = _configure_logged(
        ros_context, f'param_banana_{name}', parameter_overrides=[
            Parameter('autostart', value=False), Parameter('allow_random_weights', value=True),
            Parameter(name, value='banana')])
    assert config is None
    assert not [line for line in lines['info'] if 'building engine' in line], lines['info']
    errors = lines['error']
    assert len(errors) == 1 and f"{name} must be one of" in errors[0], errors
    assert "got 'banana'" in errors[0]


def test_a_node_that_cannot_start_says_why_before_any_warning(ros_context):
    """Random weights not allowed (no checkpoint) and no position limits: the one line is the
    refusal, not a warning about limits of a node that will not run first."""
    config, lines = _configure_logged(
        ros_context, 'param_refusal_first', parameter_overrides=[
            Parameter('autostart', value=False), Parameter('allow_random_weights', value=False)])
    assert config is None
    assert len(lines['error']) == 1 and 'allow_random_weights' in lines['error'][0], lines
    assert not [w for w in lines['warning'] if 'joint_position_min' in w], lines['warning']


def test_boolean_for_a_string_parameter_suggests_quoting(ros_context):
    error = _refused(ros_context, 'quantize', False, 'param_bool_str')
    assert 'not a valid str' in error.expected and 'booleans' in error.expected
    assert "'fp8'" in error.expected            # the values allowed are listed


@pytest.mark.parametrize('value, ok', [('42', True), ('0', True), ('232', True), ('', True),
                                       ('233', False), ('300', False), ('abc', False),
                                       ('-1', False)])
def test_ros_domain_id_is_checked_before_dds_starts(value, ok):
    from molmobot_policy.ros.main import ros_domain_id_problem

    problem = ros_domain_id_problem({'ROS_DOMAIN_ID': value})
    assert (problem is None) == ok
    if not ok:
        assert 'ROS_DOMAIN_ID' in problem and '0 to 232' in problem and repr(value) in problem


def test_node_main_refuses_an_unusable_domain_id_before_dds_starts(monkeypatch, capsys):
    from molmobot_policy.ros import main as main_module

    monkeypatch.setenv('ROS_DOMAIN_ID', '300')
    monkeypatch.setattr(main_module.rclpy, 'init', lambda **_: pytest.fail('DDS was started'))
    assert main_module.main([]) == 1
    err = capsys.readouterr().err
    assert 'ROS_DOMAIN_ID' in err and "'300'" in err


def test_help_prints_the_usage_and_starts_no_node(monkeypatch, capsys):
    """`policy_node --help` (a fresh-user trial: it started the node, which failed on the
    empty checkpoint_path): the usage, exit 0, no DDS."""
    from molmobot_policy.ros import main as main_module

    monkeypatch.setattr(main_module.rclpy, 'init', lambda **_: pytest.fail('DDS was started'))
    assert main_module.main(['policy_node', '--help']) == 0
    out = capsys.readouterr().out
    assert out.startswith('usage: policy_node') and 'docs/PARAMETERS.md' in out
    assert main_module.wants_help(['policy_node', '-h'])
    assert not main_module.wants_help(['policy_node', '--ros-args', '-h'])    # ROS's -h


def test_out_of_range_value_names_the_allowed_range(ros_context):
    error = _refused(ros_context, 'chunk_period', -1.0, 'param_range')
    assert 'out of range' in error.expected and '0.01 to 60.0' in error.expected
    assert 'decimal point' not in error.expected


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
    assert any("'buckets'" in e and "'auto'" in e and 'prompt lengths' in e
               for e in errors), errors


def test_a_quoted_number_for_a_float_parameter_says_to_drop_the_quotes(ros_context):
    error = _refused(ros_context, 'chunk_period', '1.5', 'param_quoted_float')
    assert 'quoted number' in error.expected and 'write 1.5 without quotes' in error.expected


def test_the_decimal_point_example_is_the_default_not_an_out_of_range_value(ros_context):
    error = _refused(ros_context, 'chunk_period', 0, 'param_int_period')
    assert 'e.g. 1.0 (the default)' in error.expected and '0.01 to 60.0' in error.expected


@pytest.mark.parametrize('name, value, expected', [
    ('camera_qos', 'fast', "['sensor_data', 'reliable']"),
    ('max_step', [0.1, 0.2], '0, 1 or 7')])
def test_values_a_descriptor_cannot_check_are_refused_at_configure(ros_context, name, value,
                                                                   expected):
    config, errors = _configure(ros_context, f'param_value_{name}', **{name: value})
    assert config is None
    assert any(f"'{name}'" in e and repr(value) in e and expected in e for e in errors), errors


def test_camera_topics_that_resolve_to_one_topic_fail_configure_naming_them(ros_context):
    """Seventh fresh-user trial: '/cam1/image_raw' and 'cam1/image_raw' (the same topic in
    the root namespace) passed the check of the names as written, then activation failed
    with no reason logged."""
    default = list(PARAMETERS['camera_topics'][0])
    cameras = [*default[:-1], default[0].lstrip('/')]
    config, errors = _configure(ros_context, 'param_resolved_twice', camera_topics=cameras)
    assert config is None
    assert any(f"all resolve to {default[0]}" in e and 'each input needs its own topic' in e
               for e in errors), errors


def test_a_warn_threshold_above_its_error_threshold_is_refused(ros_context):
    """Eighth fresh-user trial: diag_inference_warn_ms 500 with diag_inference_error_ms 100
    was accepted silently, at configure and at run time."""
    from molmobot_policy.ros.parameters import check_parameter_values
    values = {name: default for name, (default, _) in PARAMETERS.items()}
    with pytest.raises(ParameterError, match=r"'diag_jitter_warn_ms': 100.0 is above "
                                             r'diag_jitter_error_ms = 10.0; expected WARN'):
        check_parameter_values({**values, 'diag_jitter_warn_ms': 100.0,
                                'diag_jitter_error_ms': 10.0}.get)
    node = _node(ros_context, [Parameter('autostart', value=False)], 'param_thresholds')
    try:
        result = node.set_parameters([Parameter('diag_inference_error_ms', value=100.0)])[0]
        assert not result.successful and 'diag_inference_warn_ms' in result.reason
        both = node.set_parameters_atomically([Parameter('diag_inference_warn_ms', value=50.0),
                                               Parameter('diag_inference_error_ms', value=100.0)])
        assert both.successful, both.reason
    finally:
        node.destroy_node()


def test_list_values_set_at_run_time_arrive_as_arrays_and_are_taken():
    """rclpy hands a DOUBLE_ARRAY / INTEGER_ARRAY set through the SetParameters service over
    as array.array: configure refused max_joint_velocity [0.3] set that way as 'not a number
    or a list of numbers' (ninth fresh-user trial)."""
    import array
    from molmobot_policy.ros.parameters import bucket_lengths, check_parameter_values, per_joint
    values = {name: default for name, (default, _) in PARAMETERS.items()}
    values.update(max_joint_velocity=array.array('d', [0.3]),
                  max_step=array.array('d', [0.2] * 7),
                  joint_position_min=array.array('d', [-1.0]))
    check_parameter_values(values.get)
    assert per_joint(values.get, 'max_joint_velocity') == [0.3] * 7
    assert bucket_lengths(array.array('q', [1664])) == (1664,)


def test_position_limits_that_would_clip_the_gripper_command_are_refused():
    """A documentation audit: joint_position_min [0.1] (meant for the arm, in rad) clipped
    gripper_open 0.04 / gripper_closed 0.0 to 0.1 in every point."""
    from molmobot_policy.ros.parameters import motion_limiter
    values = {name: default for name, (default, _) in PARAMETERS.items()}
    values.update(gripper_index=6, gripper_open=0.04, gripper_closed=0.0,
                  joint_position_min=[0.1])
    with pytest.raises(ParameterError, match=r"'joint_position_min': \[0.1\] puts the gripper "
                                             r'dimension \(gripper_index 6\) at 0.1, which '
                                             r'would clip gripper_open 0.04, gripper_closed 0.0'):
        motion_limiter(values.get)
    values['joint_position_min'] = 0.1                      # one number, as written
    with pytest.raises(ParameterError, match=r"'joint_position_min': 0.1 puts the gripper"):
        motion_limiter(values.get)
    values['joint_position_min'] = [-3.0] * 6 + [0.0]      # the gripper's own limit: taken
    values['joint_position_max'] = [3.0] * 6 + [0.04]
    motion_limiter(values.get)


def test_an_empty_topic_or_joint_list_is_refused():
    """(rclpy cannot type an empty list parameter; a list that ends up empty is refused.)"""
    from molmobot_policy.ros.parameters import check_parameter_values
    values = {name: default for name, (default, _) in PARAMETERS.items()}
    with pytest.raises(ParameterError) as info:
        check_parameter_values({**values, 'joint_names': []}.get)
    assert (info.value.name, info.value.value) == ('joint_names', [])


def test_the_first_sigint_requests_the_stop_and_the_second_interrupts():
    """The first SIGINT sets the stop request and raises nothing (the main thread stops at its
    next check, then shuts the context down); a later one raises KeyboardInterrupt (main then
    exits 130)."""
    import signal

    from molmobot_policy.ros.main import StopSignals

    clock = [100.0]
    handler = StopSignals(clock=lambda: clock[0])
    assert not handler.requested.is_set()
    handler(signal.SIGINT, None)
    assert handler.requested.is_set() and not handler.forced
    clock[0] += 1.5
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, None)
    assert handler.forced


def test_a_second_sigint_says_it_interrupts_at_once(capsys):
    """The exit status 130 came with no line saying why (second trial of 2026-12-07)."""
    import signal

    from molmobot_policy.ros.entry import StopSignals

    clock = [100.0]
    handler = StopSignals(clock=lambda: clock[0])
    handler(signal.SIGINT, None)
    clock[0] += 1.5
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, None)
    assert 'SIGINT again: interrupting at once (exit status 130)' in capsys.readouterr().err


def test_a_second_sigint_right_after_the_first_is_the_same_stop_request():
    """A process-group SIGINT and `ros2 launch` forwarding its own arrive within ms: no
    KeyboardInterrupt inside the shutdown (it aborted the process 2 of 9 times)."""
    import signal

    from molmobot_policy.ros.main import StopSignals

    clock = [100.0]
    handler = StopSignals(clock=lambda: clock[0])
    handler(signal.SIGINT, None)
    clock[0] += 0.05
    handler(signal.SIGINT, None)                 # raises nothing
    assert not handler.forced


def test_sigterm_requests_the_stop_and_never_interrupts():
    import signal

    from molmobot_policy.ros.main import StopSignals

    clock = [100.0]
    handler = StopSignals(clock=lambda: clock[0])
    handler(signal.SIGTERM, None)
    assert handler.requested.is_set()
    clock[0] += 5.0
    handler(signal.SIGTERM, None)                # raises nothing: launch escalates to SIGKILL
    assert not handler.forced


def test_stop_signals_replace_sigint_and_sigterm_handlers_and_restore_them():
    """Installed over SIG_IGN too (a shell's background job: `ros2 launch` still stops the
    node with SIGINT), restored on uninstall."""
    import signal

    from molmobot_policy.ros.main import StopSignals

    previous = (signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.getsignal(signal.SIGTERM))
    try:
        handler = StopSignals().install()
        assert signal.getsignal(signal.SIGINT) is handler
        assert signal.getsignal(signal.SIGTERM) is handler
        handler.uninstall()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is previous[1]
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


# ------------------------------------------------------------------ safety parameters
def _values(**changes):
    values = {name: default for name, (default, _) in PARAMETERS.items()}
    values.update(changes)
    return values.get


def test_motion_limits_take_one_value_for_all_joints_or_one_per_action_joint():
    from molmobot_policy.ros.parameters import motion_limiter
    assert motion_limiter(_values()).max_velocity.tolist() == [1.5] * 7      # the default
    limiter = motion_limiter(_values(max_joint_velocity=[float(k + 1) for k in range(7)],
                                     joint_position_min=[-1.0], joint_position_max=[1.0]))
    assert limiter.max_velocity.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert limiter.position_min.tolist() == [-1.0] * 7
    assert limiter.position_max.tolist() == [1.0] * 7
    assert motion_limiter(_values(max_joint_velocity=0.8)).max_velocity.tolist() == [0.8] * 7


def test_the_gripper_dimension_has_no_velocity_limit():
    """Its binarized open/closed command is no joint position to ramp."""
    from molmobot_policy.ros.parameters import motion_limiter
    velocity = motion_limiter(_values(gripper_index=6)).max_velocity
    assert velocity[:6].tolist() == [1.5] * 6 and velocity[6] == float('inf')


def test_the_motion_limiter_takes_max_step_except_for_the_gripper():
    from molmobot_policy.ros.parameters import motion_limiter
    assert motion_limiter(_values()).max_step is None        # the default: no step limit
    step = motion_limiter(_values(max_step=[0.1], gripper_index=6)).max_step
    assert step[:6].tolist() == [0.1] * 6 and step[6] == float('inf')


def test_the_motion_limiter_takes_tracking_tolerance_except_for_the_gripper():
    from molmobot_policy.ros.parameters import motion_limiter
    from molmobot_policy.timing.motion import TRACKING_WINDOW_S
    default = motion_limiter(_values(max_joint_velocity=[2.0])).tracking_tolerance
    assert default.tolist() == [2.0 * TRACKING_WINDOW_S] * 7   # max_joint_velocity x window
    tolerance = motion_limiter(_values(tracking_tolerance=[0.3],
                                       gripper_index=6)).tracking_tolerance
    assert tolerance[:6].tolist() == [0.3] * 6 and tolerance[6] == float('inf')
    with pytest.raises(ValueError, match=r"parameter 'tracking_tolerance': \[0.0\] must be > 0 "
                                         r'\(inf: no check\)$'):
        motion_limiter(_values(tracking_tolerance=[0.0]))


@pytest.mark.parametrize('name, value, expected', [
    ('max_joint_velocity', [1.0, 2.0], '1 or 7'),
    ('max_joint_velocity', [], '1 or 7'),
    ('joint_position_min', [0.1, 0.2], '0, 1 or 7'),
    ('max_joint_velocity', ['fast'], 'not a number'),
    ('camera_transports', ['raw', 'compressed'], "1 or 8 (one per camera topic) of ['raw', "
                                                 "'compressed']"),
    ('camera_transports', ['theora'], "of ['raw', 'compressed']"),
    ('min_image_size', [32], 'is not [height, width]'),
    ('min_image_size', [32, -1], 'two pixel counts >= 0')])
def test_bad_safety_parameters_are_refused_naming_them(name, value, expected):
    from molmobot_policy.ros.parameters import check_parameter_values
    with pytest.raises(ParameterError) as info:
        check_parameter_values(_values(**{name: value}))
    assert info.value.name == name and expected in str(info.value)


ARM = ['shoulder_pan_joint', 'shoulder_lift_joint', 'elbow_joint']


def test_an_action_joint_not_in_joint_names_fails_configure_naming_it_and_the_closest(
        ros_context):
    # a fresh-user trial: such a joint was only warned about, then published unanchored; its
    # first points jumped -3.87 -> -2.92 -> 6.22 -> 0.08 rad between chunks
    config, errors = _configure(ros_context, 'param_unanchored', joint_names=ARM,
                                action_joint_names=['shoulder_pan', *ARM[1:]])
    assert config is None
    assert any("'action_joint_names'" in e and f'not in joint_names {ARM}' in e
               and "'shoulder_pan' (did you mean 'shoulder_pan_joint'?)" in e
               and 'allow_unanchored_action_joints: true' in e for e in errors), errors


def test_allow_unanchored_action_joints_lets_them_past_the_parameter_checks(ros_context):
    from molmobot_policy.ros.parameters import check_parameter_values
    values = _values(joint_names=ARM, action_joint_names=[*ARM, 'gripper'],
                     allow_unanchored_action_joints=True)
    check_parameter_values(values)      # no ParameterError
    capture = _Capture()
    node = PolicyNode(engine_factory=capture, node_name='param_unanchored_allowed',
                      context=ros_context, parameter_overrides=[
                          Parameter('autostart', value=False),
                          Parameter('allow_random_weights', value=True),
                          Parameter('joint_names', value=ARM),
                          Parameter('action_joint_names', value=[*ARM, 'gripper']),
                          Parameter('allow_unanchored_action_joints', value=True)])
    try:
        assert node.get_parameter('allow_unanchored_action_joints').value is True
        assert node.trigger_configure() == TransitionCallbackReturn.FAILURE   # 'captured'
        assert capture.config is not None       # past every parameter check
    finally:
        node.destroy_node()


def test_the_gripper_action_joint_need_not_be_in_joint_names():
    """Its binarized command is not anchored to a measured position."""
    from molmobot_policy.ros.parameters import check_parameter_values
    check_parameter_values(_values(joint_names=ARM, action_joint_names=[*ARM, 'gripper'],
                                   gripper_index=3))
    with pytest.raises(ParameterError, match="'gripper'"):
        check_parameter_values(_values(joint_names=ARM, action_joint_names=[*ARM, 'gripper'],
                                       gripper_index=0))


def test_a_non_positive_velocity_limit_fails_configure_naming_the_parameter(ros_context):
    config, errors = _configure(ros_context, 'param_velocity_zero', max_joint_velocity=[0.0])
    assert config is None
    assert any('max_joint_velocity' in e and 'must be > 0' in e for e in errors), errors


def test_compressed_cameras_are_subscribed_on_the_compressed_subtopic():
    from molmobot_policy.ros.parameters import camera_subscriptions
    topics = ['/a/image_raw', '/b/image_raw']
    assert camera_subscriptions(_values(camera_topics=topics)) == [
        ('/a/image_raw', False), ('/b/image_raw', False)]
    assert camera_subscriptions(_values(camera_topics=topics,
                                        camera_transports=['raw', 'compressed'])) == [
        ('/a/image_raw', False), ('/b/image_raw/compressed', True)]


def test_the_action_joints_with_an_infinite_velocity_limit_are_named_but_the_gripper():
    from molmobot_policy.ros.parameters import (PARAMETERS as P, motion_limiter,
                                                unlimited_velocity_joints)

    def unlimited(**changes):
        values = _values(**changes)
        return unlimited_velocity_joints(values, motion_limiter(values))
    names = list(P['action_joint_names'][0])
    assert unlimited() == []
    inf = float('inf')
    assert unlimited(max_joint_velocity=[inf]) == names
    per_joint = [1.0] * 5 + [inf, inf]
    assert unlimited(max_joint_velocity=per_joint, gripper_index=6) == [names[5]]


@pytest.mark.parametrize('changes, message', [
    ({'max_joint_velocity': [0.0]},
     "parameter 'max_joint_velocity': [0.0] must be > 0 (inf: no limit)"),
    ({'joint_position_min': [1.0], 'joint_position_max': [0.0]},
     "parameter 'joint_position_min': [1.0] must be <= joint_position_max per joint"),
])
def test_a_bad_motion_limit_is_named_by_its_parameter_alone(changes, message):
    from molmobot_policy.ros.parameters import motion_limiter
    with pytest.raises(ValueError) as error:
        motion_limiter(_values(**changes))
    assert str(error.value).startswith(message), str(error.value)


def test_a_joint_named_twice_in_joint_names_is_refused_as_such():
    """Not as an action joint missing from joint_names (with a 'did you mean' pointing
    elsewhere), which the check of action_joint_names said first (third fresh-user trial)."""
    from molmobot_policy.ros.parameters import PARAMETERS as P, ParameterError, \
        check_parameter_values
    joints = list(P['joint_names'][0])
    joints[2] = joints[1]
    with pytest.raises(ParameterError, match=rf"joint_names.*names \['{joints[1]}'\] more than "
                                             'once'):
        check_parameter_values(_values(joint_names=joints))


def test_an_empty_yaml_list_means_no_position_limits():
    """rcl hands `joint_position_min: []` from a parameter file to rclpy as no value (None)."""
    from molmobot_policy.ros.parameters import motion_limiter
    limiter = motion_limiter(_values(joint_position_min=None, joint_position_max=None))
    assert limiter.position_min is None and limiter.position_max is None


@pytest.mark.skipif(__import__('torch').version.cuda is not None,
                    reason='checks the refusal of a CPU-only torch build')
def test_a_cuda_device_on_a_cpu_build_of_torch_fails_configure_before_the_engine(ros_context):
    config, errors = _configure(ros_context, 'param_device_cpu_build', device='cuda:1')
    assert config is None      # refused before any engine (or weight file) is touched
    assert any("configure failed: device 'cuda:1': this torch" in e
               and 'is built without CUDA' in e for e in errors), errors


def test_declaring_the_parameters_leaves_the_table_as_written(ros_context):
    """rclpy fills in the descriptor it is given (its name; the type of a dynamically typed
    one): declared from the shared table itself, the second node in a process (and the
    reference docs rendered after a node ran) saw another table."""
    before = {name: (d.name, d.type, d.dynamic_typing) for name, (_, d) in PARAMETERS.items()}
    node = _node(ros_context, [Parameter('autostart', value=False),
                               Parameter('buckets', value=[448, 512])], 'param_table')
    try:
        after = {name: (d.name, d.type, d.dynamic_typing) for name, (_, d) in PARAMETERS.items()}
        assert after == before
    finally:
        node.destroy_node()


def _configure_from_file(context, tmp_path, name: str, body: str):
    """Configure a node (autostart off) whose parameters come from a YAML file that rcl
    parses (--params-file); returns (the engine config or None, the error log lines)."""
    params = tmp_path / f'{name}.yaml'
    params.write_text(f'/{name}:\n  ros__parameters:\n    autostart: false\n'
                      f'    allow_random_weights: true\n{body}')
    return _configure_capturing(context, name,
                                cli_args=['--ros-args', '--params-file', str(params)])


def test_empty_buckets_in_a_parameter_file_mean_no_padding(ros_context, tmp_path):
    """docs/PARAMETERS.md: `buckets: []` is no padding; rcl hands the empty YAML list to
    rclpy as a parameter without a value (None), which configure refused."""
    config, errors = _configure_from_file(ros_context, tmp_path, 'param_buckets_file',
                                          '    buckets: []\n')
    assert config is not None, errors
    assert config['buckets'] == ()


@pytest.mark.parametrize('value', [[], None, 'none'])
def test_empty_or_none_buckets_reach_the_engine_as_no_padding(ros_context, value):
    """[] (the default), None (rcl's empty list) and 'none' all mean no padding."""
    config, errors = _configure(ros_context, f'param_buckets_{type(value).__name__}',
                                buckets=value)
    assert config is not None, errors
    assert config['buckets'] == ()


def test_bad_buckets_are_refused_naming_the_value_given(ros_context, tmp_path):
    config, errors = _configure_from_file(ros_context, tmp_path, 'param_buckets_bad',
                                          '    buckets: [1.5, 2.5]\n')
    assert config is None
    assert any("parameter 'buckets': [1.5, 2.5] is not a list of prompt lengths" in e
               for e in errors), errors


def test_an_integer_set_at_run_time_for_a_float_parameter_is_taken_as_that_float(ros_context):
    """`ros2 param set <node> diag_min_camera_rate 2` sends the integer 2: the node takes it
    as 2.0 (rclpy alone refuses it: "Wrong parameter type, expected '3' got '2'"); a value of
    another type is still refused, and the node's log says what was expected."""
    node = _node(ros_context, [Parameter('autostart', value=False)], 'param_widen')
    try:
        result = node.set_parameters([Parameter('diag_min_camera_rate', value=2)])[0]
        assert result.successful, result.reason
        value = node.get_parameter('diag_min_camera_rate').value
        assert isinstance(value, float) and value == 2.0
        warnings = []
        node.get_logger().warning = lambda msg, **kw: warnings.append(msg)
        refused = node.set_parameters([Parameter('diag_min_camera_rate', value='fast')])[0]
        assert not refused.successful
        assert any("'diag_min_camera_rate': 'fast' is not a valid float" in w
                   and 'write a number' in w for w in warnings), warnings
        assert node.get_parameter('diag_min_camera_rate').value == 2.0
    finally:
        node.destroy_node()


def test_every_accepted_run_time_change_is_logged_with_its_old_and_new_value(ros_context):
    """`ros2 param set /molmobot_policy max_image_age 0.8` left no trace in the log (only
    instruction changes did): each accepted change is one INFO line, old -> new; a refused
    one (out of range) logs none."""
    node = _node(ros_context, [Parameter('autostart', value=False)], 'param_log_set')
    try:
        lines = []
        node.get_logger().info = lambda msg, **kw: lines.append(msg)
        result = node.set_parameters_atomically([Parameter('max_image_age', value=0.8),
                                                 Parameter('diag_jitter_warn_ms', value=20.0)])
        assert result.successful, result.reason
        assert lines == ["parameter 'max_image_age' set: 0.5 -> 0.8",
                         "parameter 'diag_jitter_warn_ms' set: 10.0 -> 20.0"]
        assert not node.set_parameters([Parameter('max_image_age', value=-1.0)])[0].successful
        assert len(lines) == 2 and node.get_parameter('max_image_age').value == 0.8
    finally:
        node.destroy_node()


def test_an_unknown_name_set_at_run_time_is_refused_and_logged_with_the_closest_name(
        ros_context):
    """rclpy refuses a set of an undeclared name with "Invalid access to undeclared
    parameter(s): []" (its list comes out empty); the node's log names it and the closest
    parameter."""
    node = _node(ros_context, [Parameter('autostart', value=False)], 'param_unknown_set')
    try:
        warnings = []
        node.get_logger().warning = lambda msg, **kw: warnings.append(msg)
        before = node.get_parameter('chunk_period').value
        with pytest.raises(ParameterNotDeclaredException):
            node.set_parameters([Parameter('chunk_perod', value=0.2)])
        assert any("unknown parameter 'chunk_perod' (did you mean 'chunk_period'?)" in w
                   for w in warnings), warnings
        assert node.get_parameter('chunk_period').value == before
        assert not node.has_parameter('chunk_perod')
    finally:
        node.destroy_node()


def test_a_start_only_parameter_set_at_run_time_is_refused_and_logged(ros_context):
    """rclpy refuses it ("Trying to set a read-only parameter"), but left no trace in the
    node's log (second fresh-user trial); the log names it and how to change it."""
    node = _node(ros_context, [Parameter('autostart', value=False)], 'param_read_only_set')
    try:
        warnings = []
        node.get_logger().warning = lambda msg, **kw: warnings.append(msg)
        result = node.set_parameters([Parameter('autostart', value=True)])[0]
        assert not result.successful
        assert any("refused run-time set: 'autostart' is read-only (set it in the "
                   'parameter file' in w for w in warnings), warnings
        assert node.get_parameter('autostart').value is False
        warnings.clear()        # a run-time one is not called read-only
        assert node.set_parameters([Parameter('max_image_age', value=0.7)])[0].successful
        assert not any('read-only' in w for w in warnings), warnings
    finally:
        node.destroy_node()


def test_a_run_time_value_out_of_its_range_is_refused_and_logged(ros_context):
    """rclpy refuses it ("Parameter max_image_age out of range ...") to the caller only; the
    node's log said nothing (ninth fresh-user trial): it names the parameter and the range."""
    node = _node(ros_context, [Parameter('autostart', value=False)], 'param_range_set')
    try:
        warnings = []
        node.get_logger().warning = lambda msg, **kw: warnings.append(msg)
        before = node.get_parameter('max_image_age').value
        assert not node.set_parameters([Parameter('max_image_age', value=-1.0)])[0].successful
        assert any("refused run-time set: parameter 'max_image_age': -1.0 is out of range"
                   in w and 'allowed: 0.0 to' in w for w in warnings), warnings
        assert node.get_parameter('max_image_age').value == before
        warnings.clear()        # a value in range: no line
        assert node.set_parameters([Parameter('max_image_age', value=0.7)])[0].successful
        assert not warnings, warnings
    finally:
        node.destroy_node()


def test_a_misspelled_engine_option_set_at_run_time_is_refused_and_logged(ros_context):
    """Unconfigured, 'quantize' may be set; 'fp9' was taken and refused only at the next
    configure (second trial of 2026-12-07)."""
    node = _node(ros_context, [Parameter('autostart', value=False)], 'param_choice_set')
    try:
        warnings = []
        node.get_logger().warning = lambda msg, **kw: warnings.append(msg)
        result = node.set_parameters([Parameter('quantize', value='fp9')])[0]
        assert not result.successful and 'quantize must be one of' in result.reason
        assert any("refused run-time set: quantize must be one of" in w and "'fp9'" in w
                   for w in warnings), warnings
        assert node.get_parameter('quantize').value == 'none'
        assert node.set_parameters([Parameter('quantize', value='fp8')])[0].successful
    finally:
        node.destroy_node()


def test_a_configure_time_parameter_is_taken_while_the_node_is_unconfigured(ros_context):
    """Eighth fresh-user trial: cleanup, set, configure could change nothing (every
    configure-time parameter was read-only in every state)."""
    node = _node(ros_context, [Parameter('autostart', value=False)], 'param_unconfigured_set')
    try:
        before = node.get_parameter('chunk_period').value
        result = node.set_parameters([Parameter('chunk_period', value=before * 2)])[0]
        assert result.successful, result.reason
        assert node.get_parameter('chunk_period').value == before * 2
    finally:
        node.destroy_node()


def test_use_sim_time_set_at_run_time_is_refused_and_the_clock_stays(ros_context):
    """Switching it on a running node made ROS time jump by the epoch and left the camera
    receiver process (refused under sim time) running (third fresh-user trial)."""
    node = _node(ros_context, [Parameter('autostart', value=False)], 'param_sim_time_set')
    try:
        warnings = []
        node.get_logger().warning = lambda msg, **kw: warnings.append(msg)
        result = node.set_parameters([Parameter('use_sim_time', value=True)])[0]
        assert not result.successful and 'set at start only' in result.reason
        assert any("refused run-time set: 'use_sim_time' is set at start only" in w
                   for w in warnings), warnings
        assert node.get_parameter('use_sim_time').value is False
        assert not node.get_clock().ros_time_is_active
        assert node.set_parameters([Parameter('use_sim_time', value=False)])[0].successful
    finally:
        node.destroy_node()


def test_widen_integers_leaves_every_other_parameter_as_it_came():
    from molmobot_policy.ros.parameters import widen_integers
    given = [Parameter('diag_min_camera_rate', value=3), Parameter('autostart', value=True),
             Parameter('not_a_parameter', value=4), Parameter('chunk_period', value=0.1)]
    widened = widen_integers(given)
    assert widened[0].type_ == Parameter.Type.DOUBLE and widened[0].value == 3.0
    assert widened[1:] == given[1:]
