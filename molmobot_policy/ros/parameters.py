"""The policy node's parameters: the table (defaults and descriptors) and the checks that
turn what rclpy refuses, and what it would silently ignore, into one clear error each.

`PARAMETERS` maps each name to (default, `rcl_interfaces/ParameterDescriptor`): the
description, type, range or allowed values that `ros2 param describe` shows. A value rclpy
refuses at declaration (wrong type, out of range) becomes a `ParameterError` naming the
parameter, the value given and what is expected; a parameter given but not declared (a
misspelled name) is an error too, since it would otherwise leave the node running on its
defaults (a parameter file without a section for the node: `ros.param_files`).
"""
from __future__ import annotations

import array
import copy
import difflib
import re

import numpy as np

from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor,
                                ParameterType)
from rclpy.exceptions import InvalidParameterTypeException, InvalidParameterValueException
from rclpy.parameter import Parameter

from molmobot_policy.preprocess.transforms import repeated
from molmobot_policy.timing import ChunkStitcher, MotionLimiter

DEFAULT_CAMERAS = [f'/cam{k}/image_raw' for k in range(8)]
DEFAULT_JOINTS = [f'jaco_joint_{k}' for k in range(1, 7)] + ['jaco_finger_1']
CAMERA_QOS = ('sensor_data', 'reliable')
CAMERA_TRANSPORTS = ('raw', 'compressed')
CAMERA_RECEIVERS = ('auto', 'in_process', 'subprocess')
# a list parameter's value: a list from a parameter file, an array.array ('d', 'q') from a
# run-time set (rclpy's conversion of a DOUBLE_ARRAY / INTEGER_ARRAY message)
ARRAYS = (list, tuple, array.array)
DEFAULT_MAX_JOINT_VELOCITY = 1.5    # rad/s: below common arm limits (Franka 2.2-2.6, UR
                                    # 3.1 rad/s); above what the demo's Jaco moves (its
                                    # actuators: 0.6-0.8 rad/s)


def descriptor(description: str, type_: int = ParameterType.PARAMETER_NOT_SET,
               read_only: bool = True,
               float_range: tuple[float, float] | None = None,
               int_range: tuple[int, int] | None = None,
               constraints: str = '', dynamic: bool = False) -> ParameterDescriptor:
    """A ParameterDescriptor (read-only unless said, with its ranges); the node's and the sim
    robot's. dynamic: leave the parameter's type open (on_configure converts the value) where rclpy
    would otherwise refuse what a user writes: a list whose default is empty (rclpy infers
    BYTE_ARRAY from [] and then refuses `buckets: [448, 512]`), or a string whose values
    include on / off (YAML and `-p name:=on` read those as booleans)."""
    descriptor = ParameterDescriptor(description=description, type=type_, read_only=read_only,
                                     additional_constraints=constraints, dynamic_typing=dynamic)
    if float_range is not None:
        descriptor.floating_point_range = [
            FloatingPointRange(from_value=float_range[0], to_value=float_range[1])]
    if int_range is not None:
        descriptor.integer_range = [IntegerRange(from_value=int_range[0], to_value=int_range[1])]
    return descriptor


_S, _SA = ParameterType.PARAMETER_STRING, ParameterType.PARAMETER_STRING_ARRAY
_D, _B = ParameterType.PARAMETER_DOUBLE, ParameterType.PARAMETER_BOOL
_I, _IA = ParameterType.PARAMETER_INTEGER, ParameterType.PARAMETER_INTEGER_ARRAY
_DA = ParameterType.PARAMETER_DOUBLE_ARRAY


# Parameters read once at start-up (ros.main, the node's constructor): never set at run time.
START_ONLY = frozenset({'autostart', 'stop_with_parent', 'diagnostics_period'})


# name: (default, descriptor). read_only: read at configure / activate (settable only while
# unconfigured; START_ONLY: never) where a change while configured is unsafe or would be ignored.
PARAMETERS = {
    'autostart': (True, descriptor('run configure + activate at start-up', _B)),
    'stop_with_parent': (True, descriptor(
        'stop (as on Ctrl-C) once the process that started the node exits: `ros2 launch` '
        'stopped with SIGTERM exits without stopping its children; not when started with '
        'SIGHUP ignored (`nohup`)', _B)),
    'camera_topics': (DEFAULT_CAMERAS, descriptor(
        'sensor_msgs/Image topics in model image order (camera k -> "Image k+1"); at most the '
        "model's max_images", _SA)),
    'camera_qos': ('sensor_data', descriptor(
        'QoS of the camera subscriptions', _S, constraints="'sensor_data' (best effort, keep "
        "last 5) or 'reliable' (reliable, keep last 1)")),
    'camera_transports': (['raw'], descriptor(
        "per camera topic 'raw' (sensor_msgs/Image on the topic) or 'compressed' "
        "(sensor_msgs/CompressedImage, jpeg or png, on <topic>/compressed, as image_transport "
        'names it); one value: every camera', _SA)),
    'camera_receiver': ('auto', descriptor(
        'where the camera messages are received', _S,
        constraints="'subprocess' (a child process, node <name>_camera_receiver, receives "
        'them and passes the newest frame of each camera through shared memory, so that the '
        "camera traffic takes no time from this process's interpreter; system clock only: "
        "refused with use_sim_time), 'in_process' (this node's subscriptions) or 'auto' "
        "(subprocess, unless use_sim_time is set or /dev/shm has no room for 8 MiB per "
        'camera + 32 MiB; decided and logged at activate)')),
    'joint_state_topic': ('/joint_states', descriptor('sensor_msgs/JointState topic', _S)),
    'joint_names': (DEFAULT_JOINTS, descriptor(
        'joints making up the state vector, in order (matched by name)', _SA)),
    'action_joint_names': (DEFAULT_JOINTS, descriptor(
        'JointTrajectory joint_names; action dim k drives joint k; each (but the '
        'gripper_index one) must be in joint_names, so that every chunk starts from its '
        'measured position', _SA)),
    'allow_unanchored_action_joints': (False, descriptor(
        'allow action joints that are not in joint_names (e.g. a gripper whose state comes '
        'on another topic): each is anchored only while joint_state_topic carries it, else '
        'its points are published from the plan alone (a chunk may start far from the arm; '
        "logged, 'output' status WARN); false: configure fails naming them", _B)),
    'instruction': ('', descriptor('task text given to the model; may change at run time',
                                    _S, read_only=False)),
    'control_period': (0.1, descriptor(
        'seconds between consecutive actions of a chunk', _D, float_range=(0.001, 10.0))),
    'chunk_period': (1.0, descriptor(
        'seconds between published chunks (the policy period)', _D,
        float_range=(0.01, 60.0))),
    'smoothing': ('none', descriptor(
        'joining a new chunk to the previous one (timing.ChunkStitcher)', _S,
        constraints="'none' or 'linear' (cross-fade over the overlap)")),
    'max_step': ([], descriptor(
        'largest change per joint between consecutive points, robot units (rad); empty: no '
        'limit, one value: all joints, else one per action joint', _DA, dynamic=True)),
    'max_image_age': (0.5, descriptor(
        'seconds; a camera whose newest header stamp is older is stale and the tick skipped',
        _D, read_only=False, float_range=(0.0, 3600.0))),
    'max_image_spread': (0.2, descriptor(
        'seconds; a camera whose newest header stamp is further behind the newest camera\'s '
        'is refused and the tick skipped, naming it (one observation would mix views taken '
        'that far apart); about two frame intervals of the slowest camera', _D,
        read_only=False, float_range=(0.0, 3600.0))),
    'max_state_age': (0.5, descriptor(
        'seconds; same for the joint state', _D, read_only=False, float_range=(0.0, 3600.0))),
    'max_future_stamp': (0.05, descriptor(
        'seconds; an input whose header stamp is further ahead of the node clock is refused '
        '(clocks not synchronized) and never used', _D, float_range=(0.0, 60.0))),
    'min_image_size': ([32, 32], descriptor(
        'pixels [height, width]; a camera frame smaller in either is refused (a failing '
        'driver or a wrong topic: the model, which sees 14-pixel patches of a 378-pixel '
        'resize, would get a blown-up handful of pixels) and the tick skipped, naming the '
        'camera; [0, 0]: no minimum', _IA)),
    'max_joint_velocity': ([DEFAULT_MAX_JOINT_VELOCITY], descriptor(
        'rad/s (robot units/s) per action joint, one value for all or one per joint, each > 0 '
        '(.inf: none): the first point of every chunk moves at most this fast from the '
        'measured /joint_states position, each later point from the one before, so a plan '
        'far from the arm is reached along a ramp; default 1.5: below common arm limits, '
        "above what the demo's arm moves", _DA, dynamic=True)),
    'tracking_tolerance': ([], descriptor(
        'robot units (rad) per action joint, one value for all or one per joint, each > 0: '
        'a joint measured further than this from where the chunk the arm executes had it at '
        'the /joint_states stamp does not follow the chunks (controller rejecting them, a '
        'stop, a blocked arm): its next chunk starts from the measurement instead of the '
        'position predicted along that chunk (WARN naming it); empty: max_joint_velocity x '
        '0.1 s; .inf: never judged (e.g. fingers that close on an object, where gripper_index '
        'does not name them)', _DA, dynamic=True)),
    'joint_position_min': ([], descriptor(
        'per action joint lower position limit, robot units (rad); every published point is '
        'clipped to it and clipping is counted on /diagnostics, except while a joint measured '
        'outside the limits is ramped back in at max_joint_velocity (no step into the range; '
        'WARN naming it); empty: none, one value: all joints, -.inf: none for that joint',
        _DA, dynamic=True)),
    'joint_position_max': ([], descriptor(
        'per action joint upper position limit, as joint_position_min', _DA, dynamic=True)),
    'model': ('tiny', descriptor(
        'model preset, used when checkpoint_path is empty: tiny (the test model; up to 8 '
        'cameras, state and actions 8-D, horizon 16), molmobot-droid (2 cameras, 8-D, 16), '
        'molmobot-4b-8cam (the full size; 8 cameras, 14-D, 16)', _S)),
    'checkpoint_path': ('', descriptor(
        'upstream checkpoint directory (config.yaml + model.pt or *.safetensors) or weight '
        'file; empty: random weights of the preset `model`, only with allow_random_weights',
        _S)),
    'allow_random_weights': (False, descriptor(
        'serve random weights (preset `model`, `seed`) when checkpoint_path is empty: tests '
        'and the demo; false: configure fails without a checkpoint', _B)),
    'tokenizer_path': ('', descriptor('Qwen tokenizer.json (empty: beside the checkpoint)',
                                       _S)),
    'tokenizer': ('auto', descriptor(
        'which tokenizer serves the model', _S, constraints="'auto' (tokenizer_path or the "
        'tokenizer.json beside the checkpoint; the built-in tiny one for random weights), '
        "'tiny' (the built-in one, also for a checkpoint trained with it) or 'file'")),
    'norm_stats_key': ('', descriptor(
        "dataset key of the checkpoint's normalization stats (stats_by_repo), e.g. "
        "'synthmanip'; empty: the checkpoint's default_repo_id", _S)),
    'gripper_index': (-1, descriptor(
        'action dimension binarized as the gripper command (-1: off)', _I,
        int_range=(-1, 1023))),
    'gripper_threshold': (0.0, descriptor(
        'robot units; gripper action >= threshold -> gripper_closed, else gripper_open', _D)),
    'gripper_open': (0.0, descriptor('command written for an open gripper, robot units', _D)),
    'gripper_closed': (1.0, descriptor('command written for a closed gripper, robot units',
                                        _D)),
    'device': ('cpu', descriptor("torch device, e.g. 'cpu', 'cuda', 'cuda:1'", _S)),
    'dtype': ('float32', descriptor('serving dtype of the weights', _S,
                                     constraints="'float32', 'bfloat16' or 'float16'")),
    'seed': (0, descriptor('seed of random weights and flow noise', _I,
                            int_range=(0, 2**31 - 1))),
    'flow_steps': (0, descriptor("Euler flow steps (0: the model config's)", _I,
                                  int_range=(0, 1000))),
    'compile': (False, descriptor('torch.compile the query', _B)),
    'cuda_graphs': (False, descriptor('capture each padding bucket as a CUDA graph', _B)),
    'quantize': ('none', descriptor('LLM Linear quantization', _S,
                                     constraints="'none', 'fp8', 'fp8-rowwise', 'fp8-tensor'")),
    'overlong': ('error', descriptor(
        'a prompt longer than the largest bucket', _S,
        constraints="'error' (refuse the observation) or 'truncate' (cut words from the end "
                    "of the instruction)")),
    'vit_fp32_attention': (False, descriptor(
        "upstream's float32 ViT attention (true) or the fused bf16 kernel (false, 2.5x faster "
        'ViT on an H200)', _B)),
    'fused_action_expert': ('auto', descriptor(
        "each flow step's DiT blocks as one kernel (CUDA): the thread-block-cluster kernel "
        '(Hopper, bfloat16, the full-size expert; built with nvcc on first use, ~10-20 s), '
        'or the persistent Triton kernel (bfloat16 or float16)', _S,
        constraints="'auto' (with compile or cuda_graphs: the cluster kernel where it can "
                    "serve, else the Triton kernel, else the blocks, logged), "
                    "'cluster' (required: configure fails where it cannot serve), "
                    "'on' / true / 'triton' (the Triton kernel, required likewise), "
                    "'off' / false",
        dynamic=True)),
    'llm_attention': ('auto', descriptor(
        "the LLM's masked attention: FlashAttention-4's kernel with the mask as a rule per "
        'score and its tiles classified per query (CUDA compute capability 9.x / 10.x: H100, '
        'H200, B200; bfloat16 or float16; the flash-attn-4 package; checked against float32 '
        'at start-up), or the additive (L, L) mask through SDPA', _S,
        constraints="'auto' (FlashAttention-4 where it can serve, else the additive mask, "
                    "logged), 'flash' (required: configure fails where it cannot serve), "
                    "'masked'")),
    'buckets': ([], descriptor(
        "fixed prompt lengths (tokens) to pad to; empty ([] or 'none'): no padding", _IA,
        dynamic=True)),
    'output_topic': ('~/joint_trajectory', descriptor(
        'trajectory_msgs/JointTrajectory output topic', _S)),
    'publish_float_array': (False, descriptor(
        'also publish each chunk\'s points as std_msgs/Float32MultiArray on ~/actions (layout '
        'action x joint, robot units, no stamp: row k is for the trajectory\'s header.stamp + '
        'k x control_period; docs/ROBOT.md)', _B)),
    'gc_freeze': (True, descriptor(
        'after configure, move the start-up heap (model, compiled code) out of the garbage '
        "collector's reach (gc.freeze): full collections then take ms, not hundreds of ms",
        _B)),
    'debug_timing': (False, descriptor(
        "per-chunk delay clues on ~/chunk_info (wake_late_ms, runqueue_wait_ms, "
        'publish_call_ms, tail_stall_ms, stalled_threads, and the work before: '
        'start_late_ms, observe_ms, preprocess_ms, model_ms, after_predict_ms: where a late '
        'publish spent its time; reads /proc per chunk)', _B)),
    'diagnostics_period': (1.0, descriptor(
        'seconds between /diagnostics messages (system clock: they come without /clock too)',
        _D, float_range=(0.05, 60.0))),
    'output_error_periods': (3, descriptor(
        "chunk periods without a published chunk before the 'output' status goes ERROR (WARN "
        'after 1.5: a tick missed)', _I, int_range=(2, 1000))),
    'diag_min_camera_rate': (1.0, descriptor(
        'Hz; a camera or joint state below this rate is WARN', _D, read_only=False,
        float_range=(0.0, 1000.0))),
    'diag_inference_warn_ms': (500.0, descriptor(
        'ms; inference p99 above this is WARN', _D, read_only=False,
        float_range=(0.0, 1e6))),
    'diag_inference_error_ms': (1000.0, descriptor(
        'ms; inference p99 above this is ERROR', _D, read_only=False,
        float_range=(0.0, 1e6))),
    'diag_jitter_warn_ms': (10.0, descriptor(
        'ms; the largest publish jitter of the last 20 chunks after start-up above this is WARN', _D,
        read_only=False, float_range=(0.0, 1e6))),
    'diag_jitter_error_ms': (50.0, descriptor(
        'ms; the largest publish jitter of the last 20 chunks after start-up above this is ERROR', _D,
        read_only=False, float_range=(0.0, 1e6))),
}

ENGINE_PARAMETERS = ('model', 'checkpoint_path', 'tokenizer_path', 'tokenizer',
                     'norm_stats_key', 'device', 'dtype', 'seed', 'flow_steps', 'compile',
                     'cuda_graphs', 'quantize', 'buckets', 'overlong', 'vit_fp32_attention',
                     'fused_action_expert', 'llm_attention', 'instruction')
CONTRACT_PARAMETERS = ('gripper_index', 'gripper_threshold', 'gripper_open', 'gripper_closed')



class ParameterError(ValueError):
    """A parameter value the node cannot use.

    Attributes:
        name: the parameter. value: the value given. expected: what the node accepts
            (the allowed range or values, with a hint how to write it).
    """

    def __init__(self, name: str, value, expected: str) -> None:
        super().__init__(f"parameter '{name}': {value!r} {expected}")
        self.name, self.value, self.expected = name, value, expected


def given_parameters(node) -> dict:
    """{name: rclpy Parameter} given to `node` (--params-file, -p, parameter_overrides).
    rclpy keeps them in Node._parameter_overrides only; no public accessor exists."""
    return dict(getattr(node, '_parameter_overrides', {}))


def declare_parameters(node) -> None:
    """Declare every PARAMETERS entry on `node`, each with a copy of its descriptor (rclpy
    fills in the descriptor it is given: name, and the type of a dynamically typed one; the
    table must stay as written for the next node in the process and for the reference docs).

    Raises:
        ParameterError: a given value has the wrong type or is out of range.
    """
    for name, (default, descriptor) in PARAMETERS.items():
        declared = copy.deepcopy(descriptor)
        # rclpy's read_only refuses a set in every state; the node refuses the configure-time
        # ones only while configured (PolicyNode._not_settable), so cleanup, set, configure
        # takes the new value
        declared.read_only = name in START_ONLY
        try:
            node.declare_parameter(name, default, declared)
        except (InvalidParameterTypeException, InvalidParameterValueException) as error:
            given = given_parameters(node).get(name)
            value = given.value if given is not None else '?'
            if isinstance(error, InvalidParameterValueException):
                raise ParameterError(name, value, _out_of_range_text(descriptor)) from None
            raise ParameterError(name, value, _type_expectation(default, value, descriptor)
                                 + f'): {error}') from None


def widen_integers(parameters: list) -> list:
    """rclpy pre-set parameters callback (`Node.add_pre_set_parameters_callback`): a run-time
    integer for a float parameter becomes that float (`ros2 param set <node> name 2` sends
    the integer 2, which rclpy would refuse as "Wrong parameter type, expected '3' got '2'"),
    an integer list for a float-list parameter a float list. Every other value, and every
    parameter not in PARAMETERS, passes unchanged: rclpy's own checks (type, range, read
    only) and the node's then run as usual.

    parameters: list of rclpy.parameter.Parameter. Returns a list of the same length.
    """
    widened = []
    for parameter in parameters:
        declared = PARAMETERS.get(parameter.name)
        kind = declared[1].type if declared is not None else None
        if kind == _D and parameter.type_ == Parameter.Type.INTEGER:
            parameter = Parameter(parameter.name, Parameter.Type.DOUBLE, float(parameter.value))
        elif kind == _DA and parameter.type_ == Parameter.Type.INTEGER_ARRAY:
            parameter = Parameter(parameter.name, Parameter.Type.DOUBLE_ARRAY,
                                  [float(v) for v in parameter.value])
        widened.append(parameter)
    return widened


def type_mismatches(parameters: list) -> list[str]:
    """For a run-time set (after `widen_integers`): one message per parameter of PARAMETERS
    given a value of another type than declared, e.g. "parameter 'diag_min_camera_rate':
    'fast' is not a valid float (...)", the way a parameter file's is reported (rclpy then
    refuses it with only "Wrong parameter type, expected '3' got '4'"). Dynamically typed
    parameters and unknown names give none. parameters: list of rclpy.parameter.Parameter."""
    problems = []
    for parameter in parameters:
        declared = PARAMETERS.get(parameter.name)
        if declared is None or declared[1].dynamic_typing:
            continue
        default, descriptor = declared
        if parameter.type_.value != descriptor.type:
            problems.append(f"parameter '{parameter.name}': {parameter.value!r} "
                            + _type_expectation(default, parameter.value, descriptor) + ')')
    return problems


def out_of_range(parameters: list) -> list[str]:
    """For a run-time set (after `widen_integers`): one message per number of its declared
    type outside its parameter's declared range, e.g. "parameter 'max_image_age': -1.0 is
    out of range (...; allowed: 0.0 to 3600.0)", the way a parameter file's is reported
    (rclpy then refuses the set, and no line of the node's log would say so). Values of
    another type (`type_mismatches`) and unknown names give none.
    parameters: list of rclpy.parameter.Parameter."""
    problems = []
    for parameter in parameters:
        declared = PARAMETERS.get(parameter.name)
        if declared is None:
            continue
        descriptor = declared[1]
        ranges = list(descriptor.floating_point_range) or list(descriptor.integer_range)
        value = parameter.value
        if (not ranges or parameter.type_.value != descriptor.type
                or parameter.type_ not in (Parameter.Type.DOUBLE, Parameter.Type.INTEGER)):
            continue
        if not ranges[0].from_value <= value <= ranges[0].to_value:
            problems.append(str(ParameterError(parameter.name, value,
                                               _out_of_range_text(descriptor))))
    return problems


def _out_of_range_text(descriptor: ParameterDescriptor) -> str:
    """'is out of range (<description>; allowed: min to max)': a file's value and a run-time
    set's say the same."""
    return f'is out of range ({descriptor.description}; {_range_text(descriptor)})'


def _type_expectation(default, value, descriptor: ParameterDescriptor) -> str:
    """'is not a valid <type> (<description>; <constraints, hints, range>' for `value`."""
    text = f'is not a valid {type(default).__name__} ({descriptor.description}'
    if descriptor.additional_constraints:
        text += f'; {descriptor.additional_constraints}'
    if isinstance(default, float):
        text += _float_hint(value, default)
    if descriptor.floating_point_range or descriptor.integer_range:
        text += f'; {_range_text(descriptor)}'
    if isinstance(default, str) and isinstance(value, bool):
        text += ('; YAML reads unquoted on/off/yes/no/true/false as booleans: '
                 + ('write one of the values listed' if descriptor.additional_constraints
                    else "quote it, e.g. 'yes'"))
    return text


def check_unknown_parameters(node) -> None:
    """Raises ValueError naming every parameter given to `node` (e.g. in --params-file)
    that PARAMETERS does not declare, with the closest declared name: a misspelled
    `checkpont_path` must not silently serve random weights."""
    unknown = sorted(n for n in given_parameters(node)
                     if not node.has_parameter(n) and not n.startswith('qos_overrides.'))
    if unknown:
        raise ValueError(f"unknown parameter(s) for node '{node.get_name()}': "
                         f"{', '.join(_with_closest(n) for n in unknown)}; every parameter: "
                         'docs/PARAMETERS.md')


def _with_closest(name: str, names=PARAMETERS) -> str:
    """The name quoted, with the closest of `names` (default: the declared parameters) if
    there is one, e.g. `'chunk_perod' (did you mean 'chunk_period'?)`."""
    close = difflib.get_close_matches(name, list(names), n=1)
    return f"'{name}'" + (f" (did you mean '{close[0]}'?)" if close else '')


def undeclared(parameters: list, declared) -> list[str]:
    """For a run-time set: one message per parameter whose name `declared(name)` (e.g.
    `node.has_parameter`) does not know, with the closest declared name; rclpy then refuses
    the set with only "Invalid access to undeclared parameter(s): []" (its list comes out
    empty). parameters: list of rclpy.parameter.Parameter."""
    return [f'unknown parameter {_with_closest(p.name)}; `ros2 param list` or '
            'docs/PARAMETERS.md list the parameters' for p in parameters
            if not declared(p.name)]


def bucket_lengths(value) -> tuple[int, ...]:
    """The `buckets` parameter as prompt lengths (tokens): a list of integers, or no
    padding from an empty list or the string 'none' (any case). rcl cannot type an empty
    list (`buckets: []` in a parameter file, `-p buckets:=[]`) and hands it to rclpy as a
    parameter without a value: None here, also no padding. Raises ParameterError (a
    ValueError) naming the parameter and the value given otherwise."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ('', 'none')):
        return ()
    if isinstance(value, ARRAYS) and all(
            isinstance(b, int) and not isinstance(b, bool) for b in value):
        return tuple(value)
    raise ParameterError('buckets', list(value) if isinstance(value, ARRAYS) else value,
                         'is not a list of prompt lengths in tokens (e.g. [1664, 1856]), '
                         "nor [] or 'none' (no padding)")


THRESHOLD_PAIRS = (('diag_inference_warn_ms', 'diag_inference_error_ms'),
                   ('diag_jitter_warn_ms', 'diag_jitter_error_ms'))


def threshold_problem(parameter) -> ParameterError | None:
    """None, or the error of a WARN threshold above its ERROR one (the status would skip
    WARN on its way to ERROR); `parameter(name)` -> its value."""
    for warn, error in THRESHOLD_PAIRS:
        if parameter(warn) > parameter(error):
            return ParameterError(warn, parameter(warn), f'is above {error} = '
                                                         f'{parameter(error)!r}; expected WARN '
                                                         '<= ERROR')
    return None


def check_parameter_values(parameter) -> None:
    """The checks a descriptor cannot express; `parameter(name)` -> its value.

    Raises:
        ParameterError: camera_topics, joint_names or action_joint_names empty or naming
            one twice; camera_qos not one of CAMERA_QOS; camera_transports not 1 or one per
            camera of CAMERA_TRANSPORTS; max_step, max_joint_velocity, joint_position_min /
            _max not numbers, or with other than 0 (max_joint_velocity: 1), 1 or one value per
            action joint; action_joint_names not in joint_names (`unanchored_action_joints`);
            min_image_size not two pixel counts >= 0; a WARN threshold above its ERROR one
            (`threshold_problem`).
    """
    contradiction = threshold_problem(parameter)
    if contradiction is not None:
        raise contradiction
    for name in ('camera_topics', 'joint_names', 'action_joint_names'):
        values = list(parameter(name))
        if not values:
            raise ParameterError(name, values, 'is empty; list at least one')
        twice = repeated(values)
        if twice:           # before the name checks below, which it would confuse
            raise ParameterError(name, values, f'names {twice} more than once; each must '
                                               'appear once')
    unanchored = unanchored_action_joints(parameter)
    if unanchored and not parameter('allow_unanchored_action_joints'):
        joints = list(parameter('joint_names'))
        raise ParameterError(
            'action_joint_names', list(parameter('action_joint_names')),
            f"has joints not in joint_names {joints}: "
            f"{', '.join(_with_closest(n, joints) for n in unanchored)}; each chunk's first "
            "point is limited against the measured position of every action joint, and only "
            "joint_names are sure to be measured (a tick waits for all of them): fix the "
            'name, or set allow_unanchored_action_joints: true to publish a joint that '
            'joint_state_topic may not carry (e.g. a gripper on another topic) from the plan '
            'alone')
    if parameter('camera_qos') not in CAMERA_QOS:
        raise ParameterError('camera_qos', parameter('camera_qos'),
                             f'is not one of {list(CAMERA_QOS)}')
    transports, cameras = list(parameter('camera_transports')), len(parameter('camera_topics'))
    if len(transports) not in (1, cameras) or set(transports) - set(CAMERA_TRANSPORTS):
        raise ParameterError('camera_transports', transports,
                             f'is not 1 or {cameras} (one per camera topic) of '
                             f'{list(CAMERA_TRANSPORTS)}')
    for name in MOTION_LIMITS:
        per_joint(parameter, name)
    size = parameter('min_image_size')
    size = [] if size is None else list(size)
    if len(size) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                 for v in size):
        raise ParameterError('min_image_size', size,
                             'is not [height, width]: two pixel counts >= 0 (e.g. [32, 32]; '
                             '[0, 0]: no minimum)')
    receiver = parameter('camera_receiver')
    if receiver not in CAMERA_RECEIVERS:
        raise ParameterError('camera_receiver', receiver,
                             f'is not one of {list(CAMERA_RECEIVERS)}')
    if receiver == 'subprocess' and parameter('use_sim_time'):
        raise ParameterError('camera_receiver', receiver,
                             "cannot serve with use_sim_time: true (the receiver process "
                             "stamps receive times on the system clock, not /clock); set "
                             "camera_receiver: 'in_process' or use_sim_time: false")


def unanchored_action_joints(parameter) -> list[str]:
    """The action joints (`action_joint_names`, but the `gripper_index` one: its binarized
    command is no measured position) that are not in `joint_names`: a tick does not wait for
    their positions, so a chunk may go out with none to anchor them to (the MotionLimiter
    then bounds them only between the points of one chunk); `parameter(name)` -> its value."""
    joints = set(parameter('joint_names'))
    return [n for k, n in enumerate(parameter('action_joint_names'))
            if k != parameter('gripper_index') and n not in joints]


def unlimited_velocity_joints(parameter, limiter: MotionLimiter) -> list[str]:
    """The action joints (but the `gripper_index` one, exempt by design) without a velocity
    limit in `limiter` (`motion_limiter`'s: max_joint_velocity `.inf` in YAML): no limit on
    their steps, nor on the first point's distance from the measured state;
    `parameter(name)` -> its value."""
    names = list(parameter('action_joint_names'))
    velocity = np.broadcast_to(limiter.max_velocity, (len(names),))
    return [n for k, (n, v) in enumerate(zip(names, velocity))
            if k != parameter('gripper_index') and np.isinf(v)]


def as_written(value):
    """A parameter value as a user wrote it, for messages: an array.array (a run-time set of
    a list) as a list, anything else as it is."""
    return list(value) if isinstance(value, array.array) else value


def per_joint(parameter, name: str) -> list[float] | None:
    """A per-action-joint list parameter (float or list) as one float per action joint, or
    None when empty (an empty YAML list reaches rclpy as no value: None); `parameter(name)`
    -> its value. Raises ParameterError otherwise."""
    value, joints = parameter(name), len(parameter('action_joint_names'))
    values = [] if value is None else list(value) if isinstance(value, ARRAYS) else [value]
    value = as_written(value)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ParameterError(name, value, f'is not a number or a list of numbers (one value, '
                                          f'or one per action joint: {joints})')
    allowed = (1, joints) if name == 'max_joint_velocity' else (0, 1, joints)
    if len(values) not in allowed:
        expected = ', '.join(map(str, allowed[:-1])) + f' or {allowed[-1]}'
        raise ParameterError(name, value, f'has {len(values)} values; expected {expected} '
                                          '(one per action joint)')
    if not values:
        return None
    return [float(v) for v in values] * (joints if len(values) == 1 else 1)


def chunk_stitcher(parameter) -> ChunkStitcher:
    """The `ChunkStitcher` of control_period, smoothing and max_step (one value: every
    action joint); `parameter(name)` -> its value. Raises ValueError on a bad value."""
    max_step = per_joint(parameter, 'max_step')
    return ChunkStitcher(parameter('control_period'), smoothing=parameter('smoothing'),
                         max_step=None if max_step is None else np.array(max_step))


def check_gripper_within_limits(parameter, gripper: int, limits: dict) -> None:
    """ParameterError when gripper_open or gripper_closed lies outside the position limits of
    the gripper dimension `gripper` (a single limit written for the arm's joints in rad also
    applies to it): every point's gripper command would be clipped to the limit, the
    gripper then never reaching that state. `limits`: {'joint_position_min': `per_joint`'s
    list or None, 'joint_position_max': ...}."""
    commands = {'gripper_open': parameter('gripper_open'),
                'gripper_closed': parameter('gripper_closed')}
    for name, side in (('joint_position_min', min), ('joint_position_max', max)):
        if limits[name] is None:
            continue
        limit = limits[name][gripper]
        outside = {k: v for k, v in commands.items()
                   if (v < limit if side is min else v > limit)}
        if outside:
            raise ParameterError(name, as_written(parameter(name)), (
                f'puts the gripper dimension (gripper_index {gripper}) at {limit!r}, which '
                f"would clip {', '.join(f'{k} {v!r}' for k, v in outside.items())}: give "
                "the gripper's own limit in its units (one value per action joint), or "
                f"{'-.inf' if side is min else '.inf'} for it"))


# the per-action-joint parameters `motion_limiter` builds the MotionLimiter of
MOTION_LIMITS = ('max_step', 'max_joint_velocity', 'joint_position_min', 'joint_position_max',
                 'tracking_tolerance')


def motion_limiter(parameter) -> MotionLimiter:
    """The `MotionLimiter` of MOTION_LIMITS; `parameter(name)` -> its value. The gripper
    dimension (gripper_index >= 0) has no velocity or step limit here: its binarized open /
    closed command is no joint position. Raises ValueError on a bad value (ParameterError
    naming the parameter)."""
    velocity = per_joint(parameter, 'max_joint_velocity')
    step = per_joint(parameter, 'max_step')
    tolerance = per_joint(parameter, 'tracking_tolerance')
    limits = {name: per_joint(parameter, name)
              for name in ('joint_position_min', 'joint_position_max')}
    gripper = parameter('gripper_index')
    if 0 <= gripper < len(velocity):
        velocity[gripper] = np.inf
        if step is not None:
            step[gripper] = np.inf
        if tolerance is not None:
            tolerance[gripper] = np.inf
        check_gripper_within_limits(parameter, gripper, limits)
    try:
        return MotionLimiter(max_velocity=velocity,
                             position_min=limits['joint_position_min'],
                             position_max=limits['joint_position_max'],
                             max_step=step, tracking_tolerance=tolerance)
    except ParameterError:
        raise
    except ValueError as error:     # MotionLimiter's names -> the parameters'
        message = str(error)
        for inner, outer in (('max_velocity', 'max_joint_velocity'),
                             ('position_min', 'joint_position_min'),
                             ('position_max', 'joint_position_max')):
            message = re.sub(rf'(?<![a-z_]){inner}\b', outer, message)
        name, _, expected = message.partition(' ')
        if name not in MOTION_LIMITS:
            raise ValueError(message) from None
        if expected.startswith('must be > 0'):      # its ', got' is the value per joint
            expected = expected.split(', got ')[0]
        raise ParameterError(name, as_written(parameter(name)), expected) from None


def camera_subscriptions(parameter) -> list[tuple[str, bool]]:
    """(topic to subscribe, compressed?) per camera, in camera order: `<topic>/compressed`
    where camera_transports says 'compressed'; `parameter(name)` -> its value."""
    topics = list(parameter('camera_topics'))
    transports = list(parameter('camera_transports'))
    transports = transports * len(topics) if len(transports) == 1 else transports
    return [(f"{t.rstrip('/')}/compressed", True) if kind == 'compressed' else (t, False)
            for t, kind in zip(topics, transports)]


def _float_hint(value, default: float) -> str:
    """How to write a float parameter that came as another type (the example is the
    default, always in range)."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return f'; write a number, e.g. {default!r} (the default)'
        return f'; a quoted number is a string: write {value} without quotes'
    return f'; write floats with a decimal point, e.g. {default!r} (the default)'


def _range_text(descriptor: ParameterDescriptor) -> str:
    """'allowed: min to max' from a descriptor's floating-point or integer range."""
    ranges = list(descriptor.floating_point_range) or list(descriptor.integer_range)
    if not ranges:
        return descriptor.additional_constraints or 'see the parameter description'
    return f'allowed: {ranges[0].from_value} to {ranges[0].to_value}'
