"""The node's wiring in this process (its own rclpy context, a stand-in engine, a peer node
publishing two cameras and the joint state): ~/chunk_info per chunk (the frames decoded and
their decode time), its delay clues only with debug_timing, and /diagnostics naming every
input."""
from __future__ import annotations

import math

import pytest

rclpy = pytest.importorskip('rclpy')

from molmobot_policy.ros.messages import ChunkInfo  # noqa: E402

from _robot_inputs import RecordingGraph, StandInEngine, graphs  # noqa: E402

pytestmark = pytest.mark.timeout(60)

JOINTS = [f'joint_{k}' for k in range(7)]
CAMERAS = ['/chunk_info_cam0', '/chunk_info_cam1']
JOINT_STATES = '/chunk_info_joint_states'


class _Engine(StandInEngine):
    """The tiny preset's contract; actions = the observation's seq."""

    def action_value(self, observation) -> float:
        return float(observation.seq)


def _graph(name: str, **parameters) -> RecordingGraph:
    return RecordingGraph(name, CAMERAS, JOINT_STATES, JOINTS, engine=_Engine, **parameters)


@pytest.fixture
def graph():
    yield from graphs(_graph)


def test_chunk_info_without_debug_timing_has_no_delay_clues(graph):
    g = graph('chunk_info_plain')
    assert g.wait_for(lambda: len(g.infos) >= 2)
    assert all(not set(ChunkInfo.DELAY) & set(info) for info in g.infos)


def test_chunk_info_reports_the_frames_decoded_and_their_decode_time(graph):
    g = graph('chunk_info_decode')
    assert g.wait_for(lambda: len(g.infos) >= 2)
    # the peer publishes faster than the chunk period: every chunk decodes fresh frames
    assert all(info[ChunkInfo.FRAMES_DECODED] == str(len(CAMERAS)) for info in g.infos)
    assert all(float(info[ChunkInfo.DECODE_MS]) > 0.0 for info in g.infos)


def test_chunk_info_names_the_instruction_each_chunk_was_computed_for(graph):
    """Eighth fresh-user trial: after a run-time change of 'instruction' nothing said which
    chunk first used it."""
    from rclpy.parameter import Parameter
    g = graph('chunk_info_instruction')
    assert g.wait_for(lambda: len(g.infos) >= 1)
    first = g.infos[0][ChunkInfo.INSTRUCTION]
    assert first == g.policy.get_parameter('instruction').value
    assert g.policy.set_parameters([Parameter('instruction', value='open the drawer')])[0] \
        .successful
    assert g.wait_for(lambda: g.infos[-1][ChunkInfo.INSTRUCTION] == 'open the drawer')


def test_chunk_info_with_debug_timing_has_the_delay_clues(graph):
    g = graph('chunk_info_debug', debug_timing=True)
    assert g.wait_for(lambda: len(g.infos) >= 2)
    for info in g.infos:
        assert set(ChunkInfo.DELAY) <= set(info)
        assert math.isfinite(float(info[ChunkInfo.PUBLISH_CALL_MS]))    # always measured
        if info[ChunkInfo.WAKE_LATE_MS] == '':        # no timed wait, so no run-queue mark
            assert info[ChunkInfo.RUNQUEUE_WAIT_MS] == ''


def test_diagnostics_name_every_input_the_inference_and_the_schedule(graph):
    g = graph('chunk_info_diagnostics')
    assert g.wait_for(lambda: any(len(a.status) == len(CAMERAS) + 4 for a in g.diagnostics))
    with g.lock:
        names = [s.name for s in g.diagnostics[-1].status]
    assert names == ([f'chunk_info_diagnostics: camera {t}' for t in CAMERAS]
                     + [f'chunk_info_diagnostics: joint state {JOINT_STATES}',
                        'chunk_info_diagnostics: inference', 'chunk_info_diagnostics: schedule',
                        'chunk_info_diagnostics: output'])
