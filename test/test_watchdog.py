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
    state = watch.check(1.15)
    assert state.level == WARN
    assert 'camera /cam3 is stale' in state.message
    assert state.since_last == pytest.approx(0.15)


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
