"""Which micro-batches ``padfree bench`` trains and how a few measured ones stand for an epoch: each
strategy's epoch of micro-batches, their modeled work (:mod:`padfree.core.cost`), the stratified picks and
the ratio estimator of the epoch's seconds."""

from __future__ import annotations

import numpy as np

from padfree.bench.measure import Batching
from padfree.bench.peers import PEER_NAMES, plan_with_peer
from padfree.core.config import STRATEGIES as PADFREE  # padfree's own, by name
from padfree.core.config import PlanConfig
from padfree.core.cost import micro_shapes
from padfree.core.planner import make_plan

STRATEGIES = PADFREE + PEER_NAMES
PACKED = ("packed", "hf_flattening", "trl_bfd")


def strategy_batching(name: str, lengths: np.ndarray, budget: int, seed: int) -> Batching:
    """One epoch of micro-batches of a strategy over ``lengths`` (all within the budget)."""
    if name in PADFREE:
        cfg = PlanConfig(strategy=name, budget=budget, world_size=1, grad_accum=1, seed=seed)
        plan = make_plan(lengths, cfg)
        indices, offsets = plan.indices.astype(np.int64), plan.offsets.astype(np.int64)
        return Batching(indices, offsets, cfg.packed, "padfree plan")
    return plan_with_peer(name, lengths, budget, seed)


def bench_subset(lengths: np.ndarray, steps: int, budget: int, seed: int) -> np.ndarray:
    """Ids of a seeded random subset of samples holding about ``steps x budget`` tokens (at least two
    samples), in id order: an epoch of it is about ``steps`` full micro-batches.

    >>> bench_subset(np.full(100, 10), steps=2, budget=50, seed=0).shape
    (10,)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    perm = np.random.default_rng(seed).permutation(lengths.shape[0])
    n = int(np.searchsorted(np.cumsum(lengths[perm]), steps * budget, side="right"))
    return np.sort(perm[: max(2, min(n, lengths.shape[0]))])


def attention_weight(model: str, overrides: dict) -> float:
    """Modeled cost of one causal attention pair relative to one token's dense work, for a model
    (:meth:`padfree.core.config.CostModel.from_shape` of its hidden size, layers and vocabulary)."""
    from padfree.core.config import CostModel
    from padfree.models import build_config

    c = build_config(model, **overrides)
    return CostModel.from_shape(c.hidden_size, c.num_hidden_layers, c.vocab_size).b


def micro_work(lengths: np.ndarray, b: Batching, attn_weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Per micro-batch: ``(modeled work, loss tokens)``. Work = computed slots + ``attn_weight`` x causal
    attention pairs (padded: ``count x longest^2``; packed: the sum of each document's square), the shape
    of :meth:`padfree.core.config.CostModel.from_shape` with ``a = 1``; loss tokens = tokens after each
    sample's first.

    >>> b = Batching(np.array([0, 1, 2]), np.array([0, 2, 3]), packed=False)
    >>> work, loss = micro_work(np.array([4, 2, 6]), b, attn_weight=0.5)
    >>> work.tolist(), loss.tolist()
    ([24.0, 24.0], [4.0, 5.0])
    """
    sh = micro_shapes(lengths[b.order], b.offsets, b.packed)
    loss = sh.real - sh.count
    return sh.slots + attn_weight * sh.attn, loss


def stratified(work_per_token: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``k`` micro-batches that represent an epoch, and the stratum each stands for: the micro-batches are
    ordered by modeled work per loss token (what sets their speed: padding and attention length), cut into
    ``k`` strata of equal count, and the middle one of each is taken. Returns ``(picks in epoch order,
    stratum id of every micro-batch, indexed like the picks)``; with at most ``k`` micro-batches every one
    is its own stratum.

    >>> picks, stratum = stratified(np.array([5.0, 1.0, 4.0, 2.0, 3.0, 6.0]), 2)
    >>> picks.tolist(), stratum.tolist()
    ([0, 3], [0, 1, 0, 1, 1, 0])
    """
    n = work_per_token.shape[0]
    if n <= k:
        return np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)
    by = np.argsort(work_per_token, kind="stable")
    rank_of = np.empty(n, dtype=np.int64)
    rank_of[by] = np.arange(n)
    edges = np.floor(np.arange(k + 1) * n / k).astype(np.int64)
    stratum_by_rank = np.searchsorted(edges, np.arange(n), side="right") - 1
    mids = by[(edges[:-1] + edges[1:]) // 2]
    order = np.argsort(mids, kind="stable")  # picks in epoch order; renumber strata to match
    renumber = np.empty(k, dtype=np.int64)
    renumber[order] = np.arange(k)
    return mids[order], renumber[stratum_by_rank[rank_of]]


def epoch_seconds(sec: np.ndarray, picks: np.ndarray, stratum: np.ndarray, work: np.ndarray) -> float:
    """An epoch's training seconds estimated from its measured picks: each pick's seconds per unit of
    modeled work, times the modeled work of the stratum it stands for (a ratio estimator: the model
    carries each pick's speed to micro-batches of the same kind; the seconds themselves are measured).

    >>> epoch_seconds(np.array([2.0, 6.0]), np.array([0, 2]), np.array([0, 0, 1, 1]),
    ...               np.array([1.0, 3.0, 3.0, 3.0]))
    20.0
    """
    per_work = sec / work[picks]
    stratum_work = np.bincount(stratum, weights=work, minlength=picks.shape[0])
    return float(per_work @ stratum_work)


def micro_ids(b: Batching, k: int) -> np.ndarray:
    return b.order[b.offsets[k] : b.offsets[k + 1]]
