"""ros/diagnostics.py: the node's /diagnostics rules as diagnostic_updater-shaped tasks, and
the Updater that publishes them as one DiagnosticArray. No ROS graph: plain statistics in, a
recording stand-in for the node."""
from __future__ import annotations

import math

import pytest

pytest.importorskip('rclpy')

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from rclpy.serialization import deserialize_message, serialize_message  # noqa: E402

from molmobot_policy.ros.diagnostics import (DiagnosticStatusWrapper,  # noqa: E402
                                             DiagnosticTask, InferenceTask, InputTask,
                                             ScheduleTask, Updater)
from molmobot_policy.ros.parameters import PARAMETERS  # noqa: E402
from molmobot_policy.ros.synchronizer import TopicStats  # noqa: E402
from molmobot_policy.timing import GcPauses, LoopStats, RollingStats  # noqa: E402

OK, WARN, ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR
DEFAULTS = {name: default for name, (default, _) in PARAMETERS.items()}


def _run(task) -> tuple:
    stat = task.run(DiagnosticStatusWrapper())
    return stat.level, stat.message, {kv.key: kv.value for kv in stat.values}


def _input(stats: TopicStats, **parameters):
    return InputTask('camera', '/cam0', lambda: stats, 'max_image_age',
                     {**DEFAULTS, **parameters}.get)


@pytest.mark.parametrize('stats, level, words', [
    (TopicStats(0.0, None, 0), ERROR, 'no message received'),
    (TopicStats(10.0, 0.1, 5, 'newest frame refused: bad step'), WARN, 'bad step'),
    (TopicStats(10.0, None, 5), ERROR, 'no usable message'),
    (TopicStats(10.0, 0.75, 5), WARN, 'stale: age 0.750 s > 0.500 s'),
    (TopicStats(0.5, 0.1, 5), WARN, 'rate 0.5 Hz < 1.0 Hz'),
    (TopicStats(10.0, 0.1, 5), OK, 'ok')])
def test_an_input_is_rated_by_count_problem_age_and_rate(stats, level, words):
    got_level, message, values = _run(_input(stats))
    assert got_level == level and words in message
    assert values['messages'] == str(stats.count)
    assert values['age_ms'] == ('nan' if stats.age is None else f'{stats.age * 1e3:.1f}')


def test_input_thresholds_are_read_at_every_update():
    parameters = dict(DEFAULTS)
    task = InputTask('camera', '/cam0', lambda: TopicStats(10.0, 0.75, 5), 'max_image_age',
                     parameters.get)
    assert _run(task)[0] == WARN
    parameters['max_image_age'] = 1.0             # `ros2 param set` at run time
    assert _run(task)[0] == OK


def _stats(values) -> RollingStats:
    stats = RollingStats(100)
    for value in values:
        stats.add(value)
    return stats


@pytest.mark.parametrize('latency_ms, level, words', [
    ([], OK, 'ok'), ([100.0] * 10, OK, 'ok'), ([600.0] * 10, WARN, 'inference p99 600 ms slow'),
    ([1200.0] * 10, ERROR, 'inference p99 1200 ms too slow')])
def test_inference_is_rated_by_its_p99(latency_ms, level, words):
    task = InferenceTask(_stats(latency_ms), lambda: {'model': 'tiny'}, DEFAULTS.get)
    got_level, message, values = _run(task)
    assert (got_level, message) == (level, words)
    assert values['engine_model'] == 'tiny'
    assert math.isnan(float(values['inference_p99_ms'])) == (not latency_ms)


def _schedule(jitter_ms, last_skip='') -> tuple[ScheduleTask, LoopStats]:
    stats = LoopStats()
    stats.jitter_ms = _stats(jitter_ms)
    stats.chunks_published, stats.deadline_misses, stats.skipped_ticks = 7, 2, 3
    stats.last_skip = last_skip
    return ScheduleTask(stats, GcPauses(), lambda: 56, DEFAULTS.get), stats


@pytest.mark.parametrize('jitter_ms, level', [([1.0] * 5, OK), ([20.0] * 5, WARN),
                                              ([80.0] * 5, ERROR)])
def test_the_schedule_is_rated_by_the_publish_jitter_p99(jitter_ms, level):
    task, _ = _schedule(jitter_ms)
    got_level, message, values = _run(task)
    assert got_level == level and (level == OK or 'publish jitter p99' in message)
    assert (values['chunks_published'], values['deadline_misses'], values['skipped_ticks'],
            values['frames_decoded']) == ('7', '2', '3', '56')
    assert values['gc_collections'] == '0/0/0'


def test_the_last_skip_is_reported_once():
    task, stats = _schedule([1.0], last_skip='camera /cam3 is stale')
    assert _run(task)[:2] == (WARN, 'last skip: camera /cam3 is stale')
    assert stats.last_skip == '' and _run(task)[:2] == (OK, 'ok')


class _Node:
    """What Updater uses of an rclpy node, recorded."""

    def __init__(self) -> None:
        self.published, self.timers, self.destroyed = [], [], []

    def get_name(self):
        return 'policy'

    def create_publisher(self, msg_type, topic, depth):
        self.topic = (msg_type, topic)
        return self

    def publish(self, msg):
        self.published.append(msg)

    def create_timer(self, period, callback):
        self.timers.append((period, callback))
        return 'timer'

    def get_clock(self):
        import rclpy.clock
        return rclpy.clock.Clock()

    def destroy_timer(self, timer):
        self.destroyed.append(timer)

    def destroy_publisher(self, publisher):
        self.destroyed.append('publisher')


class _Named(DiagnosticTask):
    def __init__(self, name, level=None):
        super().__init__(name)
        self.level = level

    def run(self, stat):
        if self.level is not None:
            stat.summary(self.level, f'{self.name} says hi')
            stat.add('x', 1)
        return stat


def test_the_updater_publishes_every_task_as_one_array_on_its_timer():
    node = _Node()
    updater = Updater(node, 0.5)
    updater.setHardwareID('arm_1')
    for task in (_Named('a', OK), _Named('b', WARN), _Named('silent')):
        updater.add(task)
    assert node.topic == (DiagnosticArray, '/diagnostics') and node.timers[0][0] == 0.5
    node.timers[0][1]()                                   # the timer fires
    (array,) = node.published
    assert [(s.name, s.level, s.message, s.hardware_id) for s in array.status] == [
        ('policy: a', OK, 'a says hi', 'arm_1'), ('policy: b', WARN, 'b says hi', 'arm_1'),
        ('policy: silent', ERROR, 'No message was set', 'arm_1')]
    round_trip = deserialize_message(serialize_message(array), DiagnosticArray)
    assert [kv.key for kv in round_trip.status[0].values] == ['x']
    updater.destroy()
    assert node.destroyed == ['timer', 'publisher']
