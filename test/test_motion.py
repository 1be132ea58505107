"""MotionLimiter: published points continuous with the measured joint state (no jump at the
start or after a gap), per-joint velocity and position limits, counts of what was limited."""
import numpy as np
import pytest

from molmobot_policy.timing.motion import MotionLimiter

PERIOD = 0.1


def _times(n, start=10.0):
    return start + PERIOD * np.arange(n)


def test_first_point_due_at_once_stays_at_the_measured_state():
    limiter = MotionLimiter(max_velocity=1.0)
    plan = np.full((16, 2), 2.0)                 # 2 rad away from the arm
    out = limiter.limit(_times(16), plan, measured=np.zeros(2), publish_time=10.0)
    np.testing.assert_allclose(out.positions[0], [0.0, 0.0])
    np.testing.assert_allclose(out.positions[1], [0.1, 0.1])   # then 1 rad/s * 0.1 s
    np.testing.assert_allclose(out.start_offset, [2.0, 2.0])


def test_first_point_allowance_is_the_time_from_publish_to_that_point():
    # the fresh-user trial's case: first point 3 ms after the publish, the measurement 1.3 s
    # old and the plan 1.98 rad away: the controller would have had 3 ms for it
    limiter = MotionLimiter(max_velocity=1.5)
    out = limiter.limit(_times(4), np.full((4, 1), 1.98), measured=np.zeros(1),
                        publish_time=10.0 - 0.003)
    assert abs(out.positions[0, 0]) <= 1.5 * 0.003 + 1e-12


def test_later_points_ramp_at_the_limit_and_converge_to_the_plan():
    limiter = MotionLimiter(max_velocity=1.0)
    plan = np.full((30, 1), 2.0)
    out = limiter.limit(_times(30), plan, measured=np.zeros(1), publish_time=10.0)
    steps = np.diff(np.concatenate([[0.0], out.positions[:, 0]]))
    assert np.all(steps <= 1.0 * PERIOD + 1e-12)
    np.testing.assert_allclose(out.positions[:21, 0], 0.1 * np.arange(21))
    np.testing.assert_allclose(out.positions[20:, 0], 2.0)      # reached, then the plan itself
    assert out.velocity_limited == 20


def test_plan_within_reach_passes_unchanged():
    limiter = MotionLimiter(max_velocity=1.0)
    plan = 0.05 * np.arange(8)[:, None] * np.ones((1, 3))
    out = limiter.limit(_times(8), plan, measured=np.zeros(3), publish_time=10.0)
    np.testing.assert_array_equal(out.positions, plan)
    assert out.velocity_limited == 0 and out.position_clipped == 0


def test_first_point_later_than_the_publish_may_move_that_much_further():
    limiter = MotionLimiter(max_velocity=1.0)
    out = limiter.limit(_times(4), np.full((4, 1), 2.0), measured=np.zeros(1),
                        publish_time=9.7)   # sent 0.3 s before the first point is due
    np.testing.assert_allclose(out.positions[0], [0.3])


def test_per_joint_velocity_limits():
    limiter = MotionLimiter(max_velocity=[1.0, 2.0, np.inf])
    out = limiter.limit(_times(1), np.full((1, 3), 1.0), measured=np.zeros(3), publish_time=9.9)
    np.testing.assert_allclose(out.positions[0], [0.1, 0.2, 1.0])


def test_unmeasured_joint_is_not_anchored_but_rate_limited_within_the_chunk():
    limiter = MotionLimiter(max_velocity=1.0)
    plan = np.array([[5.0], [6.0]])
    out = limiter.limit(_times(2), plan, measured=np.array([np.nan]), publish_time=10.0)
    np.testing.assert_allclose(out.positions[:, 0], [5.0, 5.1])


def test_position_limits_clip_every_point_and_are_counted():
    limiter = MotionLimiter(max_velocity=np.inf, position_min=[-1.0, -np.inf],
                            position_max=[1.0, 0.5])
    plan = np.array([[2.0, 1.0], [0.0, 0.0], [-3.0, 0.7]])
    out = limiter.limit(_times(3), plan, measured=np.zeros(2), publish_time=10.0)
    np.testing.assert_allclose(out.positions, [[1.0, 0.5], [0.0, 0.0], [-1.0, 0.5]])
    assert out.position_clipped == 4


def test_arm_outside_position_limits_is_ramped_back_not_stepped():
    limiter = MotionLimiter(max_velocity=1.0, position_max=1.0)
    out = limiter.limit(_times(5), np.full((5, 1), 0.0), measured=np.array([1.5]),
                        publish_time=10.0)
    np.testing.assert_allclose(out.positions[:, 0], [1.5, 1.4, 1.3, 1.2, 1.1])
    assert out.outside_limits == (0,)            # named, for the node's warning


def test_only_joints_measured_outside_their_limits_are_reported_outside():
    limiter = MotionLimiter(max_velocity=1.0, position_min=[-1.0, -1.0, -1.0],
                            position_max=[1.0, 1.0, 1.0])
    out = limiter.limit(_times(2), np.zeros((2, 3)), measured=np.array([0.5, -1.2, np.nan]),
                        publish_time=10.0)
    assert out.outside_limits == (1,)            # in range, below min, not measured
    assert MotionLimiter(max_velocity=1.0).limit(
        _times(2), np.zeros((2, 1)), measured=np.array([9.0]), publish_time=10.0
    ).outside_limits == ()                        # no limits: nothing is outside


def test_max_step_bounds_the_ramp_toward_the_arm_and_every_step():
    # a fresh-user trial: max_step 0.1 was applied by the stitcher, then this limiter's ramp
    # at max_velocity x control_period (0.3 rad) took larger steps after an activation
    limiter = MotionLimiter(max_velocity=1.5, max_step=0.1)
    times = 10.0 + 0.2 * np.arange(6)
    plan = np.array([[0.0], [0.3], [0.6], [0.9], [1.0], [1.0]])
    out = limiter.limit(times, plan, measured=np.array([-0.5]), publish_time=9.0)
    steps = np.abs(np.diff(np.concatenate([[-0.5], out.positions[:, 0]])))
    assert steps.max() <= 0.1 + 1e-12, steps
    assert out.positions[-1, 0] == pytest.approx(0.1)       # six steps of 0.1 from -0.5
    assert out.velocity_limited == 6


def test_max_step_per_joint_and_inf_for_none():
    limiter = MotionLimiter(max_velocity=10.0, max_step=[0.1, np.inf])
    out = limiter.limit(_times(2), np.array([[0.0, 0.0], [1.0, 1.0]]), measured=np.zeros(2),
                        publish_time=9.0)
    assert out.positions[1].tolist() == pytest.approx([0.1, 1.0])


def test_empty_chunk_passes_through():
    limiter = MotionLimiter(max_velocity=1.0)
    out = limiter.limit(np.zeros(0), np.zeros((0, 2)), measured=np.zeros(2), publish_time=1.0)
    assert out.positions.shape == (0, 2)


@pytest.mark.parametrize('kwargs, match', [
    (dict(max_velocity=0.0), 'max_velocity must be > 0'),
    (dict(max_velocity=[1.0, -1.0]), 'max_velocity must be > 0'),
    (dict(max_velocity=[[1.0]]), 'max_velocity must be a float or a 1-D list'),
    (dict(position_min=[1.0], position_max=[0.0]), 'position_min must be <= position_max'),
    (dict(position_min=[np.nan]), 'position_min must not contain nan'),
    (dict(max_step=[0.1, 0.0]), 'max_step must be > 0'),
    (dict(tracking_tolerance=[0.1, -1.0]), 'tracking_tolerance must be > 0'),
])
def test_bad_limits_are_refused_naming_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MotionLimiter(**kwargs)


def test_limit_length_must_match_the_commanded_joints():
    limiter = MotionLimiter(max_velocity=[1.0, 1.0])
    with pytest.raises(ValueError, match='max_velocity has 2 values but the chunk commands 3'):
        limiter.limit(_times(1), np.zeros((1, 3)), measured=np.zeros(3), publish_time=10.0)


def test_the_tracking_tolerance_defaults_to_the_velocity_limit_over_its_window():
    from molmobot_policy.timing.motion import TRACKING_WINDOW_S
    limiter = MotionLimiter(max_velocity=[1.0, np.inf])
    np.testing.assert_allclose(limiter.tracking_tolerance, [TRACKING_WINDOW_S, np.inf])
    np.testing.assert_allclose(MotionLimiter(tracking_tolerance=0.2).tracking_tolerance, [0.2])
    with pytest.raises(ValueError, match='tracking_tolerance has 2 values but the chunk '
                                         'commands 3'):
        limiter.anchor(np.zeros(3), 1.0, 2.0, None)
