"""ros/messages.py: the JointTrajectory a JointTrajectoryController consumes, the optional
Float32MultiArray, and ~/chunk_info with its keys (the delay clues only with debug_timing)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip('rclpy')

from molmobot_policy.ros.messages import (ChunkInfo, action_array, chunk_info,  # noqa: E402
                                          joint_trajectory, stamp_seconds)
from molmobot_policy.timing import ChunkReport, DelayClues, StitchedChunk  # noqa: E402

JOINTS = ['shoulder', 'elbow', 'wrist']


def _chunk(first_time: float = 1234.5678901234, points: int = 4) -> StitchedChunk:
    times = first_time + 0.1 * np.arange(points)
    positions = np.arange(points * len(JOINTS), dtype=np.float64).reshape(points, -1) / 7
    return StitchedChunk(times=times, positions=positions, dropped=2, first_index=2)


def _report(delay=None) -> ChunkReport:
    return ChunkReport(tick=12, observation_seq=40, observation_stamp=1234.3,
                       observation_age_ms=255.25, inference_ms=71.04, publish_jitter_ms=0.4321,
                       positions=_chunk().positions, dropped=2, count=9, delay=delay)


def test_the_trajectory_is_stamped_with_its_first_point_and_spaced_by_the_control_period():
    chunk = _chunk()
    msg = joint_trajectory(chunk, JOINTS, control_period=0.1)
    assert list(msg.joint_names) == JOINTS
    stamp_ns = msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec
    assert stamp_ns == round(chunk.times[0] * 1e9)
    offsets = [p.time_from_start.sec * 10**9 + p.time_from_start.nanosec for p in msg.points]
    assert offsets == [round(j * 0.1 * 1e9) for j in range(4)]
    assert np.array([p.positions for p in msg.points]).tolist() == chunk.positions.tolist()


def test_a_time_past_a_whole_second_carries_into_sec():
    msg = joint_trajectory(_chunk(first_time=9.9999999996, points=1), JOINTS, 0.1)
    assert (msg.header.stamp.sec, msg.header.stamp.nanosec) == (10, 0)
    assert stamp_seconds(msg.header.stamp) == 10.0


def test_the_float_array_is_action_by_joint_row_major():
    positions = _chunk().positions
    msg = action_array(positions)
    (action, joint) = msg.layout.dim
    assert (action.label, action.size, action.stride) == ('action', 4, 12)
    assert (joint.label, joint.size, joint.stride) == ('joint', 3, 3)
    assert np.allclose(np.array(msg.data).reshape(4, 3), positions, atol=1e-6)


def test_chunk_info_without_debug_timing_has_no_delay_keys():
    info = chunk_info(_report(), 'policy', frames_decoded=8, decode_s=0.0123456)
    values = {kv.key: kv.value for kv in info.values}
    assert (info.name, info.hardware_id, info.message) == ('policy: chunk', 'policy', 'chunk 9')
    assert set(values) == {ChunkInfo.TICK, ChunkInfo.OBSERVATION_SEQ,
                           ChunkInfo.OBSERVATION_STAMP, ChunkInfo.OBSERVATION_AGE_MS,
                           ChunkInfo.INFERENCE_MS, ChunkInfo.PUBLISH_JITTER_MS,
                           ChunkInfo.POINTS, ChunkInfo.DROPPED, ChunkInfo.FRAMES_DECODED,
                           ChunkInfo.DECODE_MS, ChunkInfo.FIRST_ACTION,
                           ChunkInfo.VELOCITY_LIMITED, ChunkInfo.POSITION_CLIPPED,
                           ChunkInfo.START_OFFSET, ChunkInfo.INSTRUCTION}
    assert values[ChunkInfo.TICK] == '12' and values[ChunkInfo.POINTS] == '4'
    assert float(values[ChunkInfo.OBSERVATION_STAMP]) == 1234.3
    assert values[ChunkInfo.FRAMES_DECODED] == '8' and values[ChunkInfo.DROPPED] == '2'
    assert values[ChunkInfo.DECODE_MS] == '12.346'          # ms, 3 decimals
    assert values[ChunkInfo.FIRST_ACTION] == '[0.000, 0.143, 0.286]'


def test_chunk_info_with_debug_timing_carries_the_delay_clues_in_ms():
    info = chunk_info(_report(DelayClues(wake_late=0.0021, runqueue_wait=None,
                                         publish_call=0.00005, tail_stall=0.0031,
                                         stalled_threads='executor: spin x.py:3')),
                      'policy', 8, 0.0)
    values = {kv.key: kv.value for kv in info.values}
    assert [values[k] for k in ChunkInfo.DELAY] == ['2.100', '', '0.050', '3.100'] + [''] * 5
    assert values[ChunkInfo.STALLED_THREADS] == 'executor: spin x.py:3'


def test_chunk_info_with_debug_timing_carries_the_works_parts_in_ms():
    info = chunk_info(_report(DelayClues(wake_late=None, runqueue_wait=None,
                                         publish_call=0.00005, start_late=0.0004,
                                         observe=0.0021, preprocess=0.0025, model=0.0491,
                                         after_predict=0.0003)), 'policy', 8, 0.0)
    values = {kv.key: kv.value for kv in info.values}
    assert [values[k] for k in (ChunkInfo.START_LATE_MS, ChunkInfo.OBSERVE_MS,
                                ChunkInfo.PREPROCESS_MS, ChunkInfo.MODEL_MS,
                                ChunkInfo.AFTER_PREDICT_MS)] == \
        ['0.400', '2.100', '2.500', '49.100', '0.300']


def test_chunk_info_names_no_threads_without_a_stall():
    info = chunk_info(_report(DelayClues(wake_late=None, runqueue_wait=None,
                                         publish_call=0.00005, tail_stall=None)),
                      'policy', 8, 0.0)
    values = {kv.key: kv.value for kv in info.values}
    assert values[ChunkInfo.TAIL_STALL_MS] == ''
    assert ChunkInfo.STALLED_THREADS not in values


def test_chunk_info_carries_the_motion_limits_counts():
    report = ChunkReport(tick=1, observation_seq=2, observation_stamp=1.0,
                         observation_age_ms=1.0, inference_ms=1.0, publish_jitter_ms=0.0,
                         positions=_chunk().positions, dropped=0, count=1, velocity_limited=5,
                         position_clipped=2, start_offset=1.98761)
    values = {kv.key: kv.value for kv in chunk_info(report, 'policy', 8, 0.0).values}
    assert (values[ChunkInfo.VELOCITY_LIMITED], values[ChunkInfo.POSITION_CLIPPED],
            values[ChunkInfo.START_OFFSET]) == ("5", "2", "1.9876")
