"""What the benchmarks share: the timed query, timing, statistics, provenance and reporting.

Not part of the package: the benchmarks import it as `common` (their folder is first on
sys.path when run as `python benchmarks/<name>.py`); importing it puts the repository root and
demo/ on sys.path, so `molmobot_policy` and `molmobot_policy_demo` come from this checkout.

- `full_size_observation`, `make_engine`, `device_inputs`: the query the GPU benchmarks time
  (random uint8 480x640 frames, a random state, one instruction) and the engine around it.
- `time_calls` (wall clock, synchronized), `time_replays` (CUDA events around a
  `StaticRunner` replay): per-call ms; `summary`: their p50 / p99 / max.
- `provenance`: date, command, machine, git commit and `package_digest` for every JSON.
- `write_json`, `print_table`.
- For the ROS benchmarks (rclpy imported only where used): `random_rgb8_image`,
  `interrupt_then_kill`, `cpu_seconds`.

`python3 benchmarks/common.py` prints the package digest of this checkout: compare it with a
result's `package_digest` to tell which code it measured (the GPU machine runs a copy of the
working tree whose git HEAD may be stale or absent).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
for _folder in (REPO / 'demo', REPO):     # the two packages' source folders, REPO first
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

INSTRUCTION = 'pick up the red cube and put it in the bowl'
CLK_TCK = os.sysconf('SC_CLK_TCK')


# ------------------------------------------------------------------------ the timed query
def full_size_observation(cameras: int, state_dim: int, seed: int = 1, height: int = 480,
                          width: int = 640, instruction: str = INSTRUCTION):
    """`types.Observation` of `cameras` random uint8 (height, width, 3) frames and a float32
    (state_dim,) state uniform in [-0.5, 0.5) rad, from numpy seed `seed`."""
    from molmobot_policy.types import Observation
    rng = np.random.default_rng(seed)
    frames = tuple(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
                   for _ in range(cameras))
    state = rng.uniform(-0.5, 0.5, state_dim).astype(np.float32)
    return Observation(images=frames, state=state, instruction=instruction)


def make_engine(config: dict, model=None, warm_up: bool = True, label: str = ''):
    """`PolicyEngine(EngineConfig(instruction=INSTRUCTION, **config), model=model)`, warmed up
    (every bucket compiled / captured) unless `warm_up` is false; returns (engine, seconds of
    construction + warm-up). `label` prefixes the warm-up's progress lines."""
    from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine
    start = time.perf_counter()
    engine = PolicyEngine(EngineConfig(**{'instruction': INSTRUCTION, **config}), model=model)
    if warm_up:
        engine.warmup(progress=lambda msg: print(f'  [{label}] {msg}', flush=True))
    return engine, time.perf_counter() - start


def device_inputs(engine, observation):
    """`preprocess.pipeline.ModelInputs` of `observation` on the engine's device: the inputs of
    the device part of a query (`engine.sample_actions`), what `engine.predict` builds before
    the model runs."""
    return engine.preprocessor(observation, observation.instruction or INSTRUCTION)


# ---------------------------------------------------------------------------------- timing
def _synchronize(cuda: bool) -> None:
    if cuda:
        import torch
        torch.cuda.synchronize()


def time_calls(fn, iters: int, cuda: bool, period_ms: float = 0.0) -> list[float]:
    """Wall-clock ms of each of `iters` calls of fn(), the device synchronized around each.

    period_ms > 0: a call starts every period_ms (the device idles in between, as under the
    node's chunk schedule) instead of back to back.
    """
    samples = []
    for _ in range(iters):
        _synchronize(cuda)
        start = time.perf_counter()
        fn()
        _synchronize(cuda)
        samples.append((time.perf_counter() - start) * 1e3)
        if period_ms > 0:
            time.sleep(max(0.0, period_ms / 1e3 - (time.perf_counter() - start)))
    return samples


def time_replays(runner, iters: int) -> list[float]:
    """ms of each of `iters` `runner.run()` calls (a `runtime.graphs.StaticRunner`): CUDA
    events around the replay on a GPU (device time, no host overhead), wall clock on a CPU."""
    import torch
    if not torch.cuda.is_available():
        return time_calls(runner.run, iters, cuda=False)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        runner.run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


def summary(values, samples: bool = False) -> dict:
    """p50 / p99 / max / min / n of a list of numbers (nan when empty); `samples`: also the
    values in call order, rounded to 0.001 (a drift, e.g. a clock settling under a power
    cap, shows there and not in the percentiles)."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        result = {'p50': math.nan, 'p99': math.nan, 'max': math.nan, 'min': math.nan, 'n': 0}
    else:
        result = {'p50': float(np.percentile(a, 50)), 'p99': float(np.percentile(a, 99)),
                  'max': float(a.max()), 'min': float(a.min()), 'n': int(a.size)}
    if samples:
        result['samples'] = [round(float(v), 3) for v in a]
    return result


# ------------------------------------------------------------------------------ provenance
def package_digest() -> str:
    """sha256 (first 16 hex digits) of the molmobot_policy sources (*.py and the CUDA
    kernels' *.cu, sorted by path). Results written before 2026-12-07 10:45 UTC carry the digest
    of the *.py files alone (it missed changes to cluster_dit.cu)."""
    root = REPO / 'molmobot_policy'
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(f for f in filenames if f.endswith(('.py', '.cu'))):
            path = os.path.join(dirpath, name)
            digest.update(os.path.relpath(path, root).encode() + b'\0')
            digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def git_commit() -> str | None:
    """`git rev-parse --short HEAD` of the checkout, '+dirty' when molmobot_policy/ has
    uncommitted changes; None where there is no git repository (a copied tree)."""
    try:
        head = subprocess.run(['git', '-C', str(REPO), 'rev-parse', '--short', 'HEAD'],
                              capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(['git', '-C', str(REPO), 'status', '--porcelain', '--',
                                'molmobot_policy'], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ('+dirty' if dirty.stdout.strip() else '')


def provenance() -> dict:
    """What names a result: UTC date, the command line, the machine, the code (git commit and
    package digest) and, where torch is loaded, its version and the GPU (named only where this
    process already uses CUDA: the ROS benchmarks' recorder must not take a CUDA context)."""
    result = {'date': datetime.now(timezone.utc).isoformat(timespec='seconds'),
              'command': ' '.join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
              'host': platform.node(), 'platform': platform.platform(),
              'python': platform.python_version(), 'cpus': os.cpu_count(),
              'commit': git_commit(), 'package_digest': package_digest()}
    torch = sys.modules.get('torch')
    if torch is not None:
        result['torch'] = torch.__version__
        result['gpu'] = torch.cuda.get_device_name() if torch.cuda.is_initialized() else None
    return result


# ------------------------------------------------------------------------------- reporting
def write_json(path, data: dict) -> None:
    """`data` as indented JSON at `path`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def print_table(headers: list[str], rows: list[list], digits: int = 2) -> None:
    """A plain-text table: the first column left-aligned, the others right-aligned; floats
    with `digits` decimals, None as '-', anything else as str()."""
    def cell(value) -> str:
        if value is None:
            return '-'
        if isinstance(value, float):
            return f'{value:.{digits}f}'
        return str(value)
    cells = [headers] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for r in cells:
        print('  '.join(r[0].ljust(widths[0]) if i == 0 else r[i].rjust(widths[i])
                        for i in range(len(r))).rstrip())


# ------------------------------------------------------------------- ROS benchmark helpers
def random_rgb8_image(topic: str, height: int, width: int, rng: np.random.Generator):
    """A sensor_msgs/Image of random rgb8 pixels (height, width), frame_id from the topic's
    first part; publishers restamp and resend it."""
    from sensor_msgs.msg import Image
    frame = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    msg = Image(height=height, width=width, encoding='rgb8', step=width * 3,
                data=frame.tobytes())
    msg.header.frame_id = topic.strip('/').split('/')[0]
    return msg


def interrupt_then_kill(popen: subprocess.Popen, timeout: float) -> int:
    """SIGINT a running child (a clean ROS shutdown), SIGKILL it if it has not exited after
    `timeout` s; returns its exit status."""
    if popen.poll() is None:
        popen.send_signal(signal.SIGINT)
        try:
            popen.wait(timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
    return popen.returncode


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), s, from /proc/<pid>/stat (nan if gone)."""
    try:
        text = Path(f'/proc/{pid}/stat').read_text()
    except OSError:
        return math.nan
    fields = text[text.rindex(')') + 2:].split()   # fields from 3 (state) on
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


if __name__ == '__main__':
    print(package_digest())
