"""The cameras received in a process of their own (`camera_receiver: subprocess`).

The policy node's executor thread would otherwise turn every camera message (8 cameras x
30 Hz of 921 KB rgb8 frames) into a Python message and run a callback for it, holding the
GIL its worker needs between the CUDA calls of inference. Here a child process (its own
interpreter, its own rclpy context and node `<node>_camera_receiver` in the node's
namespace, the node's camera topics, transports and QoS) subscribes the cameras and writes
each message into its camera's slot of a `ros.frame_slots.FrameSlots` segment, with its
header stamp and the receive time on the child's system clock. The policy process copies
the newest frame of each camera out (`CameraReceiver.poll`: the worker before each
observation, the diagnostics before each update) into its `ObservationSynchronizer`, which
applies every input rule (unset, future and older stamps, stale and undecodable frames) as
for a message received in the node; frames overwritten between two polls are counted in
its receive statistics but never offered.

Only the system clock: the receive times come from the child's clock, which does not
follow /clock; the node refuses `subprocess` with use_sim_time (`ros.parameters`), and
`auto` (the default) receives in process there, or where /dev/shm lacks room for the slots
(`choose_receiver`).

Lifetime: `start` creates the segment (a unique name) and starts the child ('spawn'
start method: no fork of a process with CUDA and DDS threads); `stop` asks it to end,
kills it after STOP_TIMEOUT_S, and unlinks the segment. The child also ends when its
parent is gone. A child that exits is reported by `problem` ("camera receiver process
exited with code N"): the node skips its ticks with that reason and keeps running.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import NamedTuple

from molmobot_policy.ros.frame_slots import DEFAULT_CAPACITY, FrameSlots, slot_bytes

STOP_TIMEOUT_S = 5.0        # the child's time to end after being asked, before SIGKILL
SPIN_TIMEOUT_S = 0.1        # the child checks its stop event and its parent this often
SHM_DIR = '/dev/shm'        # where the segment lives (Python's shared_memory on Linux)
SHM_HEADROOM = 32 * 1024 * 1024   # bytes left free beside the slots: Fast DDS's segments
                                  # (config/fastdds_large_images.xml: 16 MiB per process)


def shm_free(path: str = SHM_DIR) -> int | None:
    """Bytes free in the shared-memory filesystem at `path`, None where there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class ReceiverChoice(NamedTuple):
    """Where the cameras are received (`choose_receiver`): mode 'in_process' or 'subprocess';
    reason, for the log and the 'inference' status; warning: the choice may fail at run time
    (log it as a warning)."""
    mode: str
    reason: str
    warning: bool = False


def choose_receiver(setting: str, use_sim_time: bool, cameras: int, free: int | None,
                    capacity: int = DEFAULT_CAPACITY) -> ReceiverChoice:
    """Where the cameras are received, for the camera_receiver parameter `setting` ('auto',
    'in_process', 'subprocess').

    free: bytes free in /dev/shm (`shm_free`), None where there is none. 'auto' receives in a
    child process unless use_sim_time is set (its receive times are on the system clock) or
    /dev/shm cannot hold every slot full (`cameras` x `capacity` bytes plus SHM_HEADROOM: a
    write into a full tmpfs kills the writer with SIGBUS). An explicit setting is kept;
    `subprocess` without that room comes with a warning.
    """
    need = cameras * slot_bytes(capacity) + SHM_HEADROOM
    room = free is not None and free >= need
    space = (f'no {SHM_DIR}' if free is None else
             f'{free / 2**20:.0f} MiB free in {SHM_DIR} for {need / 2**20:.0f} MiB ({cameras} '
             f'cameras x {capacity / 2**20:.0f} MiB + {SHM_HEADROOM // 2**20} MiB for DDS)')
    if setting == 'in_process':
        return ReceiverChoice('in_process', 'set')
    if setting == 'subprocess':
        if room:
            return ReceiverChoice('subprocess', 'set')
        return ReceiverChoice('subprocess', f'set, with {space}: the receiver process dies if '
                              'the frames fill it', warning=True)
    if use_sim_time:
        return ReceiverChoice('in_process', 'auto: use_sim_time is set and the receiver '
                              'process stamps on the system clock')
    if not room:
        return ReceiverChoice('in_process', f'auto: {space}')
    return ReceiverChoice('subprocess', f'auto: the system clock, {space}')


class CameraReceiver:
    """The receiver child of one activation (policy-process side).

    Args:
        node_name: the policy node's name (the child's node is `<node_name>_camera_receiver`).
        namespace: the policy node's namespace.
        cameras: (topic to subscribe, compressed?) per camera, in camera order
            (`ros.parameters.camera_subscriptions`), fully qualified as the policy node
            resolves them (its remap rules, namespace and `~` applied: the child's own node
            has none of its command line); also the names frames are offered under.
        camera_qos: 'sensor_data' or 'reliable' (the camera_qos parameter).
        capacity: data bytes per camera slot.
    """

    def __init__(self, node_name: str, namespace: str, cameras, camera_qos: str,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self.node_name = f'{node_name}_camera_receiver'
        self._namespace, self._cameras = namespace, list(cameras)
        self._qos, self._capacity = camera_qos, capacity
        self._slots: FrameSlots | None = None
        self._process = None
        self._stop = self._ready = None
        self._seen = [0] * len(self._cameras)     # the last message count read per camera
        # poll, restart: worker and diagnostics threads (reentrant: restart calls stop)
        self._lock = threading.RLock()
        self.restarts = 0

    @property
    def segment(self) -> str | None:
        """The shared-memory segment's name while started, else None."""
        return None if self._slots is None else self._slots.name

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Create the segment and start the child (returns at once: the child subscribes
        once its interpreter and rclpy have started)."""
        context = multiprocessing.get_context('spawn')
        self._slots = FrameSlots.create(len(self._cameras), self._capacity)
        try:
            self._stop, self._ready = context.Event(), context.Event()
            self._process = context.Process(
                target=run_receiver, name=self.node_name, daemon=True,
                args=(self.node_name, self._namespace, self._cameras, self._qos,
                      self._slots.name, self._capacity, self._stop, os.getpid(),
                      self._ready))
            # the child starts with SIGINT blocked (the mask survives the spawn's exec): a
            # Ctrl-C, which reaches the whole process group, does not interrupt its start-up
            # imports with a traceback before run_receiver ignores SIGINT
            masked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                self._process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, masked)
        except BaseException:
            self._slots.unlink()
            self._slots = None
            raise

    def wait_ready(self, timeout: float, stop=None) -> bool:
        """Wait up to `timeout` s until the child has subscribed every camera (its
        interpreter, rclpy and the subscriptions take ~1 s, several on a busy machine); False
        when it has not by then, has exited, or `stop` (a threading.Event: a stop request) is
        set."""
        deadline = time.monotonic() + timeout
        while self._ready is not None and not self._ready.wait(0.05):
            if self.problem() or time.monotonic() > deadline or (stop is not None
                                                                 and stop.is_set()):
                return False
        return self._ready is not None

    def restart(self) -> None:
        """A new child and segment in place of an exited child (`stop`, then `start`);
        `poll` waits meanwhile and then reads the new segment from its first frame."""
        with self._lock:
            self.stop()
            self._seen = [0] * len(self._cameras)
            self.start()
            self.restarts += 1

    def problem(self) -> str:
        """'' while the child runs, else why no frames can arrive."""
        if self._process is None:
            return 'camera receiver process not started'
        code = self._process.exitcode
        return '' if code is None else f'camera receiver process exited with code {code}'

    def poll(self, sync, log=None) -> int:
        """Offer `sync` (an ObservationSynchronizer) each camera's newest frame written since
        the last poll. Returns how many were offered. `log(topic, reason)` is called for a
        frame `sync` refused for its stamp."""
        offered = 0
        with self._lock:
            if self._slots is None:
                return 0
            for k, (topic, _) in enumerate(self._cameras):
                frame = self._slots.read(k, since=self._seen[k])
                if frame is None:
                    continue
                self._seen[k] = frame.count
                offered += 1
                stored = sync.add_image(topic, frame.message, frame.stamp, frame.received,
                                        earlier_receives=frame.earlier_receives)
                if not stored and log is not None:
                    refused = sync.refused(topic)
                    if refused:
                        log(topic, refused)
        return offered

    def stop(self) -> None:
        """Ask the child to end (SIGKILL after STOP_TIMEOUT_S), then unlink the segment.
        Idempotent."""
        try:
            if self._process is not None:
                self._stop.set()
                self._process.join(STOP_TIMEOUT_S)
                if self._process.exitcode is None:
                    self._process.kill()
                    self._process.join(STOP_TIMEOUT_S)
        finally:
            with self._lock:
                if self._slots is not None:
                    self._slots.unlink()
                    self._slots = None
            self._process = None


def _name_process(name: bytes) -> None:
    """Set this process's name as ps, top and `pgrep -x` show it (Linux prctl PR_SET_NAME,
    at most 15 bytes): the 'spawn' child's command line is only `python -c ...spawn_main`,
    and `pgrep -f camera_receiver` would find the policy node's own command line."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)
    except (OSError, AttributeError):     # not Linux: the name is cosmetic
        pass


def run_receiver(node_name: str, namespace: str, cameras, camera_qos: str, segment: str,
                 capacity: int, stop, parent_pid: int, ready=None) -> None:
    """The child's main: subscribe `cameras` (then set `ready`, a multiprocessing Event)
    and write each message into its slot of `segment` until `stop` (an Event) is set or the
    parent `parent_pid` is gone. SIGINT is ignored (a Ctrl-C reaches the whole process group;
    the parent stops the child); SIGTERM ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _name_process(b'camera_receiver')
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from rclpy.signals import SignalHandlerOptions
    from sensor_msgs.msg import CompressedImage, Image

    from molmobot_policy.ros.messages import stamp_seconds

    slots = FrameSlots.attach(segment, len(cameras), capacity)
    context = rclpy.Context()
    rclpy.init(args=[], context=context, signal_handler_options=SignalHandlerOptions.NO)
    try:
        node = rclpy.create_node(node_name, namespace=namespace or None, context=context)
        clock = node.get_clock()
        if camera_qos == 'sensor_data':
            qos = qos_profile_sensor_data
        else:
            qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             history=HistoryPolicy.KEEP_LAST)
        too_large = set()

        def on_image(k: int, topic: str, compressed: bool, msg) -> None:
            received = clock.now().nanoseconds * 1e-9
            stamp = stamp_seconds(msg.header.stamp)
            if compressed:
                fits = slots.write(k, msg.data, stamp, received, encoding=msg.format,
                                   compressed=True)
            else:
                fits = slots.write(k, msg.data, stamp, received, height=msg.height,
                                   width=msg.width, step=msg.step, encoding=msg.encoding)
            if not fits and topic not in too_large:
                too_large.add(topic)
                node.get_logger().error(f'camera {topic}: a {len(msg.data)}-byte frame does '
                                        f'not fit the {capacity}-byte shared-memory slot')

        for k, (topic, compressed) in enumerate(cameras):
            node.create_subscription(
                CompressedImage if compressed else Image, topic,
                lambda msg, k=k, topic=topic, compressed=compressed:
                    on_image(k, topic, compressed, msg), qos)
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(node)
        if ready is not None:
            ready.set()
        if not stop.is_set():   # a parent that stopped while this child started: say nothing
            node.get_logger().info(f'receiving {len(cameras)} cameras into shared memory '
                                   f'{segment}')
        while not stop.is_set() and os.getppid() == parent_pid and context.ok():
            executor.spin_once(timeout_sec=SPIN_TIMEOUT_S)
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
    finally:
        rclpy.try_shutdown(context=context)
        slots.close()
