"""The ``chunked`` strategy: every micro-batch at most one chunk (the budget); a long document is cut into
consecutive chunks kept in order on one rank inside one optimizer step, so it trains with its whole context.

ChunkFlow's layout (ICML 2025): short documents are packed into rows of ``budget`` tokens as ``packed`` does;
a document of ``n`` chunks (``budget < length <= grad_accum * budget``, the *reach*) takes ``n`` consecutive
micro-batches of one rank's ``grad_accum`` in one step, one chunk each (piece ``p`` starts at token
``p * budget``: ``Plan.starts``), and :func:`padfree.torch.execution.chunked.chunked_backward` trains those
chunks with
each attending to its earlier chunks' keys and values. A document over the reach falls under the overlong
policy at the reach (error, truncate or drop; ``split`` would cut it into pieces that no longer see their
beginning, which is what this strategy avoids).

One rank's ``grad_accum`` micro-batches of a step are a *lane*. Long documents are best-fit into lanes by
chunk count, their free slots and further lanes take the packed rows, lanes are sorted by modeled cost (a
chunk's attention reaches over its earlier chunks: ``l^2 + 2*l*start``, alike within
:data:`LANE_TOLERANCE`) and dealt ``world_size`` at a time into steps (ranks of a step cost alike), and the
steps are shuffled. Balance comes first: a step of long documents' lanes holds few short ones, so steps mix
lengths less than ``packed``'s (its step divergence is higher). A step's lanes are its ranks, so the
plan is the same assigned or not, and a step is given to ranks as it is: the strategy lays out its own
epoch (:func:`layout`, registered in :mod:`padfree.core.strategies` with :func:`chunks` and :func:`check`).

>>> from padfree.core.config import PlanConfig
>>> from padfree.core.planner import make_plan
>>> cfg = PlanConfig(strategy="chunked", budget=8, grad_accum=4, seed=1)
>>> plan = make_plan([30, 3, 5, 2, 12, 6, 1, 7], cfg)
>>> [(r["indices"], r["starts"]) for r in plan.records() if 0 in r["indices"]]
[([0], [0]), ([0], [8]), ([0], [16]), ([0], [24])]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from padfree.core import batching, cost, kernels, steps
from padfree.core.batching import Laid
from padfree.core.items import Items
from padfree.errors import ConfigError

if TYPE_CHECKING:
    from padfree.core.budget import Budget
    from padfree.core.config import PlanConfig


LANE_TOLERANCE = 0.01
"""Lanes whose modeled costs differ by less than this share of the dearest lane's are dealt into steps at
random among themselves (a step's ranks then cost within about this much of each other)."""


def chunks(config: PlanConfig) -> int:
    """The chunks (micro-batches of one rank's step) a document may span: ``grad_accum``; the reach is
    that many budgets (:attr:`padfree.core.budget.Budget.reach`)."""
    return int(config.grad_accum)


def check(config: PlanConfig) -> None:
    """Refuse what a chunked plan cannot be: split documents (a piece would not see its beginning), SP/CP
    shards and padded shapes (its chunks are neither sharded nor padded)."""
    if config.overlong == "split":
        raise ConfigError(
            "the chunked strategy trains a document whole in chunks; over grad_accum x budget tokens it "
            "can truncate or drop one (overlong: truncate, drop, error), not split it"
        )
    if config.sp * config.cp > 1:
        raise ConfigError(
            "the chunked strategy is not planned with sp or cp > 1 (its chunks are not sharded)"
        )
    if config.shapes is not None:
        raise ConfigError("the chunked strategy is not planned with shapes (its chunks are not padded)")


def documents(items: Items) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(first item, tokens, sample, start)`` of each document: an item, or consecutive items of one sample
    that continue each other (the chunks of a plan's rest, re-planned at another shape)."""
    length = items.length.astype(np.int64, copy=False)
    n = length.shape[0]
    if items.start is None or items.sample is None:
        first = np.arange(n, dtype=np.int64)
        start = np.zeros(n, np.int64) if items.start is None else items.start.astype(np.int64)
        return first, length, items.sample_ids().astype(np.int64, copy=False), start
    sample, start = items.sample.astype(np.int64), items.start.astype(np.int64)
    cont = np.zeros(n, np.bool_)
    cont[1:] = (sample[1:] == sample[:-1]) & (start[1:] == start[:-1] + length[:-1])
    first = np.flatnonzero(~cont)
    tokens = np.add.reduceat(length, first) if n else length
    return first, tokens, sample[first], start[first]


def layout(items: Items, config: PlanConfig, budget: Budget, rng: np.random.Generator) -> Laid:
    """One epoch of a chunked plan (see the module) in plan order, steps given to ranks
    (:func:`padfree.core.plan.plan_items` makes the :class:`Plan`); ``config`` is the segment's,
    ``budget.plan`` the chunk size. Deterministic for the generator ``rng``; no item is dropped or
    repeated."""
    if items.anchors is not None or config.attn_budget is not None or config.anchor_budget is not None:
        raise ConfigError(
            "the chunked strategy takes no drafter bounds (anchors, anchor_budget, attn_budget)"
        )
    size, g, w = int(budget.plan), config.grad_accum, config.world_size
    first, tokens, sample, doc_start = documents(items)
    chunks = -(-tokens // size)
    if chunks.size and int(chunks.max()) > g:
        j = int(np.argmax(chunks))
        raise ConfigError(
            f"sample {int(sample[j])}: {int(tokens[j])} tokens need {int(chunks[j])} chunks of {size}, but a "
            f"rank runs {g} micro-batches per step (grad_accum): raise grad_accum or the budget, or set an "
            "overlong policy (truncate, drop)"
        )
    short, long = np.flatnonzero(chunks == 1), np.flatnonzero(chunks > 1)
    # short documents: packed rows, as the packed strategy forms them
    if short.size:
        s_order, s_offsets, _ = batching.packed_batches(tokens[short], size, rng)
        s_docs = short[s_order]
    else:
        s_docs, s_offsets = np.empty(0, np.int64), np.zeros(1, np.int64)
    # long documents: best-fit by chunk count into lanes of grad_accum slots
    long = long[rng.permutation(long.size)]
    n_long = chunks[long]
    if long.size:
        lane_of, n_lanes_long = kernels.best_fit(n_long, g)
        lane_of = np.asarray(lane_of, np.int64)
    else:
        lane_of, n_lanes_long = np.empty(0, np.int64), 0
    long_slots = int(n_long.sum())
    k = w * g
    total = long_slots + (s_offsets.shape[0] - 1)
    m = max(-(-total // k), -(-int(n_lanes_long) // w), 1) * k
    # more rows than the packing made, to fill whole steps: halve the fullest rows, then empty micro-batches
    free_slots = m - long_slots
    s_offsets = _split_largest(s_offsets, free_slots)
    n_rows = s_offsets.shape[0] - 1
    n_lanes = m // g
    used = np.bincount(lane_of, weights=n_long, minlength=n_lanes).astype(np.int64)
    slot = np.arange(m, dtype=np.int64)
    free = slot[(slot % g) >= used[slot // g]]
    # items of every micro-batch (in lane-slot numbering): long documents' chunks, then the packed rows
    within = np.cumsum(n_long) - n_long  # slots before each long document in its lane, in lane order
    by_lane = np.argsort(lane_of, kind="stable")
    lane_sorted = lane_of[by_lane]
    lane_first = np.searchsorted(lane_sorted, lane_sorted, side="left")
    offset_in_lane = np.empty_like(within)
    cum = np.cumsum(n_long[by_lane]) - n_long[by_lane]
    offset_in_lane[by_lane] = cum - cum[lane_first]
    piece = np.arange(long_slots, dtype=np.int64) - np.repeat(within, n_long)
    l_doc = np.repeat(long, n_long)
    l_mb = np.repeat(lane_of * g + offset_in_lane, n_long) + piece
    row_of = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(s_offsets))
    doc = np.concatenate((l_doc, s_docs))
    mb = np.concatenate((l_mb, free[row_of]))
    start = doc_start[doc] + np.concatenate((piece * size, np.zeros(s_docs.shape[0], np.int64)))
    length = np.concatenate(
        (np.minimum(size, tokens[l_doc] - piece * size), tokens[s_docs] if s_docs.size else s_docs)
    )
    # lanes by modeled cost, dealt world_size at a time into steps; steps shuffled
    order = np.argsort(mb, kind="stable")
    counts = np.bincount(mb, minlength=m)
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    shapes = cost.micro_shapes(length[order], offsets, True, context=start[order])
    lane_cost = cost.micro_costs(shapes, config.cost).reshape(n_lanes, g).sum(axis=1)
    # cost within 1% of the dearest lane counts as equal: lanes alike are grouped at random (fresh partners)
    quantum = max(float(lane_cost.max()) * LANE_TOLERANCE, 1e-300)
    lanes = np.lexsort((rng.random(n_lanes), np.floor(lane_cost / quantum)))
    steps = lanes.reshape(-1, w)[rng.permutation(n_lanes // w)].ravel()
    mb_perm = (steps[:, None] * g + np.arange(g)[None, :]).ravel()
    order, offsets = kernels.gather_segments(order, offsets, mb_perm)
    return Laid(sample[doc[order]], offsets, length[order], start[order])


def _split_largest(offsets: np.ndarray, n_rows: int) -> np.ndarray:
    """``n_rows`` rows: the rows with the most documents halved (one at a time) while that is possible, then
    empty rows at the end."""
    offsets = steps.split_largest(offsets, n_rows)
    missing = n_rows - (offsets.shape[0] - 1)
    return np.concatenate((offsets, np.full(missing, offsets[-1], np.int64))) if missing > 0 else offsets
