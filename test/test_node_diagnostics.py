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
    (TopicStats(0.0, 24.2, 5), ERROR, 'stale: age 24.200 s > 0.500 s for 23.7 s'),
    (TopicStats(0.5, 0.1, 5), WARN, 'rate 0.5 Hz < 1.0 Hz'),
    (TopicStats(10.0, 0.1, 5), OK, 'ok')])
def test_an_input_is_rated_by_count_problem_age_and_rate(stats, level, words):
    got_level, message, values = _run(_input(stats))
    assert got_level == level and words in message
    assert values['messages'] == str(stats.count)
    assert values['age_ms'] == ('nan' if stats.age is None else f'{stats.age * 1e3:.1f}')


def test_a_joint_state_status_names_the_joints_that_went_stale_while_others_are_current():
    ages = {'arm_1': 0.02, 'arm_2': 0.03, 'finger': 1.6}
    task = InputTask('joint state', '/joint_states',
                     lambda: TopicStats(100.0, 1.6, 50, joint_ages=ages), 'max_state_age',
                     DEFAULTS.get)
    level, message, _ = _run(task)
    assert level == ERROR and message.startswith("stale for joints ['finger']: age 1.600 s")
    every = {name: 1.6 for name in ages}     # the whole topic stale: no joint singled out
    task = InputTask('joint state', '/joint_states',
                     lambda: TopicStats(0.0, 1.6, 50, joint_ages=every), 'max_state_age',
                     DEFAULTS.get)
    assert _run(task)[1].startswith('stale: age 1.600 s')


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


def _schedule(jitter_ms, last_skip='', startup_ms=()) -> tuple[ScheduleTask, LoopStats]:
    """`startup_ms`: the start-up chunks' jitter, before `jitter_ms` (as the loop adds them)."""
    stats = LoopStats()
    stats.jitter_ms = _stats(list(startup_ms) + list(jitter_ms))
    stats.startup_jitter_ms = _stats(startup_ms)
    stats.chunks_published, stats.deadline_misses, stats.skipped_ticks = 7, 2, 3
    stats.last_skip = last_skip
    return ScheduleTask(stats, GcPauses(), lambda: 56, DEFAULTS.get), stats


@pytest.mark.parametrize('jitter_ms, level', [([1.0] * 5, OK), ([20.0] * 5, WARN),
                                              ([80.0] * 5, ERROR)])
def test_the_schedule_is_rated_by_the_largest_recent_publish_jitter(jitter_ms, level):
    task, _ = _schedule(jitter_ms)
    got_level, message, values = _run(task)
    assert got_level == level and (level == OK or 'publish jitter up to' in message)
    assert (values['chunks_published'], values['deadline_misses'], values['skipped_ticks'],
            values['frames_decoded']) == ('7', '2', '3', '56')
    assert values['gc_collections'] == '0/0/0'


def test_late_chunks_after_activation_stop_rating_the_schedule_once_newer_ones_are_on_time():
    """Three chunks 170 ms late right after activation (cold caches), then on time: ERROR
    while they are among the last LEVEL_CHUNKS, OK after; the values keep the whole window."""
    from molmobot_policy.ros.diagnostics import LEVEL_CHUNKS
    task, stats = _schedule([170.0] * 3 + [1.0] * (LEVEL_CHUNKS - 3))
    assert _run(task)[0] == ERROR
    for _ in range(3):
        stats.jitter_ms.add(1.0)
    level, message, values = _run(task)
    assert level == OK and float(values['publish_jitter_max_ms']) == 170.0


def test_late_start_up_chunks_warn_naming_them_and_are_not_rated_but_stay_in_the_values():
    """Start-up chunks run on a lead estimated before the activation measured an inference:
    97 ms late, then on time, is WARN naming them, never ERROR (trials saw them hold ERROR for
    20 chunks), until LEVEL_CHUNKS chunks followed; their lateness stays in the values."""
    from molmobot_policy.ros.diagnostics import LEVEL_CHUNKS
    task, stats = _schedule([], startup_ms=[96.8, 96.8])
    level, message, values = _run(task)
    assert level == WARN and message.startswith('start-up chunks late: up to 96.8 ms over '
                                                'the first 2')
    assert (values['startup_chunks'], values['startup_publish_jitter_max_ms']) == ('2', '96.80')
    for _ in range(LEVEL_CHUNKS - 1):
        stats.jitter_ms.add(1.0)
    assert _run(task)[0] == WARN
    stats.jitter_ms.add(1.0)
    level, message, values = _run(task)
    assert (level, message) == (OK, 'ok')
    assert float(values['publish_jitter_max_ms']) == 96.8 and values['startup_chunks'] == '2'
    # the figure the level is set by, beside the values that include the start-up chunks
    assert (values['rated_publish_jitter_max_ms'], values['rated_chunks']) == ('1.00', '20')


def test_a_late_chunk_after_the_start_up_chunks_is_rated_without_them():
    """Only the start-up chunks are left out: a chunk after them 60 ms late makes the
    schedule ERROR, the largest over the chunks after start-up alone."""
    task, _ = _schedule([1.0, 60.0], startup_ms=[96.8, 96.8])
    assert _run(task)[:2] == (ERROR, 'publish jitter up to 60.0 ms over the last 2 chunks')


def test_on_time_start_up_chunks_leave_the_schedule_ok():
    task, _ = _schedule([1.0], startup_ms=[2.0, 3.0])
    assert _run(task)[:2] == (OK, 'ok')


def test_the_last_skip_is_reported_until_a_chunk_is_published_again():
    """Cleared after one report, the status flipped OK / WARN every update while every tick
    was skipped (ticks 1.5 s apart, updates 1 s: second fresh-user trial)."""
    task, stats = _schedule([1.0], last_skip='camera /cam3 is stale')
    assert _run(task)[:2] == (WARN, 'last skip: camera /cam3 is stale')
    assert _run(task)[:2] == (WARN, 'last skip: camera /cam3 is stale')   # still skipping
    stats.last_skip = ''            # what the loop does when it publishes a chunk
    assert _run(task)[:2] == (OK, 'ok')


class _Node:
    """What Updater uses of an rclpy node, recorded."""

    def __init__(self) -> None:
        self.published, self.timers, self.destroyed = [], [], []

    namespace = '/'

    def get_name(self):
        return 'policy'

    def get_fully_qualified_name(self):
        return f"{self.namespace.rstrip('/')}/policy"

    def create_publisher(self, msg_type, topic, depth):
        self.topic = (msg_type, topic)
        return self

    def publish(self, msg):
        self.published.append(msg)

    def create_timer(self, period, callback, clock=None):
        self.timer_clock = clock
        self.timers.append((period, callback))
        return 'timer'

    def get_clock(self):
        import rclpy.clock
        return rclpy.clock.Clock()

    def destroy_timer(self, timer):
        self.destroyed.append(timer)

    def destroy_publisher(self, publisher):
        self.destroyed.append('publisher')

    def get_logger(self):
        from types import SimpleNamespace
        if not hasattr(self, 'lines'):
            self.lines = []
        return SimpleNamespace(warning=lambda m, **k: self.lines.append(('WARN', m)),
                               info=lambda m, **k: self.lines.append(('INFO', m)))


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


def test_status_names_carry_the_namespace_so_two_robots_never_share_one():
    """Two nodes in /robot1 and /robot2 published 'molmobot_policy: output' both: a monitor
    keyed by name showed robot1's ERROR and robot2's OK in turn (fourth fresh-user trial)."""
    names = []
    for namespace in ('/robot1', '/robot2'):
        node = _Node()
        node.namespace = namespace
        updater = Updater(node, 0.5)
        updater.add(_Named('output', OK))
        node.timers[0][1]()
        names.append(node.published[0].status[0].name)
    assert names == ['robot1/policy: output', 'robot2/policy: output']


def test_a_logged_task_entering_and_leaving_error_is_logged_once_each():
    """CPU overload put 'schedule' in ERROR on /diagnostics with no log line (fifth
    fresh-user trial): tasks with log_errors log the change both ways, not every update."""
    node = _Node()
    updater = Updater(node, 0.5)
    task = _Named('schedule', OK)
    task.log_errors = True
    quiet = _Named('camera', ERROR)             # not a logged task
    updater.add(task)
    updater.add(quiet)
    for level in (OK, ERROR, ERROR, WARN, OK):
        task.level = level
        node.timers[0][1]()
    assert getattr(node, 'lines', []) == [
        ('WARN', "status 'schedule' is ERROR: schedule says hi"),
        ('INFO', "status 'schedule' is no longer ERROR: schedule says hi")]


# ------------------------------------------------------------------ safety (issue 17)
def test_an_input_problem_lasting_longer_than_its_max_age_is_an_error():
    """An unsupported encoding refused at every tick: WARN at first, ERROR once it lasted
    longer than max_image_age (nothing from that camera can be used)."""
    problem = "newest frame refused: image on '/cam0': unsupported encoding 'yuv422'"
    assert _run(_input(TopicStats(10.0, 0.1, 5, problem, problem_age=0.2)))[0] == WARN
    level, message, _ = _run(_input(TopicStats(10.0, 0.1, 5, problem, problem_age=0.7)))
    assert level == ERROR and "'yuv422'" in message and 'max_image_age' in message


@pytest.mark.parametrize('latency_ms, level, words', [
    ([], WARN, 'serving RANDOM WEIGHTS (preset tiny, seed 0): actions are noise'),
    ([600.0] * 10, WARN,
     'inference p99 600 ms slow; serving RANDOM WEIGHTS (preset tiny, seed 0): actions are noise'),
    ([1200.0] * 10, ERROR, 'inference p99 1200 ms too slow; serving RANDOM WEIGHTS (preset '
                           'tiny, seed 0): actions are noise')])
def test_random_weights_make_the_inference_status_warn_naming_them(latency_ms, level, words):
    """An untrained model is never OK on /diagnostics (a monitor reading only the levels
    must see it); a slow inference keeps its own level and words."""
    task = InferenceTask(_stats(latency_ms), lambda: {}, DEFAULTS.get,
                         served='RANDOM WEIGHTS (preset tiny, seed 0)')
    assert _run(task)[:2] == (level, words)


def test_a_checkpoint_leaves_the_inference_status_ok():
    task = InferenceTask(_stats([100.0] * 10), lambda: {}, DEFAULTS.get,
                         served='checkpoint /ckpt (weights fingerprint 0123456789ab)')
    assert _run(task)[:2] == (OK, 'ok')


def test_inference_reports_what_is_served_and_the_lead_estimate():
    from molmobot_policy.timing import latency_estimator
    latency = latency_estimator(1.0, inference_seconds=0.2)
    task = InferenceTask(_stats([]), lambda: {}, DEFAULTS.get,
                         served='RANDOM WEIGHTS (preset tiny, seed 0)', latency=latency)
    latency.restart()                         # as the loop does at each activation
    values = _run(task)[2]
    assert values['weights'] == 'RANDOM WEIGHTS (preset tiny, seed 0)'
    assert values['lead_ms'] == '240.0' and values['latency_estimate_ms'] == 'nan'
    for _ in range(2 + 5):                   # settle, then min_samples
        latency.record(0.1)
    values = _run(task)[2]
    assert values['latency_estimate_ms'] == '100.0' and values['lead_ms'] == '120.0'
    assert values['latency_samples_ignored'] == '2'


def _output(stats=None, sim_time=False, now=10.0, wall=None, error_periods=3):
    from molmobot_policy.ros.diagnostics import OutputTask
    from molmobot_policy.timing import OutputWatchdog
    watchdog = OutputWatchdog(0.5, error_periods)
    clock = {'now': now, 'wall': 100.0 if wall is None else wall}
    task = OutputTask(watchdog, stats or LoopStats(), lambda: clock['now'], lambda: sim_time,
                      wall=lambda: clock['wall'])
    return task, watchdog, clock


def test_the_output_goes_warn_then_error_while_no_chunk_is_published_naming_the_reason():
    task, watchdog, clock = _output()
    assert task.getName() == 'output'
    watchdog.start(10.0)
    watchdog.published(10.0)
    assert _run(task)[0] == OK
    watchdog.skipped("joint state /joint_states has non-finite positions for joints ['j2']")
    clock['now'] = 10.8                            # > 1.5 periods of 0.5 s: a tick missed
    level, message, _ = _run(task)
    assert level == WARN and "['j2']" in message
    clock['now'] = 11.6
    level, message, values = _run(task)
    assert level == ERROR and "['j2']" in message and 'no commands' in message
    assert values['since_last_chunk_s'] == '1.60'


def test_the_output_names_a_missing_clock_under_sim_time():
    task, watchdog, clock = _output(sim_time=True, now=0.0)
    level, message, _ = _run(task)
    assert level == WARN and 'waiting for /clock' in message
    clock['wall'] += 1.6                           # > 3 periods of 0.5 s
    level, message, _ = _run(task)
    assert level == ERROR and 'waiting for /clock' in message


def test_the_output_reports_the_motion_limits_counts():
    stats = LoopStats()
    stats.velocity_limited, stats.position_clipped = 12, 3
    values = _run(_output(stats)[0])[2]
    assert (values['velocity_limited'], values['position_clipped']) == ('12', '3')


def test_the_updater_runs_on_the_steady_clock_and_stamps_system_time_before_clock():
    """So /diagnostics comes while sim time waits for /clock (a ROS-time timer never fires)."""
    from types import SimpleNamespace

    from rclpy.clock import ClockType
    from rclpy.time import Time
    node = _Node()       # a node on sim time before the first /clock message: ROS time 0
    node.get_clock = lambda: SimpleNamespace(now=lambda: Time(clock_type=ClockType.ROS_TIME))
    updater = Updater(node, 0.5)
    assert node.timer_clock.clock_type == ClockType.STEADY_TIME
    updater.add(_Named('a', OK))
    node.timers[0][1]()
    stamp = node.published[0].header.stamp
    assert stamp.sec > 1_600_000_000                     # system time, not 0


def test_the_idle_output_status_says_why_nothing_is_sent():
    from molmobot_policy.ros.diagnostics import IdleOutputTask
    state = (ERROR, 'configure failed, no commands are sent: checkpoint_path is empty')
    level, message, _ = _run(IdleOutputTask(lambda: state))
    assert level == ERROR and 'checkpoint_path is empty' in message
