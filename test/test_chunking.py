"""Specification of ChunkStitcher: past actions dropped, chunks joined without pause, jump
back or step. Times are plain floats (seconds, ROS time)."""
import math

import numpy as np
import pytest

from molmobot_policy.timing import ChunkStitcher

DT = 0.125  # control period; a binary fraction so the times below are exact


def ramp(horizon=8, action_dim=2, start=0.0):
    """Actions whose value is start + k (joint 0) and -(start + k) (joint 1) at step k."""
    k = start + np.arange(horizon, dtype=np.float64)
    return np.stack([k, -k] + [k] * (action_dim - 2), axis=1)[:, :action_dim]


def test_action_k_is_stamped_first_time_plus_k_periods():
    chunk = ChunkStitcher(DT).stitch(ramp(), first_time=10.0, now=9.0)
    np.testing.assert_array_equal(chunk.times, 10.0 + DT * np.arange(8))
    np.testing.assert_array_equal(chunk.positions, ramp())
    assert chunk.dropped == 0 and chunk.first_index == 0


def test_time_from_start_counts_from_the_first_published_point():
    chunk = ChunkStitcher(DT).stitch(ramp(), first_time=10.0, now=10.2)
    np.testing.assert_allclose(chunk.time_from_start, DT * np.arange(len(chunk)))


def test_actions_in_the_past_are_dropped_from_the_front():
    chunk = ChunkStitcher(DT).stitch(ramp(), first_time=10.0, now=10.0 + 2.5 * DT)
    assert chunk.dropped == 3 and chunk.first_index == 3
    np.testing.assert_array_equal(chunk.positions, ramp()[3:])
    np.testing.assert_array_equal(chunk.times, 10.0 + DT * np.arange(3, 8))


def test_an_action_due_exactly_now_is_kept():
    chunk = ChunkStitcher(DT).stitch(ramp(), first_time=10.0, now=10.0 + 2 * DT)
    assert chunk.dropped == 2 and chunk.times[0] == 10.0 + 2 * DT


def test_a_chunk_entirely_in_the_past_gives_no_points():
    stitcher = ChunkStitcher(DT)
    chunk = stitcher.stitch(ramp(), first_time=10.0, now=20.0)
    assert len(chunk) == 0 and chunk.dropped == 8
    assert chunk.positions.shape == (0, 2)
    assert stitcher.previous is None


def test_chunk_stamps_are_monotonic_across_successive_chunks():
    stitcher = ChunkStitcher(DT, smoothing='linear')
    executed_times = []
    for tick in range(6):
        now = 10.0 + tick * 3 * DT  # publish every 3 control periods
        chunk = stitcher.stitch(ramp(start=tick), first_time=now - DT, now=now)
        assert np.all(chunk.times >= now)
        assert np.all(np.diff(chunk.times) > 0)
        # the robot executes the previous chunk until the new one takes over
        executed_times = [t for t in executed_times if t < chunk.times[0]] + list(chunk.times)
    assert np.all(np.diff(executed_times) > 0)  # no pause, no jump back


def test_no_smoothing_switches_to_the_new_plan_at_its_first_point():
    stitcher = ChunkStitcher(DT, smoothing='none')
    stitcher.stitch(np.zeros((8, 2)), first_time=10.0, now=10.0)
    chunk = stitcher.stitch(np.ones((8, 2)), first_time=10.0 + 2 * DT, now=10.0 + 2 * DT)
    np.testing.assert_array_equal(chunk.positions, np.ones((8, 2)))


def test_linear_cross_fade_starts_on_the_old_trajectory_and_ends_on_the_new():
    stitcher = ChunkStitcher(DT, smoothing='linear')
    old = stitcher.stitch(np.zeros((8, 2)), first_time=10.0, now=10.0)
    start = 10.0 + 3 * DT
    chunk = stitcher.stitch(np.ones((8, 2)), first_time=start, now=start)
    overlap = chunk.times <= old.times[-1]  # 5 points: weights 0, 1/4, 1/2, 3/4, 1
    np.testing.assert_allclose(chunk.positions[overlap, 0], [0.0, 0.25, 0.5, 0.75, 1.0])
    np.testing.assert_array_equal(chunk.positions[~overlap], 1.0)


def test_linear_cross_fade_is_continuous_with_the_executed_trajectory():
    stitcher = ChunkStitcher(DT, smoothing='linear')
    old = stitcher.stitch(ramp(), first_time=10.0, now=10.0)
    start = 10.0 + 2.5 * DT  # the new chunk's grid is offset from the old one
    chunk = stitcher.stitch(ramp(start=50.0), first_time=start, now=start)
    old_at_start = [np.interp(start, old.times, old.positions[:, j]) for j in range(2)]
    np.testing.assert_allclose(chunk.positions[0], old_at_start)


def test_linear_cross_fade_without_a_previous_chunk_keeps_the_actions():
    chunk = ChunkStitcher(DT, smoothing='linear').stitch(ramp(), first_time=1.0, now=1.0)
    np.testing.assert_array_equal(chunk.positions, ramp())


def test_max_step_bounds_every_step_including_the_join_with_the_previous_chunk():
    max_step = np.array([0.1, 0.3])
    stitcher = ChunkStitcher(DT, max_step=max_step)
    old = stitcher.stitch(np.zeros((8, 2)), first_time=10.0, now=10.0)
    start = 10.0 + 3 * DT
    chunk = stitcher.stitch(np.full((8, 2), 5.0), first_time=start, now=start)
    last_executed = old.positions[2]  # the old point just before the new chunk starts
    steps = np.abs(np.diff(np.vstack([last_executed, chunk.positions]), axis=0))
    assert np.all(steps <= max_step + 1e-12)
    np.testing.assert_allclose(chunk.positions[-1], 8 * max_step)  # moving at the limit


def test_max_step_bounds_steps_within_a_single_chunk():
    actions = np.array([[0.0], [1.0], [1.0], [-1.0]])
    chunk = ChunkStitcher(DT, max_step=0.5).stitch(actions, first_time=0.0, now=0.0)
    np.testing.assert_allclose(chunk.positions[:, 0], [0.0, 0.5, 1.0, 0.5])


def test_max_step_leaves_slow_trajectories_unchanged():
    chunk = ChunkStitcher(DT, max_step=2.0).stitch(ramp(), first_time=0.0, now=0.0)
    np.testing.assert_array_equal(chunk.positions, ramp())


def test_reset_forgets_the_previous_chunk():
    stitcher = ChunkStitcher(DT, smoothing='linear')
    stitcher.stitch(np.zeros((8, 2)), first_time=10.0, now=10.0)
    stitcher.reset()
    chunk = stitcher.stitch(np.ones((8, 2)), first_time=5.0, now=5.0)
    np.testing.assert_array_equal(chunk.positions, 1.0)


def test_now_going_backwards_is_an_error():
    stitcher = ChunkStitcher(DT)
    stitcher.stitch(ramp(), first_time=10.0, now=10.0)
    with pytest.raises(ValueError, match='now went backwards'):
        stitcher.stitch(ramp(), first_time=9.0, now=9.5)


@pytest.mark.parametrize('actions', [np.zeros(8), np.zeros((0, 2)), np.zeros((8, 0)),
                                     np.zeros((2, 8, 2)), np.full((8, 2), np.nan)])
def test_actions_must_be_a_finite_h_by_a_array(actions):
    with pytest.raises(ValueError, match='actions'):
        ChunkStitcher(DT).stitch(actions, first_time=0.0, now=0.0)


def test_action_dim_must_match_the_previous_chunk():
    stitcher = ChunkStitcher(DT)
    stitcher.stitch(np.zeros((8, 2)), first_time=0.0, now=0.0)
    with pytest.raises(ValueError, match='A=3'):
        stitcher.stitch(np.zeros((8, 3)), first_time=1.0, now=1.0)


def test_per_joint_max_step_must_match_the_action_dim():
    with pytest.raises(ValueError, match='max_step'):
        ChunkStitcher(DT, max_step=[0.1, 0.1, 0.1]).stitch(ramp(), first_time=0.0, now=0.0)


@pytest.mark.parametrize('kwargs, name', [({'control_period': 0.0}, 'control_period'),
                                          ({'control_period': math.nan}, 'control_period'),
                                          ({'smoothing': 'cubic'}, 'smoothing'),
                                          ({'max_step': 0.0}, 'max_step'),
                                          ({'max_step': [[0.1]]}, 'max_step')])
def test_constructor_arguments_are_validated(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ChunkStitcher(**{'control_period': DT, **kwargs})


@pytest.mark.parametrize('first_time, now', [(math.nan, 0.0), (0.0, math.inf)])
def test_times_must_be_finite(first_time, now):
    with pytest.raises(ValueError, match='must be a finite number'):
        ChunkStitcher(DT).stitch(ramp(), first_time=first_time, now=now)


def test_commit_makes_the_published_points_the_reference_of_the_next_chunk():
    """After MotionLimiter moved the points, the next chunk is joined (max_step) to what was
    published, not to the plan."""
    from dataclasses import replace
    stitcher = ChunkStitcher(0.1, max_step=0.3)
    first = stitcher.stitch(np.full((4, 1), 1.0), first_time=10.0, now=10.0)
    published = replace(first, positions=np.full((4, 1), 0.2))
    stitcher.commit(published)
    second = stitcher.stitch(np.full((4, 1), 1.0), first_time=10.2, now=10.2)
    assert second.positions[0, 0] == pytest.approx(0.5)      # 0.2 + max_step, not 1.0
    with pytest.raises(ValueError, match='last stitched chunk'):
        stitcher.commit(published)                           # not the last one any more


def test_chunk_gap_warns_when_a_chunk_ends_before_the_next_arrives():
    from molmobot_policy.timing.chunking import chunk_gap
    # a fresh-user trial: 16 x 0.05 s of actions, a chunk every 1.5 s: stop and go, all OK
    message = chunk_gap(16, 0.05, 1.5, 0.1)
    assert 'stands still ~0.80 s between chunks' in message and 'control_period' in message
    assert chunk_gap(16, 0.1, 1.0, 0.3) == ''      # 1.6 s - 0.3 s lead covers 1.0 s
    assert chunk_gap(0, 0.1, 1.0, 0.3) == ''       # horizon unknown (a stand-in engine)


def test_unpublishable_chunks_says_plainly_when_every_action_is_past_at_publish():
    """control_period 0.01 s: 16 actions span 0.16 s, less than a 0.4 s lead (third
    fresh-user trial: only 'stop and go' was said, then every tick was skipped)."""
    from molmobot_policy.timing.chunking import chunk_gap, unpublishable_chunks
    assert unpublishable_chunks(16, 0.01, 0.4).startswith('no chunk can be published: its 16 '
                                                          'actions x control_period 0.01 s')
    assert unpublishable_chunks(16, 0.05, 0.8) != ''     # 0.80 s of actions, 0.80 s lead
    assert unpublishable_chunks(16, 0.05, 0.1) == ''     # stop and go at worst: chunk_gap's
    assert unpublishable_chunks(0, 0.01, 0.4) == ''      # horizon unknown (a stand-in engine)
    assert chunk_gap(16, 0.01, 1.5, 0.4) == ''           # said once, by unpublishable_chunks
