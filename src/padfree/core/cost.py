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
packed, ``count x most x longest / 2`` padded).

A packed row is computed as what it holds (``PackCollator`` pads nothing; varlen attention runs per
document), so its *slots* are its tokens and its padding efficiency is 1. How full its bin is against the
budget is a separate number, the *fill* (real tokens / budget per micro-batch), which decides how many
micro-batches an epoch needs. The cost of a micro-batch is ``a*slots + b*attention + c``
(``+ d*blocks + e*reach`` for a drafter, :class:`~padfree.core.config.CostModel`); a step costs what its
slowest rank costs.
"""

from __future__ import annotations

import numpy as np

from padfree.core.config import CostModel


def micro_shapes(
    lens: np.ndarray, offsets: np.ndarray, packed: bool, anchors: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Per micro-batch: ``count`` samples, ``real`` tokens, computed ``slots``, ``real_attn`` (sum of l^2)
    and computed ``attn``; ``lens`` are the lengths in plan order, ``offsets`` the micro-batch boundaries.
    With ``anchors`` (in plan order) also ``anchors`` (real), computed ``blocks`` and ``reach``.

    >>> sh = micro_shapes(np.array([5, 3, 4, 2]), np.array([0, 3, 4]), packed=False)
    >>> sh["slots"].tolist(), sh["attn"].tolist(), sh["real"].tolist()
    ([15.0, 2.0], [75.0, 4.0], [12.0, 2.0])
    >>> micro_shapes(np.array([5, 3, 4]), np.array([0, 3]), packed=True)["slots"].tolist()
    [12.0]
    """
    starts = offsets[:-1]
    count = np.diff(offsets)
    if lens.size == 0:
        z = np.zeros(count.shape[0])
        out = {"count": count, "real": z, "slots": z, "real_attn": z, "attn": z}
        return out if anchors is None else {**out, "anchors": z, "blocks": z, "reach": z}
    lf = lens.astype(np.float64)
    real = np.add.reduceat(lf, starts)
    real_attn = np.add.reduceat(lf * lf, starts)
    if packed:
        out = {"count": count, "real": real, "slots": real, "real_attn": real_attn, "attn": real_attn}
    else:
        longest = np.maximum.reduceat(lf, starts)
        out = {
            "count": count,
            "real": real,
            "slots": count * longest,
            "real_attn": real_attn,
            "attn": count * longest * longest,
        }
    if anchors is None:
        return out
    af = anchors.astype(np.float64)
    out["anchors"] = np.add.reduceat(af, starts)
    if packed:
        out["blocks"] = out["anchors"]
        out["reach"] = np.add.reduceat(af * lf, starts) / 2.0
    else:
        most = np.maximum.reduceat(af, starts)
        out["blocks"] = count * most
        out["reach"] = out["blocks"] * np.maximum.reduceat(lf, starts) / 2.0
    return out


def work(shapes: dict[str, np.ndarray], drafter: tuple[float, float]) -> np.ndarray:
    """The linear work of each micro-batch in token slots: ``slots + wb*blocks + wr*reach`` with
    ``drafter = (wb, wr)`` (:attr:`CostModel.drafter`); the slots alone without drafter terms or blocks."""
    wb, wr = drafter
    if "blocks" not in shapes or not (wb or wr):
        return shapes["slots"]
    return shapes["slots"] + wb * shapes["blocks"] + wr * shapes["reach"]


def micro_costs(shapes: dict[str, np.ndarray], cost: CostModel) -> np.ndarray:
    """Modeled cost of computing each micro-batch: ``a*slots + b*attention + c`` (``+ d*blocks +
    e*reach`` when the shapes have drafter blocks): ``a*work + b*attention + c``, see :func:`work`."""
    return cost.a * work(shapes, cost.drafter) + cost.b * shapes["attn"] + cost.c


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
