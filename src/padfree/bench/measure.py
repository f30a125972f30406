"""How a batching of samples is measured, the same way for padfree and for every peer.

A batching is ``(order, offsets)``: micro-batch ``k`` holds samples ``order[offsets[k]:offsets[k+1]]``. What
a micro-batch computes is :func:`padfree.core.cost.micro_shapes`, the planner's own model: a *padded*
micro-batch computes ``count x longest`` slots, a *packed* row its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from padfree.core.config import CostModel
from padfree.core.cost import imbalance, micro_costs, micro_shapes, rank_costs


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


def batching_stats(lengths: np.ndarray, b: Batching, budget: int) -> dict:
    """Padding efficiency (real tokens / computed slots), fill (real tokens / budget per micro-batch) and
    the shape of the micro-batches; over budget: padded ``count x longest`` or packed tokens above it.

    >>> b = Batching(np.array([0, 1, 2]), np.array([0, 2, 3]), packed=False)
    >>> st = batching_stats(np.array([4, 2, 6]), b, budget=8)
    >>> st["padding_efficiency"], st["fill"]
    (0.8571428571428571, 0.75)
    """
    sh = micro_shapes(lengths[b.order], b.offsets, b.packed)
    tokens = sh.real
    return {
        "padding_efficiency": float(tokens.sum() / sh.slots.sum()),
        "fill": float(tokens.sum() / (b.n_micro * budget)),
        "micro_batches": b.n_micro,
        "samples_covered": int(b.order.shape[0]),
        "tokens_per_micro_mean": float(tokens.mean()),
        "tokens_per_micro_max": float(tokens.max()),
        "over_budget_micro": int((sh.slots > budget).sum()),
        "largest_micro_slots": int(sh.slots.max()),
    }


def rank_imbalance(
    lengths: np.ndarray, b: Batching, world_size: int, grad_accum: int, cost: CostModel | None = None
) -> float:
    """Modeled rank imbalance (:func:`padfree.core.cost.imbalance`: mean over steps of the most loaded rank
    over the mean rank) when the micro-batches are dealt in their order: each run of ``world_size x
    grad_accum`` is a step, rank ``r`` takes its ``grad_accum`` micro-batches ``r*grad_accum ...``: the
    layout of padfree's plans and of ``BatchRebalanceSampler``; a trailing partial step is left out.
    ``cost`` defaults to slots alone (``a=1, b=c=0``).

    >>> b = Batching(np.arange(4), np.array([0, 1, 2, 3, 4]), packed=True)
    >>> rank_imbalance(np.array([3, 1, 2, 2]), b, world_size=2, grad_accum=1)
    1.25
    """
    sh = micro_shapes(lengths[b.order], b.offsets, b.packed)
    k = world_size * grad_accum
    whole = (b.n_micro // k) * k
    if whole == 0:
        return 1.0
    costs = micro_costs(sh, cost or CostModel(1.0, 0.0, 0.0))[:whole]
    return imbalance(rank_costs(costs, world_size, grad_accum))


def covers_each_once(b: Batching, n: int) -> bool:
    """True if every sample id in ``0..n-1`` appears exactly once."""
    return b.order.shape[0] == n and bool(np.all(np.bincount(b.order, minlength=n) == 1))
