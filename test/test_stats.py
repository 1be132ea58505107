"""Specification of RollingStats, the rolling window behind the /diagnostics timing values,
of GcPauses, the garbage-collector pause timer reported beside them, and of
runqueue_wait_s, the thread's wait for a CPU that splits publish jitter by cause."""
import gc
import math

import numpy as np
import pytest

from molmobot_policy.timing import GcPauses, RollingStats, runqueue_wait_s


def filled(values, window=1000):
    stats = RollingStats(window)
    for value in values:
        stats.add(value)
    return stats


def test_statistics_match_numpy_over_the_samples():
    values = np.random.default_rng(0).exponential(0.01, size=500)
    stats = filled(values)
    assert stats.count == 500
    assert stats.p50 == pytest.approx(np.quantile(values, 0.5))
    assert stats.p99 == pytest.approx(np.quantile(values, 0.99))
    assert stats.max == values.max() and stats.min == values.min()
    assert stats.mean == pytest.approx(values.mean())


def test_only_the_last_window_samples_count():
    stats = filled([100.0] * 3 + [1.0, 2.0, 3.0], window=3)
    assert stats.count == 3 and stats.total == 6
    assert stats.max == 3.0 and stats.p50 == 2.0
    np.testing.assert_array_equal(stats.values(), [1.0, 2.0, 3.0])  # oldest first


def test_empty_statistics_are_nan_not_an_error():
    summary = RollingStats().summary()
    assert summary['count'] == 0 and summary['total'] == 0
    for key in ('p50', 'p99', 'max', 'min', 'mean'):
        assert math.isnan(summary[key])


def test_summary_reports_every_statistic_scaled():
    summary = filled([0.001, 0.002, 0.003]).summary(scale=1000.0)
    assert summary['count'] == 3
    assert summary['p50'] == pytest.approx(2.0)
    assert summary['max'] == pytest.approx(3.0)
    assert summary['min'] == pytest.approx(1.0)
    assert summary['mean'] == pytest.approx(2.0)
    assert summary['p99'] == pytest.approx(np.quantile([1.0, 2.0, 3.0], 0.99))


def test_clear_drops_every_sample():
    stats = filled([1.0, 2.0])
    stats.clear()
    assert stats.count == 0 and math.isnan(stats.max)


@pytest.mark.parametrize('sample', [math.nan, math.inf, 'slow', None])
def test_samples_must_be_finite_numbers(sample):
    with pytest.raises(ValueError, match='sample'):
        RollingStats().add(sample)


@pytest.mark.parametrize('window', [0, -5, 2.5, True])
def test_window_must_be_a_positive_int(window):
    with pytest.raises(ValueError, match='window'):
        RollingStats(window)


def test_quantile_must_be_between_0_and_1():
    with pytest.raises(ValueError, match='quantile'):
        filled([1.0]).quantile(1.5)


def test_gc_pauses_times_each_collection_while_installed():
    pauses = GcPauses(window=10)
    clock = iter([1.0, 1.004, 2.0, 2.0005]).__next__    # two collections: 4 ms, 0.5 ms
    pauses._clock = clock
    enabled = gc.isenabled()
    gc.disable()                # no automatic collection may consume the fake clock
    pauses.install()
    try:
        pauses.install()                                 # idempotent: one callback
        assert gc.callbacks.count(pauses) == 1
        gc.collect()                                     # a full collection: generation 2
        gc.collect(0)
    finally:
        pauses.remove()
        if enabled:
            gc.enable()
    assert pauses not in gc.callbacks
    assert pauses.collections == [1, 0, 1]
    assert pauses.pauses_ms.values() == pytest.approx([4.0, 0.5])
    assert pauses.max_ms == pytest.approx(4.0)
    gc.collect()                                         # removed: not counted
    assert sum(pauses.collections) == 2


def test_runqueue_wait_is_the_second_schedstat_field_in_seconds(tmp_path):
    schedstat = tmp_path / 'schedstat'
    schedstat.write_text('298327577 64325 7\n')     # on-CPU ns, run-queue ns, slices
    assert runqueue_wait_s(str(schedstat)) == pytest.approx(64325e-9)


@pytest.mark.parametrize('text', ['', '12\n', 'a b c\n'])
def test_runqueue_wait_is_none_for_an_unreadable_schedstat(tmp_path, text):
    schedstat = tmp_path / 'schedstat'
    schedstat.write_text(text)
    assert runqueue_wait_s(str(schedstat)) is None
    assert runqueue_wait_s(str(tmp_path / 'missing')) is None


def test_thread_account_reads_schedstat_times_and_the_threads_rusage(tmp_path):
    from molmobot_policy.timing.stats import thread_account
    schedstat = tmp_path / 'schedstat'
    schedstat.write_text('2500000 64325 17\n')
    account = thread_account(str(schedstat))
    assert account[:2] == (pytest.approx(2.5e-3), pytest.approx(64325e-9))
    assert all(isinstance(n, int) and n >= 0 for n in account[2:]) and len(account) == 6
    assert thread_account(str(tmp_path / 'missing')) is None


def test_account_difference_names_each_part_of_a_stall():
    from molmobot_policy.timing.stats import account_difference
    before, after = (1.0, 0.5, 10, 2, 100, 0), (1.0021, 0.5004, 11, 2, 103, 1)
    assert account_difference(before, after) == (
        'on_cpu_ms=2.100 runqueue_ms=0.400 csw_voluntary=1 csw_involuntary=0 '
        'faults_minor=3 faults_major=1')
    assert account_difference(None, after) == '' and account_difference(before, None) == ''
