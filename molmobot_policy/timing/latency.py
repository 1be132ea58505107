"""Inference latency estimate that sets the scheduler's lead.

Timing model (DESIGN.md, "Timing model"): inference for a tick starts `lead` seconds
before the tick's deadline so that the chunk is ready when it is due. The lead is a high
quantile of recently measured warm inference latencies times a safety margin:

    lead = quantile_q(last `window` warm samples) * margin

Warm-up samples (first calls, compilation, CUDA graph capture) are recorded with
`warm=False` and ignored: they say nothing about steady-state latency. So are the first
`settle` samples after `restart()` (the node calls it on every activation: the first
inferences after a pause run on cold caches and clocks), and outliers: a sample more than
`outlier_factor` times the median of the window (once it holds `min_samples`). A single
slow call would otherwise hold the lead at its cap for the whole window (a lead above
need drops actions from the front of every chunk). A run of `min_samples` consecutive
outliers is a new regime, not an outlier: the window restarts from those samples. Until
`min_samples` warm samples have been seen, the lead is the configured `initial` (set it from
the engine's measured warm-up inference time, not a guess) or, where longer, the slowest warm
sample so far times the margin.
The quantile is numpy's default (linear interpolation between order statistics,
Hyndman & Fan type 7). Plain python + numpy; thread-safe (one lock).
"""
from __future__ import annotations

import math
import threading
from collections import deque
from typing import Optional

import numpy as np

from .validation import finite


class LatencyEstimator:
    """Rolling high-quantile estimate of inference latency, in seconds.

    Args:
        window: number of most recent warm samples kept (int >= 1).
        quantile: which quantile of the window (0 < quantile <= 1), e.g. 0.99.
        margin: multiplier applied to the quantile (>= 1.0 is sensible; must be > 0).
        min_samples: warm samples needed before the estimate replaces `initial`
            (1 <= min_samples <= window).
        initial: seconds (>= 0); the lead returned until `min_samples` warm samples.
            Set it from a known latency (e.g. the engine's warm-up timing).
        max_lead: None or seconds (> 0); upper bound of `lead()`. A lead above the
            period lets a single worker run at most every other tick; capping it (e.g.
            just under the period) trades those misses for late publishes on spikes.
        settle: samples ignored after each `restart()` (int >= 0).
        outlier_factor: None (keep every sample) or a number > 1: a sample above this times
            the window's median is ignored (see the module docstring).

    Raises:
        ValueError: any argument outside the ranges above.
    """

    def __init__(self, window: int = 50, quantile: float = 0.99, margin: float = 1.2,
                 min_samples: int = 5, initial: float = 0.1,
                 max_lead: Optional[float] = None, settle: int = 0,
                 outlier_factor: Optional[float] = None):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f'window must be an int >= 1, got {window!r}')
        if not (isinstance(quantile, (int, float)) and 0.0 < quantile <= 1.0):
            raise ValueError(f'quantile must be in (0, 1], got {quantile!r}')
        if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin > 0.0):
            raise ValueError(f'margin must be a finite number > 0, got {margin!r}')
        if (isinstance(min_samples, bool) or not isinstance(min_samples, int)
                or not 1 <= min_samples <= window):
            raise ValueError(
                f'min_samples must be an int in [1, window={window}], got {min_samples!r}')
        if not (isinstance(initial, (int, float)) and math.isfinite(initial) and initial >= 0.0):
            raise ValueError(f'initial must be a finite number of seconds >= 0, got {initial!r}')
        if max_lead is not None and not (isinstance(max_lead, (int, float))
                                         and math.isfinite(max_lead) and max_lead > 0.0):
            raise ValueError(f'max_lead must be None or a finite number of seconds > 0, '
                             f'got {max_lead!r}')
        if isinstance(settle, bool) or not isinstance(settle, int) or settle < 0:
            raise ValueError(f'settle must be an int >= 0, got {settle!r}')
        if outlier_factor is not None and not (
                isinstance(outlier_factor, (int, float)) and math.isfinite(outlier_factor)
                and outlier_factor > 1.0):
            raise ValueError(f'outlier_factor must be None or a finite number > 1, '
                             f'got {outlier_factor!r}')
        self.window = int(window)
        self.quantile = float(quantile)
        self.margin = float(margin)
        self.min_samples = int(min_samples)
        self.initial = float(initial)
        self.max_lead = None if max_lead is None else float(max_lead)
        self.settle = int(settle)
        self.outlier_factor = None if outlier_factor is None else float(outlier_factor)
        self._samples: deque[float] = deque(maxlen=self.window)
        self._outliers: list[float] = []     # the current run of consecutive outliers
        self._ignored = 0
        self._to_settle = 0
        self._measured = False      # a warm sample past settling since the last restart
        self._lock = threading.Lock()

    def restart(self) -> None:
        """Ignore the next `settle` samples (call on activation, after a pause)."""
        with self._lock:
            self._to_settle = self.settle
            self._outliers.clear()
            self._measured = False

    def record(self, seconds: float, warm: bool = True) -> None:
        """Record one measured inference latency.

        Args:
            seconds: latency in seconds (finite, >= 0).
            warm: False for warm-up / compilation calls; those are counted and ignored,
                like the settling samples after `restart()` and outliers.
        Raises:
            ValueError: seconds negative or not finite.
        """
        seconds = finite('latency', seconds, 'a finite number of seconds >= 0')
        if seconds < 0.0:
            raise ValueError(f'latency must be a finite number of seconds >= 0, got {seconds!r}')
        with self._lock:
            if not warm:
                self._ignored += 1
            elif self._to_settle > 0:
                self._to_settle -= 1
                self._ignored += 1
            elif self._is_outlier(seconds):
                self._measured = True
                self._outliers.append(seconds)
                self._ignored += 1
                if len(self._outliers) >= self.min_samples:     # a new regime
                    self._samples.clear()
                    self._samples.extend(self._outliers)
                    self._outliers.clear()
            else:
                self._measured = True
                self._outliers.clear()
                self._samples.append(seconds)

    def _is_outlier(self, seconds: float) -> bool:
        if self.outlier_factor is None or len(self._samples) < self.min_samples:
            return False
        return seconds > self.outlier_factor * float(np.median(np.fromiter(self._samples, float)))

    @property
    def count(self) -> int:
        """Number of warm samples currently in the window."""
        with self._lock:
            return len(self._samples)

    @property
    def ignored(self) -> int:
        """Number of samples ignored so far (warm-up, settling, outliers)."""
        with self._lock:
            return self._ignored

    @property
    def measured(self) -> bool:
        """True once a warm sample past the settling ones (an outlier too) was recorded since
        the last `restart()` (or construction): until then `lead()` has seen nothing of this
        run's latency, only `initial` or what came before the restart."""
        with self._lock:
            return self._measured

    def estimate(self) -> float:
        """The configured quantile of the warm samples in the window, seconds (no margin).

        Returns nan while fewer than `min_samples` warm samples have been recorded.
        """
        with self._lock:
            if len(self._samples) < self.min_samples:
                return math.nan
            return float(np.quantile(np.fromiter(self._samples, float), self.quantile))

    def lead(self) -> float:
        """Seconds to start inference before the deadline: estimate() * margin.

        Until `min_samples` warm samples have been recorded: `initial`, or the slowest warm
        sample so far times the margin where that is longer (a loop slower than the warm-up
        measured, e.g. with frames to decode or a busier machine, is late at most until its
        first warm sample, not for `min_samples` ticks). Capped at `max_lead` when set.
        """
        q = self.estimate()
        if math.isnan(q):
            with self._lock:
                slowest = max(self._samples, default=0.0)
            lead = max(self.initial, slowest * self.margin)
        else:
            lead = q * self.margin
        return lead if self.max_lead is None else min(lead, self.max_lead)
