"""Latest-message store and observation assembly for the policy node (no rclpy).

Subscription callbacks hand every message to `ObservationSynchronizer.add_image` /
`add_joint_state`, which only store it (one message per camera topic, one position per
joint: bounded memory). The worker calls `build(now, ...)` once per tick: it checks the
age of every input, decodes only the frames it uses (lazily, `codec.decode_image`: raw or
compressed; several frames at once on a shared thread pool, as OpenCV's decoders release the
GIL: 8 jpeg frames decoded one after the other would cost the tick 8 decodes) and returns a
`types.Observation`, or a `Skip` naming what was missing, stale or bad. `latest_positions`
gives the motion limits the newest measured position of each commanded joint (the action joints, which may differ from the state joints).

Times are plain float seconds in ROS time (header stamps, and `now` from the node clock).
"""
from __future__ import annotations

import difflib
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from molmobot_policy.preprocess.transforms import repeated
from molmobot_policy.ros.codec import SUPPORTED_ENCODINGS, decode_image
from molmobot_policy.types import Observation


PROBLEM_CLEAR_S = 0.2  # an input's problem ends after this long of usable messages only: a
                       # driver that interleaves bad and good messages (a NaN now and then)
                       # keeps its problem's start, so its status escalates to ERROR as a
                       # steady problem does, instead of restarting WARN at each good one
LAYOUT_LOG_S = 10.0    # a camera's frame layout changing mid-run is logged at most this often
RATE_RESTART_S = 1.0   # a receive time this far before the last one is ROS time gone back (sim
                       # time restarted): the rate window starts over. Smaller steps back are
                       # callbacks on two threads stamping out of order, not a new time base
NOT_YET = ('has no image yet', 'has no message yet')    # an input that never arrived (the
                                                        # skip reasons' words: `build`)
DECODE_THREADS = 8     # the decode pool: one thread per camera of the 8-camera contract
_decode_pool: ThreadPoolExecutor | None = None
log = logging.getLogger('molmobot_policy.inputs')
_decode_pool_lock = threading.Lock()


def decode_pool() -> ThreadPoolExecutor:
    """The process's frame-decoding threads, created on first use and shared by every
    synchronizer (a node's activations reuse them instead of leaving threads behind)."""
    global _decode_pool
    with _decode_pool_lock:
        if _decode_pool is None:
            _decode_pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix='decode')
        return _decode_pool


def stale_while_others_current(ages: dict[str, float], max_age: float) -> list[str]:
    """The joints of `ages` (s since each joint's newest header stamp, one joint state topic)
    older than `max_age` while another joint on it is current: a joint its driver stopped
    publishing, not a late topic. [] when none is stale or none is current."""
    stale = [name for name, age in ages.items() if age > max_age]
    return stale if stale and len(stale) < len(ages) else []


@dataclass(frozen=True)
class Skip:
    """Why no observation could be built for this tick.

    Attributes:
        reasons: one human-readable line per problem, each naming the topic or joint.
        topics: the camera/joint-state topics (or joint names) involved, in input order.
    """

    reasons: tuple[str, ...]
    topics: tuple[str, ...] = ()

    def __str__(self) -> str:
        return '; '.join(self.reasons)


@dataclass
class _Frame:
    msg: object          # sensor_msgs/Image or CompressedImage (decoded only when used)
    stamp: float         # header stamp, s
    received: float      # receive time, s (node clock)
    decoded: np.ndarray | None = None


@dataclass(frozen=True)
class TopicStats:
    """Receive statistics of one input, for diagnostics.

    Attributes:
        rate_hz: messages per second over the recent receive times, measured up to `now`
            (0.0 with < 2 messages).
        age: now - newest header stamp, s (None before the first message).
        count: messages received since construction.
        problem: why the newest input cannot be used although messages arrive (a frame
            that failed to decode, a refused stamp, a malformed joint state, configured
            joints never sent); '' when none.
        problem_age: s since the problem began (None without a problem, or for joints
            never sent); usable messages in between end it only after PROBLEM_CLEAR_S of
            nothing but usable ones (an input that flaps keeps its start).
        joint_ages: the joint state topic only: s since each configured joint's newest
            stamp (a joint its driver stopped publishing is older than the rest); else None.
    """

    rate_hz: float
    age: float | None
    count: int
    problem: str = ''
    problem_age: float | None = None
    joint_ages: dict[str, float] | None = None


def _layout_text(msg) -> str:
    """'rgb8 480x640' (encoding, height x width) or 'compressed jpeg': a frame's layout as
    logged when it changes."""
    if hasattr(msg, 'format'):
        return f'compressed {msg.format}'
    return f'{msg.encoding} {msg.height}x{msg.width}'


def _names_hint(wanted: Sequence[str], seen: tuple[str, ...] | None,
                lead: str = 'its latest message names', configured=frozenset()) -> str:
    """' (<lead> [...]; did you mean ...?)' for joints `wanted` that a joint-state message
    naming `seen` lacks; '' when no message was seen. A name of `configured` (the joints
    already in joint_names / action_joint_names) is never suggested: renaming to it would
    map two joints to one."""
    if seen is None:
        return ''
    shown = list(seen[:12]) + (['...'] if len(seen) > 12 else [])

    def plain(name: str) -> str:     # 'Jaco_Joint_1' ~ 'jaco_joint1': case and separators
        return ''.join(c for c in name.lower() if c.isalnum())
    by_plain = {plain(n): n for n in seen if n not in configured}
    close = []
    for name in wanted:
        match = difflib.get_close_matches(plain(name), list(by_plain), n=1, cutoff=0.6)
        if match:       # an exact match scores 1.0, so it comes first
            close.append((name, by_plain[match[0]]))
    guess = '; did you mean ' + ', '.join(f"'{m}' for '{w}'" for w, m in close) + \
        ' (joint_names / action_joint_names)?' if close else ''
    return f' ({lead} {shown}{guess})'


def _clock_went_back(dropped: tuple[float, float] | None, kept_stamp: float, now: float,
                     max_age: float, what: str) -> str:
    """'; its <what> keep arriving ... stamped N s before the one kept: ...' when an input's
    messages still arrive (within `max_age` s of `now`) but are dropped for stamps older than
    the one kept (`dropped`: the newest such (stamp, received), s), else ''."""
    if dropped is None or now - dropped[1] > max_age:
        return ''
    return (f'; its {what} keep arriving (the newest {max(now - dropped[1], 0.0):.3f} s ago) '
            f'stamped {kept_stamp - dropped[0]:.3f} s before the one kept, so they are '
            "dropped: the driver's clock went back")


class ObservationSynchronizer:
    """Keeps the newest camera frames and joint positions; builds observations on demand.

    Thread-safe: `add_*` run in subscription callbacks, `build` in the worker thread.

    Args:
        camera_topics: image topics in the model's image order (camera k -> "Image k+1").
        joint_names: names of the joints that make up `Observation.state`, in order.
        joint_state_topic: used only to name the joint state in reasons and stats.
        decode: msg, topic -> uint8 (H, W, 3) RGB; raises ValueError on bad data.
        rate_window: receive times kept per topic for the rate estimate.
        max_future: s (>= 0); a header stamp more than this ahead of the receive time (or of
            `now` at build) is refused: the sender's clock is ahead of ours, and such a frame
            would look fresh long after its camera stopped and block every later frame.
        action_joint_names: further joints whose newest position is kept for
            `latest_positions` (the commanded joints; those in joint_names are kept anyway).
        min_image_size: (height, width) pixels; a decoded frame smaller in either is refused
            like an undecodable one ((0, 0): no minimum).
        input_hint: topic -> '' or a clause naming why no message may arrive on it (the node
            asks the ROS graph: a publisher of another message type), appended to 'has no
            image yet' / 'has no message yet'.

    Attributes:
        frames_decoded: frames `build` has decoded (or tried to) since construction.
        last_build_decoded: the frames of the latest observation `build` returned that the
            observation before it did not use (each decoded once: by that build or by a
            skipped one before it); worker thread only.
        last_build_decode_s: wall time (time.perf_counter) spent decoding frames (in
            parallel where several) by that build and the skipped builds since the
            observation before it, s; 0.0 when none decoded anything (frames already decoded
            are reused).

    Raises:
        ValueError: empty or duplicated camera topics or joint names, max_future < 0,
            min_image_size not two counts >= 0.

    A refused input (future or unset stamp, non-finite joint positions, undecodable frame) is
    never stored as the newest; `stats` names the problem for diagnostics.
    """

    def __init__(self, camera_topics: Sequence[str], joint_names: Sequence[str],
                 joint_state_topic: str = '/joint_states',
                 decode: Callable[[object, str], np.ndarray] = decode_image,
                 rate_window: int = 30, max_future: float = 0.05,
                 action_joint_names: Sequence[str] = (),
                 min_image_size: Sequence[int] = (0, 0),
                 input_hint: Callable[[str], str] | None = None) -> None:
        self.camera_topics = tuple(camera_topics)
        self.joint_names = tuple(joint_names)
        self.joint_state_topic = joint_state_topic
        if not self.camera_topics:
            raise ValueError('camera_topics is empty; expected at least one image topic')
        if len(set(self.camera_topics)) != len(self.camera_topics):
            raise ValueError(f'camera_topics has duplicates: {list(self.camera_topics)}')
        if not self.joint_names:
            raise ValueError('joint_names is empty; expected the joints of the state vector')
        if len(set(self.joint_names)) != len(self.joint_names):
            raise ValueError(f'joint_names has duplicates: {list(self.joint_names)}')
        if not max_future >= 0.0:
            raise ValueError(f'max_future must be >= 0 s, got {max_future!r}')
        self.max_future = float(max_future)
        self.min_image_size = tuple(int(v) for v in min_image_size)
        if len(self.min_image_size) != 2 or min(self.min_image_size) < 0:
            raise ValueError(f'min_image_size must be (height, width) >= 0, got '
                             f'{tuple(min_image_size)}')
        self.action_joint_names = tuple(action_joint_names)
        self._kept_joints = frozenset(self.joint_names + self.action_joint_names)
        self._decode = decode
        self._input_hint = input_hint or (lambda topic: '')
        self._lock = threading.Lock()
        self._frames: dict[str, _Frame] = {}
        self._joints: dict[str, tuple[float, float]] = {}    # name -> (position, stamp)
        self._joint_names_seen: tuple[str, ...] | None = None   # the latest message's names
        # per input, the newest message dropped for a stamp older than the one kept:
        # (its stamp, when it arrived), to tell a clock that went back from a stopped input
        self._dropped_older: dict[str, tuple[float, float]] = {}
        self._receive_times = {t: deque(maxlen=rate_window)
                               for t in self.camera_topics + (joint_state_topic,)}
        self._counts = dict.fromkeys(self._receive_times, 0)
        self._last_stamps: dict[str, float] = {}   # per input, stamps used by the last build
        self._problems: dict[str, str] = {}        # per input, why its newest message is unusable
        self._refused: dict[str, str] = {}         # per input, why its last message was not stored
        self._problem_since: dict[str, float] = {}  # per input, when its problem began
        self._clean_since: dict[str, float] = {}    # ... and its first usable message after
        self._lagging: dict[str, str] = {}         # per camera, how far it lags the others
        self._layouts: dict[str, str] = {}          # per camera, `_layout_text` of its newest frame
        self._layout_logged: dict[str, float] = {}  # ... when a change of it was last logged
        self._layout_changes: dict[str, int] = {}   # ... changes since, not logged
        self._layout_told: dict[str, str] = {}      # ... the layout the last line left it in
        self._layout_first: dict[str, str] = {}     # ... the layout it first came with
        self._seq = 0
        self.frames_decoded, self.last_build_decoded, self.last_build_decode_s = 0, 0, 0.0
        self._decode_s_since = 0.0      # decode time since the last observation returned

    # ----------------------------------------------------------------- store (callbacks)
    def add_image(self, topic: str, msg, stamp: float, received: float,
                  earlier_receives: Sequence[float] = ()) -> bool:
        """Store `msg` as the newest frame of `topic` unless it is older than the stored one.

        Args:
            topic: one of `camera_topics`. msg: the image message (kept undecoded).
            stamp: its header stamp, s. received: receive time, s.
            earlier_receives: receive times (s, oldest first) of messages on `topic` that
                arrived before this one and are never offered (a receiver that keeps only
                the newest frame, `ros.camera_receiver`): counted in `stats` only.

        Returns:
            True if stored, False if dropped: older than the stored frame, or refused for
            its stamp (unset, or in the future: `stamp_problem`).

        Raises:
            KeyError: `topic` is not one of `camera_topics`.
        """
        if topic not in self._receive_times or topic == self.joint_state_topic:
            raise KeyError(f'unknown camera topic {topic!r}; expected one of '
                           f'{list(self.camera_topics)}')
        problem = self.stamp_problem(stamp, received)
        with self._lock:
            for earlier in earlier_receives:
                self._note_receive(topic, earlier)
            self._note_receive(topic, received)
            self._note_problem(self._refused, topic,
                               problem and f'newest frame refused: {problem}', received)
            if problem:
                return False
            current = self._frames.get(topic)
            if current is not None and stamp < current.stamp:
                self._dropped_older[topic] = (float(stamp), float(received))
                return False
            self._frames[topic] = _Frame(msg, float(stamp), float(received))
            change = self._layout_change(topic, msg, received)
        if change:
            log.warning(change)
        return True

    def _layout_change(self, topic: str, msg, received: float) -> str:
        """The line to log when `msg`'s layout (encoding, size) differs from the one last
        logged (or first seen) for the topic (a camera reconfigured mid-run: a colour camera
        sending mono8 is replicated to grey RGB and served), at most once per LAYOUT_LOG_S
        per topic: changes within it are told at the first frame after it; else ''. Holds
        the lock."""
        layout = _layout_text(msg)
        self._layout_first.setdefault(topic, layout)
        before, self._layouts[topic] = self._layouts.get(topic), layout
        if before is not None and before != layout:
            self._layout_changes[topic] = self._layout_changes.get(topic, 0) + 1
            self._layout_told.setdefault(topic, before)
        if not self._layout_changes.get(topic):
            return ''
        last = self._layout_logged.get(topic)
        if last is not None and 0.0 <= received - last < LAYOUT_LOG_S:
            return ''
        self._layout_logged[topic] = received
        count, told = self._layout_changes.pop(topic), self._layout_told.pop(topic)
        if told == layout:
            return (f'camera {topic}: frames changed layout {count} times since the last such '
                    f'line and are {layout} again')
        more = f' ({count} changes since the last such line)' if count > 1 else ''
        min_h, min_w = self.min_image_size
        encoding = getattr(msg, 'encoding', None)
        if encoding is not None and encoding not in SUPPORTED_ENCODINGS:
            return (f'camera {topic}: frames changed from {told} to {layout}{more}; frames '
                    f'of encoding {encoding!r} are refused (supported: '
                    f'{list(SUPPORTED_ENCODINGS)})')
        if getattr(msg, 'height', min_h) < min_h or getattr(msg, 'width', min_w) < min_w:
            return (f'camera {topic}: frames changed from {told} to {layout}{more}; frames '
                    f'smaller than min_image_size {min_h}x{min_w} are refused')
        if layout == self._layout_first[topic]:
            return (f'camera {topic}: frames changed from {told} to {layout}{more}, the layout '
                    'they first came with')
        return (f'camera {topic}: frames changed from {told} to {layout}{more}; the model '
                'gets them resized to its input as they come: is the camera configured as '
                'in training?')

    def add_joint_state(self, names: Sequence[str], positions: Sequence[float], stamp: float,
                        received: float) -> None:
        """Store the positions of the named joints (other joints are ignored).

        A message may carry a subset of the joints (split publishers); each joint keeps its
        newest position. Per joint, a message older than the stored one is ignored.

        Args:
            names: sensor_msgs/JointState.name. positions: JointState.position (rad or m).
            stamp: header stamp, s. received: receive time, s.

        Raises:
            ValueError: `names` and `positions` differ in length, or a joint this node uses
                appears more than once (which of its positions is meant is unknown).
        """
        problem = ''
        if len(names) != len(positions):
            problem = (f'joint state on {self.joint_state_topic!r}: {len(names)} names but '
                       f'{len(positions)} positions; expected equal lengths')
        elif len(set(names)) != len(names):
            used = [n for n in repeated(names) if n in self._kept_joints]
            if used:
                problem = (f'joint state on {self.joint_state_topic!r}: joints {used} '
                           'appear more than once; expected each joint once')
        if problem:
            with self._lock:
                self._note_receive(self.joint_state_topic, received)
                self._note_problem(self._refused, self.joint_state_topic,
                                   f'last message refused: {problem}', received)
            raise ValueError(problem)
        problem = self.stamp_problem(stamp, received)
        bad = [n for n, p in zip(names, positions) if n in self.joint_names
               and not math.isfinite(p)]
        topic = self.joint_state_topic
        with self._lock:
            self._note_receive(topic, received)
            self._note_problem(self._refused, topic,
                               problem and f'last message refused: {problem}', received)
            if problem:
                return
            # stored: the arm's state is unknown, the next build says which joints
            self._note_problem(self._problems, topic,
                               bad and f'non-finite positions for joints {bad}', received)
            self._joint_names_seen = tuple(names)
            older = False
            for name, position in zip(names, positions):
                if name in self._kept_joints:
                    old = self._joints.get(name)
                    if old is None or stamp >= old[1]:
                        self._joints[name] = (float(position), float(stamp))
                    else:
                        older = True
            if older:
                self._dropped_older[topic] = (float(stamp), float(received))

    def stamp_problem(self, stamp: float, now: float) -> str:
        """Why a header stamp cannot be used at time `now` (s), or '' when it can.

        Unset (0: the driver never filled it), the node's clock not started (0: use_sim_time
        and no /clock yet, where every stamp would look like the future), or more than
        `max_future` ahead of `now`.
        """
        if stamp == 0.0:
            return 'header stamp unset (0)'
        if now <= 0.0:
            return ("this node's clock has not started (use_sim_time: true and no /clock "
                    'received yet): no header stamp can be judged')
        if stamp - now > self.max_future:
            return (f'stamped {stamp - now:.3f} s in the future (more than max_future_stamp '
                    f'{self.max_future:.3f} s ahead of this node\'s clock): are the clocks '
                    'synchronized?')
        return ''

    def silence_hint(self, topic: str) -> str:
        """The `input_hint` of `topic` (why nothing may arrive on it; '' for none)."""
        return self._input_hint(topic)

    def refused(self, topic: str) -> str:
        """Why the last message on `topic` (a camera or the joint state topic) was not
        stored ('' when it was): its stamp was unset or in the future, or it was malformed."""
        with self._lock:
            return self._refused.get(topic, '')

    def latest_positions(self, names: Sequence[str]) -> tuple[np.ndarray, float]:
        """The newest measured position of each joint in `names` (state or action joints).

        Returns:
            (positions, stamp): float64 (len(names),), robot units, nan for a joint never
            received (or not kept: neither a state nor an action joint); and the newest
            header stamp among those received, s (nan when none).
        """
        with self._lock:
            found = [self._joints.get(n) for n in names]
        positions = np.array([np.nan if j is None else j[0] for j in found], dtype=np.float64)
        stamps = [j[1] for j in found if j is not None]
        return positions, (max(stamps) if stamps else float('nan'))

    def position_problem(self, names: Sequence[str], now: float, max_age: float) -> str:
        """Why the newest positions of `names` (the action joints) cannot anchor a chunk at
        `now` (s), or '': a joint received as non-finite, or one older than `max_age` (s).
        A joint never received is no problem here (it is not anchored)."""
        with self._lock:
            found = {n: self._joints.get(n) for n in names}
        bad = [n for n, j in found.items() if j is not None and not math.isfinite(j[0])]
        if bad:
            return (f'joint state {self.joint_state_topic} has non-finite positions for action '
                    f'joints {bad}')
        stale = [n for n, j in found.items() if j is not None and now - j[1] > max_age]
        if stale:
            why = self.refused(self.joint_state_topic)
            return (f'joint state {self.joint_state_topic} is stale for action joints '
                    + self._stale_text(stale, now, max_age) + (f' ({why})' if why else ''))
        return ''

    def _stale_text(self, stale: list[str], now: float, max_age: float) -> str:
        """'<stale>: age <s> > max_state_age <s>', asking whether they are still published
        when other joints of the topic are current (a dropped joint, not a late topic)."""
        with self._lock:
            ages = {n: now - j[1] for n, j in self._joints.items()}
        limit = f'age {max(ages[n] for n in stale):.3f} s > max_state_age {max_age:.3f} s'
        if not stale_while_others_current(ages, max_age):
            return f'{stale}: {limit}'
        return (f'{stale} ({limit}) while other joints on it are current: '
                f"{'is that joint' if len(stale) == 1 else 'are those joints'} still published?")

    def anchor_positions(self, names: Sequence[str], gripper_index: int, now: float,
                         max_age: float) -> tuple[np.ndarray, float, list[str]]:
        """The measured positions a chunk's first point is anchored to (the MotionLimiter's
        `measured`): the newest position of each action joint in `names`.

        Args:
            names: the action joints, in action order. gripper_index: the action dimension
                holding the binarized gripper command (no joint position: its entry is nan),
                or -1 / out of range for none. now: s. max_age: s (max_state_age).

        Returns:
            (positions, stamp, unseen): float64 (len(names),), robot units, nan for a joint
            never received and for the gripper; the newest header stamp among them, s; the
            non-gripper joints never received (not anchored).

        Raises:
            ValueError: a joint received as non-finite, or one older than `max_age`
                (`position_problem`): the tick must be skipped.
        """
        anchored = [n for k, n in enumerate(names) if k != gripper_index]
        problem = self.position_problem(anchored, now, max_age)
        if problem:
            raise ValueError(problem)
        positions, stamp = self.latest_positions(names)
        unseen = [n for k, n in enumerate(names) if math.isnan(positions[k]) and k != gripper_index]
        if 0 <= gripper_index < len(names):
            positions[gripper_index] = math.nan
        return positions, stamp, unseen

    def _note_problem(self, table: dict, topic: str, problem: str, t: float) -> None:
        """Set (`problem` non-empty) or clear `topic`'s entry of `table` (self._refused or
        self._problems), keeping when the topic's problems began until its messages have
        been usable for PROBLEM_CLEAR_S (time `t`, s). Holds the lock."""
        if problem:
            table[topic] = problem
            self._problem_since.setdefault(topic, t)
            self._clean_since.pop(topic, None)
            return
        table.pop(topic, None)
        if topic in self._refused or topic in self._problems or topic in self._lagging or \
                topic not in self._problem_since:
            return
        if t - self._clean_since.setdefault(topic, t) >= PROBLEM_CLEAR_S:
            self._problem_since.pop(topic)
            self._clean_since.pop(topic)

    def reset_history(self) -> None:
        """Forget everything stored and which stamps were used (after a ROS time jump back:
        stored stamps belong to the old timeline and would refuse every new input)."""
        with self._lock:
            self._frames.clear()
            self._joints.clear()
            self._dropped_older.clear()
            self._last_stamps = {}
            self._problem_since.clear()      # times of the old timeline
            self._clean_since.clear()

    def _note_receive(self, topic: str, received: float) -> None:
        times = self._receive_times[topic]
        if times and (received < times[-1] - RATE_RESTART_S or times[0] <= 0.0 < received):
            times.clear()       # ROS time went back or just started: a new time base
        times.append(received)
        self._counts[topic] += 1

    # ------------------------------------------------------------------- build (worker)
    def build(self, now: float, max_image_age: float, max_state_age: float,
              instruction: str = '', max_image_spread: float = math.inf) -> Observation | Skip:
        """Assemble the newest inputs into an Observation, or say why not.

        Args:
            now: current ROS time, s.
            max_image_age: a frame whose header stamp is older than now - max_image_age is
                stale, s. max_state_age: same for each joint's position, s.
            instruction: task text copied into the observation.
            max_image_spread: s; a camera whose newest header stamp is further behind the
                newest camera's is refused (one observation would mix views taken that far
                apart), named with how far it lags.

        Returns:
            Observation with images (uint8 (H, W, 3) RGB, camera order), state (float32
            (len(joint_names),), joint-name order), stamp = oldest input header stamp, a
            seq one higher than the previous one; or Skip naming every missing, stale,
            lagging or undecodable camera topic and missing or stale joint. Never returns an
            observation that uses an input older than one used by an earlier observation.
            Every fresh frame is decoded (once) even when another input skips the tick, so
            that a camera's own fault is named at once, not after the others are fixed.
        """
        with self._lock:
            frames = {t: self._frames.get(t) for t in self.camera_topics}
            joints = {n: self._joints.get(n) for n in self.joint_names}
            any_joint = bool(self._joints)
            refused = dict(self._refused)
            names_seen = self._joint_names_seen
            dropped_older = dict(self._dropped_older)
        reasons, topics, usable = [], [], {}
        for topic, frame in frames.items():
            why = f' ({refused[topic]})' if topic in refused else ''
            if frame is None:
                reasons.append(f'camera {topic} has no image yet{why}{self._input_hint(topic)}')
                topics.append(topic)
            elif self.stamp_problem(frame.stamp, now):
                reasons.append(f'camera {topic} {self.stamp_problem(frame.stamp, now)}')
                topics.append(topic)
            elif now - frame.stamp > max_image_age:
                arriving = ('; its frames keep arriving (the newest '
                            f'{max(now - frame.received, 0.0):.3f} s ago) with stamps that old: '
                            'the publisher stamps them late (still starting up, or its '
                            'latency) or its clock is behind'
                            if now - frame.received <= max_image_age and not why else '')
                arriving = _clock_went_back(dropped_older.get(topic), frame.stamp, now,
                                            max_image_age, 'frames') or arriving
                reasons.append(f'camera {topic} is stale: age {now - frame.stamp:.3f} s > '
                               f'max_image_age {max_image_age:.3f} s{why}{arriving}')
                topics.append(topic)
            else:
                usable[topic] = frame
        if usable:
            self._check_spread(usable, max_image_spread, now, reasons, topics)
        self._check_joints(joints, any_joint, refused, now, max_state_age, reasons, topics,
                           names_seen, dropped_older.get(self.joint_state_topic))

        pending = [(topic, frame) for topic, frame in usable.items() if frame.decoded is None]
        errors = {}
        if pending:
            began = time.perf_counter()
            errors = dict(zip((topic for topic, _ in pending), self._decode_frames(pending)))
            self._decode_s_since += time.perf_counter() - began
            self.frames_decoded += len(pending)
        for topic, error in errors.items():
            with self._lock:
                self._note_problem(self._problems, topic,
                                   f'newest frame refused: {error}' if error else '', now)
            if error is not None:
                reasons.append(str(error))
                topics.append(topic)
        if reasons:
            return Skip(tuple(reasons), tuple(topics))

        stamps = {t: f.stamp for t, f in frames.items()}
        stamps.update({f'joint:{n}': j[1] for n, j in joints.items()})
        older = [k for k, s in stamps.items() if s < self._last_stamps.get(k, -np.inf)]
        if older:
            return Skip(tuple(f'{k} went back in time' for k in older), tuple(older))

        self.last_build_decoded = sum(1 for t, f in frames.items()
                                      if f.stamp != self._last_stamps.get(t))
        self.last_build_decode_s, self._decode_s_since = self._decode_s_since, 0.0
        self._last_stamps = stamps
        self._seq += 1
        image_stamps = tuple(f.stamp for f in frames.values())
        state_stamp = min(j[1] for j in joints.values())
        return Observation(
            images=tuple(f.decoded for f in frames.values()),
            state=np.array([joints[n][0] for n in self.joint_names], dtype=np.float32),
            instruction=instruction,
            stamp=min(min(image_stamps), state_stamp),
            image_stamps=image_stamps,
            state_stamp=state_stamp,
            seq=self._seq,
        )

    def _check_spread(self, usable: dict, max_spread: float, now: float, reasons: list,
                      topics: list) -> None:
        """Append a reason for each camera of `usable` (topic -> frame) whose stamp is more
        than `max_spread` s behind the newest one's, and keep it as that camera's problem
        (diagnostics) until a build finds it within the spread."""
        lead = max(usable, key=lambda t: usable[t].stamp)
        newest = usable[lead].stamp
        for topic, frame in usable.items():
            behind = newest - frame.stamp
            problem = (f'camera {topic} lags camera {lead} by {behind:.3f} s > '
                       f'max_image_spread {max_spread:.3f} s: one observation would mix views '
                       "taken that far apart (the camera's latency or its clock?)"
                       if behind > max_spread else '')
            with self._lock:
                self._note_problem(self._lagging, topic, problem, now)
            if problem:
                reasons.append(problem)
                topics.append(topic)

    def _check_joints(self, joints: dict, any_joint: bool, refused: dict, now: float,
                      max_state_age: float, reasons: list, topics: list,
                      names_seen: tuple[str, ...] | None,
                      dropped_older: tuple[float, float] | None) -> None:
        """Append the reasons the joints of `joints` (name -> (position, stamp) or None)
        cannot be used: missing (with the names the latest message carries), stale (saying
        when messages still arrive stamped older, or without the joints), future-stamped,
        non-finite."""
        missing = [n for n, j in joints.items() if j is None]
        future = [n for n, j in joints.items() if j is not None and self.stamp_problem(j[1], now)]
        stale = [n for n, j in joints.items() if j is not None and now - j[1] > max_state_age]
        nonfinite = [n for n, j in joints.items() if j is not None and not math.isfinite(j[0])]
        if missing:
            with self._lock:
                problem = (self._refused.get(self.joint_state_topic)
                           or self._problems.get(self.joint_state_topic, ''))
            what = (f'lacks joints {missing}'
                    + _names_hint(missing, names_seen, configured=self._kept_joints)
                    if any_joint or (names_seen is not None and not problem)
                    else f'has no usable position for joints {missing}' if problem
                    else 'has no message yet' + self._input_hint(self.joint_state_topic))
            reasons.append(f'joint state {self.joint_state_topic} {what}'
                           + (f' ({problem})' if problem else ''))
        if stale:
            why = refused.get(self.joint_state_topic)
            oldest = min(joints[n][1] for n in stale)
            hint = _clock_went_back(dropped_older, oldest, now, max_state_age, 'messages')
            if not hint and names_seen is not None and not set(stale) & set(names_seen):
                hint = _names_hint(stale, names_seen,
                                   'its latest message names none of them, only',
                                   configured=self._kept_joints)
            reasons.append(f'joint state {self.joint_state_topic} is stale for '
                           + self._stale_text(stale, now, max_state_age)
                           + (f' ({why})' if why else '') + hint)
        if future:
            reasons.append(f'joint state {self.joint_state_topic} for {future} '
                           f'{self.stamp_problem(max(joints[n][1] for n in future), now)}')
        if nonfinite:
            reasons.append(f'joint state {self.joint_state_topic} has non-finite positions '
                           f'for joints {nonfinite}')
        if missing or stale or future or nonfinite:
            topics.append(self.joint_state_topic)

    def _decode_frames(self, pending: list) -> list:
        """Decode each (topic, frame) of `pending` into frame.decoded, on the decode pool when
        there are several; the ValueError (or None) of each, in order. Other errors raise."""
        min_h, min_w = self.min_image_size

        def one(item):
            topic, frame = item
            try:
                image = self._decode(frame.msg, topic)
            except ValueError as bad:     # named by its topic once (the decoders name it)
                return bad if repr(topic) in str(bad) or str(bad).startswith(topic) \
                    else ValueError(f'{topic}: {bad}')
            if image.shape[0] < min_h or image.shape[1] < min_w:
                return ValueError(f'{topic}: a {image.shape[0]}x{image.shape[1]} frame, smaller '
                                  f'than min_image_size {min_h}x{min_w} (height x width): a '
                                  'failing camera driver or the wrong topic?')
            frame.decoded = image
            return None
        if len(pending) < 2:
            return [one(item) for item in pending]
        return list(decode_pool().map(one, pending))

    # ---------------------------------------------------------------------- diagnostics
    def stats(self, now: float) -> dict[str, TopicStats]:
        """Receive rate, age and count per camera topic and for the joint state topic.

        The joint state age is that of its oldest configured joint (None until all seen).
        """
        with self._lock:
            result = {}
            for topic, times in self._receive_times.items():
                # measured up to now, so the rate decays when a topic stops
                span = max(now, times[-1]) - times[0] if times else 0.0
                rate = (len(times) - 1) / span if len(times) >= 2 and span > 0 else 0.0
                problem = (self._refused.get(topic) or self._problems.get(topic)
                           or self._lagging.get(topic, ''))
                since = self._problem_since.get(topic) if problem else None
                if topic == self.joint_state_topic:
                    seen = [self._joints.get(n) for n in self.joint_names]
                    age = None if None in seen else now - min(j[1] for j in seen)
                    never = [n for n, j in zip(self.joint_names, seen) if j is None]
                    ages = {n: now - j[1] for n, j in zip(self.joint_names, seen) if j}
                    if never and self._counts[topic] and not problem:
                        problem = f'joints {never} never received'
                else:
                    frame = self._frames.get(topic)
                    age, ages = (None if frame is None else now - frame.stamp), None
                result[topic] = TopicStats(rate, age, self._counts[topic], problem,
                                           None if since is None else max(now - since, 0.0),
                                           ages)
            return result
