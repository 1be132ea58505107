"""/diagnostics of the policy node, shaped like ROS's diagnostic_updater.

diagnostic_updater (ros/diagnostics) is not on PyPI, so this module offers the part of its
interface the node uses, with the same names, so that the real library can replace it on a
full ROS install: a `DiagnosticTask` has a name (`getName()`) and `run(stat)`, which fills a
`DiagnosticStatusWrapper` (`summary(level, message)`, `add(key, value)`) and returns it; an
`Updater` collects tasks (`add(task)`), names each status '<node name>: <task name>' with the
hardware id (`setHardwareID`) and publishes all of them as one `diagnostic_msgs/
DiagnosticArray` on /diagnostics every `period` seconds (`update()`).

The node's rules, one task each (thresholds are node parameters, read at every update):
- `InputTask`, per camera topic and for the joint state: ERROR without a message (or
  without a usable one), WARN for a refused newest message, a stale one (age > the
  max_*_age parameter) or a rate below diag_min_camera_rate, else OK.
- `InferenceTask`: WARN / ERROR when the inference p99 exceeds diag_inference_warn_ms /
  diag_inference_error_ms; carries the engine's mode.
- `ScheduleTask`: WARN / ERROR when the publish jitter p99 exceeds diag_jitter_warn_ms /
  diag_jitter_error_ms, WARN with the last skip reason since the previous update; the
  loop's counters, sensor-to-publish age and garbage-collector pauses.
"""
from __future__ import annotations

import math
from typing import Callable

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

OK, WARN, ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR


def policy_updater(node, sync, stats, gc_pauses, parameter: Callable[[str], object],
                   now: Callable[[], float], mode: Callable[[], dict]) -> Updater:
    """The node's Updater (period: the diagnostics_period parameter) with its tasks: one
    `InputTask` per camera of `sync` (an ObservationSynchronizer) and for its joint state,
    `InferenceTask` and `ScheduleTask` over `stats` (a timing.LoopStats); `now()` -> s."""
    updater = Updater(node, parameter('diagnostics_period'))
    updater.setHardwareID(node.get_name())
    inputs = [('camera', t, 'max_image_age') for t in sync.camera_topics]
    for label, topic, max_age in inputs + [('joint state', sync.joint_state_topic,
                                            'max_state_age')]:
        updater.add(InputTask(label, topic, lambda topic=topic: sync.stats(now())[topic],
                              max_age, parameter))
    updater.add(InferenceTask(stats.inference_ms, mode, parameter))
    updater.add(ScheduleTask(stats, gc_pauses, lambda: sync.frames_decoded, parameter))
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
    """A named check; `run(stat)` fills `stat` (a DiagnosticStatusWrapper) and returns it."""

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
        self._publisher = node.create_publisher(DiagnosticArray, '/diagnostics', 10)
        self._timer = node.create_timer(period, self.update)

    def setHardwareID(self, hardware_id: str) -> None:     # noqa: N802
        self._hardware_id = hardware_id

    def add(self, task: DiagnosticTask) -> None:
        self._tasks.append(task)

    def update(self) -> None:
        """Run every task, in the order added, and publish their statuses."""
        statuses = []
        for task in self._tasks:
            stat = DiagnosticStatusWrapper(level=ERROR, message='No message was set',
                                           hardware_id=self._hardware_id)
            stat = task.run(stat)
            stat.name = f'{self._node.get_name()}: {task.getName()}'
            statuses.append(stat)
        array = DiagnosticArray(status=statuses)
        array.header.stamp = self._node.get_clock().now().to_msg()
        self._publisher.publish(array)

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
    """

    def __init__(self, label: str, topic: str, stats: Callable, max_age_parameter: str,
                 parameter: Callable[[str], object]) -> None:
        super().__init__(f'{label} {topic}')
        self._stats, self._max_age, self._parameter = stats, max_age_parameter, parameter

    def run(self, stat):
        stats = self._stats()
        max_age, min_rate = self._parameter(self._max_age), self._parameter(
            'diag_min_camera_rate')
        if stats.count == 0:
            stat.summary(ERROR, 'no message received')
        elif stats.problem:
            stat.summary(WARN, stats.problem)
        elif stats.age is None:
            stat.summary(ERROR, 'no usable message received')
        elif stats.age > max_age:
            stat.summary(WARN, f'stale: age {stats.age:.3f} s > {max_age:.3f} s')
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
    """Inference time: `inference_ms` a RollingStats (ms); `mode()` -> the engine's mode."""

    def __init__(self, inference_ms, mode: Callable[[], dict],
                 parameter: Callable[[str], object]) -> None:
        super().__init__('inference')
        self._inference_ms, self._mode, self._parameter = inference_ms, mode, parameter

    def run(self, stat):
        summary = self._inference_ms.summary()
        p99 = summary['p99']
        level = _level(p99, self._parameter('diag_inference_warn_ms'),
                       self._parameter('diag_inference_error_ms'))
        stat.summary(level, {OK: 'ok', WARN: f'inference p99 {p99:.0f} ms slow',
                             ERROR: f'inference p99 {p99:.0f} ms too slow'}[level])
        add_summary_ms(stat, 'inference', summary)
        for key, value in self._mode().items():
            stat.add(f'engine_{key}', value)
        return stat


class ScheduleTask(DiagnosticTask):
    """The schedule: `stats` a `timing.LoopStats`, `gc_pauses` a `timing.GcPauses`,
    `frames_decoded()` -> camera frames decoded so far. Clears `stats.last_skip`."""

    def __init__(self, stats, gc_pauses, frames_decoded: Callable[[], int],
                 parameter: Callable[[str], object]) -> None:
        super().__init__('schedule')
        self._stats, self._gc, self._frames = stats, gc_pauses, frames_decoded
        self._parameter = parameter

    def run(self, stat):
        stats = self._stats
        jitter = stats.jitter_ms.summary()
        p99 = jitter['p99']
        level = _level(p99, self._parameter('diag_jitter_warn_ms'),
                       self._parameter('diag_jitter_error_ms'))
        if level != OK:
            stat.summary(level, f'publish jitter p99 {p99:.1f} ms')
        elif stats.last_skip:
            stat.summary(WARN, f'last skip: {stats.last_skip}')
        else:
            stat.summary(OK, 'ok')
        stats.last_skip = ''
        add_summary_ms(stat, 'publish_jitter', jitter)
        add_summary_ms(stat, 'sensor_to_publish_age', stats.age_ms.summary())
        for key in ('chunks_published', 'deadline_misses', 'dropped_actions', 'skipped_ticks',
                    'failed_ticks'):
            stat.add(key, getattr(stats, key))
        stat.add('frames_decoded', self._frames())
        add_summary_ms(stat, 'gc_pause', self._gc.pauses_ms.summary())
        stat.add('gc_pause_max_since_activate_ms', f'{self._gc.max_ms:.3f}')
        stat.add('gc_collections', '/'.join(map(str, self._gc.collections)))
        return stat
