"""How a batching of samples is measured, the same way for padfree and for every peer.

A batching is ``(order, offsets)``: micro-batch ``k`` holds samples ``order[offsets[k]:offsets[k+1]]``. A
*padded* batching computes ``count x longest`` slots per micro-batch; a *packed* one computes one bin of
``budget`` slots (or the micro-batch's own token count when it overflows the budget).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Batching:
    """Micro-batches of sample ids, and whether they are padded rows or packed bins.

    Attributes:
        order: sample ids, micro-batch after micro-batch.
        offsets: micro-batch boundaries into ``order``.
        packed: True for bins of the budget (one flattened row), False for padded micro-batches.
        note: how the peer's output became micro-batches (empty for a direct plan).
    """

    order: np.ndarray
    offsets: np.ndarray
    packed: bool
    note: str = ""

    @property
    def n_micro(self) -> int:
        return int(self.offsets.shape[0] - 1)


def slots_per_micro(lengths: np.ndarray, b: Batching, budget: int) -> np.ndarray:
    """Computed slots per micro-batch: ``count x longest`` (padded) or ``max(budget, tokens)`` (packed)."""
    lens = lengths[b.order].astype(np.float64)
    starts = b.offsets[:-1]
    if lens.size == 0:
        return np.zeros(0)
    if b.packed:
        return np.maximum(float(budget), np.add.reduceat(lens, starts))
    return np.diff(b.offsets) * np.maximum.reduceat(lens, starts)


def batching_stats(lengths: np.ndarray, b: Batching, budget: int) -> dict:
    """Padding efficiency (real tokens / computed slots) and the shape of the micro-batches.

    >>> b = Batching(np.array([0, 1, 2]), np.array([0, 2, 3]), packed=False)
    >>> batching_stats(np.array([4, 2, 6]), b, budget=8)["padding_efficiency"]
    0.8571428571428571
    """
    lens = lengths[b.order].astype(np.float64)
    tokens = np.add.reduceat(lens, b.offsets[:-1]) if lens.size else np.zeros(0)
    slots = slots_per_micro(lengths, b, budget)
    padded_slots = np.diff(b.offsets) * (np.maximum.reduceat(lens, b.offsets[:-1]) if lens.size else 0)
    over = slots > budget if b.packed else padded_slots > budget
    return {
        "padding_efficiency": float(lengths.sum() / slots.sum()),
        "micro_batches": b.n_micro,
        "samples_covered": int(b.order.shape[0]),
        "tokens_per_micro_mean": float(tokens.mean()),
        "tokens_per_micro_max": float(tokens.max()),
        "over_budget_micro": int(over.sum()),
    }


def covers_each_once(b: Batching, n: int) -> bool:
    """True if every sample id in ``0..n-1`` appears exactly once."""
    return b.order.shape[0] == n and bool(np.all(np.bincount(b.order, minlength=n) == 1))
