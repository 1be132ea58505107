"""camera_receiver: subprocess: a child process (node <name>_camera_receiver) receives the
cameras and passes the newest frames through shared memory; the node in this process (its
own rclpy context, a stand-in engine, a peer publishing two cameras and the joint state)
publishes chunks of those frames, names a dead receiver in its skip reason and keeps
running, and leaves no shared-memory segment behind."""
from __future__ import annotations

import os
import signal

import pytest

rclpy = pytest.importorskip('rclpy')

from molmobot_policy.ros.messages import ChunkInfo  # noqa: E402
from molmobot_policy.ros.parameters import PARAMETERS, ParameterError  # noqa: E402

from _robot_inputs import RecordingGraph, graphs  # noqa: E402

pytestmark = pytest.mark.timeout(120)

JOINTS = [f'joint_{k}' for k in range(7)]
CAMERAS = ['/camproc_cam0', '/camproc_cam1']
JOINT_STATES = '/camproc_joint_states'


class _Graph(RecordingGraph):
    """The node with camera_receiver: subprocess (unless given); `messages` / `values`: the node's
    /diagnostics statuses' messages and key values so far."""

    def __init__(self, name: str, **kwargs) -> None:
        self.closed = False
        super().__init__(name, CAMERAS, JOINT_STATES, JOINTS,
                         **{'camera_receiver': 'subprocess', **kwargs})
        self.receiver = self.policy._receiver       # None: received in process
        self.segment = self.receiver and f'/dev/shm/{self.receiver.segment}'

    def _mine(self):
        return [s for a in self.diagnostics for s in a.status
                if s.name.startswith(f'{self.name}: ')]

    @property
    def messages(self) -> list[str]:
        return [s.message for s in self._mine()]

    @property
    def values(self) -> list[str]:
        return [kv.value for s in self._mine() for kv in s.values]

    def wait_for(self, predicate, timeout: float = 60.0) -> bool:    # a child process starts
        return super().wait_for(predicate, timeout)

    def close(self) -> None:        # also called by a test; the fixture closes it again
        if not self.closed:
            self.closed = True
            super().close()


@pytest.fixture
def graph():
    yield from graphs(_Graph)


def _segments() -> set[str]:
    return {n for n in os.listdir('/dev/shm') if n.startswith('molmobot_frames_')}


def test_chunks_come_from_frames_the_receiver_process_passes_on(graph):
    g = graph('camproc_chunks')
    assert g.wait_for(lambda: len(g.infos) >= 3)
    # every chunk decoded one fresh frame per camera, taken out of the shared memory
    assert all(info[ChunkInfo.FRAMES_DECODED] == str(len(CAMERAS)) for info in g.infos[1:])
    subscribers = {i.node_name for t in CAMERAS
                   for i in g.peer.get_subscriptions_info_by_topic(t)}
    assert subscribers == {'camproc_chunks_camera_receiver'}    # not the policy node
    # named for ps / `pgrep -x camera_receiver`, and its pid on /diagnostics
    with open(f'/proc/{g.receiver.pid}/comm') as comm:
        assert comm.read().strip() == 'camera_receiver'
    assert g.wait_for(lambda: any(f'pid {g.receiver.pid}' in v for v in g.values))


def test_compressed_cameras_pass_through_the_receiver_and_are_decoded_in_the_node(graph):
    g = graph('camproc_jpeg', camera_transports=['compressed'])
    assert g.wait_for(lambda: len(g.infos) >= 3)
    assert all(info[ChunkInfo.FRAMES_DECODED] == str(len(CAMERAS)) for info in g.infos[1:])
    assert all(float(info[ChunkInfo.DECODE_MS]) > 0 for info in g.infos[1:])
    subscribers = {i.node_name for t in CAMERAS
                   for i in g.peer.get_subscriptions_info_by_topic(f'{t}/compressed')}
    assert subscribers == {'camproc_jpeg_camera_receiver'}


@pytest.mark.parametrize('receiver', ['subprocess', 'in_process'])
def test_remapped_cameras_are_received_and_named_as_the_node_resolves_them(graph, receiver):
    """camera_topics relative names remapped on the node's command line onto the peer's
    topics: the child (whose own node has no command line) subscribes what the policy node
    resolves, so frames arrive; /diagnostics names the topics the frames come on."""
    remaps = [f'cam{k}_in:={topic}' for k, topic in enumerate(CAMERAS)]
    g = graph(f'camproc_remap_{receiver}', camera_topics=['cam0_in', 'cam1_in'],
              camera_receiver=receiver,
              cli_args=['--ros-args'] + [arg for rule in remaps for arg in ('-r', rule)])
    assert g.wait_for(lambda: len(g.infos) >= 3)
    assert all(info[ChunkInfo.FRAMES_DECODED] == str(len(CAMERAS)) for info in g.infos[1:])
    subscribers = {i.node_name for t in CAMERAS
                   for i in g.peer.get_subscriptions_info_by_topic(t)}
    node = f'camproc_remap_{receiver}' + ('_camera_receiver' if receiver == 'subprocess' else '')
    assert subscribers == {node}
    with g.lock:
        names = [s.name for a in g.diagnostics for s in a.status]
    assert all(any(topic in n for n in names) for topic in CAMERAS), names
    assert not any('cam0_in' in n or 'cam1_in' in n for n in names), names


def test_a_receiver_process_that_dies_is_named_restarted_and_chunks_resume(graph):
    """SIGKILL to the receiver child: the node names the exit (the skip reason, /diagnostics),
    keeps running, starts a new child on a new segment, and chunks of fresh frames resume;
    the old segment is removed."""
    g = graph('camproc_dies')
    assert g.wait_for(lambda: len(g.infos) >= 1)
    old_pid, old_segment = g.receiver.pid, g.segment
    os.kill(old_pid, signal.SIGKILL)
    reason = 'camera receiver process exited with code -9'
    # on /diagnostics: while it is down (a skip reason), and after the restart in the
    # 'inference' status's receiver entry
    assert g.wait_for(lambda: any(reason in m for m in g.messages + g.values))
    assert g.wait_for(lambda: g.receiver.pid not in (None, old_pid) and g.receiver.restarts == 1)
    assert not os.path.exists(old_segment)
    with g.lock:
        chunks = len(g.infos)
    # chunks resume with frames from the new child (the first ones may still use the old
    # child's last frames while they are younger than max_image_age)
    assert g.wait_for(lambda: any(info[ChunkInfo.FRAMES_DECODED] == str(len(CAMERAS))
                                  for info in g.infos[chunks:]))
    assert g.policy.loop._thread.is_alive()
    # the 'inference' status's receiver entry names the new child and the restart
    assert g.wait_for(lambda: any(f'pid {g.receiver.pid}' in v and 'restarted 1 times (the '
                                  f'last exit: {reason})' in v for v in g.values))


def test_deactivate_and_destroy_stop_the_receiver_and_remove_its_shared_memory(graph):
    g = graph('camproc_cleanup')
    receiver, segment = g.receiver, g.segment
    process = receiver._process
    assert os.path.exists(segment)
    assert g.wait_for(lambda: len(g.infos) >= 1)
    g.in_executor(g.policy.trigger_deactivate)
    assert process.exitcode is not None
    assert not os.path.exists(segment)
    g.in_executor(g.policy.trigger_activate)        # a new receiver, a new segment
    receiver = g.policy._receiver
    segment, process = f'/dev/shm/{receiver.segment}', receiver._process
    assert os.path.exists(segment)
    count = len(g.infos)
    assert g.wait_for(lambda: len(g.infos) > count)
    g.close()                               # destroy_node while active
    assert process.exitcode is not None
    assert not os.path.exists(segment)
    assert not any(s.endswith(str(os.getpid())) for s in _segments())


def test_auto_is_the_default_and_receives_in_a_child_process(graph):
    assert PARAMETERS['camera_receiver'][0] == 'auto'
    g = graph('camproc_auto', camera_receiver='auto')     # /dev/shm here: gigabytes free
    # chunks of fresh frames from every camera, which only the child process receives (on a
    # loaded 2-core machine a chunk may find one camera without a new frame: not counted)
    assert g.wait_for(lambda: sum(info[ChunkInfo.FRAMES_DECODED] == str(len(CAMERAS))
                                  for info in g.infos[1:]) >= 2)
    subscribers = {i.node_name for t in CAMERAS
                   for i in g.peer.get_subscriptions_info_by_topic(t)}
    assert subscribers == {'camproc_auto_camera_receiver'}
    assert g.wait_for(lambda: any(v.startswith('subprocess (auto: the system clock, ')
                                  and f'pid {g.receiver.pid}' in v for v in g.values))


def test_auto_with_use_sim_time_receives_in_process_and_says_why():
    g = RecordingGraph('camproc_auto_sim', CAMERAS, JOINT_STATES, JOINTS,
                       camera_receiver='auto', use_sim_time=True)
    try:
        assert g.policy._receiver is None
        subscribers = {i.node_name for t in CAMERAS
                       for i in g.peer.get_subscriptions_info_by_topic(t)}
        assert subscribers == {'camproc_auto_sim'}
        assert g.policy._mode()['camera_receiver'].startswith('in_process (auto: use_sim_time')
    finally:
        g.close()


def test_subprocess_with_use_sim_time_is_refused_naming_both_parameters():
    from molmobot_policy.ros.parameters import check_parameter_values
    values = {name: default for name, (default, _) in PARAMETERS.items()}
    values.update(camera_receiver='subprocess', use_sim_time=True)
    with pytest.raises(ParameterError, match='use_sim_time') as info:
        check_parameter_values(values.get)
    assert info.value.name == 'camera_receiver'
    values.update(use_sim_time=False)
    check_parameter_values(values.get)
    values.update(camera_receiver='thread')
    with pytest.raises(ParameterError,
                       match="not one of \\['auto', 'in_process', 'subprocess'\\]"):
        check_parameter_values(values.get)


def test_a_ctrl_c_while_the_receiver_process_starts_does_not_end_it():
    """A Ctrl-C reaches the whole process group, the receiver child included, and may come
    while the child is still starting (its interpreter importing the package, before it
    ignores SIGINT itself): it starts with SIGINT blocked, so it neither dies nor prints a
    KeyboardInterrupt traceback there; the parent stops it."""
    import time

    from molmobot_policy.ros.camera_receiver import CameraReceiver
    receiver = CameraReceiver('ctrl_c_test', '/', [('/ctrl_c_test_cam/image_raw', False)],
                              'sensor_data')
    receiver.start()
    try:
        time.sleep(0.02)                    # the spawned interpreter is still starting
        os.kill(receiver.pid, signal.SIGINT)
        assert receiver.wait_ready(30.0), 'the receiver did not subscribe after the SIGINT'
        assert receiver.problem() == ''
    finally:
        receiver.stop()
