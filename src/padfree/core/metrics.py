"""Where a plan is measured. Each metric is defined in its docstring and in docs/metrics.md.

The functions measure one :class:`Plan` in memory. :class:`EpochMeter` measures every metric of an epoch
fed piece by piece (:func:`padfree.core.planner.plan_pieces`: one window's plan at a time), and
:class:`CoBatchMap` remembers one epoch's micro-batch of every item in 4 bytes an item, so that ``padfree
analyze`` and ``padfree report`` never hold a whole epoch's plan, let alone two (see docs/scale.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from padfree.core import cost
from padfree.core.budget import Budget
from padfree.core.config import PlanConfig
from padfree.core.plan import Plan

_CHUNK = 8_000_000  # samples per pass over a whole lengths array


def padding_efficiency(plan: Plan) -> float:
    """Real tokens / computed slots (see :mod:`padfree.core.cost`: padded micro-batches compute
    count x longest; packed rows compute their tokens, so packed plans are 1.0)."""
    sh = plan.shapes()
    return float(sh.real.sum() / sh.slots.sum())


def fill(plan: Plan) -> float:
    """Real tokens / (micro-batches x budget): how full the micro-batches are against the token budget (under
    SP/CP the group's row, :func:`row_budget`). Less fill means more micro-batches (and steps) for the same
    data."""
    return float(plan.shapes().real.sum() / (plan.n_micro * row_budget(plan.config)))


def row_budget(config: PlanConfig) -> int:
    """The tokens one micro-batch may hold: the budget, or under SP/CP the group's row
    (:meth:`padfree.core.shard.Shard.capacity`); samples longer than it are overlong."""
    return config.shard.capacity(config.budget) if config.shard.pads else config.budget


def compute_efficiency(plan: Plan) -> float:
    """Modeled cost of the real work (``a*tokens + b*sum l^2``) / modeled cost of what is computed
    (``a*slots + b*attention + c`` per micro-batch)."""
    return float(cost.real_cost(plan.shapes(), plan.config.cost) / plan.costs().sum())


def imbalance(plan: Plan) -> float:
    """Mean over steps of (most loaded rank's cost / mean rank cost); 1.0 is perfect balance."""
    return cost.imbalance(plan.rank_costs())


def modeled_throughput(plan: Plan) -> float:
    """Real tokens / sum over steps of the most loaded rank's modeled cost (tokens per cost unit)."""
    return float(plan.shapes().real.sum() / cost.step_costs(plan.rank_costs()).sum())


def step_of_entries(plan: Plan) -> np.ndarray:
    """The step of every entry of ``plan.indices``."""
    k = plan.config.micro_per_step
    return np.repeat(np.arange(plan.n_micro, dtype=np.int64) // k, np.diff(plan.offsets))


def step_divergence(plan: Plan) -> float:
    """Mean over steps of W1(step's token-weighted length distribution, dataset's) / dataset mean length.

    The token-weighted distribution puts mass ``l`` on a sample of length ``l``: the share of the step's
    gradient that samples of each length carry. W1 is computed exactly on the distinct lengths,
    ``sum_d |F_step(v_d) - F_data(v_d)| * (v_{d+1} - v_d)``, in blocks of steps to bound memory.
    """
    return _Divergence(np.bincount(plan.lengths)).total(plan) / plan.n_steps


class _Divergence:
    """Step divergence against the dataset's token-weighted length CDF, given item counts by length."""

    def __init__(self, counts: np.ndarray, max_cells: int = 4_000_000) -> None:
        vals = np.flatnonzero(counts)
        tokens = counts[vals] * vals.astype(np.float64)
        self.d = int(vals.shape[0])
        self.f_data = np.cumsum(tokens) / tokens.sum()
        self.gaps = np.diff(vals).astype(np.float64)
        self.rank = np.zeros(counts.shape[0], np.int32 if self.d < 2**31 else np.int64)
        self.rank[vals] = np.arange(self.d)
        self.mean_length = float(tokens.sum() / counts[vals].sum())
        self.block = max(1, max_cells // max(self.d, 1))

    def total(self, plan: Plan) -> float:
        """Sum over the plan's steps of W1 / the dataset's mean length."""
        if self.d == 1:
            return 0.0
        k, n_steps, off = plan.config.micro_per_step, plan.n_steps, plan.offsets
        total = 0.0
        for s0 in range(0, n_steps, self.block):
            s1 = min(n_steps, s0 + self.block)
            a, b = int(off[s0 * k]), int(off[s1 * k])
            per_step = np.diff(off[s0 * k : s1 * k + 1]).reshape(-1, k).sum(1)
            local = (
                np.repeat(np.arange(s1 - s0, dtype=np.int64), per_step) * self.d
                + self.rank[plan.lengths[a:b]]
            )
            w = plan.lengths[a:b].astype(np.float64)
            hist = np.bincount(local, weights=w, minlength=(s1 - s0) * self.d).reshape(s1 - s0, self.d)
            cum = np.cumsum(hist, axis=1)
            cdf = cum / cum[:, -1:]
            total += float((np.abs(cdf[:, :-1] - self.f_data[None, :-1]) @ self.gaps).sum())
        return total / self.mean_length


class CoBatchMap:
    """The micro-batch every item of one epoch was in (4 bytes an item), to count in the next epoch the pairs
    that share a micro-batch again (:func:`cobatch_repeat`).

    An item is a sample, or under ``overlong="split"`` one piece of one: ``pieces`` (pieces per sample,
    ``None`` when nothing is split) numbers them ``first piece of the sample + start // budget``.
    """

    def __init__(self, n_samples: int, budget: int, pieces: np.ndarray | None = None) -> None:
        self.budget = budget
        self.first = None if pieces is None else np.concatenate(([0], np.cumsum(pieces, dtype=np.int64)))
        n_keys = n_samples if self.first is None else int(self.first[-1])
        self.micro = np.full(n_keys, -1, np.int32 if n_keys < 2**31 else np.int64)
        self.n_micro = 0
        self.pairs = 0.0  # sum over this epoch's micro-batches of C(n_a, 2)

    @classmethod
    def for_lengths(cls, lengths: np.ndarray, config: PlanConfig) -> CoBatchMap:
        """The map for the items :func:`padfree.core.items.make_items` makes of ``lengths``."""
        budget = row_budget(config)
        if config.overlong != "split" or int(lengths.max()) <= budget:
            return cls(int(lengths.shape[0]), budget)
        return cls(int(lengths.shape[0]), budget, (lengths.astype(np.int64) + budget - 1) // budget)

    def keys(self, plan: Plan) -> np.ndarray:
        if self.first is None:
            return plan.indices
        start = 0 if plan.starts is None else plan.starts // self.budget
        return self.first[plan.indices] + start

    def record(self, plan: Plan) -> None:
        """Remember the micro-batch of every item of this piece of the epoch."""
        n_a = np.diff(plan.offsets)
        self.micro[self.keys(plan)] = np.repeat(np.arange(plan.n_micro, dtype=np.int64) + self.n_micro, n_a)
        self.n_micro += plan.n_micro
        self.pairs += float((n_a * (n_a - 1) // 2).sum())

    def repeated(self, plan: Plan) -> float:
        """Of this piece of the next epoch: the pairs of items that shared a micro-batch in both epochs."""
        a = self.micro[self.keys(plan)].astype(np.int64)
        if a.size and a.min() < 0:
            raise ValueError("the two plans do not hold the same samples")
        b = np.repeat(np.arange(plan.n_micro, dtype=np.int64), np.diff(plan.offsets))
        _, n_ab = np.unique(b * self.n_micro + a, return_counts=True)
        return float((n_ab * (n_ab - 1) // 2).sum())


def cobatch_repeat(plan: Plan, next_plan: Plan) -> float:
    """Of the sample pairs that share a micro-batch in ``plan``, the fraction that share one in ``next_plan``.

    Computed without listing pairs: ``sum C(n_ab, 2) / sum C(n_a, 2)`` where ``n_a`` counts samples of
    micro-batch ``a`` and ``n_ab`` those in micro-batch ``a`` of this epoch and ``b`` of the next.
    """
    n = int(max(plan.indices.max(initial=-1), next_plan.indices.max(initial=-1))) + 1
    pieces = None if plan.starts is None else np.bincount(plan.indices, minlength=n)
    m = CoBatchMap(n, row_budget(plan.config), pieces)
    if not np.array_equal(np.sort(m.keys(plan)), np.sort(m.keys(next_plan))):
        raise ValueError("the two plans do not hold the same samples")
    m.record(plan)
    return 0.0 if m.pairs == 0 else m.repeated(next_plan) / m.pairs


def step_tokens(plan: Plan) -> np.ndarray:
    """Real (non-padding) tokens of each step."""
    k = plan.config.micro_per_step
    return plan.shapes().real.reshape(plan.n_steps, k).sum(1)


def adjacent_corr(plan: Plan) -> float:
    """Pearson correlation of the mean sample length of step t and step t+1 (0 when undefined).

    Length-grouped orders make consecutive steps alike (high correlation), the signature of the loss
    sawtooth; a well-mixed plan sits near 0.
    """
    k = plan.config.micro_per_step
    sh = plan.shapes()
    tok = sh.real.reshape(plan.n_steps, k).sum(1)
    cnt = sh.count.reshape(plan.n_steps, k).sum(1)
    return _corr(tok / cnt)


def _corr(x: np.ndarray) -> float:
    """Pearson correlation of ``x[t]`` and ``x[t+1]`` (0 when undefined)."""
    if x.shape[0] < 3 or np.std(x[:-1]) == 0 or np.std(x[1:]) == 0:
        return 0.0
    return float(np.corrcoef(x[:-1], x[1:])[0, 1])


def dataset_summary(lengths: np.ndarray) -> dict:
    """Samples, tokens and length percentiles of a lengths array."""
    q = np.percentile(lengths, [50, 90, 99])
    return {
        "samples": int(lengths.shape[0]),
        "tokens": int(lengths.sum()),
        "mean": float(lengths.mean()),
        "p50": float(q[0]),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": int(lengths.max()),
    }


def plan_metrics(plan: Plan, next_plan: Plan | None = None) -> dict:
    """Every metric of a plan as a flat dict; ``cobatch_repeat`` (of ``plan`` -> ``next_plan``) needs the
    next epoch's plan."""
    out = EpochMeter(plan.config, np.bincount(plan.lengths)).measure([plan], plan.plan_seconds)
    out["cobatch_repeat"] = None if next_plan is None else cobatch_repeat(plan, next_plan)
    return out


def item_counts(lengths: np.ndarray, config: PlanConfig) -> np.ndarray:
    """How many planned items have each length (index: the length, ``0 .. budget``), from the lengths and
    the overlong policy, in chunks: the distribution of every plan of them, known before any is made."""
    budget = row_budget(config)
    b = Budget.of(config)
    piece = b.reach // b.chunks  # a micro-batch's item: a document over it is cut at the reach ...
    counts = np.zeros(budget + 1, np.int64)
    for a in range(0, int(lengths.shape[0]), _CHUNK):
        c = lengths[a : a + _CHUNK].astype(np.int64)
        over = c > b.reach
        if config.overlong == "drop":
            c = c[~over]
        if b.chunks > 1:  # ... and the rest split into chunks of one micro-batch
            c = np.minimum(c, b.reach)
            over = c > piece
        if (config.overlong == "split" or b.chunks > 1) and over.any():
            long = c[over]
            counts[piece] += int((long // piece).sum())
            c = np.concatenate([c[~over], long[long % piece > 0] % piece])
        counts += np.bincount(np.minimum(c, piece), minlength=budget + 1)
    return counts


class EpochMeter:
    """Every :func:`plan_metrics` metric of one epoch, fed consecutive pieces of whole steps (the in-memory
    plan, or the window plans of :func:`padfree.core.planner.plan_pieces`): the result equals
    :func:`plan_metrics` of the concatenated plan, while memory stays one piece's.

    ``counts`` are the items by length (:func:`item_counts`; the step divergence compares each step with
    them); ``previous``, the last epoch's :class:`CoBatchMap`, adds ``cobatch_repeat``.
    """

    def __init__(self, config: PlanConfig, counts: np.ndarray, previous: CoBatchMap | None = None) -> None:
        self.config, self.previous = config, previous
        self.divergence = _Divergence(counts)

    def measure(self, pieces: Iterable[Plan], plan_seconds: float | None = None) -> dict:
        """Measure the pieces in order. ``plan_seconds``: what making them took (default: the sum of the
        pieces' own ``plan_seconds``)."""
        c = self.config
        s = dict.fromkeys(("real", "slots", "real_cost", "cost", "slowest", "ratio", "w1", "repeated"), 0.0)
        n: dict[str, float] = dict.fromkeys(
            ("micro", "truncated", "split", "dropped", "seconds", "chunked"), 0
        )
        tok, cnt, edges = [], [], None
        for p in pieces:
            sh = p.shapes()
            costs = cost.micro_costs(sh, c.cost)
            per_rank = cost.rank_costs(costs, c.world_size, c.grad_accum)
            mean = per_rank.mean(axis=1)
            s["real"] += float(sh.real.sum())
            s["slots"] += float(sh.slots.sum())
            s["real_cost"] += cost.real_cost(sh, c.cost)
            s["cost"] += float(costs.sum())
            s["slowest"] += float(per_rank.max(axis=1).sum())
            s["ratio"] += float((per_rank.max(axis=1) / np.where(mean > 0, mean, 1.0)).sum())
            s["w1"] += self.divergence.total(p)
            if self.previous is not None:
                s["repeated"] += self.previous.repeated(p)
            tok.append(sh.real.reshape(p.n_steps, -1).sum(1))
            cnt.append(sh.count.reshape(p.n_steps, -1).sum(1))
            edges = p.edges if n["micro"] == 0 else edges
            n["micro"] += p.n_micro
            for key in ("truncated", "split", "dropped"):
                n[key] += getattr(p, key)
            if c.spec.context and p.starts is not None:  # a document's second chunk starts at the budget
                n["chunked"] += int(((p.starts > 0) & (p.starts <= p.config.budget)).sum())
            n["seconds"] += p.plan_seconds
            p.forget_shapes()  # the piece's per-micro-batch arrays go with it
        steps = int(n["micro"]) // c.micro_per_step
        tok_a, cnt_a = np.concatenate(tok), np.concatenate(cnt)
        out = {
            "padding_efficiency": s["real"] / s["slots"],
            "fill": s["real"] / (n["micro"] * row_budget(c)),
            "compute_efficiency": s["real_cost"] / s["cost"],
            "imbalance": s["ratio"] / steps,
            "modeled_throughput": s["real"] / s["slowest"],
            "step_divergence": s["w1"] / steps,
            "cobatch_repeat": None,
            "adjacent_corr": _corr(tok_a / cnt_a),
            "steps": steps,
            "micro_batches": int(n["micro"]),
            "tokens_per_step_min": float(tok_a.min()),
            "tokens_per_step_median": float(np.median(tok_a)),
            "tokens_per_step_max": float(tok_a.max()),
            "plan_seconds": n["seconds"] if plan_seconds is None else plan_seconds,
            "truncated": int(n["truncated"]),
            "split": int(n["split"]),
            "dropped": int(n["dropped"]),
        }
        if c.spec.context:
            out["chunked"] = int(n["chunked"])  # documents trained in chunks, each seeing its earlier chunks
        if self.previous is not None:
            out["cobatch_repeat"] = 0.0 if self.previous.pairs == 0 else s["repeated"] / self.previous.pairs
        if edges is not None:
            out["buckets"] = int(edges.shape[0])
        return out
