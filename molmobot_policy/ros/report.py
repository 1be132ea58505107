"""The policy loop's events as the node's log lines, ~/chunk_info messages, output watchdog
updates and input resets (`LoopReport`, a `timing.LoopEvents`; runs on the worker thread)."""
from __future__ import annotations

from typing import Callable

from molmobot_policy.ros import messages
from molmobot_policy.timing import LoopEvents

WARN_THROTTLE_S = 2.0       # at most one warning per call site per this many seconds


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

    def _log(self):
        return self._node.get_logger()

    def skipped(self, tick: int, reason: str) -> None:
        self._watchdog.skipped(reason)
        self._log().warning(f'skipping tick {tick}: {reason}',
                            throttle_duration_sec=WARN_THROTTLE_S)

    def failed(self, tick: int, error: Exception) -> None:
        self._watchdog.skipped(f'tick {tick} failed: {error!r}')
        self._log().error(f'tick {tick} failed: {error!r}', throttle_duration_sec=WARN_THROTTLE_S)

    def clock_jumped(self, seconds: float) -> None:
        # the stored inputs' stamps are in the old time base: each would be refused as in
        # the future, and every newer message as older than the stored one
        self._sync.reset_history()
        self._log().warning(f'ROS time jumped back by {seconds:.3f} s: restarting the schedule '
                            'and forgetting the stored inputs and the last chunk')

    def started(self, now: float) -> None:
        self._watchdog.start(now)

    def waiting_for_clock(self, seconds: float) -> None:
        self._log().warning(f'waiting for /clock for {seconds:.0f} s: use_sim_time is true and '
                            'ROS time has not started; nothing is published until it does')

    def published(self, report) -> None:
        node = self._node
        node.chunks_published_total += 1
        self._watchdog.published(self._now())
        self._publisher.publish(messages.chunk_info(report, node.get_name(),
                                                    self._sync.last_build_decoded,
                                                    self._sync.last_build_decode_s))
        limited = ''
        if report.velocity_limited or report.position_clipped:
            began = ('' if report.start_offset != report.start_offset    # nan: none anchored
                     else f"; the model's first point was up to {report.start_offset:.3f} "
                     'rad (or m) from the measured joints')
            limited = (f', limited: {report.velocity_limited} values by max_joint_velocity, '
                       f'{report.position_clipped} by the position limits{began}')
        self._log().info(
            f'chunk {report.count}: observation age {report.observation_age_ms:.0f} ms, '
            f'inference {report.inference_ms:.0f} ms, {len(report.positions)} points '
            f'({report.dropped} dropped), first action '
            f'{messages.format_action(report.positions[0])}{limited}')
