"""PolicyNode: eight cameras + joint state in, MolmoBot action chunks out on a fixed schedule.

A lifecycle node (rclpy.lifecycle) that wires plain pieces together:
- configure checks the parameters (`ros.parameters`) and the robot contract against the
  model's config (before any weights load), then builds and warms up the engine;
- activate creates the subscriptions (their callbacks only store the newest message in an
  `ObservationSynchronizer`), the publishers, the diagnostics (`ros.diagnostics`) and the
  worker, a `timing.PolicyLoop` on the node's ROS clock (sim time aware): it ticks on
  absolute deadlines, runs `engine.predict` on the newest observation, builds the
  `trajectory_msgs/JointTrajectory` (`ros.messages`) and publishes it at the deadline;
- deactivate stops them; cleanup releases the engine.

Process entry, exit status and signals: `ros.main` (which `python -m
molmobot_policy.ros.node` runs).
"""
from __future__ import annotations

import functools
import time

from diagnostic_msgs.msg import DiagnosticStatus
from rcl_interfaces.msg import SetParametersResult
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float32MultiArray
from trajectory_msgs.msg import JointTrajectory

from molmobot_policy.ros import messages
from molmobot_policy.ros.diagnostics import Updater, policy_updater
from molmobot_policy.ros.parameters import (CONTRACT_PARAMETERS, ENGINE_PARAMETERS,
                                            bucket_lengths, check_parameter_values,
                                            check_unknown_parameters, chunk_stitcher,
                                            declare_parameters)
from molmobot_policy.ros.synchronizer import ObservationSynchronizer
from molmobot_policy.timing import GcPauses, LoopEvents, PolicyLoop, freeze_heap, unfreeze_heap
from molmobot_policy.timing.loop import STATS_WINDOW

NODE_NAME = 'molmobot_policy'
WARN_THROTTLE_S = 2.0       # at most one warning per call site per this many seconds


def _default_engine_factory(config: dict):
    """`PolicyEngine` of the EngineConfig fields in `config` and its 'contract'."""
    from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine
    options = dict(config)
    contract = options.pop('contract')
    return PolicyEngine(EngineConfig(**options), contract=contract)


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
    """The MolmoBot policy as a ROS 2 lifecycle node (parameters: `ros.parameters.PARAMETERS`).

    Args:
        engine_factory: callable(dict of EngineConfig fields and 'contract', the
            `RobotContract` of the parameters) -> engine with `warmup()`,
            `predict(Observation) -> ActionChunk`, `check_instruction(str)` (raises
            ValueError for an instruction it cannot serve), `model_config`, `mode`, `close()`.
            Default: `runtime.engine.PolicyEngine(EngineConfig(**fields), contract=contract)`.
        **kwargs: passed to rclpy LifecycleNode (e.g. parameter_overrides).
    Raises:
        ros.parameters.ParameterError: a parameter value of the wrong type or out of range.
    """

    def __init__(self, engine_factory=None, node_name: str = NODE_NAME, **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        self._engine_factory = engine_factory or _default_engine_factory
        self.engine = None
        self.contract = None       # the RobotContract built at configure
        self.loop: PolicyLoop | None = None    # the worker, built at activate
        self.gc_pauses = GcPauses(STATS_WINDOW)
        self.chunks_published_total = 0    # over every activation (loop.stats: this one)
        self._froze_heap = False        # gc.freeze() done by this node, undone at cleanup
        self._sync: ObservationSynchronizer | None = None
        self._input_subscriptions = []
        self._trajectory_pub = self._array_pub = self._chunk_info_pub = None
        self._diagnostics: Updater | None = None
        declare_parameters(self)
        self.add_on_set_parameters_callback(self._validate_parameters)

    def _param(self, name: str):
        return self.get_parameter(name).value

    def _validate_parameters(self, parameters) -> SetParametersResult:
        for p in parameters:
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

    # ------------------------------------------------------------------ lifecycle
    def autostart(self) -> bool:
        """configure + activate (what lifecycle tooling would do). True on success."""
        if self.trigger_configure() != TransitionCallbackReturn.SUCCESS:
            return False
        return self.trigger_activate() == TransitionCallbackReturn.SUCCESS

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        cameras = list(self._param('camera_topics'))
        engine_config = {name: self._param(name) for name in ENGINE_PARAMETERS}
        from molmobot_policy.runtime.config import fused_action_expert_mode
        engine_config['fused_action_expert'] = fused_action_expert_mode(  # unquoted on / off
            engine_config['fused_action_expert'])
        started = time.monotonic()
        try:
            engine_config['buckets'] = bucket_lengths(engine_config['buckets'])
            check_unknown_parameters(self)
            check_parameter_values(self._param)
            chunk_stitcher(self._param)     # raises ValueError on a bad smoothing / max_step
            # before the (possibly long) weight load: the checkpoint's config.yaml only
            contract = check_robot_contract(
                read_model_config(engine_config), cameras, list(self._param('joint_names')),
                list(self._param('action_joint_names')),
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
        if self._param('gc_freeze'):        # the start-up heap lives until cleanup
            self._froze_heap = True
            self.get_logger().info(f'froze {freeze_heap()} start-up objects out of the '
                                   'garbage collector (gc_freeze)')
        self.get_logger().info(f'configured in {time.monotonic() - started:.1f} s; engine mode '
                               f'{dict(self.engine.mode)}')
        if not self._param('instruction').strip():
            self.get_logger().warning("parameter 'instruction' is empty: the engine refuses "
                                      'observations without one; set it (it may change at '
                                      'run time)')
        return TransitionCallbackReturn.SUCCESS

    def _check_not_shut_down(self) -> None:
        """Raises KeyboardInterrupt once rclpy's signal handler shut the context down (SIGINT,
        SIGTERM; the signal itself raises none, `ros.main.GracefulSigint`): configure stops
        between its steps and warm-up buckets, not after compiling every bucket."""
        if not self.context.ok():
            raise KeyboardInterrupt('the ROS context was shut down while configuring')

    def _warmup_progress(self, message: str) -> None:
        self._check_not_shut_down()
        self.get_logger().info(message)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        joint_state_topic = self._param('joint_state_topic')
        self._sync = ObservationSynchronizer(self._param('camera_topics'),
                                             self._param('joint_names'),
                                             joint_state_topic=joint_state_topic)
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
            JointState, joint_state_topic, self._on_joint_state, qos_profile_sensor_data))
        self._trajectory_pub = self.create_publisher(JointTrajectory,
                                                     self._param('output_topic'), 10)
        if self._param('publish_float_array'):
            self._array_pub = self.create_publisher(Float32MultiArray, '~/actions', 10)
        self._chunk_info_pub = self.create_publisher(DiagnosticStatus, '~/chunk_info', 10)
        self.loop = PolicyLoop(
            clock=self._now, observe=self._observe, predict=self.engine.predict,
            publish=self._prepare_publish, stitcher=chunk_stitcher(self._param),
            chunk_period=self._param('chunk_period'),
            joints=len(self._param('action_joint_names')), events=_LoopReport(self),
            sim_time=lambda: self.get_clock().ros_time_is_active,
            debug_timing=self._param('debug_timing'))
        self.gc_pauses = GcPauses(STATS_WINDOW).install()
        self._diagnostics = policy_updater(
            self, self._sync, self.loop.stats, self.gc_pauses, self._param, self._now,
            mode=lambda: dict(self.engine.mode) if self.engine is not None else {})
        self.loop.start()
        self.get_logger().info(
            f"active: {len(self._sync.camera_topics)} cameras, chunk every "
            f"{self._param('chunk_period')} s, actions every {self._param('control_period')} s, "
            f"publishing on {self._trajectory_pub.topic_name}")
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_loop()
        self.gc_pauses.remove()
        for subscription in self._input_subscriptions:
            self.destroy_subscription(subscription)
        self._input_subscriptions = []
        for publisher in (self._trajectory_pub, self._array_pub, self._chunk_info_pub):
            if publisher is not None:
                self.destroy_publisher(publisher)
        self._trajectory_pub = self._array_pub = self._chunk_info_pub = None
        if self._diagnostics is not None:
            self._diagnostics.destroy()
            self._diagnostics = None
        chunks = self.loop.stats.chunks_published if self.loop else 0
        self.get_logger().info(f"deactivated after {chunks} chunk{'' if chunks == 1 else 's'}")
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._close_engine()
        self.get_logger().info('cleaned up: engine released, unconfigured')
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        if self._diagnostics is not None:      # active
            self.on_deactivate(state)
        self._close_engine()
        return TransitionCallbackReturn.SUCCESS

    def destroy_node(self) -> None:
        """Stops the worker and releases the engine, then destroys the node."""
        self._stop_loop()
        self._close_engine()
        super().destroy_node()

    def _stop_loop(self) -> None:
        if self.loop is not None:
            self.loop.stop()

    def _close_engine(self) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            finally:
                self.engine = None
                if self._froze_heap:        # let the collector free the engine's cycles
                    self._froze_heap = False
                    unfreeze_heap()

    # -------------------------------------------------------------- callbacks: store only
    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _on_image(self, topic: str, msg: Image) -> None:
        self._sync.add_image(topic, msg, messages.stamp_seconds(msg.header.stamp), self._now())

    def _on_joint_state(self, msg: JointState) -> None:
        try:
            self._sync.add_joint_state(msg.name, msg.position,
                                       messages.stamp_seconds(msg.header.stamp), self._now())
        except ValueError as error:
            self.get_logger().warning(f'ignoring joint state: {error}',
                                      throttle_duration_sec=WARN_THROTTLE_S)

    # ------------------------------------------------------------ the loop's injections
    def _observe(self, now: float):
        instruction = self._param('instruction')
        if not instruction.strip():     # allowed at configure, to be set at run time
            return ("parameter 'instruction' is empty: set it to the task text (it may change "
                    'at run time)')
        return self._sync.build(now, self._param('max_image_age'), self._param('max_state_age'),
                                instruction=instruction)

    def _prepare_publish(self, chunk):
        """The chunk's messages, built now; returns the call that publishes them."""
        trajectory = messages.joint_trajectory(chunk, self._param('action_joint_names'),
                                               self._param('control_period'))
        array = messages.action_array(chunk.positions) if self._array_pub is not None else None

        def send() -> None:
            self._trajectory_pub.publish(trajectory)
            if array is not None:
                self._array_pub.publish(array)
        return send


class _LoopReport(LoopEvents):
    """The worker's events as the node's log lines and ~/chunk_info messages."""

    def __init__(self, node: PolicyNode) -> None:
        self._node = node
        self._publisher = node._chunk_info_pub

    def skipped(self, tick: int, reason: str) -> None:
        self._node.get_logger().warning(f'skipping tick {tick}: {reason}',
                                        throttle_duration_sec=WARN_THROTTLE_S)

    def failed(self, tick: int, error: Exception) -> None:
        self._node.get_logger().error(f'tick {tick} failed: {error!r}',
                                      throttle_duration_sec=WARN_THROTTLE_S)

    def clock_jumped(self, seconds: float) -> None:
        self._node.get_logger().warning(f'ROS time jumped back by {seconds:.3f} s; restarting '
                                        'the schedule')

    def published(self, report) -> None:
        node = self._node
        node.chunks_published_total += 1
        self._publisher.publish(messages.chunk_info(report, node.get_name(),
                                                    node._sync.last_build_decoded))
        node.get_logger().info(
            f'chunk {report.count}: observation age {report.observation_age_ms:.0f} ms, '
            f'inference {report.inference_ms:.0f} ms, {len(report.positions)} points '
            f'({report.dropped} dropped), first action '
            f'{messages.format_action(report.positions[0])}')


if __name__ == '__main__':
    from molmobot_policy.ros.main import main
    raise SystemExit(main())
