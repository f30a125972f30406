"""What a micro-batch computes and what that costs: the one shape and cost model behind rank balancing,
metrics, ``simulate``, ``report`` and the benchmarks.

A micro-batch is either *padded* rows or one *packed* row:

    padded (count 3, longest 5)          packed (documents 5, 3, 4; budget 16)
    +-----------+                        +-----------+-------+---------+
    | a a a a a |  slots = 3 x 5 = 15    | a a a a a | b b b | c c c c |   slots = 5 + 3 + 4 = 12
    | b b b . . |  attention = 3 x 5^2   +-----------+-------+---------+   attention = 5^2 + 3^2 + 4^2
    | c c c c . |  (the row's causal                                      (per document: no pad, no
    +-----------+   square, pads too)                                      score across documents)

A drafter micro-batch (per-item ``anchors`` given) also has *blocks*, the draft blocks it computes (a packed
row: the sum of its documents' anchors; padded rows: ``count x most``, the block tensor is padded) and
*reach*, the context those blocks read (a block reads on average half of its row: ``sum a_i l_i / 2``
packed, ``count x most x longest / 2`` padded); they cost ``d*blocks + e*reach`` more.

A packed row is computed as what it holds (``PackCollator`` pads nothing; varlen attention runs per
document), so its *slots* are its tokens and its padding efficiency is 1. How full its bin is against the
budget is a separate number, the *fill* (real tokens / budget per micro-batch), which decides how many
micro-batches an epoch needs. The cost of a micro-batch is ``a*slots + b*attention + c``
(:class:`~padfree.core.config.CostModel`); a step costs what its slowest rank costs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import numpy as np

from padfree.core.shard import Shard, padded_rows


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
    and computed ``attn`` (zeros for an empty micro-batch); for a drafter plan also its real ``anchors``,
    computed ``blocks`` and their ``reach`` (else ``None``)."""

    count: np.ndarray
    real: np.ndarray
    slots: np.ndarray
    real_attn: np.ndarray
    attn: np.ndarray
    anchors: np.ndarray | None = None
    blocks: np.ndarray | None = None
    reach: np.ndarray | None = None


def micro_shapes(
    lens: np.ndarray,
    offsets: np.ndarray,
    packed: bool,
    anchors: np.ndarray | None = None,
    *,
    context: np.ndarray | None = None,
    shard: Shard | None = None,
) -> Shapes:
    """What each micro-batch computes (:class:`Shapes`); ``lens`` are the lengths in plan order, ``offsets``
    the micro-batch boundaries, ``anchors`` a drafter plan's per item (in the same order). An empty
    micro-batch (a re-cut step's, an epoch tail's) computes nothing. ``context`` (a chunked plan's piece
    starts, packed rows): the tokens of its document each piece attends to before it, so a piece of ``l``
    tokens at ``s`` has attention ``l^2 + 2*l*s`` (its rectangle over the earlier chunks' keys, counted as
    a causal square is). Under SP/CP (``shard``) the slots and attention are the padded row's
    (:mod:`padfree.core.shard`): the whole group's work, the real tokens unchanged.

    >>> sh = micro_shapes(np.array([5, 3, 4, 2]), np.array([0, 3, 4]), packed=False)
    >>> sh.slots.tolist(), sh.attn.tolist(), sh.real.tolist()
    ([15.0, 2.0], [75.0, 4.0], [12.0, 2.0])
    >>> micro_shapes(np.array([5, 3, 4]), np.array([0, 3]), packed=True).slots.tolist()
    [12.0]
    >>> micro_shapes(np.array([5, 3]), np.array([0, 0, 2, 2]), packed=False).slots.tolist()
    [0.0, 10.0, 0.0]
    >>> micro_shapes(np.array([4, 4]), np.array([0, 1, 2]), True, context=np.array([0, 4])).attn.tolist()
    [16.0, 48.0]
    """
    if context is not None and packed and lens.size:
        sh = micro_shapes(lens, offsets, packed, anchors, shard=shard)
        extra = np.zeros(offsets.shape[0] - 1)
        full = np.flatnonzero(np.diff(offsets) > 0)
        if full.size:
            wide = 2.0 * lens.astype(np.float64) * context.astype(np.float64)
            extra[full] = np.add.reduceat(wide, offsets[full])
        return replace(sh, real_attn=sh.real_attn + extra, attn=sh.attn + extra)
    count = np.diff(offsets)
    n_fields = 5 if anchors is None else 8
    if lens.size == 0:
        z = np.zeros(count.shape[0])
        return Shapes(count, *([z] * (n_fields - 1)))
    full = np.flatnonzero(count > 0)
    if full.size < count.shape[0]:
        part = _shapes(lens, np.append(offsets[full], offsets[-1]), packed, anchors, shard)
        values = (part.real, part.slots, part.real_attn, part.attn, part.anchors, part.blocks, part.reach)
        out = [np.zeros(count.shape[0]) for _ in range(n_fields - 1)]
        for arr, v in zip(out, values[: n_fields - 1], strict=True):
            arr[full] = v
        return Shapes(count, *out)
    return _shapes(lens, offsets, packed, anchors, shard)


def _shapes(
    lens: np.ndarray,
    offsets: np.ndarray,
    packed: bool,
    anchors: np.ndarray | None,
    shard: Shard | None = None,
) -> Shapes:
    starts = offsets[:-1]
    count = np.diff(offsets)
    lf = lens.astype(np.float64)
    real = np.add.reduceat(lf, starts)
    real_attn = np.add.reduceat(lf * lf, starts)
    longest = np.maximum.reduceat(lf, starts)
    if shard is not None and shard.pads:
        if packed:
            slots, attn = padded_rows(lf, starts, shard)
        else:
            width = np.maximum.reduceat(shard.sizes(lens, False).astype(np.float64), starts)
            slots, attn = count * width, count * width * width
        base = (count, real, slots, real_attn, attn)
    elif packed:
        base = (count, real, real, real_attn, real_attn)
    else:
        base = (count, real, count * longest, real_attn, count * longest * longest)
    if anchors is None:
        return Shapes(*base)
    af = anchors.astype(np.float64)
    total = np.add.reduceat(af, starts)
    if packed:
        return Shapes(*base, total, total, np.add.reduceat(af * lf, starts) / 2.0)
    blocks = count * np.maximum.reduceat(af, starts)
    return Shapes(*base, total, blocks, blocks * longest / 2.0)


def item_shapes(lens: np.ndarray, anchors: np.ndarray | None = None) -> Shapes:
    """Each item as a packed row of its own: :func:`micro_shapes` of one item per micro-batch, element by
    element (a packed item's share of its row's work).

    >>> sh = item_shapes(np.array([3, 5]), np.array([1, 2]))
    >>> sh.attn.tolist(), sh.reach.tolist()
    ([9.0, 25.0], [1.5, 5.0])
    """
    lf = lens.astype(np.float64)
    sq = lf * lf
    count = np.ones(lf.shape[0], np.int64)
    if anchors is None:
        return Shapes(count, lf, lf, sq, sq)
    af = anchors.astype(np.float64)
    return Shapes(count, lf, lf, sq, sq, af, af, af * lf / 2.0)


def work(shapes: Shapes, drafter: tuple[float, float] = (0.0, 0.0)) -> np.ndarray:
    """The linear work of each micro-batch in token slots: ``slots + wb*blocks + wr*reach`` with
    ``drafter = (wb, wr)`` (:attr:`padfree.core.config.CostModel.drafter`); the slots alone without drafter
    terms or blocks."""
    wb, wr = drafter
    if shapes.blocks is None or shapes.reach is None or not (wb or wr):
        return shapes.slots
    return shapes.slots + wb * shapes.blocks + wr * shapes.reach


def micro_costs(
    shapes: Shapes, model: HasCoefficients, drafter: tuple[float, float] | None = None
) -> np.ndarray:
    """Modeled cost of computing each micro-batch: ``a*slots + b*attention + c``, plus ``d*blocks +
    e*reach`` for a drafter plan: ``a*work + b*attention + c`` (:func:`work`; the one place it is written;
    ``model`` is a :class:`~padfree.core.config.CostModel`, whose drafter terms apply, or
    :class:`Coefficients`, with the ``drafter`` weights a :class:`~padfree.core.balance.Balance` carries)."""
    weights = getattr(model, "drafter", (0.0, 0.0)) if drafter is None else drafter
    return model.a * work(shapes, weights) + model.b * shapes.attn + model.c


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
