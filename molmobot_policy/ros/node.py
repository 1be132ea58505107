"""PolicyNode: eight cameras + joint state in, MolmoBot action chunks out on a fixed schedule.

A lifecycle node (rclpy.lifecycle). configure builds and warms the engine; activate
creates the subscriptions, publishers, the diagnostics timer and the worker thread;
deactivate stops them; cleanup releases the engine. With `autostart` (default) `main`
runs configure + activate itself, for users without lifecycle tooling.

Subscription callbacks only store the newest message (`ObservationSynchronizer`). The
worker thread ticks on absolute deadlines `t0 + k * chunk_period` in ROS time (sim time
aware, `timing.DeadlineScheduler`): it starts inference `lead` seconds before the deadline
(the measured p99 latency times a margin, `timing.LatencyEstimator`, capped at
MAX_LEAD_FRACTION of the period), builds the observation from the newest frames, runs
`engine.predict`, builds the `trajectory_msgs/JointTrajectory`, waits for the deadline
and publishes it: action k is
meant to execute at `observation.stamp + k * control_period`; actions whose time is before
the deadline (or before now, if inference overran it) are dropped; header.stamp is the time
of the first remaining action and time_from_start of point j is j * control_period.

Publish timing: the message is built before the deadline so that only `publish` runs
after the wake-up. On the system clock the worker sleeps until BUSY_WAIT_S before the
deadline and then polls the clock, yielding the GIL (`time.sleep(0)`) between polls; on sim
time it polls the ROS clock every <= 50 ms. `main` lowers the interpreter's thread switch
interval (SWITCH_INTERVAL_S) so that subscription callback threads holding the GIL delay
the worker's wake-up by at most that much. The worker is the only thread publishing chunks.

Run: python -m molmobot_policy.ros.node --ros-args --params-file config/policy_tiny.yaml
"""
from __future__ import annotations

import functools
import gc
import logging
import math
import os
import sys
import threading
import time

import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor,
                                ParameterType, SetParametersResult)
from rclpy._rclpy_pybind11 import RCLError
from rclpy.duration import Duration
from rclpy.exceptions import InvalidParameterTypeException, InvalidParameterValueException
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from rclpy.time import Time
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float32MultiArray, MultiArrayDimension
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from molmobot_policy.ros.codec import image_to_rgb
from molmobot_policy.ros.synchronizer import ObservationSynchronizer, Skip
from molmobot_policy.timing import (ChunkStitcher, DeadlineScheduler, GcPauses, LatencyEstimator,
                                    ObservationGate, RollingStats, runqueue_wait_s)

NODE_NAME = 'molmobot_policy'
DEFAULT_CAMERAS = [f'/cam{k}/image_raw' for k in range(8)]
DEFAULT_JOINTS = [f'jaco_joint_{k}' for k in range(1, 7)] + ['jaco_finger_1']
CAMERA_QOS = ('sensor_data', 'reliable')
WARN_THROTTLE_S = 2.0       # at most one warning per call site per this many seconds
STATS_WINDOW = 200          # samples kept for p50/p99/max in diagnostics
POLL_S = 0.05               # longest single wait of the worker (stop and sim time checks)
BUSY_WAIT_S = 0.001         # system clock: poll (yielding) this long before a deadline;
                            # covers the ~0.1 ms oversleep of timed waits on Linux
MAX_LEAD_FRACTION = 0.9     # lead <= this * chunk_period: one latency spike (a stalled
                            # machine) must not push the lead past the period (then at most
                            # every other tick runs) or past the chunk's span (then every
                            # action is in the past at publish time) for a whole window of
                            # latency samples; the rest of the period is left for the
                            # publish bookkeeping before the next tick starts
SWITCH_INTERVAL_S = 0.0005  # sys.setswitchinterval in main (CPython default 0.005 s): the
                            # longest a GIL-holding callback thread delays the worker's wake-up

OK, WARN, ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR


def _seconds(stamp) -> float:
    """builtin_interfaces/Time -> float seconds."""
    return stamp.sec + stamp.nanosec * 1e-9


def _default_engine_factory(config: dict):
    """`PolicyEngine` of the EngineConfig fields in `config` and its 'contract'."""
    from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine
    options = dict(config)
    contract = options.pop('contract')
    return PolicyEngine(EngineConfig(**options), contract=contract)


def _descriptor(description: str, type_: int, read_only: bool = True,
                float_range: tuple[float, float] | None = None,
                int_range: tuple[int, int] | None = None,
                constraints: str = '', dynamic: bool = False) -> ParameterDescriptor:
    """dynamic: leave the parameter's type open (on_configure converts the value) where rclpy
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



# name: (default, descriptor). read_only where a change after configure/activate is unsafe.
PARAMETERS = {
    'autostart': (True, _descriptor('run configure + activate at start-up', _B)),
    'camera_topics': (DEFAULT_CAMERAS, _descriptor(
        'sensor_msgs/Image topics in model image order (camera k -> "Image k+1"); at most the '
        "model's max_images", _SA)),
    'camera_qos': ('sensor_data', _descriptor(
        'QoS of the camera subscriptions', _S, constraints="'sensor_data' (best effort, keep "
        "last 5) or 'reliable' (reliable, keep last 1)")),
    'joint_state_topic': ('/joint_states', _descriptor('sensor_msgs/JointState topic', _S)),
    'joint_names': (DEFAULT_JOINTS, _descriptor(
        'joints making up the state vector, in order (matched by name)', _SA)),
    'action_joint_names': (DEFAULT_JOINTS, _descriptor(
        'JointTrajectory joint_names; action dim k drives joint k', _SA)),
    'instruction': ('', _descriptor('task text given to the model; may change at run time',
                                    _S, read_only=False)),
    'control_period': (0.1, _descriptor(
        'seconds between consecutive actions of a chunk', _D, float_range=(0.001, 10.0))),
    'chunk_period': (1.0, _descriptor(
        'seconds between published chunks (the policy period)', _D,
        float_range=(0.01, 60.0))),
    'smoothing': ('none', _descriptor(
        'joining a new chunk to the previous one (timing.ChunkStitcher)', _S,
        constraints="'none' or 'linear' (cross-fade over the overlap)")),
    'max_step': ([], _descriptor(
        'largest change per joint between consecutive points, robot units (rad); empty: no '
        'limit, one value: all joints, else one per action joint', _DA, dynamic=True)),
    'max_image_age': (0.5, _descriptor(
        'seconds; a camera whose newest header stamp is older is stale and the tick skipped',
        _D, read_only=False, float_range=(0.0, 3600.0))),
    'max_state_age': (0.5, _descriptor(
        'seconds; same for the joint state', _D, read_only=False, float_range=(0.0, 3600.0))),
    'model': ('tiny', _descriptor('model preset, used when checkpoint_path is empty', _S)),
    'checkpoint_path': ('', _descriptor('upstream checkpoint directory (empty: random init)',
                                        _S)),
    'tokenizer_path': ('', _descriptor('Qwen tokenizer.json (empty: beside the checkpoint)',
                                       _S)),
    'tokenizer': ('auto', _descriptor(
        'which tokenizer serves the model', _S, constraints="'auto' (tokenizer_path or the "
        'tokenizer.json beside the checkpoint; the built-in tiny one for random weights), '
        "'tiny' (the built-in one, also for a checkpoint trained with it) or 'file'")),
    'norm_stats_key': ('', _descriptor(
        "dataset key of the checkpoint's normalization stats (stats_by_repo), e.g. "
        "'synthmanip'; empty: the checkpoint's default_repo_id", _S)),
    'gripper_index': (-1, _descriptor(
        'action dimension binarized as the gripper command (-1: off)', _I,
        int_range=(-1, 1023))),
    'gripper_threshold': (0.0, _descriptor(
        'robot units; gripper action >= threshold -> gripper_closed, else gripper_open', _D)),
    'gripper_open': (0.0, _descriptor('command written for an open gripper, robot units', _D)),
    'gripper_closed': (1.0, _descriptor('command written for a closed gripper, robot units',
                                        _D)),
    'device': ('cpu', _descriptor("torch device, e.g. 'cpu', 'cuda', 'cuda:1'", _S)),
    'dtype': ('float32', _descriptor('serving dtype of the weights', _S,
                                     constraints="'float32', 'bfloat16' or 'float16'")),
    'seed': (0, _descriptor('seed of random weights and flow noise', _I,
                            int_range=(0, 2**31 - 1))),
    'flow_steps': (0, _descriptor("Euler flow steps (0: the model config's)", _I,
                                  int_range=(0, 1000))),
    'compile': (False, _descriptor('torch.compile the query', _B)),
    'cuda_graphs': (False, _descriptor('capture each padding bucket as a CUDA graph', _B)),
    'quantize': ('none', _descriptor('LLM Linear quantization', _S,
                                     constraints="'none', 'fp8', 'fp8-rowwise', 'fp8-tensor'")),
    'overlong': ('error', _descriptor(
        'a prompt longer than the largest bucket', _S,
        constraints="'error' (refuse the observation) or 'truncate' (cut words from the end "
                    "of the instruction)")),
    'vit_fp32_attention': (False, _descriptor(
        "upstream's float32 ViT attention (true) or the fused bf16 kernel (false, 2.5x faster "
        'ViT on an H200)', _B)),
    'fused_action_expert': ('auto', _descriptor(
        "each flow step's DiT blocks as one persistent Triton kernel (CUDA, bfloat16 or "
        'float16, kv_cache true)', _S,
        constraints="'auto' (when compile or cuda_graphs and the kernel can serve), 'on' / "
                    "true (required: configure fails where it cannot serve), 'off' / false",
        dynamic=True)),
    'kv_cache': (True, _descriptor(
        "compute the action expert's cross-attention K/V once per query (false: every flow "
        'step, for comparison only)', _B)),
    'buckets': ([], _descriptor(
        'fixed prompt lengths (tokens) to pad to; empty: no padding', _IA, dynamic=True)),
    'output_topic': ('~/joint_trajectory', _descriptor(
        'trajectory_msgs/JointTrajectory output topic', _S)),
    'publish_float_array': (False, _descriptor(
        'also publish std_msgs/Float32MultiArray (layout: action x joint) on ~/actions', _B)),
    'gc_freeze': (True, _descriptor(
        'after configure, move the start-up heap (model, compiled code) out of the garbage '
        "collector's reach (gc.freeze): full collections then take ms, not hundreds of ms",
        _B)),
    'diagnostics_period': (1.0, _descriptor('seconds between /diagnostics messages', _D,
                                            float_range=(0.05, 60.0))),
    'diag_min_camera_rate': (1.0, _descriptor(
        'Hz; a camera or joint state below this rate is WARN', _D, read_only=False,
        float_range=(0.0, 1000.0))),
    'diag_inference_warn_ms': (500.0, _descriptor(
        'ms; inference p99 above this is WARN', _D, read_only=False,
        float_range=(0.0, 1e6))),
    'diag_inference_error_ms': (1000.0, _descriptor(
        'ms; inference p99 above this is ERROR', _D, read_only=False,
        float_range=(0.0, 1e6))),
    'diag_jitter_warn_ms': (10.0, _descriptor(
        'ms; publish jitter p99 above this is WARN', _D, read_only=False,
        float_range=(0.0, 1e6))),
    'diag_jitter_error_ms': (50.0, _descriptor(
        'ms; publish jitter p99 above this is ERROR', _D, read_only=False,
        float_range=(0.0, 1e6))),
}

ENGINE_PARAMETERS = ('model', 'checkpoint_path', 'tokenizer_path', 'tokenizer',
                     'norm_stats_key', 'device', 'dtype', 'seed', 'flow_steps', 'compile',
                     'cuda_graphs', 'quantize', 'buckets', 'overlong', 'vit_fp32_attention',
                     'fused_action_expert', 'kv_cache', 'instruction')
CONTRACT_PARAMETERS = ('gripper_index', 'gripper_threshold', 'gripper_open', 'gripper_closed')


def bucket_lengths(value) -> tuple[int, ...]:
    """The `buckets` parameter as prompt lengths (tokens): a list of integers, or no
    padding from an empty list or the string 'none' (any case; a YAML file cannot write an
    empty list rcl can type). Raises ValueError naming the parameter otherwise."""
    if isinstance(value, str) and value.strip().lower() in ('', 'none'):
        return ()
    if isinstance(value, (list, tuple)) and all(
            isinstance(b, int) and not isinstance(b, bool) for b in value):
        return tuple(value)
    raise ValueError(f"parameter 'buckets': expected a list of prompt lengths in tokens, "
                     f"e.g. [1664, 1856], or none for no padding; got {value!r}")


def read_model_config(engine_config: dict):
    """The engine's model config without building the engine: the checkpoint's config.yaml
    (weights not read) or the preset. Raises FileNotFoundError / ValueError."""
    from molmobot_policy.model.checkpoint import load_config
    from molmobot_policy.model.config import MolmoBotConfig
    if engine_config['checkpoint_path']:
        return load_config(engine_config['checkpoint_path'],
                           norm_stats_key=engine_config['norm_stats_key'] or None)
    if engine_config['norm_stats_key']:
        raise ValueError(f"norm_stats_key={engine_config['norm_stats_key']!r} needs a "
                         'checkpoint_path (presets carry one set of stats)')
    return MolmoBotConfig.from_name(engine_config['model'])


def check_robot_contract(model, camera_topics, joint_names, action_joint_names,
                         gripper_index: int = -1, gripper_threshold: float = 0.0,
                         gripper_open: float = 0.0, gripper_closed: float = 1.0):
    """The robot's parameters as a `preprocess.transforms.RobotContract` (camera k -> image k,
    joints -> the state, action dim k -> action joint k, the gripper), checked against the
    model (`MolmoBotConfig`). Raises ValueError naming the parameter (`RobotContract.check`)."""
    from molmobot_policy.preprocess.transforms import RobotContract
    contract = RobotContract(camera_names=tuple(camera_topics), joint_names=tuple(joint_names),
                             action_joint_names=tuple(action_joint_names),
                             gripper_index=gripper_index, gripper_threshold=gripper_threshold,
                             gripper_open=gripper_open, gripper_closed=gripper_closed)
    contract.check(model)
    return contract


class PolicyNode(LifecycleNode):
    """The MolmoBot policy as a ROS 2 lifecycle node (parameters: see PARAMETERS).

    Args:
        engine_factory: callable(dict of EngineConfig fields and 'contract', the
            `RobotContract` of the parameters) -> engine with `warmup()`,
            `predict(Observation) -> ActionChunk`, `check_instruction(str)` (raises
            ValueError for an instruction it cannot serve), `model_config`, `mode`, `close()`.
            Default: `runtime.engine.PolicyEngine(EngineConfig(**fields), contract=contract)`.
        **kwargs: passed to rclpy LifecycleNode (e.g. parameter_overrides).
    """

    def __init__(self, engine_factory=None, node_name: str = NODE_NAME, **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        for name, (default, descriptor) in PARAMETERS.items():
            try:
                self.declare_parameter(name, default, descriptor)
            except (InvalidParameterTypeException, InvalidParameterValueException) as error:
                given = getattr(self, '_parameter_overrides', {}).get(name)
                value = given.value if given is not None else '?'
                if isinstance(error, InvalidParameterValueException):
                    raise ValueError(f"parameter '{name}': {value!r} is out of range "
                                     f'({descriptor.description}; {_range_text(descriptor)})'
                                     ) from None
                raise ValueError(
                    f"parameter '{name}': {value!r} is not a valid "
                    f"{type(default).__name__} ({descriptor.description}"
                    + (f'; {descriptor.additional_constraints}'
                       if descriptor.additional_constraints else '')
                    + (_float_hint(value, default) if isinstance(default, float) else '')
                    + (f'; {_range_text(descriptor)}' if descriptor.floating_point_range
                       or descriptor.integer_range else '')
                    + ('; YAML reads unquoted on/off/yes/no/true/false as booleans: write one '
                       'of the values listed'
                       if isinstance(default, str) and isinstance(value, bool) else '')
                    + f'): {error}') from None
        self.add_on_set_parameters_callback(self._validate_parameters)
        self._engine_factory = engine_factory or _default_engine_factory
        self.engine = None
        self.contract = None       # the RobotContract built at configure
        self.chunks_published_total = 0    # over every activation (chunks_published: this one)
        self._froze_heap = False        # gc.freeze() done by this node, undone at cleanup
        self._sync: ObservationSynchronizer | None = None
        self._input_subscriptions = []
        self._trajectory_pub = None
        self._array_pub = None
        self._chunk_info_pub = None
        self._diagnostics_pub = None
        self._diagnostics_timer = None
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()
        self._reset_statistics()

    def _param(self, name: str):
        return self.get_parameter(name).value

    def _validate_parameters(self, parameters) -> SetParametersResult:
        for p in parameters:
            if p.name == 'camera_qos' and p.value not in CAMERA_QOS:
                return SetParametersResult(successful=False, reason=(
                    f'camera_qos must be one of {list(CAMERA_QOS)}, got {p.value!r}'))
            # a new instruction the configured engine cannot serve (too long for its buckets
            # with overlong 'error', or empty) is refused now, not at every later tick; the
            # check tokenizes on the host only, so it is safe while inference runs
            if p.name == 'instruction' and self.engine is not None:
                try:
                    tokens = self.engine.check_instruction(p.value)
                except ValueError as error:
                    self.get_logger().warning(f"refused new 'instruction': {error}")
                    return SetParametersResult(successful=False, reason=f'instruction: {error}')
                self.get_logger().info(f'instruction set to {p.value!r} ({tokens} prompt tokens)')
        return SetParametersResult(successful=True)

    def _reset_statistics(self) -> None:
        self.inference_ms = RollingStats(STATS_WINDOW)
        self.jitter_ms = RollingStats(STATS_WINDOW)
        self.age_ms = RollingStats(STATS_WINDOW)
        self.chunks_published = 0
        self.deadline_misses = 0
        self.dropped_actions = 0
        self.skipped_ticks = 0
        self.failed_ticks = 0
        self.frames_decoded = 0     # images decoded by the synchronizer (worker thread only)
        self.last_skip = ''
        self.wake_late: float | None = None   # s, set by _sleep_until (worker thread only)
        self.runqueue_mark: float | None = None   # s, likewise
        if getattr(self, '_gc_pauses', None) is not None:
            self._gc_pauses.remove()
        self._gc_pauses = GcPauses(STATS_WINDOW)
        self._scheduler: DeadlineScheduler | None = None
        self._stitcher: ChunkStitcher | None = None
        self._gate: ObservationGate | None = None

    # ------------------------------------------------------------------ lifecycle
    def autostart(self) -> bool:
        """configure + activate (what lifecycle tooling would do). True on success."""
        if self.trigger_configure() != TransitionCallbackReturn.SUCCESS:
            return False
        return self.trigger_activate() == TransitionCallbackReturn.SUCCESS

    def _check_unknown_parameters(self) -> None:
        """Raises ValueError naming every parameter given (e.g. in --params-file) that this
        node does not declare: a misspelled `checkpont_path` must not silently serve random
        weights."""
        import difflib
        given = set(getattr(self, '_parameter_overrides', {}))
        unknown = sorted(n for n in given - set(self._parameters)
                         if not n.startswith('qos_overrides.'))
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, list(PARAMETERS), n=1)
                hints.append(f"'{name}'" + (f" (did you mean '{close[0]}'?)" if close else ''))
            raise ValueError(f"unknown parameter(s) for node '{self.get_name()}': "
                             f"{', '.join(hints)}; see `ros2 param describe` or "
                             f'molmobot_policy/ros/node.py PARAMETERS')

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        cameras = list(self._param('camera_topics'))
        joints = list(self._param('joint_names'))
        action_joints = list(self._param('action_joint_names'))
        engine_config = {name: self._param(name) for name in ENGINE_PARAMETERS}
        from molmobot_policy.runtime.config import fused_action_expert_mode
        engine_config['fused_action_expert'] = fused_action_expert_mode(  # unquoted on / off
            engine_config['fused_action_expert'])
        started = time.monotonic()
        try:
            engine_config['buckets'] = bucket_lengths(engine_config['buckets'])
            self._check_unknown_parameters()
            if not cameras or not joints or not action_joints:
                raise ValueError('camera_topics, joint_names and action_joint_names must not '
                                 'be empty')
            if self._param('camera_qos') not in CAMERA_QOS:
                raise ValueError(f"camera_qos must be one of {list(CAMERA_QOS)}, got "
                                 f"{self._param('camera_qos')!r}")
            if len(self._param('max_step')) not in (0, 1, len(action_joints)):
                raise ValueError(f"max_step has {len(self._param('max_step'))} values; expected "
                                 f'0, 1 or {len(action_joints)} (one per action joint)')
            self._make_stitcher()       # raises ValueError on a bad smoothing / max_step
            # before the (possibly long) weight load: the checkpoint's config.yaml only
            contract = check_robot_contract(
                read_model_config(engine_config), cameras, joints, action_joints,
                **{name: self._param(name) for name in CONTRACT_PARAMETERS})
            self.get_logger().info(f"configuring: building engine (model "
                                   f"{engine_config['checkpoint_path'] or engine_config['model']!r}"
                                   f", device {engine_config['device']!r}, {len(cameras)} "
                                   'cameras)')
            self.engine = self._engine_factory({**engine_config, 'contract': contract})
            self.contract = contract
            self._check_not_shut_down()
            self.get_logger().info('configuring: warming up the engine')
            self.engine.warmup(progress=self._warmup_progress)
        except Exception as error:  # noqa: BLE001 - any failure leaves the node unconfigured
            # a KeyError's str() is its message in quotes
            message = error.args[0] if isinstance(error, KeyError) and error.args else error
            self.get_logger().error(f'configure failed: {message}')
            self._close_engine()
            return TransitionCallbackReturn.FAILURE
        if self._param('gc_freeze'):
            self._freeze_heap()
        self.get_logger().info(f'configured in {time.monotonic() - started:.1f} s; engine mode '
                               f'{dict(self.engine.mode)}')
        if not self._param('instruction').strip():
            self.get_logger().warning("parameter 'instruction' is empty: the engine refuses "
                                      'observations without one; set it (it may change at '
                                      'run time)')
        return TransitionCallbackReturn.SUCCESS

    def _check_not_shut_down(self) -> None:
        """Raises KeyboardInterrupt once the context is shut down (SIGINT or SIGTERM reached
        rclpy's handler). configure checks between its steps and warm-up buckets: where the
        signal itself raises no KeyboardInterrupt (a process started with SIGINT ignored, such
        as a shell script's background job), configure stops there instead of compiling every
        bucket and then failing its transition on the dead context."""
        if not self.context.ok():
            raise KeyboardInterrupt('the ROS context was shut down while configuring')

    def _warmup_progress(self, message: str) -> None:
        self._check_not_shut_down()
        self.get_logger().info(message)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._reset_statistics()
        self._sync = ObservationSynchronizer(self._param('camera_topics'),
                                             self._param('joint_names'),
                                             joint_state_topic=self._param('joint_state_topic'),
                                             decode=self._decode_image)
        if self._param('camera_qos') == 'sensor_data':
            camera_qos = qos_profile_sensor_data
        else:
            camera_qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                                    history=HistoryPolicy.KEEP_LAST)
        for topic in self._sync.camera_topics:
            self._input_subscriptions.append(self.create_subscription(
                Image, topic, functools.partial(self._on_image, topic), camera_qos))
        # best effort subscriptions also match reliable publishers
        self._input_subscriptions.append(self.create_subscription(
            JointState, self._param('joint_state_topic'), self._on_joint_state,
            qos_profile_sensor_data))
        self._trajectory_pub = self.create_publisher(JointTrajectory,
                                                     self._param('output_topic'), 10)
        if self._param('publish_float_array'):
            self._array_pub = self.create_publisher(Float32MultiArray, '~/actions', 10)
        self._chunk_info_pub = self.create_publisher(DiagnosticStatus, '~/chunk_info', 10)
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, '/diagnostics', 10)
        self._diagnostics_timer = self.create_timer(
            self._param('diagnostics_period'), self._publish_diagnostics)
        self._gc_pauses.install()
        self._stop.clear()
        self._worker = threading.Thread(target=self._run, name='policy_worker', daemon=True)
        self._worker.start()
        self.get_logger().info(
            f"active: {len(self._sync.camera_topics)} cameras, chunk every "
            f"{self._param('chunk_period')} s, actions every {self._param('control_period')} s, "
            f"publishing on {self._trajectory_pub.topic_name}")
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_worker()
        self._gc_pauses.remove()
        for subscription in self._input_subscriptions:
            self.destroy_subscription(subscription)
        self._input_subscriptions = []
        for publisher in (self._trajectory_pub, self._array_pub, self._chunk_info_pub,
                          self._diagnostics_pub):
            if publisher is not None:
                self.destroy_publisher(publisher)
        self._trajectory_pub = self._array_pub = None
        self._chunk_info_pub = self._diagnostics_pub = None
        if self._diagnostics_timer is not None:
            self.destroy_timer(self._diagnostics_timer)
            self._diagnostics_timer = None
        self.get_logger().info(f'deactivated after {_count(self.chunks_published, "chunk")}')
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._close_engine()
        self.get_logger().info('cleaned up: engine released, unconfigured')
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        if self._worker is not None:
            self.on_deactivate(state)
        self._close_engine()
        return TransitionCallbackReturn.SUCCESS

    def _stop_worker(self) -> None:
        self._stop.set()
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def _freeze_heap(self) -> None:
        # Everything built so far (the model, compiled code, CUDA graphs: millions of Python
        # objects after torch.compile) lives until cleanup; a full collection walking it
        # stops every thread for hundreds of ms. gc.freeze() moves it to a permanent
        # generation that collections skip (refcounting still frees it).
        gc.collect()
        gc.freeze()
        self._froze_heap = True
        self.get_logger().info(f'froze {gc.get_freeze_count()} start-up objects out of the '
                               'garbage collector (gc_freeze)')

    def _close_engine(self) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            finally:
                self.engine = None
                if self._froze_heap:        # let the collector free the engine's cycles
                    self._froze_heap = False
                    gc.unfreeze()
                    gc.collect()

    # -------------------------------------------------------------- callbacks: store only
    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _on_image(self, topic: str, msg: Image) -> None:
        self._sync.add_image(topic, msg, _seconds(msg.header.stamp), self._now())

    def _decode_image(self, msg: Image, topic: str) -> np.ndarray:
        # called by the synchronizer in the worker, only for frames an observation uses
        self.frames_decoded += 1
        return image_to_rgb(msg, topic)

    def _on_joint_state(self, msg: JointState) -> None:
        try:
            self._sync.add_joint_state(msg.name, msg.position, _seconds(msg.header.stamp),
                                       self._now())
        except ValueError as error:
            self.get_logger().warning(f'ignoring joint state: {error}',
                                      throttle_duration_sec=WARN_THROTTLE_S)

    # ---------------------------------------------------------------------- worker
    def _sleep_until(self, t: float) -> bool:
        """Sleep until ROS time t (s); False if stopped first.

        Sim time: waits of at most POLL_S, re-reading the ROS clock (it follows /clock).
        System time: waits until BUSY_WAIT_S before t, then polls the clock, releasing the
        GIL between polls (time.sleep(0)), so the wake-up is not late by a timer's slack.
        On the system clock it records how late (s) the last timed wait returned
        (`self.wake_late`) and the thread's run-queue wait before it (`self.runqueue_mark`,
        `timing.runqueue_wait_s`); None: no timed wait, or sim time.
        """
        sim_time = self.get_clock().ros_time_is_active
        tail = 0.0 if sim_time else BUSY_WAIT_S
        self.wake_late = self.runqueue_mark = None
        while not self._stop.is_set():
            remaining = t - self._now()
            if remaining <= 0.0:
                return True
            if remaining > tail:
                timeout = min(remaining - tail, POLL_S)
                if not sim_time and timeout == remaining - tail:    # the last wait before t
                    self.runqueue_mark = runqueue_wait_s()
                if self._stop.wait(timeout):
                    break
                if not sim_time:
                    self.wake_late = self._now() - (t - remaining + timeout)
            else:
                time.sleep(0)
        return False

    def _run(self) -> None:
        chunk_period = self._param('chunk_period')
        while self._now() <= 0.0 and not self._stop.is_set():   # sim time not started yet
            self._stop.wait(POLL_S)
        latency = LatencyEstimator(initial=min(0.5 * chunk_period, 1.0),
                                   max_lead=MAX_LEAD_FRACTION * chunk_period)
        self._scheduler = DeadlineScheduler(chunk_period, t0=self._now() + chunk_period)
        self._stitcher = self._make_stitcher()
        self._gate = ObservationGate()
        previous_now = self._now()
        while not self._stop.is_set():
            now = self._now()
            if now < previous_now:
                self.get_logger().warning(f'ROS time jumped back by {previous_now - now:.3f} s; '
                                          'restarting the schedule')
                self._scheduler.reset(now + chunk_period)
                self._stitcher.reset()
                self._gate.reset()
            previous_now = now
            self._scheduler.set_lead(latency.lead())
            tick = self._scheduler.next_tick(now)
            if not self._sleep_until(tick.start_at):
                break
            try:
                self._tick(tick, latency)
            except Exception as error:  # noqa: BLE001 - bad input never stops the worker
                self.failed_ticks += 1
                self.get_logger().error(f'tick {tick.index} failed: {error!r}',
                                        throttle_duration_sec=WARN_THROTTLE_S)

    def _make_stitcher(self) -> ChunkStitcher:
        max_step = list(self._param('max_step'))
        if len(max_step) == 1:
            max_step = max_step * len(self._param('action_joint_names'))
        return ChunkStitcher(self._param('control_period'), smoothing=self._param('smoothing'),
                             max_step=np.array(max_step) if max_step else None)

    def _tick(self, tick, latency: LatencyEstimator) -> None:
        decoded_before = self.frames_decoded
        instruction = self._param('instruction')
        if not instruction.strip():     # allowed at configure, to be set at run time
            observation = Skip(("parameter 'instruction' is empty: set it to the task text "
                                '(it may change at run time)',))
        else:
            observation = self._sync.build(self._now(), self._param('max_image_age'),
                                           self._param('max_state_age'), instruction=instruction)
        if not isinstance(observation, Skip) and not self._gate.accept_observation(observation):
            observation = Skip(('observation is not newer than the last one used',))
        if isinstance(observation, Skip):
            self.skipped_ticks += 1
            self.last_skip = str(observation)
            self.get_logger().warning(f'skipping tick {tick.index}: {observation}',
                                      throttle_duration_sec=WARN_THROTTLE_S)
            return
        started = time.perf_counter()
        try:
            chunk = self.engine.predict(observation)
        except ValueError as error:
            self.skipped_ticks += 1
            self.last_skip = f'engine refused observation: {error}'
            self.get_logger().warning(f'skipping tick {tick.index}: {self.last_skip}',
                                      throttle_duration_sec=WARN_THROTTLE_S)
            return
        latency.record(time.perf_counter() - started)
        self.inference_ms.add(chunk.inference_ms)
        self._publish_chunk(tick, observation, chunk, self.frames_decoded - decoded_before)

    def _publish_chunk(self, tick, observation, chunk, frames_decoded: int) -> None:
        """Build the messages, wait for the tick's deadline, publish, then record stats."""
        control_period = self._param('control_period')
        joint_names = list(self._param('action_joint_names'))
        # actions before the publish time are dropped; the publish time is the deadline
        # unless inference overran it
        publish_at = max(self._now(), tick.deadline)
        actions = self.contract.joint_positions(np.asarray(chunk.actions, dtype=np.float64))
        stitched = self._stitcher.stitch(actions, first_time=observation.stamp, now=publish_at)
        self.dropped_actions += stitched.dropped
        if len(stitched) == 0:
            self.last_skip = (f'all {stitched.dropped} actions of tick {tick.index} were in '
                              f'the past at publish time')
            self.get_logger().warning(self.last_skip, throttle_duration_sec=WARN_THROTTLE_S)
            return
        actions, dropped = stitched.positions, stitched.dropped

        msg = JointTrajectory()
        msg.header.stamp = Time(nanoseconds=int(round(stitched.times[0] * 1e9))).to_msg()
        msg.joint_names = joint_names
        for j, position in enumerate(actions):     # the stitcher keeps the control period
            point = JointTrajectoryPoint()
            point.positions = [float(x) for x in position]
            point.time_from_start = Duration(
                nanoseconds=int(round(j * control_period * 1e9))).to_msg()
            msg.points.append(point)
        array = None
        if self._array_pub is not None:
            array = Float32MultiArray()
            array.layout.dim = [
                MultiArrayDimension(label='action', size=actions.shape[0], stride=actions.size),
                MultiArrayDimension(label='joint', size=actions.shape[1],
                                    stride=actions.shape[1])]
            array.data = actions.astype(np.float32).ravel().tolist()

        if not self._sleep_until(tick.deadline):
            return
        publish_called = self._now()
        self._trajectory_pub.publish(msg)
        published = self._now()
        runqueue_after = runqueue_wait_s()
        if array is not None:
            self._array_pub.publish(array)
        if published > tick.deadline + 0.5 * control_period:
            self.deadline_misses += 1           # inference overran its lead

        jitter_ms = (published - tick.deadline) * 1e3
        age_ms = (published - observation.stamp) * 1e3
        self.jitter_ms.add(jitter_ms)
        self.age_ms.add(age_ms)
        self.chunks_published += 1
        self.chunks_published_total += 1
        first = format_action(actions[0])
        self._chunk_info_pub.publish(DiagnosticStatus(
            level=OK, name=f'{self.get_name()}: chunk', hardware_id=self.get_name(),
            message=f'chunk {self.chunks_published}', values=_key_values({
                'tick': tick.index, 'observation_seq': observation.seq,
                'observation_stamp': f'{observation.stamp:.6f}',
                'observation_age_ms': f'{age_ms:.1f}',
                'inference_ms': f'{chunk.inference_ms:.1f}',
                'publish_jitter_ms': f'{jitter_ms:.3f}', 'points': len(actions),
                'dropped': dropped, 'frames_decoded': frames_decoded,
                'first_action': first,
                # where publish jitter comes from (benchmarks/benchmark_node_jitter.py):
                # the last timed wait before the deadline returning late, the worker
                # runnable without a CPU from that wait's start to after the publish (the
                # operating system's share, with at most BUSY_WAIT_S of harmless polling
                # before the deadline; the rest of a delay is sleep, i.e. the GIL), and the
                # publish call itself; '' where not measured
                'wake_late_ms': _ms(self.wake_late),
                'runqueue_wait_ms': _ms(None if self.runqueue_mark is None
                                        or runqueue_after is None
                                        else runqueue_after - self.runqueue_mark),
                'publish_call_ms': _ms(published - publish_called)})))
        self.get_logger().info(
            f'chunk {self.chunks_published}: observation age {age_ms:.0f} ms, inference '
            f'{chunk.inference_ms:.0f} ms, {len(actions)} points ({dropped} dropped), '
            f'first action {first}')

    # ------------------------------------------------------------------ diagnostics
    def _publish_diagnostics(self) -> None:
        if self._diagnostics_pub is None or self._sync is None:
            return
        now = self._now()
        name = self.get_name()
        min_rate = self._param('diag_min_camera_rate')
        statuses = []
        for topic, stats in self._sync.stats(now).items():
            is_camera = topic != self._sync.joint_state_topic
            max_age = self._param('max_image_age' if is_camera else 'max_state_age')
            if stats.count == 0:
                level, message = ERROR, 'no message received'
            elif stats.problem:
                level, message = WARN, stats.problem
            elif stats.age is None:
                level, message = ERROR, 'no usable message received'
            elif stats.age > max_age:
                level, message = WARN, f'stale: age {stats.age:.3f} s > {max_age:.3f} s'
            elif stats.rate_hz < min_rate:
                level, message = WARN, f'rate {stats.rate_hz:.1f} Hz < {min_rate:.1f} Hz'
            else:
                level, message = OK, 'ok'
            age_ms = 'nan' if stats.age is None else f'{stats.age * 1e3:.1f}'
            statuses.append(DiagnosticStatus(
                level=level, name=f"{name}: {'camera' if is_camera else 'joint state'} {topic}",
                hardware_id=name, message=message, values=_key_values({
                    'rate_hz': f'{stats.rate_hz:.2f}', 'age_ms': age_ms,
                    'messages': stats.count})))

        inference = self.inference_ms.summary()
        level, message = OK, 'ok'
        if inference['p99'] > self._param('diag_inference_error_ms'):
            level, message = ERROR, f"inference p99 {inference['p99']:.0f} ms too slow"
        elif inference['p99'] > self._param('diag_inference_warn_ms'):
            level, message = WARN, f"inference p99 {inference['p99']:.0f} ms slow"
        mode = dict(self.engine.mode) if self.engine is not None else {}
        statuses.append(DiagnosticStatus(
            level=level, name=f'{name}: inference', hardware_id=name, message=message,
            values=_key_values({**_summary('inference', inference),
                                **{f'engine_{k}': v for k, v in mode.items()}})))

        jitter = self.jitter_ms.summary()
        misses = self.deadline_misses + (self._scheduler.missed if self._scheduler else 0)
        level, message = OK, 'ok'
        if jitter['p99'] > self._param('diag_jitter_error_ms'):
            level, message = ERROR, f"publish jitter p99 {jitter['p99']:.1f} ms"
        elif jitter['p99'] > self._param('diag_jitter_warn_ms'):
            level, message = WARN, f"publish jitter p99 {jitter['p99']:.1f} ms"
        elif self.last_skip:
            level, message = WARN, f'last skip: {self.last_skip}'
        statuses.append(DiagnosticStatus(
            level=level, name=f'{name}: schedule', hardware_id=name, message=message,
            values=_key_values({
                **_summary('publish_jitter', jitter),
                **_summary('sensor_to_publish_age', self.age_ms.summary()),
                'chunks_published': self.chunks_published, 'deadline_misses': misses,
                'dropped_actions': self.dropped_actions, 'skipped_ticks': self.skipped_ticks,
                'failed_ticks': self.failed_ticks, 'frames_decoded': self.frames_decoded,
                **_summary('gc_pause', self._gc_pauses.pauses_ms.summary()),
                'gc_pause_max_since_activate_ms': f'{self._gc_pauses.max_ms:.3f}',
                'gc_collections': '/'.join(map(str, self._gc_pauses.collections))})))
        self.last_skip = ''
        array = DiagnosticArray(status=statuses)
        array.header.stamp = self.get_clock().now().to_msg()
        self._diagnostics_pub.publish(array)


def _key_values(values: dict) -> list[KeyValue]:
    return [KeyValue(key=k, value=str(v)) for k, v in values.items()]


def _summary(prefix: str, summary: dict) -> dict:
    return {f'{prefix}_{k}_ms': ('nan' if math.isnan(summary[k]) else f'{summary[k]:.2f}')
            for k in ('p50', 'p99', 'max')}


def unmatched_parameter_files(argv: list[str], node_name: str) -> list[str]:
    """Errors for `--params-file` files (in `argv`) with no section for `node_name`.

    ROS applies a parameter file section only to the node it names (`molmobot_policy:`,
    `/molmobot_policy:`, `/ns/molmobot_policy:`, or wildcards such as `/**:`); a misspelled
    section is ignored without a word and the node would run on its defaults. Returns one
    message per such file, naming its sections and the closest to `node_name`; files that
    cannot be read are left to ROS to report.
    """
    import difflib

    import yaml
    errors = []
    paths = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == '--params-file']
    for path in paths:
        try:
            with open(path) as f:
                sections = list((yaml.safe_load(f) or {}).keys())
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        names = [str(k).rstrip('/').split('/')[-1] for k in sections]
        if any('*' in str(k) for k in sections) or node_name in names:
            continue
        close = difflib.get_close_matches(node_name, names, n=1)
        errors.append(f"parameter file {path} has no section for node '{node_name}' (its "
                      f'sections: {sections}' + (f"; did you mean '{node_name}' for "
                                                  f"'{close[0]}'?" if close else '')
                      + '): none of its parameters would apply')
    return errors


def ros_domain_id_problem(environ) -> str | None:
    """Why the environment's ROS_DOMAIN_ID cannot work, or None (unset is fine).

    Fast DDS derives its UDP ports from the domain id (port = 7400 + 250 * id + offset), so ids
    above 232 give ports above 65535 and DDS fails to start with a transport error only."""
    value = environ.get('ROS_DOMAIN_ID', '').strip()
    if not value:
        return None
    if not value.isdigit() or int(value) > 232:
        return f'ROS_DOMAIN_ID must be an integer from 0 to 232, got {value!r}'
    return None


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


def _ms(seconds: float | None) -> str:
    """A duration in s as milliseconds with 3 decimals; '' for None (not measured)."""
    return '' if seconds is None else f'{seconds * 1e3:.3f}'


def _count(n: int, noun: str) -> str:
    return f'{n} {noun}' + ('' if n == 1 else 's')


def format_action(values) -> str:
    """One action vector as '[0.120, -0.003, ...]': fixed-point with 3 decimals on one line,
    whatever the values (numpy's array2string wraps at 75 characters and switches to
    scientific notation when small and large values mix, which split chunk log lines)."""
    return '[' + ', '.join(f'{float(v):.3f}' for v in values) + ']'


_SEVERITY = {logging.CRITICAL: 'FATAL', logging.ERROR: 'ERROR', logging.WARNING: 'WARN',
             logging.INFO: 'INFO'}


class RosLogHandler(logging.Handler):
    """Python `logging` records (the package's own: the engine's and fp8's, which hold no ROS
    logger) passed to a ROS logger, so that they reach the console and /rosout formatted and
    filtered like the node's lines; without it a warning printed as a bare line and an info
    line (e.g. which fp8 mode the start-up probe chose) not at all. Once `context` is shut
    down (Ctrl-C) the records are printed in the same format instead."""

    def __init__(self, ros_logger, context=None) -> None:
        super().__init__(logging.INFO)
        self._ros_logger = ros_logger
        self._context = context

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            level = record.levelno
            if self._context is not None and not self._context.ok():
                _print_log(self._ros_logger.name, _SEVERITY.get(level, 'DEBUG'), message)
            elif level >= logging.CRITICAL:
                self._ros_logger.fatal(message)
            elif level >= logging.ERROR:
                self._ros_logger.error(message)
            elif level >= logging.WARNING:
                self._ros_logger.warning(message)
            elif level >= logging.INFO:
                self._ros_logger.info(message)
            else:
                self._ros_logger.debug(message)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def _print_log(name: str, severity: str, message: str) -> None:
    """A log line in the ROS console format, printed to stderr: for when the context is shut
    down (Ctrl-C) and the ROS logger's /rosout publisher would fail on every line."""
    print(f'[{severity}] [{time.time():.9f}] [{name}]: {message}', file=sys.stderr, flush=True)


def _forget_keyboard_interrupt() -> None:
    """Keep a handled KeyboardInterrupt from turning the exit status into 'killed by SIGINT'.

    CPython marks the interpreter's exit as a Ctrl-C exit whenever a KeyboardInterrupt
    leaves code run through its PyRun_* functions (as C extensions' embedded Python does,
    e.g. pybind11's py::exec during an import), even when Python code catches it afterwards;
    at exit it then kills itself with SIGINT (status 130, or -2 to a parent's Popen): seen
    in 3 of 10 interrupted start-ups. Any later PyRun_* call clears that mark
    (Python/pythonrun.c, run_eval_code_obj): an empty one is run here. No-op elsewhere.
    """
    try:
        import ctypes
        ctypes.pythonapi.PyRun_SimpleString(b'pass')
    except (ImportError, AttributeError, OSError):
        pass


def main(args=None) -> int:
    """Console entry point: run the node until Ctrl-C. Returns the exit status."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    problem = ros_domain_id_problem(os.environ)
    if problem:
        _print_log(NODE_NAME, 'FATAL', problem)
        return 1
    try:
        rclpy.init(args=args)
    except RCLError as error:     # e.g. a params file that is not valid YAML
        _print_log(NODE_NAME, 'FATAL', f'ROS 2 could not start: {error}'.rstrip())
        return 1
    node = None
    status = 0
    starting = False        # inside autostart's configure + activate
    package_log = logging.getLogger('molmobot_policy')
    forward = None
    try:
        try:
            node = PolicyNode()
        except ValueError as error:
            _print_log(NODE_NAME, 'FATAL', str(error))
            return 1
        forward = RosLogHandler(node.get_logger(), node.context)
        package_log.addHandler(forward)
        package_log.setLevel(logging.INFO)
        package_log.propagate = False       # printed once, by the ROS logger
        file_errors = unmatched_parameter_files(list(args if args is not None else sys.argv),
                                                node.get_name())
        if file_errors:
            for error in file_errors:
                node.get_logger().fatal(error)
            return 1
        # One thread for every callback: they only store messages (the worker thread runs
        # inference). rclpy's MultiThreadedExecutor(4) under 240 camera frames/s creates
        # task and future objects per callback (a garbage collection every few ms) and holds
        # the GIL the worker needs between CUDA calls: on the H200, inference p99 199-253 ms
        # instead of 70 ms and publish jitter p99 140-146 ms instead of 0.8-1.0 ms
        # (benchmarks/RESULTS.md, "What it took: the executor and the garbage collector").
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        if node.get_parameter('autostart').value:
            starting = True
            started = node.autostart()
            starting = False
        if node.get_parameter('autostart').value and not started:
            if rclpy.ok():
                node.get_logger().fatal('autostart failed (see the error above); exiting')
                status = 1
            else:   # Ctrl-C / SIGTERM while starting: rclpy's handler shut the context down
                _print_log(node.get_name(), 'INFO',
                           'interrupted while starting (configure / activate)')
        else:
            if not node.get_parameter('autostart').value:
                node.get_logger().info(
                    f'autostart is off: waiting unconfigured for lifecycle transitions on '
                    f'{node.get_fully_qualified_name()}/change_state (e.g. `ros2 lifecycle set '
                    f'{node.get_fully_qualified_name()} configure`, then activate)')
            executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException) as stop:
        if starting:
            _print_log(node.get_name(), 'INFO',
                       'interrupted while starting (configure / activate)')
        if isinstance(stop, KeyboardInterrupt):
            _forget_keyboard_interrupt()
    except RCLError:
        if rclpy.ok():          # a real error; with Ctrl-C the context is already shut down
            raise
    finally:
        if node is not None:
            message = f'shutting down after {_count(node.chunks_published_total, "chunk")}'
            if rclpy.ok():
                node.get_logger().info(message)
            else:       # after Ctrl-C the context is gone: /rosout cannot take it
                _print_log(node.get_name(), 'INFO', message)
            node._stop_worker()
            node._close_engine()
            node.destroy_node()
        if forward is not None:
            package_log.removeHandler(forward)
            package_log.propagate = True
        rclpy.try_shutdown()
    return status


if __name__ == '__main__':
    raise SystemExit(main())
