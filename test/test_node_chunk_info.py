"""The node's wiring in this process (its own rclpy context, a stand-in engine, a peer node
publishing two cameras and the joint state): ~/chunk_info per chunk (the frames decoded and
their decode time), its delay clues only with debug_timing, and /diagnostics naming every
input."""
from __future__ import annotations

import math
import threading

import pytest

rclpy = pytest.importorskip('rclpy')
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from molmobot_policy.ros.messages import ChunkInfo  # noqa: E402
from molmobot_policy.ros.node import PolicyNode  # noqa: E402

from _robot_inputs import (InProcessGraph, StandInEngine, graphs,  # noqa: E402
                           publish_robot_inputs)

pytestmark = pytest.mark.timeout(60)

JOINTS = [f'joint_{k}' for k in range(7)]
CAMERAS = ['/chunk_info_cam0', '/chunk_info_cam1']
JOINT_STATES = '/chunk_info_joint_states'


class _Engine(StandInEngine):
    """The tiny preset's contract; actions = the observation's seq."""

    def action_value(self, observation) -> float:
        return float(observation.seq)


class _Graph(InProcessGraph):
    """A PolicyNode and a peer spinning in one executor thread; the peer records."""

    def __init__(self, name: str, **parameters) -> None:
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.policy = PolicyNode(engine_factory=_Engine, node_name=name, context=self.context,
                                 parameter_overrides=[Parameter(k, value=v) for k, v in dict(
                                     autostart=False, camera_topics=CAMERAS, joint_names=JOINTS,
                                     action_joint_names=JOINTS, instruction='pick',
                                     allow_random_weights=True,
                                     joint_state_topic=JOINT_STATES,
                                     chunk_period=0.2, control_period=0.05,
                                     diagnostics_period=0.2, gc_freeze=False,
                                     **parameters).items()])
        self.peer = rclpy.create_node(f'{name}_peer', context=self.context)
        self.lock = threading.Lock()
        self.infos, self.diagnostics = [], []
        self.peer.create_subscription(DiagnosticStatus, f'/{name}/chunk_info', self._on_info, 10)
        self.peer.create_subscription(DiagnosticArray, '/diagnostics', self._on_diagnostics, 10)
        publish_robot_inputs(self.peer, CAMERAS, JOINT_STATES, JOINTS, period=0.05,
                             height=4, width=4)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.policy)
        self.executor.add_node(self.peer)
        assert self.policy.autostart()
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def _on_info(self, msg):
        with self.lock:
            self.infos.append({kv.key: kv.value for kv in msg.values})

    def _on_diagnostics(self, msg):
        with self.lock:
            self.diagnostics.append(msg)


@pytest.fixture
def graph():
    yield from graphs(_Graph)


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
