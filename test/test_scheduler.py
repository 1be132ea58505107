"""Specification of the tick schedule, the latency lead and the observation gate.

All times come from a fake clock (plain floats), as the node passes ROS time."""
import math

import pytest

from molmobot_policy.timing import DeadlineScheduler, LatencyEstimator, ObservationGate, Tick


class FakeClock:
    """A clock that only moves when told to; `sleep_until` jumps to the target."""

    def __init__(self, now):
        self.now = now
        self.sleeps = []

    def __call__(self):
        return self.now

    def sleep_until(self, t):
        self.sleeps.append(t)
        self.now = max(self.now, t)
        return True


def run_tick(scheduler, clock, inference):
    """One worker iteration: next tick, sleep to start_at, infer, sleep to the deadline."""
    tick = scheduler.next_tick(clock())
    scheduler.wait(tick, clock.sleep_until)
    clock.now += inference
    scheduler.wait(tick, clock.sleep_until, target='deadline')
    return tick


# DeadlineScheduler ------------------------------------------------------------------------

def test_deadlines_do_not_drift_over_100000_ticks():
    # adding 0.1 to the previous deadline would be ~2e-8 s off by the end
    t0, period = 1234.5678, 0.1
    scheduler = DeadlineScheduler(period, t0, lead=0.03)
    clock = FakeClock(t0 - 1.0)
    for k in range(100_000):
        tick = run_tick(scheduler, clock, inference=0.02)
        assert tick.index == k
        assert abs(tick.deadline - (t0 + k * period)) < 1e-9
    assert scheduler.missed == 0


def test_start_at_is_deadline_minus_lead():
    scheduler = DeadlineScheduler(0.1, t0=5.0, lead=0.04)
    tick = scheduler.next_tick(0.0)
    assert tick == Tick(index=0, deadline=5.0, start_at=5.0 - 0.04, skipped=0)


def test_set_lead_moves_start_at_but_not_the_deadline():
    scheduler = DeadlineScheduler(0.1, t0=5.0, lead=0.01)
    scheduler.next_tick(0.0)
    scheduler.set_lead(0.05)
    tick = scheduler.next_tick(4.9)
    assert tick.deadline == pytest.approx(5.1, abs=1e-12)
    assert tick.start_at == pytest.approx(5.05, abs=1e-12)
    assert scheduler.lead == 0.05


def test_slow_inference_of_two_periods_is_exactly_one_reported_miss():
    period, t0 = 0.125, 10.0  # binary fractions: the arithmetic below is exact
    misses = []
    scheduler = DeadlineScheduler(period, t0, lead=0.0625, on_miss=misses.append)
    clock = FakeClock(t0 - 1.0)
    for _ in range(3):
        run_tick(scheduler, clock, inference=0.03125)
    slow = scheduler.next_tick(clock())
    scheduler.wait(slow, clock.sleep_until)
    clock.now += 2 * period  # the slow inference
    resumed = scheduler.next_tick(clock())
    assert slow.index == 3
    assert resumed.index == 5 and resumed.skipped == 1
    assert scheduler.missed == 1
    assert scheduler.last_missed_count == 1
    assert len(misses) == 1 and misses[0].first_index == 4 and misses[0].count == 1


def test_schedule_recovers_on_the_grid_without_a_burst_after_a_slow_inference():
    period, t0 = 0.125, 10.0
    scheduler = DeadlineScheduler(period, t0, lead=0.0625)
    clock = FakeClock(t0 - 1.0)
    inferences = [0.03125] * 3 + [2 * period] + [0.03125] * 20
    ticks = [run_tick(scheduler, clock, inference) for inference in inferences]
    deadlines = [tick.deadline for tick in ticks]
    gaps = [b - a for a, b in zip(deadlines, deadlines[1:])]
    assert min(gaps) >= period  # never two ticks back to back to catch up
    assert all(tick.deadline == t0 + tick.index * period for tick in ticks)  # on the grid
    assert scheduler.missed == 1
    assert scheduler.last_missed_count == 0  # the latest call skipped nothing


def test_a_start_time_equal_to_now_has_not_passed():
    scheduler = DeadlineScheduler(0.25, t0=1.0)
    scheduler.next_tick(0.0)
    tick = scheduler.next_tick(1.25)
    assert tick.index == 1 and scheduler.missed == 0


def test_ticks_before_the_first_call_are_not_counted_as_missed():
    scheduler = DeadlineScheduler(0.25, t0=1.0, lead=0.125)
    tick = scheduler.next_tick(3.0)  # e.g. a long warm-up after construction
    assert tick.index == 9 and tick.start_at >= 3.0  # first tick that can start on time
    assert scheduler.missed == 0


def test_each_tick_index_is_issued_once_and_increases():
    scheduler = DeadlineScheduler(0.1, t0=0.0)
    indices = [scheduler.next_tick(-1.0).index for _ in range(5)]
    assert indices == [0, 1, 2, 3, 4]


def test_wait_sleeps_until_start_at_with_the_injected_sleep():
    scheduler = DeadlineScheduler(0.1, t0=2.0, lead=0.02)
    clock = FakeClock(1.0)
    tick = scheduler.next_tick(clock())
    assert scheduler.wait(tick, clock.sleep_until) is True
    assert clock.sleeps == [tick.start_at]


def test_wait_reports_an_interrupted_sleep():
    scheduler = DeadlineScheduler(0.1, t0=2.0)
    tick = scheduler.next_tick(1.0)
    assert scheduler.wait(tick, lambda t: False) is False


def test_wait_sleeps_again_after_an_early_wake_up():
    scheduler = DeadlineScheduler(0.1, t0=2.0)
    clock = FakeClock(1.0)
    wake_ups = iter([1.5, 1.9, 2.0])

    def sleep_until(t):
        clock.now = next(wake_ups)

    tick = scheduler.next_tick(clock())
    assert scheduler.wait(tick, sleep_until, now=clock) is True
    assert clock() == tick.start_at


def test_reset_restarts_the_grid_and_the_counters():
    scheduler = DeadlineScheduler(0.125, t0=0.0)
    scheduler.next_tick(0.0)
    scheduler.next_tick(1.0)
    assert scheduler.missed == 7        # ticks 1..7 start before 1.0; tick 8 at 1.0 runs
    scheduler.reset(t0=100.0)
    tick = scheduler.next_tick(50.0)
    assert tick.index == 0 and tick.deadline == 100.0 and scheduler.missed == 0


@pytest.mark.parametrize('period', [0.0, -0.1, math.nan, math.inf, 'fast'])
def test_period_must_be_positive_and_finite(period):
    with pytest.raises(ValueError, match='period'):
        DeadlineScheduler(period, t0=0.0)


@pytest.mark.parametrize('lead', [-0.01, math.nan])
def test_lead_must_be_non_negative_and_finite(lead):
    scheduler = DeadlineScheduler(0.1, t0=0.0)
    with pytest.raises(ValueError, match='lead'):
        scheduler.set_lead(lead)


def test_now_must_be_finite():
    with pytest.raises(ValueError, match='now'):
        DeadlineScheduler(0.1, t0=0.0).next_tick(math.nan)


# LatencyEstimator ------------------------------------------------------------------------

def test_lead_is_initial_until_min_samples():
    estimator = LatencyEstimator(min_samples=5, initial=0.2)
    for _ in range(4):
        estimator.record(0.05)
    assert estimator.lead() == 0.2


def test_lead_is_quantile_of_warm_samples_times_margin():
    estimator = LatencyEstimator(window=10, quantile=0.5, margin=1.5, min_samples=3)
    for seconds in [0.01, 0.02, 0.03, 0.04, 0.05]:
        estimator.record(seconds)
    assert estimator.lead() == pytest.approx(0.03 * 1.5)


def test_non_warm_samples_are_ignored():
    estimator = LatencyEstimator(window=10, quantile=1.0, margin=1.0, min_samples=1)
    estimator.record(5.0, warm=False)  # compilation
    estimator.record(0.04)
    assert estimator.lead() == pytest.approx(0.04)
    assert estimator.count == 1 and estimator.ignored == 1


def test_lead_follows_only_the_recent_window():
    estimator = LatencyEstimator(window=5, quantile=1.0, margin=1.0, min_samples=1)
    estimator.record(1.0)
    for _ in range(5):
        estimator.record(0.02)
    assert estimator.lead() == pytest.approx(0.02)


def test_lead_is_capped_at_max_lead():
    estimator = LatencyEstimator(quantile=1.0, margin=1.0, min_samples=1, max_lead=0.045)
    estimator.record(0.2)
    assert estimator.lead() == 0.045


@pytest.mark.parametrize('seconds', [-0.001, math.nan, math.inf])
def test_latency_sample_must_be_finite_and_non_negative(seconds):
    with pytest.raises(ValueError, match='latency'):
        LatencyEstimator().record(seconds)


@pytest.mark.parametrize('kwargs', [{'window': 0}, {'quantile': 0.0}, {'quantile': 1.5},
                                    {'margin': 0.0}, {'min_samples': 0},
                                    {'window': 3, 'min_samples': 4}, {'initial': -1.0},
                                    {'max_lead': 0.0}])
def test_estimator_arguments_are_validated(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        LatencyEstimator(**kwargs)


# ObservationGate -------------------------------------------------------------------------

def test_first_observation_is_accepted():
    assert ObservationGate().accept(stamp=3.0, seq=1) is True


def test_observation_older_than_the_last_used_is_never_used_again():
    gate = ObservationGate()
    assert gate.accept(stamp=2.0, seq=2)
    assert gate.accept(stamp=1.5, seq=1) is False
    assert gate.accept(stamp=1.5, seq=1) is False
    assert gate.last_stamp == 2.0 and gate.refused == 2


def test_the_same_observation_is_not_used_twice():
    gate = ObservationGate()
    assert gate.accept(stamp=2.0, seq=7)
    assert gate.accept(stamp=2.0, seq=7) is False


def test_newer_observation_is_accepted_and_becomes_the_reference():
    gate = ObservationGate()
    gate.accept(stamp=2.0, seq=1)
    assert gate.accept(stamp=2.1, seq=2)
    assert (gate.last_stamp, gate.last_seq) == (2.1, 2)


def test_equal_stamp_with_larger_seq_is_newer():
    gate = ObservationGate()
    gate.accept(stamp=2.0, seq=1)
    assert gate.accept(stamp=2.0, seq=2)


def test_is_newer_does_not_record_anything():
    gate = ObservationGate()
    assert gate.is_newer(1.0, 1)
    assert gate.last_stamp is None and gate.accept(1.0, 1)


def test_observation_objects_are_gated_by_stamp_and_seq():
    from molmobot_policy.types import Observation
    gate = ObservationGate()
    newer = Observation(images=(), state=None, instruction='', stamp=2.0, seq=2)
    older = Observation(images=(), state=None, instruction='', stamp=1.0, seq=1)
    assert gate.accept_observation(newer)
    assert gate.accept_observation(older) is False


def test_gate_stamp_must_be_finite():
    with pytest.raises(ValueError, match='stamp'):
        ObservationGate().accept(math.nan)
