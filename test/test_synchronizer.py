"""ros/synchronizer.py: latest-message store, staleness, joint matching by name, monotonicity."""
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from molmobot_policy.ros.synchronizer import ObservationSynchronizer, Skip
from molmobot_policy.types import Observation

CAMERAS = ('/cam0/image_raw', '/cam1/image_raw')
JOINTS = ('joint_a', 'joint_b', 'finger')


def _image(value, encoding='rgb8', height=2, width=3):
    channels = {'rgb8': 3, 'bgr8': 3, 'mono8': 1, 'yuv422': 2}[encoding]
    return SimpleNamespace(height=height, width=width, encoding=encoding,
                           step=width * channels, data=bytes([value]) * (height * width * channels))


def _sync(**kwargs):
    return ObservationSynchronizer(CAMERAS, JOINTS, joint_state_topic='/joint_states', **kwargs)


def _fill(sync, stamp=10.0, value=1):
    for topic in CAMERAS:
        sync.add_image(topic, _image(value), stamp, stamp)
    sync.add_joint_state(JOINTS, [0.1, 0.2, 0.3], stamp, stamp)


def test_fresh_inputs_build_an_observation_in_camera_and_joint_order():
    sync = _sync()
    sync.add_image(CAMERAS[1], _image(20), 10.0, 10.0)
    sync.add_image(CAMERAS[0], _image(10), 10.1, 10.1)
    sync.add_joint_state(JOINTS, [1.0, 2.0, 3.0], 10.05, 10.05)
    obs = sync.build(now=10.2, max_image_age=0.5, max_state_age=0.5, instruction='stack')
    assert isinstance(obs, Observation)
    assert [int(im[0, 0, 0]) for im in obs.images] == [10, 20]
    assert obs.images[0].shape == (2, 3, 3) and obs.images[0].dtype == np.uint8
    np.testing.assert_array_equal(obs.state, np.array([1.0, 2.0, 3.0], np.float32))
    assert obs.state.dtype == np.float32
    assert obs.instruction == 'stack'
    assert obs.image_stamps == (10.1, 10.0) and obs.state_stamp == 10.05
    assert obs.stamp == 10.0


def test_joint_state_is_matched_by_name_not_index():
    sync = _sync()
    for topic in CAMERAS:
        sync.add_image(topic, _image(1), 10.0, 10.0)
    sync.add_joint_state(['other', 'finger', 'joint_b', 'joint_a'], [9.0, 3.0, 2.0, 1.0],
                         10.0, 10.0)
    obs = sync.build(now=10.0, max_image_age=1.0, max_state_age=1.0)
    np.testing.assert_array_equal(obs.state, [1.0, 2.0, 3.0])


def test_joint_state_split_over_messages_is_merged():
    sync = _sync()
    for topic in CAMERAS:
        sync.add_image(topic, _image(1), 10.0, 10.0)
    sync.add_joint_state(['joint_a', 'joint_b'], [1.0, 2.0], 10.0, 10.0)
    sync.add_joint_state(['finger'], [3.0], 10.01, 10.01)
    obs = sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    np.testing.assert_array_equal(obs.state, [1.0, 2.0, 3.0])


def test_missing_joint_is_named_in_skip():
    sync = _sync()
    for topic in CAMERAS:
        sync.add_image(topic, _image(1), 10.0, 10.0)
    sync.add_joint_state(['joint_a', 'joint_b'], [1.0, 2.0], 10.0, 10.0)
    skip = sync.build(now=10.0, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip)
    assert "'finger'" in str(skip) and '/joint_states' in skip.topics


def test_a_joint_state_refused_from_the_start_is_named_with_its_refusal_not_as_lacking():
    sync = _sync()
    for topic in CAMERAS:
        sync.add_image(topic, _image(1), 10.0, 10.0)
    sync.add_joint_state(JOINTS, [0.1, 0.2, 0.3], 0.0, 10.0)      # stamp unset
    skip = sync.build(now=10.0, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip) and 'lacks' not in str(skip)
    assert f'has no usable position for joints {list(JOINTS)}' in str(skip)
    assert 'header stamp unset (0)' in str(skip)


def test_joint_state_never_received_says_so_in_skip():
    sync = _sync()
    for topic in CAMERAS:
        sync.add_image(topic, _image(1), 10.0, 10.0)
    skip = sync.build(now=10.0, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip)
    assert 'joint state /joint_states has no message yet' in str(skip)
    assert 'lacks' not in str(skip) and '/joint_states' in skip.topics


def test_joint_names_matching_nothing_say_what_the_messages_name():
    # the day-one mistake: joint_names spelled unlike the driver's; messages do arrive
    sync = _sync()
    for topic in CAMERAS:
        sync.add_image(topic, _image(1), 10.0, 10.0)
    sync.add_joint_state(['joint_A', 'joint_B', 'finger_1'], [1.0, 2.0, 3.0], 10.0, 10.0)
    skip = sync.build(now=10.0, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip) and 'no message yet' not in str(skip)
    assert f'lacks joints {list(JOINTS)}' in str(skip)
    assert "its latest message names ['joint_A', 'joint_B', 'finger_1']" in str(skip)
    assert "did you mean 'joint_A' for 'joint_a'" in str(skip)


def test_joints_gone_from_the_messages_are_stale_with_the_names_the_messages_carry():
    sync = _sync()
    _fill(sync, stamp=10.0)
    for t in (10.5, 11.0, 11.5):       # the driver renamed its joints mid-run
        sync.add_joint_state(['j1', 'j2', 'j3'], [0.0, 0.0, 0.0], t, t)
        sync.add_image(CAMERAS[0], _image(1), t, t)
        sync.add_image(CAMERAS[1], _image(1), t, t)
    skip = sync.build(now=11.5, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip) and 'is stale for' in str(skip)
    assert "(its latest message names none of them, only ['j1', 'j2', 'j3'])" in str(skip)


def test_a_joint_the_driver_stopped_publishing_is_not_matched_to_a_configured_one():
    """The driver drops joint_b and keeps the others: 'finger' is close to nothing and
    'joint_a' is configured already, so no renaming is suggested (second trial of 2026-12-07:
    'did you mean fr3_joint7 for fr3_joint4' with fr3_joint7 in joint_names)."""
    sync = _sync()
    _fill(sync, stamp=10.0)
    for t in (10.5, 11.0, 11.5):
        sync.add_joint_state(['joint_a', 'finger'], [0.0, 0.0], t, t)
        for topic in CAMERAS:
            sync.add_image(topic, _image(1), t, t)
    skip = sync.build(now=11.5, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip) and "is stale for ['joint_b']" in str(skip), str(skip)
    assert 'did you mean' not in str(skip), str(skip)


def test_a_camera_whose_clock_went_back_is_told_from_a_stopped_one():
    sync = _sync()
    _fill(sync, stamp=10.0)
    for t in (10.5, 11.0, 11.5):       # camera 1 keeps sending, stamped 30 s back
        sync.add_image(CAMERAS[0], _image(1), t, t)
        sync.add_joint_state(JOINTS, [0.1, 0.2, 0.3], t, t)
        assert not sync.add_image(CAMERAS[1], _image(1), t - 30.0, t)
    skip = sync.build(now=11.5, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip) and skip.topics == (CAMERAS[1],)
    assert 'stale: age 1.500 s' in str(skip)
    assert ('its frames keep arriving (the newest 0.000 s ago) stamped 28.500 s before the '
            "one kept, so they are dropped: the driver's clock went back") in str(skip)
    stopped = _sync()
    _fill(stopped, stamp=10.0)
    for t in (10.5, 11.0, 11.5):       # camera 1 silent: no such hint
        stopped.add_image(CAMERAS[0], _image(1), t, t)
        stopped.add_joint_state(JOINTS, [0.1, 0.2, 0.3], t, t)
    assert 'clock went back' not in str(stopped.build(now=11.5, max_image_age=1.0,
                                                      max_state_age=1.0))


def test_a_joint_state_whose_clock_went_back_says_so_when_stale():
    sync = _sync()
    _fill(sync, stamp=10.0)
    for t in (10.5, 11.0, 11.5):
        for topic in CAMERAS:
            sync.add_image(topic, _image(1), t, t)
        sync.add_joint_state(JOINTS, [0.1, 0.2, 0.3], t - 30.0, t)
    skip = sync.build(now=11.5, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip) and 'joint state /joint_states is stale for' in str(skip)
    assert "its messages keep arriving (the newest 0.000 s ago) stamped 28.500 s before " \
        "the one kept, so they are dropped: the driver's clock went back" in str(skip)


def test_camera_without_any_image_is_named_in_skip():
    sync = _sync()
    sync.add_image(CAMERAS[0], _image(1), 10.0, 10.0)
    sync.add_joint_state(JOINTS, [0, 0, 0], 10.0, 10.0)
    skip = sync.build(now=10.0, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip)
    assert skip.topics == (CAMERAS[1],)
    assert CAMERAS[1] in str(skip) and CAMERAS[0] not in str(skip)


def test_stale_camera_is_named_with_its_age():
    sync = _sync()
    _fill(sync, stamp=10.0)
    sync.add_image(CAMERAS[0], _image(1), 10.9, 10.9)
    sync.add_joint_state(JOINTS, [0, 0, 0], 10.9, 10.9)
    skip = sync.build(now=11.0, max_image_age=0.5, max_state_age=0.5)
    assert isinstance(skip, Skip)
    assert skip.topics == (CAMERAS[1],)
    assert 'stale' in str(skip) and 'age 1.000 s' in str(skip)


def _stale_joint_state_skip():
    """Every joint stamped 10.0 s, the cameras 10.9 s, built at 11.0 s with ages of 0.5 s."""
    sync = _sync()
    _fill(sync, stamp=10.0)
    for topic in CAMERAS:
        sync.add_image(topic, _image(1), 10.9, 10.9)
    return sync.build(now=11.0, max_image_age=0.5, max_state_age=0.5)


def test_stale_joint_state_is_reported():
    skip = _stale_joint_state_skip()
    assert isinstance(skip, Skip)
    assert skip.topics == ('/joint_states',) and 'stale' in str(skip)


def test_stale_joint_state_says_how_old_it_is_and_that_no_joint_is_current():
    skip = _stale_joint_state_skip()
    assert str(skip).count(f"is stale for {list(JOINTS)}: age 1.000 s > max_state_age "
                           f"0.500 s") == 1, skip
    assert 'current' not in str(skip)


def test_a_joint_no_longer_published_is_named_as_such_while_the_others_are_current():
    """A driver that drops one joint from /joint_states leaves that joint's position aging
    while the others stay fresh: the skip says so rather than pointing at timing alone."""
    sync = _sync()
    _fill(sync, stamp=10.0)
    for topic in CAMERAS:
        sync.add_image(topic, _image(1), 10.9, 10.9)
    sync.add_joint_state(JOINTS[:2], [0.1, 0.2], 10.9, 10.9)     # 'finger' no longer sent
    skip = sync.build(now=11.0, max_image_age=0.5, max_state_age=0.5)
    assert isinstance(skip, Skip) and skip.topics == ('/joint_states',)
    assert ("joint state /joint_states is stale for ['finger'] (age 1.000 s > max_state_age "
            "0.500 s) while other joints on it are current: is that joint still published?"
            ) in str(skip), skip
    problem = sync.position_problem(['joint_a', 'finger'], now=11.0, max_age=0.5)
    assert "stale for action joints ['finger'] (age 1.000 s" in problem
    assert 'is that joint still published?' in problem, problem

def test_age_limit_is_inclusive_and_images_and_state_have_separate_limits():
    sync = _sync()
    _fill(sync, stamp=10.0)
    assert isinstance(sync.build(now=10.5, max_image_age=0.5, max_state_age=1.0), Observation)
    assert isinstance(sync.build(now=10.6, max_image_age=1.0, max_state_age=0.5), Skip)


def test_older_message_does_not_replace_a_newer_one():
    sync = _sync()
    _fill(sync, stamp=10.0, value=5)
    assert sync.add_image(CAMERAS[0], _image(99), 9.0, 10.1) is False
    obs = sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    assert int(obs.images[0][0, 0, 0]) == 5 and obs.image_stamps[0] == 10.0


def test_never_returns_an_observation_older_than_one_already_used():
    sync = _sync()
    _fill(sync, stamp=10.0)
    first = sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    sync.add_image(CAMERAS[0], _image(3), 9.5, 10.2)           # out of order: ignored
    sync.add_joint_state(JOINTS, [5.0, 5.0, 5.0], 9.5, 10.2)   # out of order: ignored
    second = sync.build(now=10.2, max_image_age=1.0, max_state_age=1.0)
    assert second.stamp >= first.stamp
    assert all(b >= a for a, b in zip(first.image_stamps, second.image_stamps))
    np.testing.assert_array_equal(second.state, first.state)


def test_seq_increases_with_every_observation():
    sync = _sync()
    _fill(sync, stamp=10.0)
    seqs = [sync.build(now=10.0, max_image_age=1.0, max_state_age=1.0).seq for _ in range(3)]
    assert seqs == [1, 2, 3]


def test_frames_are_decoded_lazily_and_only_when_used():
    decoded = []

    def decode(msg, topic):
        decoded.append(topic)
        return np.zeros((1, 1, 3), np.uint8)

    sync = _sync(decode=decode)
    for stamp in (10.0, 10.1, 10.2):
        _fill(sync, stamp=stamp)
    assert decoded == []
    sync.build(now=10.2, max_image_age=1.0, max_state_age=1.0)
    assert sync.last_build_decoded == len(CAMERAS)
    sync.build(now=10.3, max_image_age=1.0, max_state_age=1.0)
    assert decoded == list(CAMERAS)      # newest frames only, each decoded once
    assert (sync.frames_decoded, sync.last_build_decoded) == (len(CAMERAS), 0)   # counted


def test_decode_time_covers_the_decoding_and_is_zero_when_nothing_was_decoded():
    spent = []

    def decode(msg, topic):        # measures its own duration, as the synchronizer should
        began = time.perf_counter()
        time.sleep(0.002)
        spent.append(time.perf_counter() - began)
        return np.zeros((1, 1, 3), np.uint8)

    sync = _sync(decode=decode)
    assert sync.last_build_decode_s == 0.0
    _fill(sync, stamp=10.0)
    sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    assert len(spent) == len(CAMERAS)
    assert sync.last_build_decode_s >= max(spent)     # the frames decode in parallel
    sync.build(now=10.2, max_image_age=1.0, max_state_age=1.0)    # the decoded frames reused
    assert (sync.last_build_decoded, sync.last_build_decode_s) == (0, 0.0)
    _fill(sync, stamp=10.3)
    sync.build(now=10.4, max_image_age=1.0, max_state_age=1.0)
    assert sync.last_build_decode_s >= max(spent[len(CAMERAS):]) > 0.0
    reported = sync.last_build_decode_s
    sync.build(now=20.0, max_image_age=1.0, max_state_age=1.0)    # stale: a skip, no decode
    assert sync.last_build_decode_s == reported      # still the last observation's


def test_a_build_decodes_its_frames_concurrently():
    """Every camera's decode waits at one barrier for all the others: decoded one after the
    other, the first would wait alone and the barrier would break (8 jpeg frames at ~6 ms
    each would otherwise cost a tick ~50 ms)."""
    cameras = tuple(f'/cam{k}/image_raw' for k in range(8))
    barrier = threading.Barrier(len(cameras), timeout=10.0)
    threads = set()

    def decode(msg, topic):
        barrier.wait()
        threads.add(threading.get_ident())
        return np.zeros((1, 1, 3), np.uint8)

    sync = ObservationSynchronizer(cameras, JOINTS, decode=decode)
    for topic in cameras:
        sync.add_image(topic, _image(1), 10.0, 10.0)
    sync.add_joint_state(JOINTS, [0.1, 0.2, 0.3], 10.0, 10.0)
    observation = sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(observation, Observation) and len(observation.images) == len(cameras)
    assert len(threads) == len(cameras) and sync.last_build_decoded == len(cameras)


def test_decode_time_counts_a_frame_that_failed_to_decode():
    """The skipped build's decodes (the good frame and the failed one) count toward the next
    observation's decode time; its frames are the ones new since the last observation."""
    sync = _with_undecodable_frame(CAMERAS[1])
    assert isinstance(sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0), Skip)
    assert sync.frames_decoded == len(CAMERAS)
    sync.add_image(CAMERAS[1], _image(2), 10.2, 10.2)
    assert isinstance(sync.build(now=10.2, max_image_age=1.0, max_state_age=1.0), Observation)
    assert sync.frames_decoded == len(CAMERAS) + 1
    assert sync.last_build_decoded == len(CAMERAS)      # both frames new to an observation
    assert sync.last_build_decode_s > 0.0


def _with_undecodable_frame(camera):
    """Fresh inputs at 10.0 s, then a 'yuv422' frame (unsupported) on `camera` at 10.1 s."""
    sync = _sync()
    _fill(sync, stamp=10.0)
    bad = _image(1)
    bad.encoding = 'yuv422'
    sync.add_image(camera, bad, 10.1, 10.1)
    return sync


def test_undecodable_frame_skips_the_tick_naming_the_topic():
    sync = _with_undecodable_frame(CAMERAS[1])
    skip = sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip)
    assert skip.topics == (CAMERAS[1],) and "'yuv422'" in str(skip)


def test_a_decode_error_that_names_its_topic_is_not_prefixed_with_it_again():
    """The decoders name the topic inside their message ("image on '<topic>': ..."): the
    skip reason carries it once."""
    sync = _with_undecodable_frame(CAMERAS[1])
    skip = sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    assert str(skip).count(CAMERAS[1]) == 1, str(skip)


def test_a_frame_below_min_image_size_is_refused_until_a_big_enough_one_arrives():
    sync = _sync(min_image_size=(4, 4))
    for topic in CAMERAS:
        sync.add_image(topic, _image(1, height=4, width=6), 10.0, 10.0)
    sync.add_joint_state(JOINTS, [0.1, 0.2, 0.3], 10.0, 10.0)
    assert isinstance(sync.build(now=10.0, max_image_age=1.0, max_state_age=1.0), Observation)
    sync.add_image(CAMERAS[1], _image(2, height=2, width=2), 10.1, 10.1)    # a broken driver
    skip = sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip) and skip.topics == (CAMERAS[1],)
    assert f'{CAMERAS[1]}: a 2x2 frame, smaller than min_image_size 4x4' in str(skip)
    # refused again, not kept as decoded, on the next build
    assert isinstance(sync.build(now=10.15, max_image_age=1.0, max_state_age=1.0), Skip)
    assert 'min_image_size' in sync.stats(now=10.15)[CAMERAS[1]].problem
    sync.add_image(CAMERAS[1], _image(3, height=5, width=4), 10.2, 10.2)
    obs = sync.build(now=10.2, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(obs, Observation) and obs.images[1].shape == (5, 4, 3)


def test_a_frame_too_large_for_the_receivers_slot_is_named_by_its_camera():
    from molmobot_policy.ros.frame_slots import RawFrame
    sync = _sync()
    _fill(sync)
    sync.add_joint_state(list(JOINTS), [0.1, 0.2, 0.3], 10.0, 10.0)
    big = RawFrame(2, 3, 'rgb8', 9, b'', too_large='a frame of 9437184 bytes does not fit')
    sync.add_image(CAMERAS[1], big, 10.1, 10.1)
    skip = sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip) and skip.topics == (CAMERAS[1],)
    assert str(skip).startswith(f'{CAMERAS[1]}: a frame of 9437184 bytes does not fit')


def test_min_image_size_must_be_two_non_negative_counts():
    for bad in ((-1, 4), (4,), (1, 2, 3)):
        with pytest.raises(ValueError, match='min_image_size'):
            _sync(min_image_size=bad)


def test_mismatched_joint_state_lengths_raise():
    with pytest.raises(ValueError, match='2 names but 1 positions'):
        _sync().add_joint_state(['joint_a', 'joint_b'], [1.0], 10.0, 10.0)


def test_unknown_camera_topic_raises():
    with pytest.raises(KeyError, match='/cam9'):
        _sync().add_image('/cam9', _image(1), 10.0, 10.0)


def test_bad_configuration_is_rejected():
    with pytest.raises(ValueError, match='camera_topics has duplicates'):
        ObservationSynchronizer(['/a', '/a'], JOINTS)
    with pytest.raises(ValueError, match='joint_names is empty'):
        ObservationSynchronizer(['/a'], [])


def test_the_receive_rate_starts_over_when_ros_time_starts_or_goes_back():
    """Messages received before /clock (ROS time 0) or before a jump back do not enter the
    rate of the new time base (a 1000 s span would read ~0 Hz until they age out)."""
    sync = _sync()
    for _ in range(5):                                  # sim time not started: received at 0
        sync.add_image(CAMERAS[0], _image(1), 0.0, 0.0)
    for k in range(3):
        t = 1000.0 + 0.1 * k
        sync.add_image(CAMERAS[0], _image(1), t, t)
    assert sync.stats(now=1000.2)[CAMERAS[0]].rate_hz == pytest.approx(10.0)
    for k in range(3):                                  # 10 s back
        t = 990.5 + 0.1 * k
        sync.add_image(CAMERAS[0], _image(1), t, t)
    assert sync.stats(now=990.7)[CAMERAS[0]].rate_hz == pytest.approx(10.0)
    assert sync.stats(now=990.7)[CAMERAS[0]].count == 11


def test_stats_report_rate_age_and_count_per_topic():
    sync = _sync()
    for k in range(11):
        t = 10.0 + 0.1 * k
        sync.add_image(CAMERAS[0], _image(1), t, t)
        sync.add_joint_state(JOINTS, [0, 0, 0], t, t)
    stats = sync.stats(now=11.0)
    assert stats[CAMERAS[0]].rate_hz == pytest.approx(10.0)
    assert stats[CAMERAS[0]].age == pytest.approx(0.0)
    assert stats[CAMERAS[0]].count == 11
    assert stats[CAMERAS[1]].count == 0 and stats[CAMERAS[1]].age is None
    assert stats['/joint_states'].rate_hz == pytest.approx(10.0)
    assert sync.stats(now=13.0)[CAMERAS[0]].rate_hz == pytest.approx(10 / 3.0)
    assert all(s.problem == '' for s in stats.values())


def test_stats_name_an_undecodable_camera_until_a_good_frame_decodes():
    sync = _with_undecodable_frame(CAMERAS[1])
    sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    problem = sync.stats(now=10.1)[CAMERAS[1]].problem
    assert problem.startswith('newest frame refused') and "'yuv422'" in problem
    assert sync.stats(now=10.1)[CAMERAS[0]].problem == ''
    sync.add_image(CAMERAS[1], _image(2), 10.2, 10.2)
    assert isinstance(sync.build(now=10.2, max_image_age=1.0, max_state_age=1.0), Observation)
    assert sync.stats(now=10.2)[CAMERAS[1]].problem == ''


def test_a_cameras_decode_fault_is_named_while_another_input_skips_the_tick():
    """Seventh fresh-user trial: a camera sending 16UC1 showed OK while another camera was
    missing (frames were decoded only once every other input passed), so the operator fixed
    one fault and then met the next."""
    sync = _sync()
    bad = _image(1)
    bad.encoding = 'yuv422'
    sync.add_image(CAMERAS[1], bad, 10.0, 10.0)
    sync.add_joint_state(JOINTS, [0.1, 0.2, 0.3], 10.0, 10.0)       # camera 0 never sends
    skip = sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip) and set(skip.topics) == set(CAMERAS)
    assert f'camera {CAMERAS[0]} has no image yet' in str(skip) and "'yuv422'" in str(skip)
    assert "'yuv422'" in sync.stats(now=10.1)[CAMERAS[1]].problem


def test_a_camera_switching_between_faults_is_never_shown_ok_in_between():
    """The trial saw a camera's status flick to OK at a switch 16UC1 -> yuv422: a frame of
    another layout cleared the problem before it was decoded."""
    sync = _with_undecodable_frame(CAMERAS[1])
    sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    other = _image(3)
    other.encoding = '16UC1'
    sync.add_image(CAMERAS[1], other, 10.15, 10.15)
    assert sync.stats(now=10.15)[CAMERAS[1]].problem != ''       # not yet judged: still named
    sync.build(now=10.2, max_image_age=1.0, max_state_age=1.0)
    assert "'16UC1'" in sync.stats(now=10.2)[CAMERAS[1]].problem


def test_a_fixed_camera_clears_at_the_next_build_even_while_a_joint_is_bad():
    sync = _with_undecodable_frame(CAMERAS[1])
    sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    sync.add_image(CAMERAS[1], _image(2), 10.2, 10.2)
    sync.add_joint_state(['joint_a'], [float('nan')], 10.2, 10.2)
    assert isinstance(sync.build(now=10.2, max_image_age=1.0, max_state_age=1.0), Skip)
    assert sync.stats(now=10.2)[CAMERAS[1]].problem == ''


def test_a_camera_lagging_the_others_beyond_max_image_spread_is_refused_and_named():
    """Seventh fresh-user trial: a camera stamped 0.4 s (and, with max_image_age raised, 2 s)
    behind the others was served in one observation with them."""
    sync = _sync()
    sync.add_image(CAMERAS[0], _image(1), 10.0, 10.0)
    sync.add_image(CAMERAS[1], _image(1), 9.6, 10.0)
    sync.add_joint_state(JOINTS, [0.1, 0.2, 0.3], 10.0, 10.0)
    skip = sync.build(now=10.05, max_image_age=1.0, max_state_age=1.0, max_image_spread=0.2)
    assert isinstance(skip, Skip) and skip.topics == (CAMERAS[1],)
    assert (f'camera {CAMERAS[1]} lags camera {CAMERAS[0]} by 0.400 s > max_image_spread '
            '0.200 s') in str(skip)
    assert 'lags' in sync.stats(now=10.05)[CAMERAS[1]].problem
    assert sync.stats(now=10.05)[CAMERAS[0]].problem == ''
    sync.add_image(CAMERAS[1], _image(2), 9.9, 10.1)              # back within the spread
    obs = sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0, max_image_spread=0.2)
    assert isinstance(obs, Observation) and obs.image_stamps == (10.0, 9.9)
    assert sync.stats(now=10.1)[CAMERAS[1]].problem == ''


def test_a_stale_camera_whose_frames_keep_arriving_is_told_apart_from_a_dead_one():
    sync = _sync()
    _fill(sync, stamp=10.0)
    sync.add_image(CAMERAS[1], _image(2), 10.5, 12.5)     # arrives now, stamped 2 s ago
    sync.add_joint_state(JOINTS, [0.1, 0.2, 0.3], 12.5, 12.5)
    skip = str(sync.build(now=12.5, max_image_age=0.5, max_state_age=0.5))
    assert f'camera {CAMERAS[1]} is stale: age 2.000 s' in skip
    assert "frames keep arriving (the newest 0.000 s ago) with stamps that old" in skip
    dead = skip.split('; ')[0]
    assert dead.startswith(f'camera {CAMERAS[0]} is stale') and 'keep arriving' not in dead


def test_no_image_yet_carries_the_input_hint():
    hints = {CAMERAS[0]: ': a publisher of sensor_msgs/msg/CompressedImage is on it'}
    sync = _sync(input_hint=lambda topic: hints.get(topic, ''))
    sync.add_image(CAMERAS[1], _image(1), 10.0, 10.0)
    skip = str(sync.build(now=10.0, max_image_age=1.0, max_state_age=1.0))
    assert (f'camera {CAMERAS[0]} has no image yet: a publisher of '
            'sensor_msgs/msg/CompressedImage is on it') in skip


def test_a_camera_changing_its_layout_is_logged_once_per_interval(caplog):
    sync = _sync()
    with caplog.at_level('WARNING', logger='molmobot_policy.inputs'):
        sync.add_image(CAMERAS[0], _image(1), 10.0, 10.0)
        sync.add_image(CAMERAS[0], _image(1), 10.1, 10.1)
        assert caplog.records == []                          # the same layout: nothing
        sync.add_image(CAMERAS[0], _image(1, 'mono8'), 10.2, 10.2)
        sync.add_image(CAMERAS[0], _image(1), 10.3, 10.3)    # within LAYOUT_LOG_S: held
        sync.add_image(CAMERAS[0], _image(1, 'mono8'), 10.4, 10.4)
        assert len(caplog.records) == 1
        sync.add_image(CAMERAS[0], _image(1, 'mono8'), 25.0, 25.0)   # told, though unchanged
        sync.add_image(CAMERAS[0], _image(1), 26.0, 26.0)
        sync.add_image(CAMERAS[0], _image(1), 40.0, 40.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith(f'camera {CAMERAS[0]}: frames changed from rgb8 2x3 to mono8 2x3')
    assert lines[1] == (f'camera {CAMERAS[0]}: frames changed layout 2 times since the last '
                        'such line and are mono8 2x3 again')
    assert 'from mono8 2x3 to rgb8 2x3' in lines[2]       # held back, told at the next frame


def test_a_camera_shrinking_below_min_image_size_is_told_refused_not_resized(caplog):
    sync = _sync(min_image_size=(2, 2))
    with caplog.at_level('WARNING', logger='molmobot_policy.inputs'):
        sync.add_image(CAMERAS[0], _image(1), 10.0, 10.0)
        sync.add_image(CAMERAS[0], _image(1, height=1, width=1), 10.1, 10.1)
    assert [r.getMessage() for r in caplog.records] == [
        f'camera {CAMERAS[0]}: frames changed from rgb8 2x3 to rgb8 1x1; frames smaller than '
        'min_image_size 2x2 are refused']


def test_a_camera_changing_to_an_unsupported_encoding_is_told_refused_not_resized(caplog):
    """A fresh-user trial: a camera switched to yuv422 was told 'resized as they come' while
    its frames were refused."""
    from molmobot_policy.ros.codec import SUPPORTED_ENCODINGS
    sync = _sync()
    with caplog.at_level('WARNING', logger='molmobot_policy.inputs'):
        sync.add_image(CAMERAS[0], _image(1), 10.0, 10.0)
        sync.add_image(CAMERAS[0], _image(1, 'yuv422'), 10.1, 10.1)
    assert [r.getMessage() for r in caplog.records] == [
        f'camera {CAMERAS[0]}: frames changed from rgb8 2x3 to yuv422 2x3; frames of encoding '
        f"'yuv422' are refused (supported: {list(SUPPORTED_ENCODINGS)})"]


def test_a_camera_back_to_its_first_layout_is_told_so(caplog):
    """A fresh-user re-check: a camera back to rgb8 after a refused yuv422 spell was told
    'resized as they come: is the camera configured as in training?'."""
    sync = _sync()
    with caplog.at_level('WARNING', logger='molmobot_policy.inputs'):
        sync.add_image(CAMERAS[0], _image(1), 10.0, 10.0)
        sync.add_image(CAMERAS[0], _image(1, 'yuv422'), 10.1, 10.1)
        sync.add_image(CAMERAS[0], _image(1), 25.0, 25.0)
    assert [r.getMessage() for r in caplog.records][1] == (
        f'camera {CAMERAS[0]}: frames changed from yuv422 2x3 to rgb8 2x3, the layout they '
        'first came with')


def test_a_second_layout_change_within_the_interval_is_told_when_it_ends(caplog):
    """Ninth fresh-user trial: rgb8 -> bgr8 -> mono8 within 10 s logged only the first change;
    the log said bgr8 while the camera sent mono8."""
    sync = _sync()
    with caplog.at_level('WARNING', logger='molmobot_policy.inputs'):
        sync.add_image(CAMERAS[0], _image(1), 10.0, 10.0)
        sync.add_image(CAMERAS[0], _image(1, 'bgr8'), 11.0, 11.0)
        sync.add_image(CAMERAS[0], _image(1, 'mono8'), 12.0, 12.0)
        for t in range(13, 30):
            sync.add_image(CAMERAS[0], _image(1, 'mono8'), float(t), float(t))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert 'from rgb8 2x3 to bgr8 2x3' in lines[0] and 'from bgr8 2x3 to mono8 2x3' in lines[1]


def test_a_stale_action_joint_names_the_refused_message():
    """The trial's first skip for future-stamped joint states said 'stale' without why."""
    sync = _sync()
    sync.add_joint_state(JOINTS, [0.1, 0.2, 0.3], 10.0, 10.0)
    sync.add_joint_state(JOINTS, [0.1, 0.2, 0.3], 12.0, 11.0)       # 1 s in the future
    problem = sync.position_problem(['joint_a'], now=11.0, max_age=0.5)
    assert 'is stale for action joints' in problem and 'in the future' in problem


def test_a_refused_joint_state_is_named_in_stats_and_in_the_skip():
    sync = _sync()
    for topic in CAMERAS:
        sync.add_image(topic, _image(1), 10.0, 10.0)
    with pytest.raises(ValueError):
        sync.add_joint_state(list(JOINTS), [0.1, 0.2], 10.0, 10.0)
    stats = sync.stats(now=10.0)['/joint_states']
    assert stats.count == 1 and '3 names but 2 positions' in stats.problem
    skip = sync.build(now=10.0, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip) and '3 names but 2 positions' in str(skip)
    sync.add_joint_state(list(JOINTS), [0.1, 0.2, 0.3], 10.1, 10.1)     # a good one clears it
    assert sync.stats(now=10.1)['/joint_states'].problem == ''


def test_a_joint_state_naming_a_used_joint_twice_is_refused_and_named():
    """Neither position of the repeated joint is used: the last good state stands while it
    is fresh (as for any refused message), then the skip names the refusal."""
    sync = _sync()
    for topic in CAMERAS:
        sync.add_image(topic, _image(1), 10.0, 10.0)
    sync.add_joint_state(list(JOINTS), [0.1, 0.2, 0.3], 10.0, 10.0)
    with pytest.raises(ValueError, match=r"joints \['joint_b'\] appear more than once"):
        sync.add_joint_state(list(JOINTS) + ['joint_b'], [0.1, 0.2, 0.3, 5.0], 10.1, 10.1)
    assert 'appear more than once' in sync.stats(now=10.1)['/joint_states'].problem
    obs = sync.build(now=10.1, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(obs, Observation) and obs.state.tolist() == pytest.approx([0.1, 0.2, 0.3])
    for topic in CAMERAS:
        sync.add_image(topic, _image(2), 11.5, 11.5)
    skip = sync.build(now=11.5, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(skip, Skip) and "['joint_b'] appear more than once" in str(skip)


def test_a_repeated_joint_the_node_does_not_use_is_accepted():
    sync = _sync()
    for topic in CAMERAS:
        sync.add_image(topic, _image(1), 10.0, 10.0)
    sync.add_joint_state(list(JOINTS) + ['other', 'other'], [0.1, 0.2, 0.3, 1.0, 2.0], 10.0,
                         10.0)
    assert sync.stats(now=10.0)['/joint_states'].problem == ''
    obs = sync.build(now=10.0, max_image_age=1.0, max_state_age=1.0)
    assert isinstance(obs, Observation) and obs.state.tolist() == pytest.approx([0.1, 0.2, 0.3])


def test_stats_name_configured_joints_that_never_arrive():
    sync = _sync()
    sync.add_joint_state(['joint_a', 'joint_b'], [0.1, 0.2], 10.0, 10.0)
    stats = sync.stats(now=10.0)['/joint_states']
    assert stats.age is None and stats.problem == "joints ['finger'] never received"


def test_joint_state_stats_give_each_joints_age_and_camera_stats_none():
    sync = _sync()
    sync.add_joint_state([JOINTS[0]], [0.1], stamp=10.0, received=10.0)
    sync.add_joint_state([JOINTS[1]], [0.2], stamp=11.0, received=11.0)
    stats = sync.stats(11.5)
    assert stats['/joint_states'].joint_ages == pytest.approx({JOINTS[0]: 1.5, JOINTS[1]: 0.5})
    assert stats[CAMERAS[0]].joint_ages is None
