"""Only data from the present: future-stamped and unset-stamp inputs are refused and named,
never used, and do not block later frames; non-finite joint positions are named; a time jump
back can reset the history (ros/synchronizer.py)."""
import re
from types import SimpleNamespace

import numpy as np
import pytest

from molmobot_policy.ros.synchronizer import ObservationSynchronizer, Skip
from molmobot_policy.types import Observation

CAMERAS = ('/cam0/image_raw', '/cam1/image_raw')
JOINTS = ('joint_a', 'joint_b')


def _image(value=1):
    return SimpleNamespace(height=2, width=3, encoding='rgb8', step=9, data=bytes([value]) * 18)


def _sync(**kwargs):
    return ObservationSynchronizer(CAMERAS, JOINTS, joint_state_topic='/joint_states', **kwargs)


def _fill(sync, stamp, received=None):
    received = stamp if received is None else received
    for topic in CAMERAS:
        sync.add_image(topic, _image(), stamp, received)
    sync.add_joint_state(JOINTS, [0.1, 0.2], stamp, received)


def test_future_stamped_frame_is_refused_named_and_not_used():
    sync = _sync(max_future=0.05)
    _fill(sync, stamp=10.0)
    assert not sync.add_image(CAMERAS[0], _image(7), stamp=15.0, received=10.01)
    problem = sync.stats(10.01)[CAMERAS[0]].problem
    assert 'stamped 4.990 s in the future' in problem and 'clocks synchronized' in problem
    obs = sync.build(10.02, max_image_age=0.5, max_state_age=0.5)
    assert isinstance(obs, Observation)
    assert obs.image_stamps[0] == 10.0          # the present frame, not the future one


def test_future_frame_does_not_block_later_present_frames():
    # stored, a frame 5 s ahead would make every later frame look 'older' and be dropped
    sync = _sync()
    _fill(sync, stamp=10.0)
    sync.add_image(CAMERAS[0], _image(), stamp=15.0, received=10.0)
    assert sync.add_image(CAMERAS[0], _image(), stamp=10.1, received=10.1)
    assert sync.stats(10.1)[CAMERAS[0]].problem == ''


def test_dead_camera_goes_stale_on_time_despite_a_future_frame():
    sync = _sync()
    _fill(sync, stamp=10.0)
    sync.add_image(CAMERAS[0], _image(), stamp=15.0, received=10.0)
    skip = sync.build(10.6, max_image_age=0.5, max_state_age=5.0)
    assert isinstance(skip, Skip)
    assert CAMERAS[0] in skip.topics
    assert 'stale' in str(skip) and 'in the future' in str(skip)


def test_stamp_within_tolerance_is_accepted():
    sync = _sync(max_future=0.05)
    _fill(sync, stamp=10.04, received=10.0)
    assert isinstance(sync.build(10.0, max_image_age=0.5, max_state_age=0.5), Observation)


def test_future_stamp_at_build_time_after_now_went_back_is_refused():
    sync = _sync(max_future=0.05)
    _fill(sync, stamp=10.0)
    skip = sync.build(9.0, max_image_age=0.5, max_state_age=0.5)
    assert isinstance(skip, Skip)
    assert set(skip.topics) == set(CAMERAS) | {'/joint_states'}
    assert 'in the future' in str(skip)


def test_future_stamped_joint_state_is_refused_and_named():
    sync = _sync()
    _fill(sync, stamp=10.0)
    sync.add_joint_state(JOINTS, [9.0, 9.0], stamp=20.0, received=10.0)
    assert 'in the future' in sync.stats(10.0)['/joint_states'].problem
    obs = sync.build(10.01, max_image_age=0.5, max_state_age=0.5)
    np.testing.assert_allclose(obs.state, [0.1, 0.2])


def test_unset_stamp_is_reported_as_unset_not_as_a_huge_age():
    sync = _sync()
    assert not sync.add_image(CAMERAS[0], _image(), stamp=0.0, received=1796148637.0)
    assert 'header stamp unset (0)' in sync.stats(1796148637.0)[CAMERAS[0]].problem
    skip = sync.build(1796148637.0, max_image_age=0.5, max_state_age=0.5)
    reason = next(r for r in skip.reasons if CAMERAS[0] in r)
    assert 'header stamp unset (0)' in reason and not re.search(r'\bage\b', reason)


def test_non_finite_joint_positions_are_named_in_skip_and_stats():
    sync = _sync()
    _fill(sync, stamp=10.0)
    sync.add_joint_state(JOINTS, [0.1, float('nan')], stamp=10.05, received=10.05)
    skip = sync.build(10.06, max_image_age=0.5, max_state_age=0.5)
    assert isinstance(skip, Skip)
    assert "non-finite positions for joints ['joint_b']" in str(skip)
    assert "['joint_b']" in sync.stats(10.06)['/joint_states'].problem
    sync.add_joint_state(JOINTS, [0.1, 0.3], stamp=10.1, received=10.1)
    assert isinstance(sync.build(10.11, max_image_age=0.5, max_state_age=0.5), Observation)
    assert sync.stats(10.11)['/joint_states'].problem == ''


def test_reset_history_accepts_a_new_timeline_after_a_jump_back():
    sync = _sync()
    _fill(sync, stamp=100.0)
    assert isinstance(sync.build(100.0, 0.5, 0.5), Observation)
    sync.reset_history()
    _fill(sync, stamp=90.0)
    assert isinstance(sync.build(90.0, 0.5, 0.5), Observation)


def test_negative_tolerance_is_refused():
    with pytest.raises(ValueError, match='max_future must be >= 0'):
        _sync(max_future=-0.1)


def test_positions_of_action_joints_that_are_not_state_joints_are_kept():
    """The motion limits anchor the commanded joints, which may differ from the state."""
    sync = _sync(action_joint_names=('joint_b', 'gripper'))
    sync.add_joint_state(['joint_a', 'joint_b', 'gripper', 'other'], [0.1, 0.2, 0.04, 9.0],
                         stamp=10.0, received=10.0)
    sync.add_joint_state(['gripper'], [0.05], stamp=10.1, received=10.1)
    positions, stamp = sync.latest_positions(['gripper', 'joint_b', 'wrist', 'other'])
    np.testing.assert_allclose(positions[:2], [0.05, 0.2])
    assert np.isnan(positions[2]) and np.isnan(positions[3])   # never sent / not kept
    assert stamp == 10.1


def test_a_future_joint_state_is_not_a_measured_position():
    sync = _sync(action_joint_names=('gripper',))
    sync.add_joint_state(['gripper'], [0.05], stamp=10.0, received=10.0)
    sync.add_joint_state(['gripper'], [0.9], stamp=15.0, received=10.0)
    assert sync.latest_positions(['gripper']) == (pytest.approx([0.05]), 10.0)
    assert 'in the future' in sync.refused('/joint_states')


def test_a_problem_is_timed_from_when_it_began_until_a_usable_message():
    sync = _sync()
    _fill(sync, stamp=10.0)
    bad = SimpleNamespace(height=2, width=3, encoding='yuv422', step=6, data=bytes(12))
    for t in (10.1, 10.2, 10.3):
        sync.add_image(CAMERAS[1], bad, stamp=t, received=t)
        assert isinstance(sync.build(t, 0.5, 0.5), Skip)
    stats = sync.stats(10.9)[CAMERAS[1]]
    assert 'yuv422' in stats.problem and stats.problem_age == pytest.approx(0.8)
    assert sync.stats(10.9)[CAMERAS[0]].problem_age is None
    _fill(sync, stamp=11.0)
    assert isinstance(sync.build(11.0, 0.5, 0.5), Observation)
    assert sync.stats(11.0)[CAMERAS[1]].problem_age is None


def test_refused_names_why_the_last_message_was_not_stored():
    sync = _sync()
    assert not sync.add_image(CAMERAS[0], _image(), stamp=0.0, received=10.0)
    assert sync.refused(CAMERAS[0]) == 'newest frame refused: header stamp unset (0)'
    assert sync.add_image(CAMERAS[0], _image(), stamp=10.0, received=10.0)
    assert sync.refused(CAMERAS[0]) == ''
    assert 'max_future_stamp 0.050 s' in sync.stamp_problem(20.0, 10.0)


def test_action_joint_positions_that_are_non_finite_or_stale_cannot_anchor_a_chunk():
    # an action joint outside joint_names: NaN must not pass as "never measured"
    sync = ObservationSynchronizer(CAMERAS, JOINTS, joint_state_topic='/joint_states',
                                   action_joint_names=('joint_a', 'joint_c'))
    sync.add_joint_state(('joint_a', 'joint_b', 'joint_c'), [0.1, 0.2, float('nan')], 10.0, 10.0)
    assert "non-finite positions for action joints ['joint_c']" in \
        sync.position_problem(('joint_a', 'joint_c'), now=10.0, max_age=0.5)
    sync.add_joint_state(('joint_c',), [0.3], 10.1, 10.1)
    assert sync.position_problem(('joint_a', 'joint_c'), now=10.2, max_age=0.5) == ''
    assert "stale for action joints ['joint_a']" in \
        sync.position_problem(('joint_a', 'joint_c'), now=10.55, max_age=0.5)


def test_a_never_measured_action_joint_is_no_problem_for_anchoring():
    sync = _sync()
    _fill(sync, stamp=10.0)
    assert sync.position_problem(('joint_a', 'never_sent'), now=10.0, max_age=0.5) == ''


def test_anchor_positions_mask_the_gripper_list_the_unseen_and_refuse_a_stale_joint():
    sync = ObservationSynchronizer(CAMERAS, JOINTS, joint_state_topic='/joint_states',
                                   action_joint_names=('joint_a', 'wrist', 'finger'))
    sync.add_joint_state(('joint_a', 'finger'), [0.1, 0.04], stamp=10.0, received=10.0)
    positions, stamp, unseen = sync.anchor_positions(('joint_a', 'wrist', 'finger'),
                                                     gripper_index=2, now=10.1, max_age=0.5)
    assert positions[0] == pytest.approx(0.1) and stamp == 10.0
    assert np.isnan(positions[1]) and np.isnan(positions[2])   # never sent; the gripper
    assert unseen == ['wrist']                                  # the gripper is not "unseen"
    with pytest.raises(ValueError, match=r"stale for action joints \['joint_a'\]"):
        sync.anchor_positions(('joint_a', 'wrist', 'finger'), 2, now=10.6, max_age=0.5)
    # a stale gripper joint does not block: its dimension is a command, not a position
    sync.add_joint_state(('joint_a',), [0.2], stamp=10.6, received=10.6)
    positions, _, _ = sync.anchor_positions(('joint_a', 'wrist', 'finger'), 2, 10.7, 0.5)
    assert positions[0] == pytest.approx(0.2)


def test_without_clock_inputs_are_refused_for_the_clock_not_for_the_future():
    sync = _sync()
    assert not sync.add_image(CAMERAS[0], _image(), stamp=1796162125.7, received=0.0)
    problem = sync.stats(0.0)[CAMERAS[0]].problem
    assert 'clock has not started' in problem and 'future' not in problem


def test_a_problem_that_flaps_keeps_its_start_until_the_input_stays_good():
    """A joint driver sending a NaN every other message (good ones between): the problem's
    age counts from the first NaN, so diagnostics escalate it as a steady one; after
    PROBLEM_CLEAR_S of good messages only, a new problem is timed afresh."""
    from molmobot_policy.ros.synchronizer import PROBLEM_CLEAR_S
    sync = _sync()
    names = list(sync.joint_names)
    t = 10.0
    while t < 11.0:
        sync.add_joint_state(names, [float('nan')] + [0.0] * (len(names) - 1), t, t)
        sync.add_joint_state(names, [0.0] * len(names), t + 0.005, t + 0.005)
        t += 0.01
    sync.add_joint_state(names, [float('nan')] + [0.0] * (len(names) - 1), t, t)
    stats = sync.stats(t)['/joint_states']
    assert 'non-finite' in stats.problem and stats.problem_age == pytest.approx(t - 10.0)
    good_until = t + PROBLEM_CLEAR_S + 0.01
    while t < good_until:
        t += 0.01
        sync.add_joint_state(names, [0.0] * len(names), t, t)
    assert sync.stats(t)['/joint_states'].problem_age is None
    sync.add_joint_state(names, [float('nan')] + [0.0] * (len(names) - 1), t + 0.01, t + 0.01)
    assert sync.stats(t + 0.11)['/joint_states'].problem_age == pytest.approx(0.1)
