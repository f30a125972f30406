"""Where micro-batches become optimizer steps and are given to ranks.

A step is ``world_size * grad_accum`` consecutive micro-batches of the plan; inside a step, rank ``r`` owns
slots ``r*grad_accum .. (r+1)*grad_accum - 1``. This module (1) orders micro-batches so that every step
mixes strata in proportion to their token mass, (2) makes the micro-batch count a multiple of the step
size without duplicating or dropping samples, and (3) assigns micro-batches to ranks by modeled cost.
"""

from __future__ import annotations

import numpy as np

from padfree.core import _kernels
from padfree.errors import ConfigError


def stratified_order(strata: np.ndarray, tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """An order of micro-batches in which each stratum is spread evenly by token mass.

    Inside stratum ``s`` the micro-batches are shuffled, then micro-batch ``j`` gets the position
    ``(T_before_j + u_j * t_j) / T_s`` (its share of the stratum's cumulative tokens, jittered) and all
    micro-batches are sorted by position. Any window of the epoch then holds each stratum in proportion to
    its token mass, so every optimizer step sees the dataset's length mix.
    """
    m = strata.shape[0]
    shuffled = rng.permutation(m)
    # group by stratum, keeping the shuffled order inside each stratum
    grouped = shuffled[_kernels.counting_argsort(strata[shuffled], int(strata.max()) + 1)]
    t = tokens[grouped].astype(np.float64)
    s = strata[grouped]
    csum = np.cumsum(t)
    first = np.searchsorted(s, s, side="left")  # index of the stratum's first micro-batch
    start_tokens = csum[first] - t[first]
    total = np.bincount(s, weights=t)[s]
    before = csum - t - start_tokens
    pos = (before + rng.random(m) * t) / total
    return grouped[np.argsort(pos, kind="stable")]


def spread_tail(offsets: np.ndarray, step_size: int) -> np.ndarray:
    """Split micro-batches (the last ones first, each in two halves) until their count is a multiple of
    ``step_size``, so every rank gets the same number of micro-batches in every step. No sample is
    duplicated or dropped; a half never exceeds the budget its whole obeyed.

    >>> spread_tail(np.array([0, 2, 4, 5]), 4).tolist()
    [0, 2, 3, 4, 5]
    """
    m = offsets.shape[0] - 1
    need = (-m) % step_size
    while need > 0:
        counts = np.diff(offsets)
        splittable = np.flatnonzero(counts >= 2)
        if splittable.size == 0:
            raise ConfigError(
                f"cannot give every rank the same number of micro-batches: {int(offsets[-1])} samples make "
                f"{m} micro-batches and {need} more are needed for steps of {step_size}; "
                "lower world_size * grad_accum"
            )
        chosen = splittable[-min(need, splittable.size) :]
        mids = offsets[chosen] + counts[chosen] // 2
        offsets = np.insert(offsets, chosen + 1, mids)
        need -= chosen.size
        m = offsets.shape[0] - 1
    return offsets


def assign_ranks(
    costs: np.ndarray,
    world_size: int,
    grad_accum: int,
    max_rounds: int = 64,
    speeds: np.ndarray | None = None,
) -> np.ndarray:
    """Permutation of micro-batches that balances each step's ranks (see ``_kernels.balance_ranks``), of
    equal speed or of the given relative ``speeds``."""
    if world_size == 1:
        return np.arange(costs.shape[0], dtype=np.int64)
    uniform = speeds is None
    speeds = np.ones(world_size) if speeds is None else np.asarray(speeds, dtype=np.float64)
    c = costs.astype(np.float64)
    return _kernels.balance_ranks(c, int(world_size), int(grad_accum), int(max_rounds), speeds, uniform)
