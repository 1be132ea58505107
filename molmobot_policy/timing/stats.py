"""Rolling statistics for the timing measurements reported on /diagnostics.

Timing model (DESIGN.md, "Timing model"): publish-time jitter (actual publish time minus
the tick deadline), inference latency, sensor-to-publish age and missed deadlines are
measured continuously. Each measured quantity goes into one `RollingStats`, which keeps
the last `window` samples and reports p50 / p99 / max / mean / min over them; the node
converts the `summary()` into diagnostic key-values. Units are the caller's (the node
adds seconds and reports milliseconds via `summary(scale=1000.0)`).

Quantiles use numpy's default (linear interpolation between order statistics, Hyndman &
Fan type 7). With no samples every statistic is nan (count 0), never an exception.
Plain python + numpy; thread-safe (one lock): the worker adds, a timer reads.
"""
from __future__ import annotations

import gc
import math
import resource
import threading
import time

import numpy as np

from .validation import finite


class RollingStats:
    """Statistics over the last `window` samples of one quantity.

    Args:
        window: number of most recent samples kept (int >= 1).

    Raises:
        ValueError: window not an int >= 1.
    """

    def __init__(self, window: int = 1000):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f'window must be an int >= 1, got {window!r}')
        self.window = window
        self._buffer = np.zeros(window, dtype=np.float64)  # ring buffer
        self._count = 0     # samples currently held (<= window)
        self._next = 0      # ring position of the next sample
        self._total = 0     # samples ever added
        self._lock = threading.Lock()

    def add(self, x: float) -> None:
        """Add one sample (a finite number), evicting the oldest when the window is full.

        Raises:
            ValueError: x not a finite number.
        """
        value = finite('sample', x)
        with self._lock:
            self._buffer[self._next] = value
            self._next = (self._next + 1) % self.window
            self._count = min(self._count + 1, self.window)
            self._total += 1

    def values(self) -> np.ndarray:
        """float64 (count,), the samples in the window, oldest first (a copy)."""
        with self._lock:
            return self._ordered()

    def _ordered(self) -> np.ndarray:
        # caller holds the lock
        if self._count < self.window:
            return self._buffer[:self._count].copy()
        return np.concatenate([self._buffer[self._next:], self._buffer[:self._next]])

    def clear(self) -> None:
        """Drop every sample (total included)."""
        with self._lock:
            self._count = self._next = self._total = 0

    @property
    def count(self) -> int:
        """Number of samples in the window."""
        return self._count

    @property
    def total(self) -> int:
        """Number of samples ever added (not limited by the window)."""
        return self._total

    def quantile(self, q: float, last: int | None = None) -> float:
        """The q-quantile (0 <= q <= 1) of the window, or of its `last` newest samples;
        nan when empty.

        Raises:
            ValueError: q outside [0, 1], last < 1.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f'quantile must be in [0, 1], got {q!r}')
        if last is not None and last < 1:
            raise ValueError(f'last must be None or >= 1, got {last!r}')
        values = self.values()
        if last is not None:
            values = values[-last:]
        return float(np.quantile(values, q)) if values.size else math.nan

    @property
    def p50(self) -> float:
        """Median of the window; nan when empty."""
        return self.quantile(0.5)

    @property
    def p99(self) -> float:
        """99th percentile of the window; nan when empty."""
        return self.quantile(0.99)

    @property
    def max(self) -> float:
        """Largest sample in the window; nan when empty."""
        values = self.values()
        return float(values.max()) if values.size else math.nan

    @property
    def min(self) -> float:
        """Smallest sample in the window; nan when empty."""
        values = self.values()
        return float(values.min()) if values.size else math.nan

    @property
    def mean(self) -> float:
        """Arithmetic mean of the window; nan when empty."""
        values = self.values()
        return float(values.mean()) if values.size else math.nan

    def summary(self, scale: float = 1.0) -> dict:
        """All statistics of one consistent snapshot of the window.

        Args:
            scale: factor applied to every value statistic (e.g. 1000.0 for s -> ms).
        Returns:
            {'count': int, 'total': int, 'p50', 'p99', 'max', 'min', 'mean': float};
            the floats are nan when the window is empty.
        """
        with self._lock:
            total, values = self._total, self._ordered()
        if values.size == 0:
            stats = dict.fromkeys(('p50', 'p99', 'max', 'min', 'mean'), math.nan)
        else:
            p50, p99 = np.quantile(values, [0.5, 0.99])
            stats = {'p50': float(p50), 'p99': float(p99), 'max': float(values.max()),
                     'min': float(values.min()), 'mean': float(values.mean())}
        return {'count': int(values.size), 'total': total,
                **{key: value * scale for key, value in stats.items()}}


class GcPauses:
    """Pauses of CPython's cyclic garbage collector, timed through `gc.callbacks`.

    A collection stops every Python thread (it runs holding the GIL), so its length adds
    directly to inference latency and publish jitter. A full (generation 2) collection
    walks every tracked object: after torch.compile that is millions of objects and
    hundreds of ms. The node freezes its start-up heap (`gc.freeze()`, CPython >= 3.7)
    after configure so that later collections only walk new objects, and reports what
    remains here.

    Not thread-safe by itself, and needs not be: the collector calls back with the GIL held,
    one collection at a time. `pauses_ms` is a `RollingStats` (thread-safe) of every
    collection's length, ms; `collections` counts them per generation (0, 1, 2).
    """

    def __init__(self, window: int = 1000) -> None:
        self.pauses_ms = RollingStats(window)
        self.collections = [0, 0, 0]
        self.max_ms = 0.0           # longest pause since install, ms
        self._started: float | None = None
        self._clock = time.perf_counter

    def __call__(self, phase: str, info: dict) -> None:
        if phase == 'start':
            self._started = self._clock()
        elif self._started is not None:
            pause_ms = (self._clock() - self._started) * 1e3
            self._started = None
            generation = int(info.get('generation', 0))
            self.collections[min(max(generation, 0), 2)] += 1
            self.pauses_ms.add(pause_ms)
            self.max_ms = max(self.max_ms, pause_ms)

    def install(self) -> 'GcPauses':
        """Starts timing collections (idempotent). Returns self."""
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        """Stops timing collections (idempotent)."""
        while self in gc.callbacks:
            gc.callbacks.remove(self)


def freeze_heap() -> int:
    """Collect, then move every object still alive out of the garbage collector's reach
    (`gc.freeze`, CPython >= 3.7): a start-up heap (the model, compiled code, CUDA graphs:
    millions of objects after torch.compile) that lives until cleanup then costs no full
    collection hundreds of ms (refcounting still frees it). Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze_heap(collect: bool = True) -> None:
    """Undo `freeze_heap` and (`collect`) collect, so the collector frees the released heap's
    cycles; a process about to exit skips the collection (`freeze_for_exit`)."""
    gc.unfreeze()
    if collect:
        gc.collect()


def freeze_for_exit() -> None:
    """For a process about to exit: stop the collector and move the whole heap out of its
    reach (`gc.freeze`), so that the interpreter's own collections at shutdown, each a pass
    over every tracked object (with a model loaded, most of the time between Ctrl-C and the
    exit), find nothing to traverse. The memory goes back with the process; the cleanup that
    matters (publishers, the camera receiver's shared memory) is explicit and done before."""
    gc.disable()
    gc.freeze()


SCHEDSTAT_PATH = '/proc/thread-self/schedstat'


def runqueue_wait_s(path: str = SCHEDSTAT_PATH) -> float | None:
    """Seconds the calling thread has spent runnable but without a CPU, since it started.

    Linux's per-thread scheduler statistics, `/proc/thread-self/schedstat`: three numbers,
    time on a CPU (ns), time waiting on a run queue (ns), time slices run
    (Documentation/scheduler/sched-stats.rst). The second one is returned, in seconds.
    A thread blocked on a lock, a timed wait or the GIL is asleep, not runnable: that time
    does not count. So for a late wake-up, the increase of this value over the wait tells
    how much of the lateness the operating system's scheduling caused (no free CPU, or the
    virtual CPU not running), and the rest was waiting for the GIL or a lock.

    Returns None where the file cannot be read or parsed (other systems; kernels without
    CONFIG_SCHED_INFO). One open and read: ~15 us on a 2-core CI machine.
    """
    times = _schedstat_s(path)
    return None if times is None else times[1]


def _schedstat_s(path: str) -> tuple[float, float] | None:
    """(time on a CPU s, time on a run queue s) from a schedstat file; None where it cannot
    be read or parsed."""
    try:
        with open(path, 'rb') as f:
            fields = f.read().split()
        return int(fields[0]) * 1e-9, int(fields[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return None


def thread_account(path: str = SCHEDSTAT_PATH) -> tuple | None:
    """The calling thread's accounts so far: (time on a CPU s, time runnable without a CPU
    s, voluntary context switches, involuntary ones, minor page faults, major ones).

    The two times from `/proc/thread-self/schedstat` (`runqueue_wait_s`), the counts from
    `getrusage(RUSAGE_THREAD)` (Linux). The differences over a stall of the thread tell
    where it went: on a CPU (its own code or the kernel's work for it, e.g. a page fault),
    on a run queue (no free CPU), or neither (asleep: blocked on the GIL or a lock, or the
    virtual CPU not running where the kernel leaves steal time out of both). Returns None
    where either source is missing. A read and a system call: ~20 us.
    """
    times = _schedstat_s(path)
    try:
        usage = resource.getrusage(resource.RUSAGE_THREAD)
    except (OSError, AttributeError):       # no RUSAGE_THREAD off Linux
        return None
    if times is None:
        return None
    return times + (usage.ru_nvcsw, usage.ru_nivcsw, usage.ru_minflt, usage.ru_majflt)


def account_difference(before: tuple | None, after: tuple | None) -> str:
    """Two `thread_account` readings -> 'on_cpu_ms=.. runqueue_ms=.. csw_voluntary=..
    csw_involuntary=.. faults_minor=.. faults_major=..' ('' if either is None)."""
    if before is None or after is None:
        return ''
    d = [b - a for a, b in zip(before, after)]
    return (f'on_cpu_ms={d[0] * 1e3:.3f} runqueue_ms={d[1] * 1e3:.3f} csw_voluntary={d[2]} '
            f'csw_involuntary={d[3]} faults_minor={d[4]} faults_major={d[5]}')
