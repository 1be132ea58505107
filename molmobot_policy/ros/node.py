"""PolicyNode: eight cameras + joint state in, MolmoBot action chunks out on a fixed schedule.

A lifecycle node (rclpy.lifecycle) that wires plain pieces together:
- configure checks the parameter files (`ros.param_files`: a file with no section for this
  node's fully qualified name is an error), the parameters (`ros.parameters`), the robot
  contract against the model's config and what is served (`ros.serving`: random weights only
  with allow_random_weights), all before any weights load; then it builds and warms up the
  engine and logs what it serves;
- activate creates the subscriptions (raw or compressed cameras; their callbacks only store
  the newest message in an `ObservationSynchronizer`, which refuses future or unset stamps;
  with `camera_receiver: subprocess` a child process receives the cameras instead and the
  worker copies the newest frames out of shared memory into the synchronizer before each
  observation: `ros.camera_receiver`),
  the publishers, the diagnostics (`ros.diagnostics`) and the worker, a `timing.PolicyLoop`
  on the node's ROS clock (sim time aware): it ticks on absolute deadlines, runs
  `engine.predict` on the newest observation, stitches the chunk, limits it against the
  measured joint state (`timing.MotionLimiter`), builds the `trajectory_msgs/JointTrajectory`
  (`ros.messages`) and publishes it at the deadline; its events go to `ros.report`;
- deactivate stops them; cleanup releases the engine.

Process entry, exit status and signals: `ros.entry` (what `python -m
molmobot_policy.ros.node` and the `policy_node` script run) and `ros.main`.
"""
from __future__ import annotations

if __name__ == '__main__':  # the entry installs the stop signals before this module's imports
    from molmobot_policy.ros.entry import main
    raise SystemExit(main())

import functools  # noqa: E402 (and the imports below: after the process entry above)
import math
import threading
import time

from diagnostic_msgs.msg import DiagnosticStatus
from rcl_interfaces.msg import SetParametersResult
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Float32MultiArray
from trajectory_msgs.msg import JointTrajectory

from molmobot_policy.ros import graph, messages
from molmobot_policy.ros.camera_receiver import CameraReceiver, choose_receiver, shm_free
from molmobot_policy.ros.diagnostics import (ERROR, WARN, IdleStatus, Updater,
                                             policy_updater)
from molmobot_policy.ros.entry import NODE_NAME
from molmobot_policy.ros.param_files import (dropped_overrides, near_miss_sections,
                                             unmatched_parameter_files)
from molmobot_policy.ros.parameters import (CONTRACT_PARAMETERS, ENGINE_PARAMETERS,
                                            PARAMETERS, as_written, bucket_lengths,
                                            camera_subscriptions,
                                            check_parameter_values, check_unknown_parameters,
                                            chunk_stitcher, declare_parameters, given_parameters,
                                            motion_limiter, out_of_range, threshold_problem,
                                            type_mismatches, unanchored_action_joints,
                                            undeclared, unlimited_velocity_joints,
                                            widen_integers)
from molmobot_policy.ros.report import WARN_THROTTLE_S, LoopReport, RepeatedLines
from molmobot_policy.ros.serving import (check_robot_contract,  # noqa: F401 (public here too)
                                         default_engine_factory, read_model_config,
                                         served_weights, serves_random_weights)
from molmobot_policy.ros.synchronizer import ObservationSynchronizer, Skip
from molmobot_policy.timing import (GcPauses, OutputWatchdog, PolicyLoop, QuietWindow,
                                    freeze_heap, latency_estimator, unfreeze_heap)
from molmobot_policy.timing.chunking import chunk_gap, unpublishable_chunks
from molmobot_policy.timing.reports import STATS_WINDOW

RECEIVER_RESTART_S = 2.0    # the shortest time between two restarts of the camera receiver
RECEIVER_READY_S = 15.0     # activate waits this long for the receiver child to subscribe
NO_POSITION_LIMITS = ('joint_position_min and joint_position_max are empty: no joint position '
                      'limit is applied to the published points (set them to the arm\'s limits, '
                      'one value per action joint: docs/ROBOT.md "Safety")')


class PolicyNode(LifecycleNode):
    """The MolmoBot policy as a ROS 2 lifecycle node (parameters: `ros.parameters.PARAMETERS`).

    Args:
        engine_factory: callable(dict of EngineConfig fields and 'contract', the
            `RobotContract` of the parameters) -> engine with `warmup()`,
            `predict(Observation) -> ActionChunk`, `check_instruction(str)` (raises
            ValueError for an instruction it cannot serve), `model_config`, `mode`, `close()`,
            optionally `inference_seconds` (s of one warm query measured by `warmup`, or
            None: the loop's first lead). Default: `ros.serving.default_engine_factory`.
        argv: the process's command line (ROS arguments); each `--params-file` in it (and in
            kwargs' cli_args) must have a section for this node, checked at configure.
        **kwargs: passed to rclpy LifecycleNode (e.g. parameter_overrides, namespace).
    Raises:
        ros.parameters.ParameterError: a parameter value of the wrong type or out of range.
    """

    def __init__(self, engine_factory=None, node_name: str = NODE_NAME, argv=None,
                 stop_requested: threading.Event | None = None, **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        self._created = time.monotonic()    # the same-name check waits for discovery from it
        # set by `ros.entry.StopSignals` on SIGINT / SIGTERM: configure stops at its next step
        self.stop_requested = stop_requested or threading.Event()
        self._engine_factory = engine_factory or default_engine_factory
        self._argv = list(argv or []) + list(kwargs.get('cli_args') or [])
        self.engine = None
        self.contract = None            # the RobotContract built at configure
        self.served = ''                # what the engine serves (ros.serving.served_weights)
        self._latency = None            # the lead estimate, kept over activations
        self._watchdog: OutputWatchdog | None = None
        self._unanchored: set[str] = set()      # action joints reported never measured
        self._unanchored_now: list[str] = []    # those the latest chunk left unanchored
        self.loop: PolicyLoop | None = None    # the worker, built at activate
        self.gc_pauses = GcPauses(STATS_WINDOW)
        self.chunks_published_total = 0    # over every activation (loop.stats: this one)
        self._froze_heap = False        # gc.freeze() done by this node, undone at cleanup
        self._sync: ObservationSynchronizer | None = None
        self._compressed_cameras: set[str] = set()      # resolved names, set at activate
        self._configured = False        # configuring, inactive or active: configure-time
                                        # parameters are refused (`_not_settable`)
        self._repeats = RepeatedLines()     # the input warnings that repeat, per topic
        self._input_subscriptions = []
        self._receiver: CameraReceiver | None = None    # camera_receiver: subprocess, active
        self._receiver_failed = ''      # the receiver's exit, logged once per exit
        self._receiver_last_exit = ''   # ... the last one, kept for the 'inference' status
        self._receiver_restarting = threading.Lock()     # one restart at a time
        self._receiver_restarted_at = -math.inf          # time.monotonic() of the last try
        self.quiet_window = QuietWindow()   # the worker's publish window (ros.main's executor)
        self._receiver_choice = 'in_process'    # where and why, decided at activate
        self._trajectory_pub = self._array_pub = self._chunk_info_pub = None
        self._diagnostics: Updater | None = None        # while active
        self._idle = IdleStatus(self, self._param)      # while not active
        try:
            declare_parameters(self)
            dropped = dropped_overrides(self._argv, self.get_name(),
                                        {name: p.value for name, p in
                                         given_parameters(self).items()})
            if dropped:
                raise ValueError('; '.join(dropped))
        except BaseException:   # a value rclpy or our checks refused
            self._destroy_rcl_node()
            raise
        if hasattr(self, 'add_pre_set_parameters_callback'):     # rclpy >= Iron
            self.add_pre_set_parameters_callback(self._before_set_parameters)
        self.add_on_set_parameters_callback(self._validate_parameters)
        self._idle.set(WARN, 'unconfigured: no commands are sent (configure, then activate)')

    def _param(self, name: str):
        return self.get_parameter(name).value

    def _mode(self) -> dict:
        """What serves, for the 'inference' status: the engine's mode and where the cameras
        are received (the receiver child's pid, for ps / kill)."""
        mode = dict(self.engine.mode) if self.engine is not None else {}
        receiver = self._receiver
        mode['camera_receiver'] = self._receiver_choice
        if receiver is not None:
            mode['camera_receiver'] += f'; pid {receiver.pid}, node {receiver.node_name}'
            if receiver.restarts:
                mode['camera_receiver'] += (f'; restarted {receiver.restarts} times (the last '
                                            f'exit: {self._receiver_last_exit})')
            problem = receiver.problem()
            if problem:
                mode['camera_receiver'] += f'; {problem}'
        return mode

    def _before_set_parameters(self, parameters) -> list:
        """rclpy's pre-set callback: an integer for a float parameter taken as that float;
        a value of another wrong type or out of its range, an unknown name or a read-only
        parameter logged with what was expected (rclpy refuses each, saying so only to the
        caller)."""
        parameters = widen_integers(parameters)
        read_only = [f"'{p.name}' is read-only (set it in the parameter file; it takes effect "
                     'at the next start)' for p in parameters
                     if self.has_parameter(p.name) and self.describe_parameter(p.name).read_only]
        for problem in (type_mismatches(parameters) + out_of_range(parameters)
                        + undeclared(parameters, self.has_parameter) + read_only):
            self.get_logger().warning(f'refused run-time set: {problem}')
        return parameters

    def _not_settable(self, name: str) -> str:
        """Why a set of the parameter `name` is refused in the node's state, or '': a
        parameter read at configure / activate while the node is configured (it would be
        taken at no point, or at the next activation only)."""
        entry = PARAMETERS.get(name)
        if entry is None or not entry[1].read_only or not self._configured:
            return ''
        return (f"'{name}' is read at configure: deactivate and clean up the node, set it, then "
                'configure and activate again (or set it in the parameter file and restart)')

    @staticmethod
    def _not_a_choice(name: str, value) -> str:
        """Why `value` is refused for an engine option of a fixed set of values (`quantize`,
        `fused_action_expert`, ...: `runtime.config.CHOICES`), or ''."""
        from molmobot_policy.runtime.config import CHOICES, check_choices
        if name not in CHOICES:
            return ''
        try:
            check_choices(**{name: value})
        except ValueError as error:
            return str(error)
        return ''

    def _validate_parameters(self, parameters) -> SetParametersResult:
        """rclpy's on-set callback, after it checked each value's type, range and read-only
        flag: refuses an instruction the engine cannot serve, else logs every change (old ->
        new) at INFO, so that a log shows what the node ran with when."""
        notes = {}
        new = {p.name: p.value for p in parameters}
        contradiction = threshold_problem(lambda name: new.get(name, self._param(name)))
        if contradiction is not None:
            reason = (f'{contradiction} (set both in one atomic call, or, raising them, the '
                      'ERROR threshold first)')
            self.get_logger().warning(f'refused run-time set: {reason}')
            return SetParametersResult(successful=False, reason=reason)
        for p in parameters:
            reason = self._not_settable(p.name) or self._not_a_choice(p.name, p.value)
            if reason:
                self.get_logger().warning(f'refused run-time set: {reason}')
                return SetParametersResult(successful=False, reason=reason)
            # the time base of every stamp held, the schedule and the camera receiver's choice
            # (refused under sim time) follow use_sim_time: only a start sets it
            if p.name == 'use_sim_time' and p.value != self._param('use_sim_time'):
                reason = ("'use_sim_time' is set at start only (the stored stamps, the "
                          'schedule and the camera receiver follow it): set it in the '
                          'parameter file or the launch and restart the node')
                self.get_logger().warning(f'refused run-time set: {reason}')
                return SetParametersResult(successful=False, reason=reason)
            # a new instruction the configured engine cannot serve (too long for its buckets
            # with overlong 'error', or empty) is refused now, not at every later tick; the
            # check tokenizes on the host only, so it is safe while inference runs
            if p.name == 'instruction' and self.engine is not None:
                try:
                    tokens = self.engine.check_instruction(p.value)
                except ValueError as error:
                    self.get_logger().warning(f"refused new 'instruction': {error}")
                    return SetParametersResult(successful=False, reason=f'instruction: {error}')
                notes[p.name] = f' ({tokens} prompt tokens)'
        for p in parameters:    # accepted (the set is atomic: all of them or none)
            if p.value == self._param(p.name):
                continue        # nothing changes: nothing to log
            self.get_logger().info(f"parameter '{p.name}' set: "
                                   f"{as_written(self._param(p.name))!r} -> "
                                   f"{as_written(p.value)!r}{notes.get(p.name, '')}")
        return SetParametersResult(successful=True)

    # ------------------------------------------------------------------ lifecycle
    def autostart(self) -> bool:
        """configure + activate (what lifecycle tooling would do). True on success."""
        if self.trigger_configure() != TransitionCallbackReturn.SUCCESS:
            return False
        return self.trigger_activate() == TransitionCallbackReturn.SUCCESS

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._configured = True     # from here on the configure-time parameters are taken
        result = TransitionCallbackReturn.FAILURE
        try:
            result = self._configure_reporting()
        finally:
            self._configured = result == TransitionCallbackReturn.SUCCESS
        return result

    def _configure_reporting(self) -> TransitionCallbackReturn:
        # seconds to minutes in the executor thread: a heartbeat publishes the status
        with self._idle.configuring('checking the parameters'):
            try:
                return self._configure()
            except Exception as error:  # noqa: BLE001 - past _configure's own reporting (the
                # notes and warnings after the engine is built): never a silent failure
                self.get_logger().error(f'configure failed: {error!r}')
                self._close_engine()
                self._idle.set(ERROR, f'configure failed, no commands are sent: {error!r}')
                return TransitionCallbackReturn.FAILURE

    def _configuring(self, step: str) -> None:
        """Log the configure step and show it on the 'output' status (OK 'configuring: ...');
        raises KeyboardInterrupt instead once a stop was requested."""
        self._check_not_shut_down()
        self._idle.step(step)
        self.get_logger().info(f'configuring: {step}')

    def _configure(self) -> TransitionCallbackReturn:
        self._check_not_shut_down()     # a stop requested before configure began
        cameras = list(self._param('camera_topics'))
        engine_config = {name: self._param(name) for name in ENGINE_PARAMETERS}
        from molmobot_policy.runtime.config import CHOICES, check_choices, fused_action_expert_mode
        engine_config['fused_action_expert'] = fused_action_expert_mode(  # unquoted on / off
            engine_config['fused_action_expert'])
        started = time.monotonic()
        try:
            file_errors = unmatched_parameter_files(self._argv, self.get_fully_qualified_name())
            if file_errors:
                raise ValueError('; '.join(file_errors))
            for warning in near_miss_sections(self._argv, self.get_fully_qualified_name()):
                self.get_logger().warning(warning)
            engine_config['buckets'] = bucket_lengths(engine_config['buckets'])
            check_unknown_parameters(self)
            check_parameter_values(self._param)
            # a misspelled engine option is refused before the engine is said to be built
            check_choices(**{name: engine_config[name] for name in CHOICES})
            self._check_graph()
            chunk_stitcher(self._param)     # raises ValueError on a bad smoothing / max_step
            limiter = motion_limiter(self._param)     # ... on bad motion limits
            # before the (possibly long) weight load: the checkpoint's config.yaml only
            contract = check_robot_contract(
                read_model_config(engine_config), cameras, list(self._param('joint_names')),
                list(self._param('action_joint_names')),
                **{name: self._param(name) for name in CONTRACT_PARAMETERS})
            self.served = served_weights(engine_config, self._param('allow_random_weights'))
            from molmobot_policy.runtime.devices import describe_device  # torch, at configure
            device = describe_device(engine_config['device'])   # ValueError: cannot serve there
            # warnings after the refusals above: a node that cannot start names why first
            if limiter.position_min is None and limiter.position_max is None:
                self.get_logger().warning(NO_POSITION_LIMITS)
            unlimited = unlimited_velocity_joints(self._param, limiter)
            if unlimited:
                self.get_logger().warning(
                    f'max_joint_velocity is infinite for action joints {unlimited}: their '
                    'points are not velocity-limited, the first one not against the measured '
                    'state either (a chunk may start with a jump); set the arm\'s limits')
            self._configuring(f'building engine (loading {self.served}, device {device}, '
                              f'{len(cameras)} cameras)')
            self.engine = self._engine_factory({**engine_config, 'contract': contract})
            self.contract = contract
            self._configuring('warming up the engine')      # checks for a stop first
            self.engine.warmup(progress=self._warmup_progress)
            self._latency = latency_estimator(self._param('chunk_period'),
                                              getattr(self.engine, 'inference_seconds', None))
            # a configuration that would skip every tick is refused, not left active and silent
            unpublishable = unpublishable_chunks(self.engine.model_config.action_horizon,
                                                 self._param('control_period'),
                                                 self._latency.lead())
            if unpublishable:
                raise ValueError(unpublishable)
        except Exception as error:  # noqa: BLE001 - any failure leaves the node unconfigured
            # a KeyError's str() is its message in quotes
            message = error.args[0] if isinstance(error, KeyError) and error.args else error
            self.get_logger().error(f'configure failed: {message}')
            self._close_engine()
            self._idle.set(ERROR, f'configure failed, no commands are sent: {message}')
            return TransitionCallbackReturn.FAILURE
        if self._param('gc_freeze'):        # the start-up heap lives until cleanup
            self._froze_heap = True
            self.get_logger().info(f'froze {freeze_heap()} start-up objects out of the '
                                   'garbage collector (gc_freeze)')
        self.get_logger().info(f'configured in {time.monotonic() - started:.1f} s; engine mode '
                               f'{dict(self.engine.mode)}; first lead '
                               f'{self._latency.lead() * 1e3:.0f} ms')
        self._log_served()
        for level, note in self.contract.notes(self.engine.model_config,
                                               trained=not serves_random_weights(self.served)):
            if level == 'WARN':     # one severity per call site: rclpy raises otherwise
                self.get_logger().warning(note)
            else:
                self.get_logger().info(note)
        unanchored = unanchored_action_joints(self._param)
        if unanchored:      # allowed: check_parameter_values refuses them otherwise
            self.get_logger().warning(
                f'allow_unanchored_action_joints is true: action joints {unanchored} are not '
                'in joint_names; they are anchored only while '
                f"{self._param('joint_state_topic')} carries them, else their points come from "
                'the plan alone and a chunk may start far from the arm')
        gap = chunk_gap(self.engine.model_config.action_horizon, self._param('control_period'),
                        self._param('chunk_period'), self._latency.lead())
        if gap:
            self.get_logger().warning(gap)
        if not self._param('instruction').strip():
            self.get_logger().warning("parameter 'instruction' is empty: the engine refuses "
                                      'observations without one; set it (it may change at '
                                      'run time)')
        random = f', serving {self.served}' if serves_random_weights(self.served) else ''
        self._idle.set(WARN, f'inactive (configured{random}): no commands are sent until '
                       'activated')
        return TransitionCallbackReturn.SUCCESS

    def _log_served(self) -> None:
        if serves_random_weights(self.served):
            self.get_logger().warning(f'serving {self.served}: allow_random_weights is true; '
                                      'the actions are noise, not a trained policy')
        else:
            self.get_logger().info(f'serving {self.served}')

    def request_stop(self) -> None:
        """A stop request (`ros.entry.StopSignals`, from a thread of its own): configure and
        activate stop at their next step, and the worker sends no chunk after this (one
        being built is dropped); the main thread then destroys the node."""
        self.stop_requested.set()
        loop = self.loop
        if loop is not None:
            loop.request_stop()

    def _check_not_shut_down(self) -> None:
        """Raises KeyboardInterrupt once a stop was requested (SIGINT, SIGTERM: the signal
        itself raises none, `ros.entry.StopSignals`) or the context was shut down: configure
        stops between its steps and warm-up buckets, not after compiling every bucket, and
        activate before the worker starts (never logging 'active' after a stop request)."""
        if self.stop_requested.is_set():
            raise KeyboardInterrupt('a stop was requested while configuring')
        if not self.context.ok():
            raise KeyboardInterrupt('the ROS context was shut down while configuring')

    def _warmup_progress(self, message: str) -> None:
        self._check_not_shut_down()
        self._idle.step(message)
        self.get_logger().info(message)

    def _input_hint(self, topic: str) -> str:
        """`graph.silence_hint` for a subscribed input (resolved name)."""
        if topic == self._sync.joint_state_topic:
            return graph.silence_hint(self, graph.JOINT_STATE_TYPE, False, topic)
        compressed = topic in self._compressed_cameras
        return graph.silence_hint(self, graph.COMPRESSED_TYPE if compressed
                                  else graph.IMAGE_TYPE,
                                  self._param('camera_qos') == 'reliable', topic)

    def _check_graph(self) -> None:
        """ValueError when another node has this node's name (asked until discovery had time
        to find one), or two inputs resolve to one topic (`ros.graph`)."""
        cameras = [t for t, _ in camera_subscriptions(self._param)]
        problem = (graph.wait_for_same_name(self, self._created)
                   or graph.shared_topics_problem(self, cameras,
                                                  self._param('joint_state_topic')))
        if problem:
            raise ValueError(problem)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._check_not_shut_down()     # a stop requested after configure: no worker
        try:
            self._activate()
        except KeyboardInterrupt:   # a stop requested while activating: nothing left running
            self._release_active()
            raise
        except Exception as error:  # noqa: BLE001 - never a silent failure, nothing half-built
            self.get_logger().error(f'activate failed: {error!r}')
            try:
                self._release_active()
            finally:
                self._idle.set(ERROR, f'activate failed, no commands are sent: {error!r}')
            return TransitionCallbackReturn.FAILURE
        return super().on_activate(state)

    def _activate(self) -> None:
        problem = graph.same_name_problem(self)     # one started since configure
        if problem:
            raise ValueError(problem)
        self._idle.stop()            # the full diagnostics take over
        joint_state_topic = self._param('joint_state_topic')
        subscribed = camera_subscriptions(self._param)
        # the inputs are named as this node resolves them (remap rules, namespace, ~ applied):
        # the topics the data comes on, in diagnostics, logs and the receiver's subscriptions
        cameras = [(self.resolve_topic_name(t), c) for t, c in subscribed]
        self._sync = ObservationSynchronizer(
            [topic for topic, _ in cameras], self._param('joint_names'),
            joint_state_topic=self.resolve_topic_name(joint_state_topic),
            max_future=self._param('max_future_stamp'),
            action_joint_names=self._param('action_joint_names'),
            min_image_size=self._param('min_image_size'),
            input_hint=self._input_hint)
        self._compressed_cameras = {topic for topic, compressed in cameras if compressed}
        if self._param('camera_qos') == 'sensor_data':
            camera_qos = qos_profile_sensor_data
        else:
            camera_qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                                    history=HistoryPolicy.KEEP_LAST)
        choice = choose_receiver(self._param('camera_receiver'), self._param('use_sim_time'),
                                 len(cameras), shm_free())
        self._receiver_choice = f'{choice.mode} ({choice.reason})'
        if choice.warning:      # one severity per call site: rclpy raises otherwise (an
            self.get_logger().warning(f'camera_receiver: {self._receiver_choice}')
        else:                   # activation after one that warned)
            self.get_logger().info(f'camera_receiver: {self._receiver_choice}')
        if choice.mode == 'subprocess':
            self._receiver = CameraReceiver(self.get_name(), self.get_namespace(), cameras,
                                            self._param('camera_qos'))
        else:
            for (topic, compressed), (name, _) in zip(subscribed, cameras):
                self._input_subscriptions.append(self.create_subscription(
                    CompressedImage if compressed else Image, topic,
                    functools.partial(self._on_image, name), camera_qos))
        # best effort subscriptions also match reliable publishers
        self._input_subscriptions.append(self.create_subscription(
            JointState, joint_state_topic, self._on_joint_state, qos_profile_sensor_data))
        self._trajectory_pub = self.create_publisher(JointTrajectory,
                                                     self._param('output_topic'), 10)
        if self._param('publish_float_array'):
            self._array_pub = self.create_publisher(Float32MultiArray, '~/actions', 10)
        self._chunk_info_pub = self.create_publisher(DiagnosticStatus, '~/chunk_info', 10)
        self._watchdog = OutputWatchdog(self._param('chunk_period'),
                                        self._param('output_error_periods'))
        sim_time = lambda: self.get_clock().ros_time_is_active     # noqa: E731
        self.loop = PolicyLoop(
            clock=self._now, observe=self._observe, predict=self.engine.predict,
            publish=self._prepare_publish, stitcher=chunk_stitcher(self._param),
            chunk_period=self._param('chunk_period'),
            to_joints=self.contract.joint_positions,
            events=LoopReport(self, self._chunk_info_pub, self._sync, self._watchdog, self._now),
            sim_time=sim_time, debug_timing=self._param('debug_timing'),
            limiter=motion_limiter(self._param), measured=self._measured, latency=self._latency,
            quiet=self.quiet_window)
        self.gc_pauses = GcPauses(STATS_WINDOW).install()
        self._unanchored_now = []
        self._diagnostics = policy_updater(
            self, self._sync, self.loop, self.gc_pauses, self._watchdog, self._param, self._now,
            mode=self._mode,
            served=self.served, sim_time=sim_time,
            refresh=self._poll_receiver if self._receiver is not None else None,
            unanchored=lambda: self._unanchored_now)
        if self._receiver is not None:
            self._receiver_failed = ''
            self._receiver.start()
            # the first ticks would otherwise find no frame ('has no image yet') while the
            # child starts: seconds on a busy machine
            ready = self._receiver.wait_ready(RECEIVER_READY_S, stop=self.stop_requested)
            self._check_not_shut_down()     # a stop requested meanwhile: not active
            if ready:
                self.get_logger().info(f'cameras received by process {self._receiver.pid} '
                                       f'(node {self._receiver.node_name}, shared memory '
                                       f'{self._receiver.segment})')
            else:
                self.get_logger().warning(
                    f'camera receiver process {self._receiver.pid} has not subscribed the '
                    f'cameras within {RECEIVER_READY_S:.0f} s '
                    f'({self._receiver.problem() or "still starting"}): ticks skip until it has')
        self._check_not_shut_down()     # a stop requested while activating: not active
        self.loop.start()
        if self.stop_requested.is_set():    # requested while this loop was being built
            self.loop.request_stop()
        self.get_logger().info(
            f"active: {len(cameras)} cameras ({', '.join(t for t, _ in cameras)}), chunk every "
            f"{self._param('chunk_period')} s, actions every {self._param('control_period')} s, "
            f"publishing on {self._trajectory_pub.topic_name}; serving {self.served}")

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release_active()
        self._idle.set(WARN, 'inactive (deactivated): no commands are sent')
        chunks = self.loop.stats.chunks_published if self.loop else 0
        self.get_logger().info(f"deactivated after {chunks} chunk{'' if chunks == 1 else 's'}")
        return super().on_deactivate(state)

    def _release_active(self) -> None:
        """Stop and remove what activation built (the worker, the receiver, subscriptions,
        publishers, diagnostics); safe on a half-built activation."""
        self._stop_loop()
        self._stop_receiver()
        if self._watchdog is not None:
            self._watchdog.stop()
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

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._close_engine()
        self._configured = False
        self._idle.set(WARN, 'unconfigured (cleaned up): no commands are sent')
        self.get_logger().info('cleaned up: engine released, unconfigured')
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        if self._diagnostics is not None:      # active
            self.on_deactivate(state)
        self._close_engine()
        self._idle.set(WARN, 'finalized (lifecycle shutdown): no commands are sent; stop the '
                             'process to end it')
        self.get_logger().info('finalized (lifecycle shutdown): no commands are sent; the '
                               'process runs until stopped')
        return TransitionCallbackReturn.SUCCESS

    def destroy_node(self, exiting: bool = False) -> None:
        """Stops the worker and releases the engine, then destroys the node. `exiting`: the
        process exits next (`ros.main`), so the released heap is not collected first."""
        try:
            self._stop_loop()
            self._stop_receiver()
        finally:
            self._idle.stop()
            self._close_engine(collect=not exiting)
            self._destroy_rcl_node()

    def _destroy_rcl_node(self) -> None:
        """rclpy's Node.destroy_node, then the lifecycle state machine, which holds the rcl
        node: rclpy's LifecycleNode leaves it (and so the node, its DDS entities and, for the
        context's last node, the participant) to the garbage collector, which may finalize it
        in any allocation, after the context's shutdown: a test run hung there, in the
        participant's teardown with the GIL held."""
        super().destroy_node()
        machine = getattr(self, '_state_machine', None)     # rclpy's, not public
        if machine is not None:
            machine.destroy_when_not_in_use()

    def _stop_loop(self) -> None:
        if self.loop is not None:
            self.loop.stop()

    def _stop_receiver(self) -> None:
        """Stop the camera receiver process and remove its shared memory (idempotent)."""
        if self._receiver is not None:
            try:
                self._receiver.stop()
            finally:
                self._receiver = None

    def _close_engine(self, collect: bool = True) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            finally:
                self.engine = None
                if self._froze_heap:        # let the collector free the engine's cycles
                    self._froze_heap = False
                    unfreeze_heap(collect)

    # -------------------------------------------------------------- callbacks: store only
    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _on_image(self, topic: str, msg) -> None:
        if not self._sync.add_image(topic, msg, messages.stamp_seconds(msg.header.stamp),
                                    self._now()):
            refused = self._sync.refused(topic)     # '' for a frame older than the stored
            if refused:
                self._warn_refused(topic, refused)

    def _warn_refused(self, topic: str, refused: str) -> None:
        suffix = self._repeats.due(topic, refused)
        if suffix is not None:
            self.get_logger().warning(f'camera {topic}: {refused}{suffix}')

    def _poll_receiver(self) -> str:
        """camera_receiver subprocess: the newest frames into the synchronizer (worker
        before each observation, diagnostics before each update); returns '' or why no
        frames can arrive (the receiver process exited: logged once)."""
        receiver = self._receiver
        if receiver is None:
            return ''
        problem = receiver.problem()
        if problem:
            if not self._receiver_failed:
                self._receiver_failed = self._receiver_last_exit = problem
                self.get_logger().error(
                    f'{problem}: no camera frames arrive (every tick is skipped); restarting it '
                    f'(at most every {RECEIVER_RESTART_S:.0f} s while it fails)')
            self._restart_receiver(receiver)
            return problem
        receiver.poll(self._sync, self._warn_refused)
        return ''

    def _restart_receiver(self, receiver: CameraReceiver) -> None:
        """A new receiver child after an exit, at most every RECEIVER_RESTART_S (a child that
        cannot start is not retried in a tight loop); from the worker or diagnostics thread,
        whichever sees the exit first."""
        if time.monotonic() - self._receiver_restarted_at < RECEIVER_RESTART_S or \
                not self._receiver_restarting.acquire(blocking=False):
            return
        try:
            if receiver is not self._receiver or not receiver.problem():
                return      # deactivated, or the other thread restarted it
            self._receiver_restarted_at = time.monotonic()
            receiver.restart()
            self._receiver_failed = ''
            self.get_logger().warning(
                f'camera receiver restarted as process {receiver.pid} (restart '
                f'{receiver.restarts} of this activation, shared memory {receiver.segment})')
        except Exception as error:  # noqa: BLE001 - the node keeps running: retried later
            self.get_logger().error(f'camera receiver restart failed: {error!r}',
                                    throttle_duration_sec=WARN_THROTTLE_S)
        finally:
            self._receiver_restarting.release()

    def _on_joint_state(self, msg: JointState) -> None:
        topic = self._sync.joint_state_topic
        try:
            self._sync.add_joint_state(msg.name, msg.position,
                                       messages.stamp_seconds(msg.header.stamp), self._now())
        except ValueError as error:
            self.get_logger().warning(f'ignoring joint state: {error}',
                                      throttle_duration_sec=WARN_THROTTLE_S)
            return
        refused = self._sync.refused(topic)
        suffix = self._repeats.due(topic, refused) if refused else None
        if suffix is not None:
            self.get_logger().warning(f'joint state {topic}: {refused}{suffix}')

    # ------------------------------------------------------------ the loop's injections
    def _observe(self, now: float):
        """The tick's Observation, or why the tick is skipped: every reason at once (an empty
        instruction, allowed at configure to be set at run time, does not hide what the inputs
        lack; an observation built while it is empty is not used)."""
        instruction = self._param('instruction')
        reasons = []
        if not instruction.strip():
            reasons.append("parameter 'instruction' is empty: set it to the task text (it may "
                           'change at run time)')
        problem = self._poll_receiver()
        if problem:
            return Skip(tuple(reasons) + (f'{problem}: no camera frames arrive',))
        problem = graph.other_commanders(self, self._trajectory_pub.topic_name)
        if problem:
            return Skip(tuple(reasons) + (problem,))
        built = self._sync.build(now, self._param('max_image_age'), self._param('max_state_age'),
                                 instruction=instruction,
                                 max_image_spread=self._param('max_image_spread'))
        if reasons:
            return Skip(tuple(reasons) + (built.reasons if isinstance(built, Skip) else ()))
        return built

    def _measured(self):
        """(positions, stamp) of the action joints for the loop's MotionLimiter
        (`ObservationSynchronizer.anchor_positions`; its ValueError skips the tick); logs each
        never-measured joint once (only with allow_unanchored_action_joints: configure
        refuses action joints that a tick does not wait for otherwise) and keeps them for
        the 'output' status."""
        positions, stamp, unseen = self._sync.anchor_positions(
            list(self._param('action_joint_names')), self._param('gripper_index'), self._now(),
            self._param('max_state_age'))
        self._unanchored_now = unseen
        if set(unseen) - self._unanchored:
            self._unanchored.update(unseen)
            self.get_logger().warning(
                f'action joints {unseen} have no position on {self._sync.joint_state_topic}: '
                'their points are not anchored to a measured state (max_joint_velocity and the '
                'position limits still hold between points)')
        return positions, stamp

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
