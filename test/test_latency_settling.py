"""LatencyEstimator: the first inferences after activation and single slow outliers do not
hold the lead at its cap; a lasting change of latency is followed."""
import pytest

from molmobot_policy.timing.latency import LatencyEstimator


def test_slow_first_inference_after_activation_is_not_counted():
    # the case: initial 1.0 s, cap 1.8 s, one 2.7 s first call, then 12 x 0.23 s
    latency = LatencyEstimator(initial=1.0, max_lead=1.8, settle=1, outlier_factor=3.0)
    latency.restart()
    latency.record(2.7)
    for _ in range(12):
        latency.record(0.23)
    assert latency.estimate() == pytest.approx(0.23)
    assert latency.lead() == pytest.approx(0.23 * 1.2)
    assert latency.ignored == 1


def test_single_spike_above_factor_times_median_is_ignored():
    latency = LatencyEstimator(min_samples=5, outlier_factor=3.0)
    for _ in range(10):
        latency.record(0.05)
    latency.record(0.5)
    assert latency.estimate() == pytest.approx(0.05)
    assert latency.ignored == 1


def test_lasting_slowdown_becomes_the_new_estimate():
    latency = LatencyEstimator(min_samples=5, outlier_factor=3.0)
    for _ in range(10):
        latency.record(0.05)
    for _ in range(5):
        latency.record(0.4)
    assert latency.estimate() == pytest.approx(0.4)


def test_restart_settles_again_on_every_activation():
    latency = LatencyEstimator(min_samples=1, settle=2)
    latency.restart()
    latency.record(9.0)
    latency.record(9.0)
    latency.record(0.1)
    assert latency.estimate() == pytest.approx(0.1)
    latency.restart()
    latency.record(9.0)
    assert latency.estimate() == pytest.approx(0.1)
    assert latency.ignored == 3


def test_measured_once_a_sample_past_settling_is_recorded_after_each_restart():
    latency = LatencyEstimator(min_samples=1, settle=2)
    assert not latency.measured
    latency.restart()
    latency.record(0.1)
    latency.record(0.1, warm=False)
    latency.record(0.1)
    assert not latency.measured             # settling (and warm-up) samples only
    latency.record(0.1)
    assert latency.measured
    latency.restart()
    assert not latency.measured             # the samples before the restart do not count


@pytest.mark.parametrize('kwargs, match', [
    (dict(settle=-1), 'settle must be an int >= 0'),
    (dict(outlier_factor=1.0), 'outlier_factor must be None or a finite number > 1'),
])
def test_bad_settling_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LatencyEstimator(**kwargs)


def test_before_enough_samples_a_loop_slower_than_the_warm_up_raises_the_lead_at_once():
    """The warm-up measured 60 ms, the loop takes 200 ms (frames to decode, a busy machine):
    the first warm sample after settling sets the lead; it does not wait for min_samples
    (every tick until then would be late). A faster sample never lowers it below initial."""
    est = LatencyEstimator(min_samples=5, initial=0.068, settle=2, margin=1.2)
    est.restart()
    est.record(0.2)
    est.record(0.2)                           # settling: ignored
    assert est.lead() == pytest.approx(0.068)
    est.record(0.2)
    assert est.lead() == pytest.approx(0.24)
    fast = LatencyEstimator(min_samples=5, initial=0.068, margin=1.2)
    fast.record(0.01)
    assert fast.lead() == pytest.approx(0.068)
