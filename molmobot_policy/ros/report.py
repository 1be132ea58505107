"""The policy loop's events as the node's log lines, ~/chunk_info messages, output watchdog
updates and input resets (`LoopReport`, a `timing.LoopEvents`; runs on the worker thread)."""
from __future__ import annotations

import re
import threading
import time
from typing import Callable

from molmobot_policy.ros import messages
from molmobot_policy.ros.diagnostics import diagnostic_name
from molmobot_policy.ros.entry import print_log
from molmobot_policy.ros.synchronizer import NOT_YET
from molmobot_policy.timing import LoopEvents

WARN_THROTTLE_S = 2.0       # at most one warning per call site per this many seconds
BACKOFF_AFTER_S = 30.0      # a warning unchanged (numbers aside) this long is logged ...
REPEAT_S = 30.0             # ... every this many seconds, saying how long it has lasted
STARTUP_GRACE_S = 5.0       # an activation's skips for inputs not yet received, before its
                            # first chunk and this long from its start, are INFO 'waiting for
                            # the first inputs' (DDS discovery, drivers starting), not warnings
_NUMBER = re.compile(r'\d+(?:\.\d+)?')


class RepeatedLines:
    """When a warning that repeats is due, per key (a topic, 'skip'): at most every
    WARN_THROTTLE_S, and once the same text, its numbers aside, has come for BACKOFF_AFTER_S,
    every REPEAT_S (a camera dead all day: ~40 lines an hour, not ~2000). Thread-safe.

    Args:
        clock: () -> s, monotonic.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock, self._lock = clock, threading.Lock()
        self._state: dict[str, list] = {}      # key -> [shape, since, last logged, count]

    def due(self, key: str, text: str) -> str | None:
        """None when `text` is not to be logged now; else the suffix to log it with ('' or
        ' (unchanged for N s, K times; logged every 30 s)')."""
        now, shape = self._clock(), _NUMBER.sub('#', text)
        with self._lock:
            state = self._state.setdefault(key, [shape, now, None, 0])
            if state[0] != shape:                       # a new text: from the start
                state[:2], state[3] = [shape, now], 0
            state[3] += 1
            lasted = now - state[1]
            interval = WARN_THROTTLE_S if lasted < BACKOFF_AFTER_S else REPEAT_S
            if state[2] is not None and now - state[2] < interval:
                return None
            state[2] = now
            if lasted < BACKOFF_AFTER_S:
                return ''
            return (f' (unchanged for {lasted:.0f} s, {state[3]} times; logged every '
                    f'{REPEAT_S:.0f} s)')

    def forget(self, key: str) -> None:
        """`key`'s warning has stopped: when it comes again, it starts over."""
        with self._lock:
            self._state.pop(key, None)


class LoopReport(LoopEvents):
    """Args:
        node: the PolicyNode (its logger, name, `chunks_published_total`).
        chunk_info: the ~/chunk_info publisher.
        sync: the ObservationSynchronizer (`reset_history` after a clock jump back,
            `last_build_decoded` and `last_build_decode_s` per chunk).
        watchdog: the timing.OutputWatchdog behind the 'output' status.
        now: () -> ROS time, s.
    """

    def __init__(self, node, chunk_info, sync, watchdog, now: Callable[[], float]) -> None:
        self._node, self._publisher = node, chunk_info
        self._sync, self._watchdog, self._now = sync, watchdog, now
        self._skipped = 0           # ticks skipped or failed since the last chunk (the log
        self._last_skip = ''        # throttles their lines: `published` says how many)
        self._repeats = RepeatedLines()
        self._started_at: float | None = None       # time.monotonic() of the loop's start,
                                                    # until its first chunk

    def _log(self):
        return self._node.get_logger()

    def _printed(self, severity: str, message: str) -> bool:
        """Print `message` (ROS console format) and return True once Ctrl-C shut the context
        down (the worker may still report its last tick): /rosout cannot take it then, and
        rclpy would print 'Failed to publish log message to rosout'. Each event method calls
        its logger itself, so rclpy's throttling keeps one call site per event."""
        if self._node.context.ok():
            return False
        print_log(self._node.get_logger().name, severity, message)
        return True

    def skipped(self, tick: int, reason: str) -> None:
        self._watchdog.skipped(reason)
        self._skipped, self._last_skip = self._skipped + 1, reason
        if self._started_at is not None and \
                time.monotonic() - self._started_at < STARTUP_GRACE_S and \
                all(any(p in part for p in NOT_YET) for part in reason.split('; ')):
            if self._repeats.due('startup', reason) is not None:
                message = f'waiting for the first inputs (tick {tick}): {reason}'
                if not self._printed('INFO', message):
                    self._log().info(message)
            return
        suffix = self._repeats.due('skip', reason)
        if suffix is None:
            return
        message = f'skipping tick {tick}: {reason}{suffix}'
        if not self._printed('WARN', message):
            self._log().warning(message)

    def failed(self, tick: int, error: Exception) -> None:
        message = f'tick {tick} failed: {error!r}'
        self._watchdog.skipped(message)
        self._skipped, self._last_skip = self._skipped + 1, message
        suffix = self._repeats.due('failed', repr(error))
        if suffix is not None and not self._printed('ERROR', message + suffix):
            self._log().error(message + suffix)

    def clock_jumped(self, seconds: float) -> None:
        # the stored inputs' stamps are in the old time base: each would be refused as in
        # the future, and every newer message as older than the stored one
        self._sync.reset_history()
        self._log().warning(f'ROS time jumped back by {seconds:.3f} s: restarting the schedule '
                            'and forgetting the stored inputs and the last chunk')

    def started(self, now: float) -> None:
        self._watchdog.start(now)
        self._started_at = time.monotonic()

    def waiting_for_clock(self, seconds: float) -> None:
        self._log().warning(f'waiting for /clock for {seconds:.0f} s: use_sim_time is true and '
                            'ROS time has not started; nothing is published until it does')

    def clock_stopped(self, now: float, seconds: float) -> None:
        self._log().warning(f'ROS time has stood at {now:.3f} s for {seconds:.0f} s: no /clock '
                            'message (use_sim_time is true; a paused or stopped simulator?); '
                            'nothing is published until it moves')

    def clock_resumed(self, now: float, seconds: float) -> None:
        self._log().info(f'ROS time moves again ({now:.3f} s) after standing still for '
                         f'{seconds:.1f} s')

    def published(self, report) -> None:
        node = self._node
        node.chunks_published_total += 1
        self._started_at = None
        self._watchdog.published(self._now())
        self._publisher.publish(messages.chunk_info(report, diagnostic_name(node),
                                                    self._sync.last_build_decoded,
                                                    self._sync.last_build_decode_s))
        limited = ''
        if report.velocity_limited or report.position_clipped:
            began = ('' if report.start_offset != report.start_offset    # nan: none anchored
                     else f"; the model's first point was up to {report.start_offset:.3f} "
                     'rad (or m) from the measured joints')
            limited = (f', limited: {report.velocity_limited} values by max_joint_velocity, '
                       f'{report.position_clipped} by the position limits{began}')
        message = (f'chunk {report.count}: observation age {report.observation_age_ms:.0f} '
                   f'ms, inference {report.inference_ms:.0f} ms, {len(report.positions)} '
                   f'points ({report.dropped} dropped), first action '
                   f'{messages.format_action(report.positions[0])}{limited}')
        if not self._printed('INFO', message):
            self._log().info(message)
        if self._skipped:       # the skips' own lines are throttled: say how many there were
            again = (f'chunk {report.count}: chunks again after {self._skipped} skipped '
                     f'tick{"s" if self._skipped > 1 else ""} (the last: {self._last_skip})')
            self._skipped = 0
            if not self._printed('INFO', again):
                self._log().info(again)
        if report.outside_limits:
            warning = (f'chunk {report.count}: action joints '
                       f'{self._action_joints(report.outside_limits)} are measured outside '
                       'joint_position_min / joint_position_max: their points ramp back in at '
                       'max_joint_velocity and stay outside the limits until they are in (no '
                       'step into the range)')
            if not self._printed('WARN', warning):
                self._log().warning(warning, throttle_duration_sec=WARN_THROTTLE_S)
        if not report.not_following:
            self._repeats.forget('not_following')
            return
        # paced as one line whichever joints it names (they change from chunk to chunk)
        suffix = self._repeats.due('not_following', 'action joints do not follow')
        if suffix is not None:
            warning = (f'chunk {report.count}: action joints '
                       f'{self._action_joints(report.not_following)} do not follow the '
                       'published chunks (measured further than tracking_tolerance from where '
                       'the chunk the arm executes had them at the joint state\'s stamp): '
                       'their first points are anchored at the measurement. Is the controller '
                       f'taking the chunks (its log), the arm held by a stop or blocked?{suffix}')
            if not self._printed('WARN', warning):
                self._log().warning(warning)

    def _action_joints(self, indices) -> list:
        """The action_joint_names of `indices` (an index where the list is shorter)."""
        names = list(self._node.get_parameter('action_joint_names').value)
        return [names[j] if j < len(names) else j for j in indices]
