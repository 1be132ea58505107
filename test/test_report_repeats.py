"""A warning that repeats (a dead camera's skip line) is logged at most every WARN_THROTTLE_S,
and after BACKOFF_AFTER_S of the same text every REPEAT_S, saying how long it has lasted
(ros/report.py RepeatedLines; seventh fresh-user trial: ~30 000 lines a day)."""
from types import SimpleNamespace

import pytest

pytest.importorskip('rclpy')
from molmobot_policy.ros.report import (BACKOFF_AFTER_S, REPEAT_S,  # noqa: E402
                                        WARN_THROTTLE_S, LoopReport, RepeatedLines)


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _logged_times(lines: RepeatedLines, clock: _Clock, text, seconds: float, step=0.5):
    """Offer `text(t)` every `step` s for `seconds`; the times (s from the start) it was due."""
    start, due = clock.t, []
    while clock.t - start < seconds:
        if lines.due('skip', text(clock.t - start)) is not None:
            due.append(clock.t - start)
        clock.t += step
    return due


def test_a_repeating_text_backs_off_after_the_backoff_time():
    clock = _Clock()
    lines = RepeatedLines(clock)
    due = _logged_times(lines, clock, lambda t: f'camera /cam2 is stale: age {t + 1:.3f} s',
                        BACKOFF_AFTER_S + 3 * REPEAT_S)
    early = [t for t in due if t < BACKOFF_AFTER_S]
    late = [t for t in due if t >= BACKOFF_AFTER_S]
    assert len(early) == pytest.approx(BACKOFF_AFTER_S / WARN_THROTTLE_S, abs=1)
    assert len(late) == 3                    # every REPEAT_S, not every WARN_THROTTLE_S


def test_the_backed_off_line_says_how_long_it_lasted_and_a_new_text_starts_over():
    clock = _Clock()
    lines = RepeatedLines(clock)
    assert lines.due('skip', 'camera /cam2 has no image yet') == ''
    clock.t += BACKOFF_AFTER_S + 1
    suffix = lines.due('skip', 'camera /cam2 has no image yet')
    assert suffix.startswith(f' (unchanged for {BACKOFF_AFTER_S + 1:.0f} s, 2 times')
    clock.t += WARN_THROTTLE_S
    assert lines.due('skip', 'joint state /joint_states has no message yet') == ''
    assert lines.due('/cam1', 'newest frame refused') == ''          # another key: its own


def test_the_node_skip_line_is_backed_off():
    logged = []
    node = SimpleNamespace(context=SimpleNamespace(ok=lambda: True), get_name=lambda: 'p',
                           get_logger=lambda: SimpleNamespace(
                               warning=lambda message, **kw: logged.append(message)))
    report = LoopReport(node, chunk_info=None, sync=None,
                        watchdog=SimpleNamespace(skipped=lambda reason: None), now=lambda: 0.0)
    clock = _Clock()
    report._repeats = RepeatedLines(clock)
    for tick in range(200):                     # 200 s of one skip a second
        report.skipped(tick, 'camera /cam2 has no image yet')
        clock.t += 1.0
    assert len(logged) < BACKOFF_AFTER_S / WARN_THROTTLE_S + 200 / REPEAT_S + 2
    assert 'unchanged for' in logged[-1]


def test_skips_before_the_first_chunk_are_info_for_the_startup_grace(monkeypatch):
    """Eighth fresh-user trial: every activation warned 'has no image yet' while its camera
    receiver and DDS discovery started."""
    import molmobot_policy.ros.report as report_module
    infos, warnings = [], []
    logger = SimpleNamespace(info=lambda m, **kw: infos.append(m),
                             warning=lambda m, **kw: warnings.append(m))
    node = SimpleNamespace(context=SimpleNamespace(ok=lambda: True), get_name=lambda: 'p',
                           get_logger=lambda: logger)
    report = LoopReport(node, chunk_info=None, sync=None,
                        watchdog=SimpleNamespace(skipped=lambda reason: None,
                                                 start=lambda now: None), now=lambda: 0.0)
    clock = _Clock()
    monkeypatch.setattr(report_module.time, 'monotonic', clock)
    report._repeats = RepeatedLines(clock)
    report.started(0.0)
    report.skipped(0, 'camera /cam0 has no image yet')
    assert infos == ['waiting for the first inputs (tick 0): camera /cam0 has no image yet']
    assert warnings == []
    clock.t += report_module.STARTUP_GRACE_S
    report.skipped(1, 'camera /cam0 has no image yet')
    assert warnings == ['skipping tick 1: camera /cam0 has no image yet']
    clock.t += report_module.WARN_THROTTLE_S
    report.started(0.0)                  # a problem that is no waiting: warned at once
    report.skipped(2, "parameter 'instruction' is empty: set it to the task text")
    assert warnings[-1] == "skipping tick 2: parameter 'instruction' is empty: set it to the task text"


def test_joints_that_do_not_follow_the_chunks_are_warned_by_name():
    """An arm whose controller does not run the chunks is anchored at its measurement
    (timing.motion.anchor_at_publish); the log names its joints and what to check."""
    import numpy as np

    from molmobot_policy.timing.reports import ChunkReport
    warnings = []
    logger = SimpleNamespace(info=lambda m, **kw: None,
                             warning=lambda m, **kw: warnings.append(m))
    node = SimpleNamespace(
        context=SimpleNamespace(ok=lambda: True), get_name=lambda: 'p',
        get_fully_qualified_name=lambda: '/p', get_logger=lambda: logger,
        chunks_published_total=0,
        get_parameter=lambda name: SimpleNamespace(value=['shoulder', 'elbow']))
    report = LoopReport(node, chunk_info=SimpleNamespace(publish=lambda message: None),
                        sync=SimpleNamespace(last_build_decoded=0, last_build_decode_s=0.0),
                        watchdog=SimpleNamespace(published=lambda now: None),
                        now=lambda: 0.0)

    def chunk(not_following):
        return ChunkReport(tick=1, observation_seq=1, observation_stamp=0.0,
                           observation_age_ms=1.0, inference_ms=1.0, publish_jitter_ms=0.0,
                           positions=np.zeros((2, 2)), dropped=0, count=1,
                           not_following=not_following)
    clock = _Clock()
    report._repeats = RepeatedLines(clock)
    report.published(chunk(()))
    assert warnings == []
    report.published(chunk((1,)))
    assert len(warnings) == 1 and "['elbow'] do not follow the published chunks" in warnings[0]
    assert 'tracking_tolerance' in warnings[0]


def test_the_not_following_warning_backs_off_whichever_joints_it_names():
    """A fresh-user trial with an arm that never moved: the line came every other chunk for
    as long as it ran, naming other joints each time."""
    import numpy as np

    from molmobot_policy.timing.reports import ChunkReport
    warnings = []
    node = SimpleNamespace(
        context=SimpleNamespace(ok=lambda: True), get_name=lambda: 'p',
        get_fully_qualified_name=lambda: '/p', chunks_published_total=0,
        get_logger=lambda: SimpleNamespace(info=lambda m, **kw: None,
                                           warning=lambda m, **kw: warnings.append(m)),
        get_parameter=lambda name: SimpleNamespace(value=['shoulder', 'elbow']))
    report = LoopReport(node, chunk_info=SimpleNamespace(publish=lambda message: None),
                        sync=SimpleNamespace(last_build_decoded=0, last_build_decode_s=0.0),
                        watchdog=SimpleNamespace(published=lambda now: None),
                        now=lambda: 0.0)
    clock = _Clock()
    report._repeats = RepeatedLines(clock)

    def chunk(count, not_following):
        return ChunkReport(tick=count, observation_seq=count, observation_stamp=0.0,
                           observation_age_ms=1.0, inference_ms=1.0, publish_jitter_ms=0.0,
                           positions=np.zeros((2, 2)), dropped=0, count=count,
                           not_following=not_following)
    for count in range(134):                    # 200 s of a chunk every 1.5 s
        report.published(chunk(count, ((0,), (1,), (0, 1))[count % 3]))
        clock.t += 1.5
    assert len(warnings) < BACKOFF_AFTER_S / WARN_THROTTLE_S + 200 / REPEAT_S + 2
    assert 'unchanged for' in warnings[-1]
    report.published(chunk(134, ()))            # the arm follows again ...
    clock.t += 1.5
    report.published(chunk(135, (0,)))          # ... and stops again: told anew
    assert warnings[-1].startswith('chunk 135:') and 'unchanged' not in warnings[-1]
