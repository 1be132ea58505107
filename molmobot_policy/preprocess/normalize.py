"""Quantile normalization of robot states and actions (upstream `quantiles` mode).

normalize:   y = 2 (x - q01) / max(q99 - q01, 1e-6) - 1
unnormalize: x = (y + 1) (q99 - q01) / 2 + q01
in float32, no clipping (golden README section 5; upstream `olmo/data/robot_processing.py`).
The operations run in exactly that order so results match upstream bit for bit.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from molmobot_policy.model.config import MolmoBotConfig

MIN_RANGE = 1e-6     # upstream's floor on q99 - q01 when normalizing


def _stat_vector(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float32)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f'{name} must be a non-empty 1-D list of floats, got shape {array.shape}')
    if not np.all(np.isfinite(array)):
        raise ValueError(f'{name} must be finite, got {array.tolist()}')
    return array


class QuantileNormalizer:
    """Maps values between robot units and the model's quantile space (about [-1, 1]).

    Args:
        q01, q99: per-dimension 1st and 99th percentiles, robot units, same length D.
    Raises:
        ValueError: empty, non-finite, not 1-D, or different lengths.
    """

    def __init__(self, q01: Sequence[float] | np.ndarray, q99: Sequence[float] | np.ndarray,
                 name: str = 'values') -> None:
        self.name = name
        self.q01 = _stat_vector(q01, f'{name} q01')
        self.q99 = _stat_vector(q99, f'{name} q99')
        if self.q01.shape != self.q99.shape:
            raise ValueError(f'{name} q01 has {self.q01.size} entries but q99 has {self.q99.size}')

    @property
    def dim(self) -> int:
        """D, the number of dimensions the statistics cover."""
        return int(self.q01.size)

    def _check(self, x: np.ndarray | Sequence[float], what: str) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if x.ndim == 0 or x.shape[-1] != self.dim:
            raise ValueError(f'{what} must have {self.dim} values in its last dimension '
                             f'({self.name} statistics), got shape {x.shape}')
        return x

    def normalize(self, x: np.ndarray | Sequence[float]) -> np.ndarray:
        """Robot units -> quantile space. x: (..., D) -> float32 (..., D). ValueError on D."""
        x = self._check(x, f'{self.name} to normalize')
        return 2 * (x - self.q01) / np.maximum(self.q99 - self.q01, np.float32(MIN_RANGE)) - 1

    def unnormalize(self, y: np.ndarray | Sequence[float]) -> np.ndarray:
        """Quantile space -> robot units. y: (..., D) -> float32 (..., D). ValueError on D."""
        y = self._check(y, f'{self.name} to unnormalize')
        return (y + 1) * (self.q99 - self.q01) / 2 + self.q01


def normalizers_from_config(cfg: MolmoBotConfig) -> tuple[QuantileNormalizer, QuantileNormalizer]:
    """(state, action) normalizers from `cfg.norm_stats`, checked against the model's widths.

    Returns:
        state normalizer of D = cfg.state_dim, action normalizer of D = cfg.action_dim.
    Raises:
        ValueError: no norm_stats, a mode other than 'quantiles', or statistics whose length
            differs from cfg.state_dim / cfg.action_dim.
    """
    stats = cfg.norm_stats
    if stats is None:
        raise ValueError(f'model config {cfg.name!r} has no norm_stats; the checkpoint config must '
                         'carry the quantile statistics of observation.state and action')
    if stats.mode != 'quantiles':
        raise ValueError(f"norm_stats.mode must be 'quantiles', got {stats.mode!r}")
    state = QuantileNormalizer(stats.state_q01, stats.state_q99, name='state')
    action = QuantileNormalizer(stats.action_q01, stats.action_q99, name='action')
    if state.dim != cfg.state_dim:
        raise ValueError(f'state statistics have {state.dim} entries but the model state_dim is '
                         f'{cfg.state_dim}')
    if action.dim != cfg.action_dim:
        raise ValueError(f'action statistics have {action.dim} entries but the model action_dim '
                         f'is {cfg.action_dim}')
    return state, action
