"""OutputWatchdog: OK while chunks flow, WARN after one missed period, ERROR after
error_periods, naming the last skip reason; quiet while deactivated."""
import pytest

from molmobot_policy.timing.watchdog import ERROR, OK, WARN, OutputWatchdog


def test_ok_while_chunks_flow():
    watch = OutputWatchdog(period=0.1)
    watch.start(0.0)
    for k in range(1, 20):
        watch.published(0.1 * k)
        assert watch.check(0.1 * k + 0.05).level == OK


def test_warn_after_one_missed_period_naming_the_skip_reason():
    watch = OutputWatchdog(period=0.1, error_periods=3)
    watch.start(0.0)
    watch.published(1.0)
    watch.skipped('camera /cam3 is stale: age 0.800 s')
    state = watch.check(1.16)
    assert state.level == WARN
    assert 'camera /cam3 is stale' in state.message
    assert state.since_last == pytest.approx(0.16)


def test_a_chunk_a_little_late_is_no_warning():
    # chunks one period apart with a few ms of jitter (the trial's flicker at exactly 1 period)
    watch = OutputWatchdog(period=1.5)
    watch.start(0.0)
    watch.published(1.5)
    assert watch.check(1.5 + 1.5 + 0.004).level == OK


def test_error_after_error_periods_without_a_chunk():
    watch = OutputWatchdog(period=0.1, error_periods=3)
    watch.start(0.0)
    watch.skipped("joint state has non-finite positions for joints ['j2']")
    assert watch.check(0.29).level == WARN
    state = watch.check(0.31)
    assert state.level == ERROR
    assert "['j2']" in state.message and 'no commands' in state.message


def test_a_published_chunk_clears_the_reason_and_the_level():
    watch = OutputWatchdog(period=0.1)
    watch.start(0.0)
    watch.skipped('no /clock')
    assert watch.check(1.0).level == ERROR
    watch.published(1.0)
    state = watch.check(1.05)
    assert state.level == OK and 'clock' not in state.message


def test_not_active_expects_no_output():
    watch = OutputWatchdog(period=0.1)
    assert watch.check(100.0).level == OK
    watch.start(0.0)
    watch.stop()
    assert watch.check(100.0).level == OK


@pytest.mark.parametrize('kwargs', [dict(period=0.0), dict(period=0.1, error_periods=1.0)])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        OutputWatchdog(**kwargs)


def test_waiting_for_the_first_clock_message_warns_at_once_then_errors():
    """Sim time reads 0 before /clock: no period passes on it, so the wall clock counts."""
    watch = OutputWatchdog(period=0.5, error_periods=3)
    state = watch.check_clock(0.0, wall=100.0)
    assert state.level == WARN and 'waiting for /clock' in state.message
    assert watch.check_clock(0.0, wall=101.0).level == WARN
    state = watch.check_clock(0.0, wall=101.6)
    assert state.level == ERROR and 'use_sim_time' in state.message


def test_a_clock_that_advances_leaves_the_state_to_check():
    watch = OutputWatchdog(period=0.5)
    assert watch.check_clock(10.0, wall=100.0) is None
    assert watch.check_clock(10.9, wall=101.0) is None


def test_a_clock_that_stops_goes_warn_then_error_on_the_wall_clock():
    watch = OutputWatchdog(period=0.5, error_periods=3)
    assert watch.check_clock(10.0, wall=100.0) is None
    assert watch.check_clock(10.0, wall=100.4) is None          # within one period
    state = watch.check_clock(10.0, wall=100.7)
    assert state.level == WARN and 'ROS time stopped at 10.000 s' in state.message
    assert watch.check_clock(10.0, wall=101.6).level == ERROR
    assert watch.check_clock(10.1, wall=101.7) is None           # /clock is back


def test_before_the_first_chunk_ok_says_no_chunk_yet_until_a_tick_is_missed():
    """Activated, nothing published: OK (no tick missed yet) but not 'on schedule'; WARN
    after 1.5 periods as ever; the first chunk makes it 'on schedule'."""
    watch = OutputWatchdog(period=1.0)
    watch.start(10.0)
    state = watch.check(10.8)
    assert state.level == OK
    assert state.message == 'active, no chunk yet (activated 0.8 s ago)'
    assert watch.check(11.6).level == WARN
    watch.published(11.7)
    state = watch.check(11.9)
    assert state.level == OK and state.message.startswith('chunks published, the last ')
