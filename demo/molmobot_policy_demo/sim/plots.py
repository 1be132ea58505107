"""PNG pictures of a run, for the demo (`make demo`) and the node benchmark: plain values in,
one file out per function (matplotlib's Agg canvas: headless, no display, no pyplot state).

- `latency_timeline`: inference, observation age and publish jitter of every chunk over time.
- `jitter_histogram`: the publish jitter's distribution with its p50 / p99 / max.
- `joint_trajectories`: per joint, the published `JointTrajectory` points (what was planned)
  against `/joint_states` (what the robot did), over time.
- `contact_sheet`: the camera frames side by side, titled with the instruction.

matplotlib comes with `requirements/demo.txt`; the node never imports this module, so a robot
install (`requirements/runtime.txt`) needs no matplotlib. Every figure has a fixed size in
pixels (`SIZES` inches x `DPI`), whatever its data.
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from molmobot_policy.ros.messages import ChunkInfo

DPI = 100
SIZES = {'timeline': (11.0, 6.5), 'histogram': (8.0, 5.0), 'trajectories': (12.0, 10.0),
         'contact_sheet': (12.0, 6.5)}      # inches (width, height)
SHEET_COLUMNS = 4
TIME_LABEL = 'time since the first planned point (s, ROS time)'
LEAD_IN_S = 2.0     # s of /joint_states shown before the first planned point
OFF_SCALE = 3.0     # a reference line this many times beyond the data is named, not drawn


def size_pixels(kind: str) -> tuple[int, int]:
    """(width, height) in pixels of the PNG a function of kind `kind` (a `SIZES` key) writes."""
    width, height = SIZES[kind]
    return round(width * DPI), round(height * DPI)


def _figure(kind: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    figure = Figure(figsize=SIZES[kind], dpi=DPI, layout='constrained')
    FigureCanvasAgg(figure)
    return figure


def _wrap(text: str, kind: str) -> str:
    """`text` wrapped to the width of a figure of `kind` (~10 title characters per inch)."""
    return '\n'.join(textwrap.fill(line, int(SIZES[kind][0] * 10))
                     for line in text.splitlines())


def _save(figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI, format='png')
    return path


def _no_data(axes, text: str) -> None:
    axes.text(0.5, 0.5, text, ha='center', va='center', transform=axes.transAxes,
              fontsize=12, color='0.4')


def _reference_lines(axes, lines: Mapping[str, float] | None, data_max: float,
                     vertical: bool) -> None:
    """Dashed lines at {label: value}; one beyond OFF_SCALE x the data's largest value would
    squash the data against the axis: it is listed in the legend as off the axis instead."""
    for k, (label, value) in enumerate((lines or {}).items()):
        if math.isfinite(data_max) and data_max > 0 and value > OFF_SCALE * data_max:
            axes.plot([], [], ' ', label=f'{label} (off the axis)')
        elif vertical:
            axes.axvline(value, ls='--', lw=1.2, color=f'C{k + 3}', label=label)
        else:
            axes.axhline(value, ls='--', lw=1, color=f'C{k + 3}', label=label)


def _largest(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.max()) if finite.size else math.nan


def _number(value) -> float:
    """A `~/chunk_info` value (a string; '' or 'nan' where not measured) as a float."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def latency_timeline(path, chunks: Sequence[Mapping[str, str]], title: str,
                     latency_lines: Mapping[str, float] | None = None,
                     jitter_lines: Mapping[str, float] | None = None) -> Path:
    """Inference and observation age (top) and publish jitter (bottom), ms, of each chunk
    against its publish time (s since the first chunk's, ROS time: observation stamp +
    observation age). A tick without a chunk leaves a gap between markers.

    Args:
        path: the PNG to write (parent folders are created).
        chunks: the values of each `~/chunk_info` message, {`ChunkInfo` key: str}, in order.
        title: the figure title (what ran).
        latency_lines / jitter_lines: {label: ms} drawn as dashed horizontal lines (e.g. the
            chunk period, the /diagnostics WARN threshold).

    Returns the path. Raises OSError when the file cannot be written.
    """
    figure = _figure('timeline')
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    figure.suptitle(_wrap(title, 'timeline'))
    stamps = np.array([_number(c.get(ChunkInfo.OBSERVATION_STAMP)) for c in chunks])
    age = np.array([_number(c.get(ChunkInfo.OBSERVATION_AGE_MS)) for c in chunks])
    inference = np.array([_number(c.get(ChunkInfo.INFERENCE_MS)) for c in chunks])
    jitter = np.array([_number(c.get(ChunkInfo.PUBLISH_JITTER_MS)) for c in chunks])
    published = stamps + age / 1e3
    t = published - published[0] if len(chunks) else published
    top.plot(t, inference, 'o-', ms=3, lw=1, label='inference (engine.predict)')
    top.plot(t, age, 's-', ms=3, lw=1, label='observation age at publish (publish - oldest '
                                             'input stamp)')
    bottom.plot(t, jitter, 'o-', ms=3, lw=1, color='tab:green',
                label='publish jitter (publish - deadline)')
    _reference_lines(top, latency_lines, _largest(np.concatenate([inference, age])), False)
    _reference_lines(bottom, jitter_lines, _largest(jitter), False)
    top.set_ylabel('latency (ms)')
    top.set_title(f'latency per chunk ({len(chunks)} chunks)')
    bottom.set_ylabel('jitter (ms)')
    bottom.set_title('publish jitter per chunk')
    bottom.set_xlabel("time since the first chunk's publish (s, ROS time)")
    for axes in (top, bottom):
        axes.grid(True, alpha=0.3)
        if len(chunks):
            axes.legend(loc='upper right', fontsize=8)
    if not len(chunks):
        _no_data(top, 'no chunk was published')
    return _save(figure, path)


def jitter_histogram(path, jitter_ms: Sequence[float], title: str,
                     lines: Mapping[str, float] | None = None) -> Path:
    """Histogram of the publish jitter (publish time - deadline, ms) with its p50, p99 and
    max marked; `lines` {label: ms} adds dashed reference lines (targets, thresholds).
    Returns the path. Raises OSError when the file cannot be written."""
    figure = _figure('histogram')
    axes = figure.subplots()
    values = np.asarray([v for v in jitter_ms if math.isfinite(v)], dtype=np.float64)
    axes.set_title(_wrap(title, 'histogram'))
    axes.set_xlabel('publish jitter (ms): publish time - deadline')
    axes.set_ylabel('chunks')
    axes.grid(True, alpha=0.3)
    if values.size == 0:
        _no_data(axes, 'no chunk was published')
        return _save(figure, path)
    axes.hist(values, bins=min(60, max(20, values.size // 4)), color='tab:green', alpha=0.75,
              label=f'{values.size} chunks')
    p50, p99 = np.percentile(values, [50, 99])
    for label, value, style in (('p50', p50, '-'), ('p99', p99, '-.'),
                                ('max', values.max(), ':')):
        axes.axvline(value, color='black', ls=style, lw=1.2, label=f'{label} {value:.3f} ms')
    _reference_lines(axes, lines, float(values.max()), True)
    from matplotlib.ticker import MaxNLocator
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.legend(fontsize=9)
    return _save(figure, path)


def joint_trajectories(path, planned: Sequence[tuple[Sequence[str], np.ndarray, np.ndarray]],
                       executed_names: Sequence[str], executed_times: np.ndarray,
                       executed_positions: np.ndarray, title: str) -> Path:
    """Per joint of the plan: the published points against the measured positions, rad,
    over time (s since the first planned point, ROS time; the measured positions from
    LEAD_IN_S before it).

    Args:
        planned: one (joint_names (A,), times float (K,) s ROS time = header.stamp +
            time_from_start, positions float (K, A) rad) per published JointTrajectory, in
            order. A chunk is drawn solid up to the next chunk's first point (from there the
            next one replaces it, as JointTrajectoryController does), dotted after.
        executed_names: the J joint names of `/joint_states`.
        executed_times: float (N,) s ROS time (header stamps); executed_positions (N, J) rad.
        title: the figure title.

    Returns the path. Raises OSError when the file cannot be written.
    """
    joints = list(dict.fromkeys(name for names, _, _ in planned for name in names))
    figure = _figure('trajectories')
    figure.suptitle(_wrap(title, 'trajectories'))
    executed_times = np.asarray(executed_times, dtype=np.float64).reshape(-1)
    executed_positions = np.asarray(executed_positions, dtype=np.float64).reshape(
        len(executed_times), len(executed_names))
    if not joints:
        _no_data(figure.subplots(), 'no JointTrajectory was published')
        return _save(figure, path)
    starts = [float(times[0]) for _, times, _ in planned]
    origin = starts[0]
    shown = executed_times >= origin - LEAD_IN_S
    executed_times, executed_positions = executed_times[shown], executed_positions[shown]
    columns = 2 if len(joints) > 3 else 1
    grid = figure.subplots(math.ceil(len(joints) / columns), columns, sharex=True,
                           squeeze=False)
    for k, axes in enumerate(grid.flat):
        if k >= len(joints):
            axes.set_visible(False)
            continue
        joint = joints[k]
        if joint in executed_names:
            axes.plot(executed_times - origin, executed_positions[:, list(
                executed_names).index(joint)], color='black', lw=1.6,
                label='executed (/joint_states)')
        for i, (names, times, positions) in enumerate(planned):
            if joint not in names:
                continue
            times, column = np.asarray(times) - origin, np.asarray(positions)[:, list(
                names).index(joint)]
            until = starts[i + 1] - origin if i + 1 < len(planned) else math.inf
            active = times <= until
            axes.plot(times[active], column[active], '.-', color='tab:blue', ms=4, lw=1,
                      label='planned (JointTrajectory points)' if i == 0 else None)
            axes.plot(times[~active], column[~active], ':', color='tab:blue', lw=0.8,
                      alpha=0.6, label='planned, replaced by the next chunk' if i == 0
                      else None)
        axes.set_title(joint, fontsize=10)
        axes.set_ylabel('position (rad)')
        axes.grid(True, alpha=0.3)
    for axes in grid[-1]:
        axes.set_xlabel(TIME_LABEL)
    if len(joints) % columns:         # the hidden last cell's neighbour above gets the label
        grid[-2, -1].set_xlabel(TIME_LABEL)
        grid[-2, -1].tick_params(labelbottom=True)
    handles, labels = grid.flat[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc='outside lower center', ncols=3, fontsize=9)
    return _save(figure, path)


def contact_sheet(path, frames: Sequence[np.ndarray], camera_names: Sequence[str],
                  instruction: str, title: str) -> Path:
    """The camera frames (uint8 (H, W, 3) RGB each; None: no frame came) in a grid of
    `SHEET_COLUMNS`, each titled with its camera name, under the title and the instruction.
    Returns the path. Raises OSError when the file cannot be written."""
    figure = _figure('contact_sheet')
    figure.suptitle(_wrap(f'{title}\ninstruction: "{instruction}"', 'contact_sheet'))
    columns = max(1, min(SHEET_COLUMNS, len(frames)))
    grid = figure.subplots(max(1, math.ceil(len(frames) / columns)), columns, squeeze=False)
    for k, axes in enumerate(grid.flat):
        axes.set_xticks([])
        axes.set_yticks([])
        if k >= len(frames):
            axes.set_visible(False)
            continue
        axes.set_title(camera_names[k], fontsize=9)
        if frames[k] is None:
            _no_data(axes, 'no frame received')
        else:
            height, width = frames[k].shape[:2]
            axes.imshow(frames[k], interpolation='nearest')
            axes.set_xlabel(f'{width}x{height}', fontsize=8)
    if not frames:
        _no_data(grid[0, 0], 'no camera')
    return _save(figure, path)
