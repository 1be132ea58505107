"""/diagnostics of the policy node, shaped like ROS's diagnostic_updater.

diagnostic_updater (ros/diagnostics) is not on PyPI, so this module offers the part of its
interface the node uses, with the same names, so that the real library can replace it on a
full ROS install: a `DiagnosticTask` has a name (`getName()`) and `run(stat)`, which fills a
`DiagnosticStatusWrapper` (`summary(level, message)`, `add(key, value)`) and returns it; an
`Updater` collects tasks (`add(task)`), names each status '<node name>: <task name>' (the
node's name with its namespace: `diagnostic_name`; ROS's Updater uses the bare name) with the
hardware id (`setHardwareID`) and publishes all of them as one `diagnostic_msgs/
DiagnosticArray` on /diagnostics every `period` seconds (`update()`). Its timer runs on the
steady clock, not on ROS time, so that /diagnostics also comes while sim time waits for
/clock (the array is then stamped with the system time).

The node's rules, one task each (thresholds are node parameters, read at every update):
- `InputTask`, per camera topic and for the joint state: ERROR without a message (or
  without a usable one) and for a problem (refused stamp, undecodable frame, non-finite
  joints) lasting longer than the max_*_age parameter, and for a message stale for longer
  than that (age > 2 x max_*_age: a dead camera or joint state publisher); WARN for a newer
  problem, a stale message (age > max_*_age) or a rate below diag_min_camera_rate, else OK.
- `InferenceTask`: WARN / ERROR when the inference p99 exceeds diag_inference_warn_ms /
  diag_inference_error_ms; at least WARN, naming them, while RANDOM WEIGHTS are served (a
  monitor that reads only levels must not see an untrained model as OK); carries what is
  served (checkpoint and weights fingerprint, or RANDOM WEIGHTS), the engine's mode (and
  where the cameras are received) and the latency estimate behind the lead.
- `ScheduleTask`: WARN / ERROR when the largest publish jitter of the last LEVEL_CHUNKS chunks
  after the start-up chunks exceeds diag_jitter_warn_ms / diag_jitter_error_ms, WARN with the
  last skip reason while ticks are skipped, WARN naming the start-up chunks when one was later
  than diag_jitter_warn_ms, until LEVEL_CHUNKS chunks have followed them; the loop's counters
  (deadline misses of every chunk), sensor-to-publish age and garbage-collector pauses.
  Start-up chunks are an activation's first chunks, scheduled on a lead that used none of its
  measured latencies (`timing.loop`; after configure, the warm-up's estimate): their
  lateness says that estimate was off, not that the steady schedule is, so it has its own
  values (`startup_*`) and never makes the status ERROR.
- `OutputTask` ('output'): whether chunks reach the robot (`timing.OutputWatchdog`): OK while
  they flow, WARN after 1.5 chunk periods without one, ERROR after output_error_periods,
  naming the last skip reason or the clock (sim time without /clock); at least WARN, naming
  them, while action joints are published without a measured anchor
  (allow_unanchored_action_joints); the motion limits' counts.
While the node is not active, `idle_updater` publishes the 'output' status alone (its
lifecycle state); during configure a `Heartbeat` thread runs it, since the executor thread
that would run its timer is busy building and warming up the engine.
"""
from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from typing import Callable

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.clock import Clock, ClockType

from molmobot_policy.ros.serving import serves_random_weights
from molmobot_policy.ros.synchronizer import stale_while_others_current

OK, WARN, ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR


def diagnostic_name(node) -> str:
    """The node's fully qualified name without its leading '/' ('molmobot_policy',
    'robot1/molmobot_policy'): the prefix of its status names ('<it>: output') and its
    hardware_id, so that nodes in two namespaces never publish the same status name (a
    monitor keyed by name would show one robot's OK over the other's ERROR)."""
    return node.get_fully_qualified_name().lstrip('/')


def policy_updater(node, sync, loop, gc_pauses, watchdog, parameter: Callable[[str], object],
                   now: Callable[[], float], mode: Callable[[], dict], served: str,
                   sim_time: Callable[[], bool],
                   refresh: Callable[[], object] | None = None,
                   unanchored: Callable[[], list] | None = None) -> Updater:
    """The node's Updater (period: the diagnostics_period parameter) with its tasks: one
    `InputTask` per camera of `sync` (an ObservationSynchronizer) and for its joint state,
    `InferenceTask`, `ScheduleTask` and `OutputTask` over `loop` (a timing.PolicyLoop: its
    stats and latency) and `watchdog` (a timing.OutputWatchdog); `now()` -> ROS time, s;
    `served`: what the engine serves; `sim_time()` -> True while ROS time follows /clock;
    `refresh()` runs before each update (the camera receiver process's newest frames into
    `sync`); `unanchored()` -> the action joints the latest chunk left unanchored."""
    updater = Updater(node, parameter('diagnostics_period'))
    updater.before_update = refresh
    updater.setHardwareID(diagnostic_name(node))
    inputs = [('camera', t, 'max_image_age') for t in sync.camera_topics]
    for label, topic, max_age in inputs + [('joint state', sync.joint_state_topic,
                                            'max_state_age')]:
        updater.add(InputTask(label, topic, lambda topic=topic: sync.stats(now())[topic],
                              max_age, parameter,
                              hint=lambda topic=topic: sync.silence_hint(topic)))
    updater.add(InferenceTask(loop.stats.inference_ms, mode, parameter, served, loop.latency))
    updater.add(ScheduleTask(loop.stats, gc_pauses, lambda: sync.frames_decoded, parameter))
    updater.add(OutputTask(watchdog, loop.stats, now, sim_time, unanchored=unanchored))
    return updater


class DiagnosticStatusWrapper(DiagnosticStatus):
    """A DiagnosticStatus filled by tasks (diagnostic_updater's interface)."""

    def summary(self, level, message: str) -> None:
        """Set the level (OK, WARN, ERROR) and the message."""
        self.level, self.message = level, message

    def add(self, key: str, value) -> None:
        """Append the key-value (key, str(value))."""
        self.values.append(KeyValue(key=key, value=str(value)))


class DiagnosticTask:
    """A named check; `run(stat)` fills `stat` (a DiagnosticStatusWrapper) and returns it.
    `log_errors`: the Updater also logs when its status becomes ERROR and when it leaves it
    (for problems no other log line reports, e.g. an overloaded machine's late publishes)."""

    log_errors = False

    def __init__(self, name: str) -> None:
        self.name = name

    def getName(self) -> str:   # noqa: N802 - diagnostic_updater's name
        return self.name

    def run(self, stat: DiagnosticStatusWrapper) -> DiagnosticStatusWrapper:
        return stat


class Updater:
    """Runs its tasks every `period` s (a node timer) and publishes one DiagnosticArray.

    Args:
        node: the rclpy node publishing (its name prefixes the status names).
        period: seconds between updates (> 0).
    """

    def __init__(self, node, period: float) -> None:
        self._node = node
        self._tasks: list[DiagnosticTask] = []
        self._hardware_id = ''
        self._levels: dict[str, object] = {}        # the last level of each logged task
        self.before_update: Callable[[], object] | None = None     # runs before the tasks
        self._publisher = node.create_publisher(DiagnosticArray, '/diagnostics', 10)
        self._timer = node.create_timer(period, self.update,
                                        clock=Clock(clock_type=ClockType.STEADY_TIME))

    def setHardwareID(self, hardware_id: str) -> None:     # noqa: N802
        self._hardware_id = hardware_id

    def add(self, task: DiagnosticTask) -> None:
        self._tasks.append(task)

    def update(self) -> None:
        """Run every task, in the order added, and publish their statuses."""
        if self.before_update is not None:
            self.before_update()
        statuses = []
        for task in self._tasks:
            stat = DiagnosticStatusWrapper(level=ERROR, message='No message was set',
                                           hardware_id=self._hardware_id)
            stat = task.run(stat)
            stat.name = f'{diagnostic_name(self._node)}: {task.getName()}'
            statuses.append(stat)
            if task.log_errors:
                self._log_level_change(task.getName(), stat)
        array = DiagnosticArray(status=statuses)
        stamp = self._node.get_clock().now()
        if stamp.nanoseconds == 0:      # sim time before /clock
            stamp = Clock(clock_type=ClockType.SYSTEM_TIME).now()
        array.header.stamp = stamp.to_msg()
        self._publisher.publish(array)

    def _log_level_change(self, name: str, stat) -> None:
        before, self._levels[name] = self._levels.get(name), stat.level
        if stat.level == ERROR and before != ERROR:
            self._node.get_logger().warning(f"status '{name}' is ERROR: {stat.message}")
        elif before == ERROR and stat.level != ERROR:
            self._node.get_logger().info(f"status '{name}' is no longer ERROR: {stat.message}")

    def destroy(self) -> None:
        """Remove the timer and the publisher from the node."""
        self._node.destroy_timer(self._timer)
        self._node.destroy_publisher(self._publisher)


def add_summary_ms(stat: DiagnosticStatusWrapper, prefix: str, summary: dict) -> None:
    """`RollingStats.summary()` as '<prefix>_p50_ms', '_p99_ms', '_max_ms' ('nan' when empty)."""
    for k in ('p50', 'p99', 'max'):
        stat.add(f'{prefix}_{k}_ms', 'nan' if math.isnan(summary[k]) else f'{summary[k]:.2f}')


class InputTask(DiagnosticTask):
    """One input: `stats()` -> `ros.synchronizer.TopicStats` of `topic` now.

    Args:
        label: 'camera' or 'joint state' (the status is named '<label> <topic>').
        max_age_parameter: 'max_image_age' or 'max_state_age'.
        parameter: name -> the node parameter's current value.
        hint: () -> '' or why nothing arrives (`ros.graph.silence_hint`), appended to 'no
            message received'.
    """

    def __init__(self, label: str, topic: str, stats: Callable, max_age_parameter: str,
                 parameter: Callable[[str], object],
                 hint: Callable[[], str] | None = None) -> None:
        super().__init__(f'{label} {topic}')
        self._stats, self._max_age, self._parameter = stats, max_age_parameter, parameter
        self._hint = hint or (lambda: '')

    def run(self, stat):
        stats = self._stats()
        max_age, min_rate = self._parameter(self._max_age), self._parameter(
            'diag_min_camera_rate')
        if stats.count == 0:
            stat.summary(ERROR, f'no message received{self._hint()}')
        elif stats.problem and stats.problem_age is not None and stats.problem_age > max_age:
            stat.summary(ERROR, f'{stats.problem} (for {stats.problem_age:.1f} s > '
                                f'{self._max_age} {max_age:.3f} s)')
        elif stats.problem:
            stat.summary(WARN, stats.problem)
        elif stats.age is None:
            stat.summary(ERROR, 'no usable message received')
        elif stats.age > 2 * max_age:      # stale for longer than its max age: a dead input
            stat.summary(ERROR, f'stale{_which(stats, max_age)}: age {stats.age:.3f} s > '
                                f'{max_age:.3f} s for {stats.age - max_age:.1f} s (longer than '
                                f'{self._max_age})')
        elif stats.age > max_age:
            stat.summary(WARN, f'stale{_which(stats, max_age)}: age {stats.age:.3f} s > '
                               f'{max_age:.3f} s')
        elif stats.rate_hz < min_rate:
            stat.summary(WARN, f'rate {stats.rate_hz:.1f} Hz < {min_rate:.1f} Hz')
        else:
            stat.summary(OK, 'ok')
        stat.add('rate_hz', f'{stats.rate_hz:.2f}')
        stat.add('age_ms', 'nan' if stats.age is None else f'{stats.age * 1e3:.1f}')
        stat.add('messages', stats.count)
        return stat


def _level(value: float, warn: float, error: float):
    """ERROR above `error`, WARN above `warn`, else OK (nan: OK, nothing measured yet)."""
    return ERROR if value > error else WARN if value > warn else OK


class InferenceTask(DiagnosticTask):
    """Inference time: `inference_ms` a RollingStats (ms); `mode()` -> the engine's mode;
    `served`: what the engine serves (`ros.serving.served_weights`); `latency`: the
    timing.LatencyEstimator setting the lead, or None."""

    log_errors = True

    def __init__(self, inference_ms, mode: Callable[[], dict],
                 parameter: Callable[[str], object], served: str = '', latency=None) -> None:
        super().__init__('inference')
        self._inference_ms, self._mode, self._parameter = inference_ms, mode, parameter
        self._served, self._latency = served, latency

    def run(self, stat):
        summary = self._inference_ms.summary()
        p99 = summary['p99']
        level = _level(p99, self._parameter('diag_inference_warn_ms'),
                       self._parameter('diag_inference_error_ms'))
        message = {OK: 'ok', WARN: f'inference p99 {p99:.0f} ms slow',
                   ERROR: f'inference p99 {p99:.0f} ms too slow'}[level]
        if serves_random_weights(self._served):     # never OK: the actions are noise
            random = f'serving {self._served}: actions are noise'
            message = random if level == OK else f'{message}; {random}'
            level = max(level, WARN)
        stat.summary(level, message)
        add_summary_ms(stat, 'inference', summary)
        stat.add('weights', self._served)
        if self._latency is not None:
            estimate = self._latency.estimate()
            stat.add('lead_ms', f'{self._latency.lead() * 1e3:.1f}')
            stat.add('latency_estimate_ms', 'nan' if math.isnan(estimate)
                     else f'{estimate * 1e3:.1f}')
            stat.add('latency_samples', self._latency.count)
            stat.add('latency_samples_ignored', self._latency.ignored)
        for key, value in self._mode().items():
            stat.add(f'engine_{key}', value)
        return stat


LEVEL_CHUNKS = 20   # the schedule's level: largest jitter of the latest chunks (the values keep
                    # the whole window): late chunks after activation, on cold caches, must
                    # not hold it at ERROR for the 200-chunk window (minutes at a 1.5 s period).
                    # The start-up chunks are left out of it: they run on a lead that used
                    # none of the activation's inference times, and late start-up chunks held
                    # the level at ERROR for 20 chunks (30 s) while every later one was on
                    # time (fresh-user trials); they are a WARN of their own instead


class ScheduleTask(DiagnosticTask):
    """The schedule: `stats` a `timing.LoopStats`, `gc_pauses` a `timing.GcPauses`,
    `frames_decoded()` -> camera frames decoded so far. Level by the largest publish jitter
    of the last LEVEL_CHUNKS chunks after the start-up chunks (`stats.startup_jitter_ms`); WARN
    naming `stats.last_skip` while ticks are skipped (the loop clears it when a chunk is
    published); WARN naming the start-up chunks when one was later than diag_jitter_warn_ms,
    until LEVEL_CHUNKS chunks have followed them."""

    log_errors = True

    def __init__(self, stats, gc_pauses, frames_decoded: Callable[[], int],
                 parameter: Callable[[str], object]) -> None:
        super().__init__('schedule')
        self._stats, self._gc, self._frames = stats, gc_pauses, frames_decoded
        self._parameter = parameter

    def run(self, stat):
        stats = self._stats
        jitter = stats.jitter_ms.summary()
        startup = stats.startup_jitter_ms.summary()
        steady = stats.jitter_ms.total - startup['total']       # chunks after start-up
        rated = min(LEVEL_CHUNKS, steady)
        # the largest, not a p99: over 20 values a p99 is the largest but for interpolation
        worst = stats.jitter_ms.quantile(1.0, last=rated) if rated > 0 else math.nan
        warn_ms = self._parameter('diag_jitter_warn_ms')
        level = _level(worst, warn_ms, self._parameter('diag_jitter_error_ms'))
        if level != OK:
            stat.summary(level, f'publish jitter up to {worst:.1f} ms over the last {rated} '
                                'chunks')
        elif stats.last_skip:
            stat.summary(WARN, f'last skip: {stats.last_skip}')
        elif startup['max'] > warn_ms and steady < LEVEL_CHUNKS:
            stat.summary(WARN, f"start-up chunks late: up to {startup['max']:.1f} ms over "
                               f"the first {startup['total']} (scheduled before the lead used "
                               "any of this activation's inference times; not rated)")
        else:
            stat.summary(OK, 'ok')
        add_summary_ms(stat, 'publish_jitter', jitter)       # every chunk, start-up included
        stat.add('rated_publish_jitter_max_ms',                # what the level is set by
                 'nan' if math.isnan(worst) else f'{worst:.2f}')
        stat.add('rated_chunks', rated)
        stat.add('startup_chunks', startup['total'])
        stat.add('startup_publish_jitter_max_ms',
                 'nan' if math.isnan(startup['max']) else f"{startup['max']:.2f}")
        add_summary_ms(stat, 'sensor_to_publish_age', stats.age_ms.summary())
        for key in ('chunks_published', 'deadline_misses', 'dropped_actions', 'skipped_ticks',
                    'failed_ticks'):
            stat.add(key, getattr(stats, key))
        stat.add('frames_decoded', self._frames())
        add_summary_ms(stat, 'gc_pause', self._gc.pauses_ms.summary())
        stat.add('gc_pause_max_since_activate_ms', f'{self._gc.max_ms:.3f}')
        stat.add('gc_collections', '/'.join(map(str, self._gc.collections)))
        return stat


class IdleOutputTask(DiagnosticTask):
    """The 'output' status while the node is not active (no loop, so no OutputTask): WARN
    (unconfigured or inactive: no commands are sent), OK 'configuring: <the latest step>'
    while configure runs, ERROR after a failed configure; `state()` -> (level, message)."""

    def __init__(self, state: Callable[[], tuple]) -> None:
        super().__init__('output')
        self._state = state

    def run(self, stat):
        level, message = self._state()
        stat.summary(level, message)
        return stat


def idle_updater(node, parameter: Callable[[str], object], state: Callable[[], tuple]
                 ) -> Updater:
    """The node's Updater while it is not active: the `IdleOutputTask` of `state()`, so a
    monitor sees an unconfigured, configuring (through a `Heartbeat`), inactive or failed
    node say so instead of going quiet."""
    updater = Updater(node, parameter('diagnostics_period'))
    updater.setHardwareID(diagnostic_name(node))
    updater.add(IdleOutputTask(state))
    return updater


def _which(stats, max_age: float) -> str:
    """' for joints [...]' when only some joints of a joint state topic are stale
    (`stale_while_others_current`), else ''."""
    stale = stale_while_others_current(stats.joint_ages or {}, max_age)
    return f' for joints {stale}' if stale else ''


class IdleStatus:
    """The 'output' status while the node is not active (`idle_updater` of `state`, created
    on the first `set`), and the configure heartbeat.

    Args:
        node: the rclpy node. parameter: name -> the node parameter's value.
    """

    def __init__(self, node, parameter: Callable[[str], object]) -> None:
        self._node, self._parameter = node, parameter
        self._updater: Updater | None = None
        self.state: tuple = (WARN, '')      # (level, message)

    def set(self, level, message: str) -> None:
        """Publish (level, message) from now on (every diagnostics_period)."""
        self.state = (level, message)
        if self._updater is None:
            self._updater = idle_updater(self._node, self._parameter, lambda: self.state)

    def step(self, text: str) -> None:
        """OK 'configuring: <text>'."""
        self.set(OK, f'configuring: {text}')

    def stop(self) -> None:
        """Stop publishing (activate: the full diagnostics take over; destroy)."""
        if self._updater is not None:
            self._updater.destroy()
            self._updater = None

    @contextmanager
    def configuring(self, first_step: str):
        """Within: OK 'configuring: <step>' published by a `Heartbeat` thread (configure
        blocks the executor, so the updater's timer cannot fire). Left while still
        'configuring' (an exception: shutting down): WARN 'configure interrupted'."""
        self.step(first_step)
        heartbeat = Heartbeat(self._updater, self._parameter('diagnostics_period'),
                              name=f'{diagnostic_name(self._node)} configure heartbeat').start()
        try:
            yield
        finally:
            heartbeat.stop()
            if self.state[1].startswith('configuring: '):
                # the node may be destroyed already: set the state, create no updater
                self.state = (WARN, 'configure interrupted (shutting down): no commands are '
                                    'sent')


class Heartbeat:
    """Runs `updater.update()` on its own thread at once and then every `period` s until
    `stop()`: /diagnostics keeps coming while the executor thread is busy in a long lifecycle
    transition (configure builds and warms up the engine), when the updater's timer cannot
    fire. rclpy publishers may publish from any thread. An update that raises (the context
    shut down) ends the thread.

    Args:
        updater: the Updater to run (the node's idle one).
        period: seconds (> 0) between updates.
        name: the thread's name.
    """

    def __init__(self, updater: Updater, period: float, name: str = 'diagnostics heartbeat'
                 ) -> None:
        self._updater, self._period = updater, float(period)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._updater.update()
            except Exception:  # noqa: BLE001 - shutting down: nothing left to publish on
                return
            self._stopped.wait(self._period)

    def stop(self) -> None:
        """Stop and join the thread (an update in progress finishes first)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()


class OutputTask(DiagnosticTask):
    """Whether chunks reach the robot: `watchdog` a timing.OutputWatchdog fed by the loop's
    events, `stats` its timing.LoopStats (the motion limits' counts), `now()` -> ROS time
    (s), `sim_time()` -> True while ROS time follows /clock (then a clock standing still is
    measured on the steady clock, `OutputWatchdog.check_clock`); `unanchored()` -> the
    action joints published without a measured anchor (never OK while there are any: a
    monitor that reads only levels must not see that as OK)."""

    LEVELS = {'OK': OK, 'WARN': WARN, 'ERROR': ERROR}

    def __init__(self, watchdog, stats, now: Callable[[], float],
                 sim_time: Callable[[], bool], wall: Callable[[], float] = time.monotonic,
                 unanchored: Callable[[], list] | None = None) -> None:
        super().__init__('output')
        self._watchdog, self._stats, self._now = watchdog, stats, now
        self._sim_time, self._wall = sim_time, wall
        self._unanchored = unanchored or list

    def run(self, stat):
        now = self._now()
        state = self._watchdog.check_clock(now, self._wall()) if self._sim_time() else None
        state = state or self._watchdog.check(now)
        level, message = self.LEVELS[state.level], state.message
        unanchored = self._unanchored()
        if unanchored:
            message += (f'; action joints {unanchored} published without a measured anchor '
                        '(allow_unanchored_action_joints: true): their chunks may start far '
                        'from the arm')
            level = max(level, WARN)
        stat.summary(level, message)
        stat.add('since_last_chunk_s', 'nan' if state.since_last is None
                 else f'{state.since_last:.2f}')
        stat.add('chunks_published', self._stats.chunks_published)
        stat.add('velocity_limited', self._stats.velocity_limited)
        stat.add('position_clipped', self._stats.position_clipped)
        return stat
