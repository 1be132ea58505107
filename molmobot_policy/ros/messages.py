"""The policy node's messages, built from plain values (no node needed).

- `joint_trajectory`: a stitched chunk as `trajectory_msgs/JointTrajectory`, the output
  ros2_control's JointTrajectoryController consumes: header.stamp = when the first point
  executes, time_from_start of point j = j * control_period, joint_names in action order.
- `action_array`: the same points as `std_msgs/Float32MultiArray` (layout action x joint).
- `chunk_info`: one `diagnostic_msgs/DiagnosticStatus` per published chunk (~/chunk_info),
  its keys the `ChunkInfo` constants (the demo, tests and benchmarks read them by name).
"""
from __future__ import annotations

import numpy as np
from builtin_interfaces.msg import Duration as DurationMsg
from builtin_interfaces.msg import Time as TimeMsg
from diagnostic_msgs.msg import DiagnosticStatus, KeyValue
from std_msgs.msg import Float32MultiArray, MultiArrayDimension
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from molmobot_policy.timing import ChunkReport, StitchedChunk


class ChunkInfo:
    """Keys of ~/chunk_info's values (all strings; floats fixed-point)."""
    TICK = 'tick'                           # the tick's index on the schedule
    OBSERVATION_SEQ = 'observation_seq'
    OBSERVATION_STAMP = 'observation_stamp'     # s, ROS time
    OBSERVATION_AGE_MS = 'observation_age_ms'   # publish time - observation stamp
    INFERENCE_MS = 'inference_ms'
    PUBLISH_JITTER_MS = 'publish_jitter_ms'     # publish time - deadline
    POINTS = 'points'
    DROPPED = 'dropped'                     # actions in the past at publish time
    FRAMES_DECODED = 'frames_decoded'       # camera frames new to this chunk's observation
    DECODE_MS = 'decode_ms'                 # decode wall time since the previous chunk
    FIRST_ACTION = 'first_action'           # `format_action` of the first point
    VELOCITY_LIMITED = 'velocity_limited'   # (point, joint) values moved by max_joint_velocity
    POSITION_CLIPPED = 'position_clipped'   # ... by joint_position_min / _max
    START_OFFSET = 'start_offset'           # max |model's first point - arm|, robot
                                            # units, before the motion limits ('nan': no
                                            # joint anchored): asked for, not sent
    INSTRUCTION = 'instruction'             # the task text the chunk was computed for
    # with debug_timing only ('' where not measured): where a late publish's time went
    WAKE_LATE_MS = 'wake_late_ms'           # the last timed wait before the deadline, late by
    RUNQUEUE_WAIT_MS = 'runqueue_wait_ms'   # runnable without a CPU (Linux schedstat)
    PUBLISH_CALL_MS = 'publish_call_ms'
    TAIL_STALL_MS = 'tail_stall_ms'         # the deadline poll's longest gap (GIL elsewhere)
    START_LATE_MS = 'start_late_ms'         # the work began after the tick's start_at by
    OBSERVE_MS = 'observe_ms'               # building the observation
    PREPROCESS_MS = 'preprocess_ms'         # the inference's host part before the model
    MODEL_MS = 'model_ms'                   # the model, up to its actions on the host
    AFTER_PREDICT_MS = 'after_predict_ms'   # inference end -> the deadline wait
    DELAY = (WAKE_LATE_MS, RUNQUEUE_WAIT_MS, PUBLISH_CALL_MS, TAIL_STALL_MS, START_LATE_MS,
             OBSERVE_MS, PREPROCESS_MS, MODEL_MS, AFTER_PREDICT_MS)
    STALLED_THREADS = 'stalled_threads'     # the other threads after a gap > 1 ms (if any)
    STALL_ACCOUNT = 'stall_account'         # the worker's accounts over that gap (if any)


def stamp_seconds(stamp) -> float:
    """builtin_interfaces/Time -> float seconds."""
    return stamp.sec + stamp.nanosec * 1e-9


def _time_msg(seconds: float) -> TimeMsg:
    nanoseconds = int(round(seconds * 1e9))
    return TimeMsg(sec=nanoseconds // 10**9, nanosec=nanoseconds % 10**9)


def _duration_msg(seconds: float) -> DurationMsg:
    nanoseconds = int(round(seconds * 1e9))
    return DurationMsg(sec=nanoseconds // 10**9, nanosec=nanoseconds % 10**9)


def joint_trajectory(chunk: StitchedChunk, joint_names, control_period: float
                     ) -> JointTrajectory:
    """The chunk's points (K >= 1, float (K, A) robot units) for joints `joint_names` (A):
    header.stamp = chunk.times[0] (s, ROS time), time_from_start = j * control_period (s)."""
    msg = JointTrajectory(joint_names=list(joint_names))
    msg.header.stamp = _time_msg(float(chunk.times[0]))
    for j, position in enumerate(chunk.positions):      # the stitcher keeps the period
        msg.points.append(JointTrajectoryPoint(
            positions=[float(x) for x in position],
            time_from_start=_duration_msg(j * control_period)))
    return msg


def action_array(positions: np.ndarray) -> Float32MultiArray:
    """float (K, A) points -> Float32MultiArray, layout dims 'action' (K) x 'joint' (A)."""
    positions = np.asarray(positions)
    msg = Float32MultiArray()
    msg.layout.dim = [
        MultiArrayDimension(label='action', size=positions.shape[0], stride=positions.size),
        MultiArrayDimension(label='joint', size=positions.shape[1], stride=positions.shape[1])]
    msg.data = positions.astype(np.float32).ravel().tolist()
    return msg


def format_action(values) -> str:
    """One action vector as '[0.120, -0.003, ...]': fixed-point with 3 decimals on one line,
    whatever the values (numpy's array2string wraps at 75 characters and switches to
    scientific notation when small and large values mix, which split chunk log lines)."""
    return '[' + ', '.join(f'{float(v):.3f}' for v in values) + ']'


def key_values(values: dict) -> list[KeyValue]:
    """{key: value} -> [KeyValue(key, str(value))], in order."""
    return [KeyValue(key=k, value=str(v)) for k, v in values.items()]


def _ms(seconds) -> str:
    """A duration in s as milliseconds with 3 decimals; '' for None (not measured)."""
    return '' if seconds is None else f'{seconds * 1e3:.3f}'


def chunk_info(report: ChunkReport, name: str, frames_decoded: int,
               decode_s: float) -> DiagnosticStatus:
    """~/chunk_info for one published chunk: level OK, name '<name>: chunk', the
    `ChunkInfo` keys; the delay keys only when the report carries delay clues.
    `frames_decoded`: the observation's camera frames new since the previous chunk's;
    `decode_s`: s spent decoding since the previous chunk (reported as decode_ms, 3 decimals)."""
    values = {
        ChunkInfo.TICK: report.tick, ChunkInfo.OBSERVATION_SEQ: report.observation_seq,
        ChunkInfo.OBSERVATION_STAMP: f'{report.observation_stamp:.6f}',
        ChunkInfo.OBSERVATION_AGE_MS: f'{report.observation_age_ms:.1f}',
        ChunkInfo.INFERENCE_MS: f'{report.inference_ms:.1f}',
        ChunkInfo.PUBLISH_JITTER_MS: f'{report.publish_jitter_ms:.3f}',
        ChunkInfo.POINTS: len(report.positions), ChunkInfo.DROPPED: report.dropped,
        ChunkInfo.FRAMES_DECODED: frames_decoded, ChunkInfo.DECODE_MS: _ms(decode_s),
        ChunkInfo.FIRST_ACTION: format_action(report.positions[0]),
        ChunkInfo.VELOCITY_LIMITED: report.velocity_limited,
        ChunkInfo.POSITION_CLIPPED: report.position_clipped,
        ChunkInfo.START_OFFSET: f'{report.start_offset:.4f}',
        ChunkInfo.INSTRUCTION: report.instruction}
    if report.delay is not None:
        values.update({ChunkInfo.WAKE_LATE_MS: _ms(report.delay.wake_late),
                       ChunkInfo.RUNQUEUE_WAIT_MS: _ms(report.delay.runqueue_wait),
                       ChunkInfo.PUBLISH_CALL_MS: _ms(report.delay.publish_call),
                       ChunkInfo.TAIL_STALL_MS: _ms(report.delay.tail_stall),
                       ChunkInfo.START_LATE_MS: _ms(report.delay.start_late),
                       ChunkInfo.OBSERVE_MS: _ms(report.delay.observe),
                       ChunkInfo.PREPROCESS_MS: _ms(report.delay.preprocess),
                       ChunkInfo.MODEL_MS: _ms(report.delay.model),
                       ChunkInfo.AFTER_PREDICT_MS: _ms(report.delay.after_predict)})
        if report.delay.stalled_threads:
            values[ChunkInfo.STALLED_THREADS] = report.delay.stalled_threads
        if report.delay.stall_account:
            values[ChunkInfo.STALL_ACCOUNT] = report.delay.stall_account
    return DiagnosticStatus(level=DiagnosticStatus.OK, name=f'{name}: chunk', hardware_id=name,
                            message=f'chunk {report.count}', values=key_values(values))
