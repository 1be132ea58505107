"""Timing core of the policy node: schedule, latency lead, chunk stitching, statistics.

Timing model (DESIGN.md, "Timing model"): the policy runs on a fixed period with absolute
deadlines `t0 + k * period` (`DeadlineScheduler`); inference for a tick starts `lead`
seconds before its deadline, the lead being a high quantile of measured warm inference
latency times a margin (`LatencyEstimator`); a tick whose start time has passed is skipped
and counted, never made up with a burst. An observation not newer than the last one used
is refused (`ObservationGate`). The chunk published at the deadline is stamped with when
each action executes; actions already in the past are dropped from the front and the new
chunk is joined to the previous one without pause, jump back or step (`ChunkStitcher`).
Jitter, latency and ages are summarized over a rolling window (`RollingStats`); garbage
collector pauses, which stop every thread, are timed by `GcPauses`; `runqueue_wait_s` reads
how long the calling thread waited for a CPU (Linux), to tell the operating system's delays
from the GIL's. `PolicyLoop` is the worker that runs them on an injected clock.

Pure python + numpy, no rclpy: every time is a float in seconds passed in by the caller
(ROS time, so simulated time works), which keeps all of it testable with a fake clock.
"""
from molmobot_policy.timing.chunking import ChunkStitcher, StitchedChunk
from molmobot_policy.timing.latency import LatencyEstimator
from molmobot_policy.timing.loop import PolicyLoop, QuietWindow, Wait, latency_estimator
from molmobot_policy.timing.motion import LimitedPoints, MotionLimiter
from molmobot_policy.timing.reports import ChunkReport, DelayClues, LoopEvents, LoopStats
from molmobot_policy.timing.watchdog import OutputState, OutputWatchdog
from molmobot_policy.timing.scheduler import DeadlineScheduler, MissedTicks, ObservationGate, Tick
from molmobot_policy.timing.stats import (GcPauses, RollingStats, freeze_heap, runqueue_wait_s,
                                          unfreeze_heap)

__all__ = ['ChunkReport', 'ChunkStitcher', 'DeadlineScheduler', 'DelayClues', 'GcPauses',
           'LatencyEstimator', 'LimitedPoints', 'LoopEvents', 'LoopStats', 'MissedTicks',
           'MotionLimiter', 'ObservationGate', 'OutputState', 'OutputWatchdog', 'PolicyLoop',
           'QuietWindow',
           'RollingStats', 'StitchedChunk', 'Tick', 'Wait', 'freeze_heap',
           'latency_estimator', 'runqueue_wait_s', 'unfreeze_heap']
