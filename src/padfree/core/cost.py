"""What a micro-batch computes and what that costs: the one shape and cost model behind rank balancing,
metrics, ``simulate``, ``report`` and the benchmarks.

A micro-batch is either *padded* rows or one *packed* row:

    padded (count 3, longest 5)          packed (documents 5, 3, 4; budget 16)
    +-----------+                        +-----------+-------+---------+
    | a a a a a |  slots = 3 x 5 = 15    | a a a a a | b b b | c c c c |   slots = 5 + 3 + 4 = 12
    | b b b . . |  attention = 3 x 5^2   +-----------+-------+---------+   attention = 5^2 + 3^2 + 4^2
    | c c c c . |  (the row's causal                                      (per document: no pad, no
    +-----------+   square, pads too)                                      score across documents)

A packed row is computed as what it holds (``PackCollator`` pads nothing; varlen attention runs per
document), so its *slots* are its tokens and its padding efficiency is 1. How full its bin is against the
budget is a separate number, the *fill* (real tokens / budget per micro-batch), which decides how many
micro-batches an epoch needs. The cost of a micro-batch is ``a*slots + b*attention + c``
(:class:`~padfree.core.config.CostModel`); a step costs what its slowest rank costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np


class Coefficients(NamedTuple):
    """``(a, b, c)`` of the cost ``a*slots + b*attention + c``: what a :class:`~padfree.core.config.CostModel`
    says (``CostModel.coefficients``), a balance fitted in seconds carries, and a numba kernel takes as three
    scalars (``np.asarray(coefficients)``)."""

    a: float
    b: float
    c: float


class HasCoefficients(Protocol):
    @property
    def a(self) -> float: ...
    @property
    def b(self) -> float: ...
    @property
    def c(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Shapes:
    """Per micro-batch: ``count`` samples, ``real`` tokens, computed ``slots``, ``real_attn`` (sum of l^2)
    and computed ``attn`` (zeros for an empty micro-batch)."""

    count: np.ndarray
    real: np.ndarray
    slots: np.ndarray
    real_attn: np.ndarray
    attn: np.ndarray


def micro_shapes(lens: np.ndarray, offsets: np.ndarray, packed: bool) -> Shapes:
    """What each micro-batch computes (:class:`Shapes`); ``lens`` are the lengths in plan order, ``offsets``
    the micro-batch boundaries. An empty micro-batch (a re-cut step's, an epoch tail's) computes nothing.

    >>> sh = micro_shapes(np.array([5, 3, 4, 2]), np.array([0, 3, 4]), packed=False)
    >>> sh.slots.tolist(), sh.attn.tolist(), sh.real.tolist()
    ([15.0, 2.0], [75.0, 4.0], [12.0, 2.0])
    >>> micro_shapes(np.array([5, 3, 4]), np.array([0, 3]), packed=True).slots.tolist()
    [12.0]
    >>> micro_shapes(np.array([5, 3]), np.array([0, 0, 2, 2]), packed=False).slots.tolist()
    [0.0, 10.0, 0.0]
    """
    count = np.diff(offsets)
    if lens.size == 0:
        z = np.zeros(count.shape[0])
        return Shapes(count, z, z, z, z)
    full = np.flatnonzero(count > 0)
    if full.size < count.shape[0]:
        part = _shapes(lens, np.append(offsets[full], offsets[-1]), packed)
        out = [np.zeros(count.shape[0]) for _ in range(4)]
        for arr, v in zip(out, (part.real, part.slots, part.real_attn, part.attn), strict=True):
            arr[full] = v
        return Shapes(count, *out)
    return _shapes(lens, offsets, packed)


def _shapes(lens: np.ndarray, offsets: np.ndarray, packed: bool) -> Shapes:
    starts = offsets[:-1]
    count = np.diff(offsets)
    lf = lens.astype(np.float64)
    real = np.add.reduceat(lf, starts)
    real_attn = np.add.reduceat(lf * lf, starts)
    if packed:
        return Shapes(count, real, real, real_attn, real_attn)
    longest = np.maximum.reduceat(lf, starts)
    return Shapes(count, real, count * longest, real_attn, count * longest * longest)


def micro_costs(shapes: Shapes, model: HasCoefficients) -> np.ndarray:
    """Modeled cost of computing each micro-batch: ``a*slots + b*attention + c`` (the one place it is
    written; ``model`` is a :class:`~padfree.core.config.CostModel` or :class:`Coefficients`)."""
    return model.a * shapes.slots + model.b * shapes.attn + model.c


def real_cost(shapes: Shapes, model: HasCoefficients) -> float:
    """Modeled cost of the real work alone, all micro-batches together: ``a*tokens + b*sum l^2`` (no padding,
    no per-micro-batch constant)."""
    return float(model.a * shapes.real.sum() + model.b * shapes.real_attn.sum())


def rank_costs(costs: np.ndarray, world_size: int, grad_accum: int) -> np.ndarray:
    """Summed cost per (step, rank) of micro-batch costs in plan order: shape ``(n_steps, world_size)``.

    >>> rank_costs(np.array([1.0, 2.0, 3.0, 4.0]), world_size=2, grad_accum=1).tolist()
    [[1.0, 2.0], [3.0, 4.0]]
    """
    k = world_size * grad_accum
    if costs.shape[0] % k:
        raise ValueError(f"{costs.shape[0]} micro-batches are not whole steps of {k}")
    return costs.reshape(costs.shape[0] // k, world_size, grad_accum).sum(axis=2)


def step_costs(per_rank: np.ndarray) -> np.ndarray:
    """What each step costs: its most loaded rank (every rank waits for it at the gradient all-reduce)."""
    return per_rank.max(axis=1)


def imbalance(per_rank: np.ndarray) -> float:
    """Mean over steps of (most loaded rank / mean rank); 1.0 is perfect balance."""
    mean = per_rank.mean(axis=1)
    return float(np.mean(per_rank.max(axis=1) / np.where(mean > 0, mean, 1.0)))
