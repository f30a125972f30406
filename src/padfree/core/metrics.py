"""Where a plan is measured. Each metric is defined in its docstring and in docs/metrics.md."""

from __future__ import annotations

import numpy as np

from padfree.core import cost
from padfree.core.plan import Plan


def padding_efficiency(plan: Plan) -> float:
    """Real tokens / computed slots (see :mod:`padfree.core.cost`: padded micro-batches compute
    count x longest; packed rows compute their tokens, so packed plans are 1.0)."""
    sh = plan.shapes()
    return float(sh["real"].sum() / sh["slots"].sum())


def fill(plan: Plan) -> float:
    """Real tokens / (micro-batches x budget): how full the micro-batches are against the token budget.
    Less fill means more micro-batches (and steps) for the same data."""
    return float(plan.shapes()["real"].sum() / (plan.n_micro * plan.config.budget))


def compute_efficiency(plan: Plan) -> float:
    """Modeled cost of the real work (``a*tokens + b*sum l^2``) / modeled cost of what is computed
    (``a*slots + b*attention + c`` per micro-batch)."""
    sh = plan.shapes()
    c = plan.config.cost
    real = c.a * sh["real"].sum() + c.b * sh["real_attn"].sum()
    return float(real / plan.costs().sum())


def imbalance(plan: Plan) -> float:
    """Mean over steps of (most loaded rank's cost / mean rank cost); 1.0 is perfect balance."""
    return cost.imbalance(plan.rank_costs())


def modeled_throughput(plan: Plan) -> float:
    """Real tokens / sum over steps of the most loaded rank's modeled cost (tokens per cost unit)."""
    return float(plan.shapes()["real"].sum() / cost.step_costs(plan.rank_costs()).sum())


def step_of_entries(plan: Plan) -> np.ndarray:
    """The step of every entry of ``plan.indices``."""
    k = plan.config.micro_per_step
    return np.repeat(np.arange(plan.n_micro, dtype=np.int64) // k, np.diff(plan.offsets))


def step_divergence(plan: Plan, max_cells: int = 4_000_000) -> float:
    """Mean over steps of W1(step's token-weighted length distribution, dataset's) / dataset mean length.

    The token-weighted distribution puts mass ``l`` on a sample of length ``l``: the share of the step's
    gradient that samples of each length carry. W1 is computed exactly on the distinct lengths,
    ``sum_d |F_step(v_d) - F_data(v_d)| * (v_{d+1} - v_d)``, in blocks of steps to bound memory.
    """
    lens = plan.lengths
    vals, inv = np.unique(lens, return_inverse=True)
    d = vals.shape[0]
    if d == 1:
        return 0.0
    w = lens.astype(np.float64)
    f_data = np.cumsum(np.bincount(inv, weights=w, minlength=d)) / w.sum()
    gaps = np.diff(vals).astype(np.float64)
    k = plan.config.micro_per_step
    n_steps = plan.n_steps
    block = max(1, max_cells // d)
    total = 0.0
    for s0 in range(0, n_steps, block):
        s1 = min(n_steps, s0 + block)
        a, b = int(plan.offsets[s0 * k]), int(plan.offsets[s1 * k])
        local = np.repeat(
            np.arange(s1 - s0, dtype=np.int64),
            np.diff(plan.offsets[s0 * k : s1 * k + 1]).reshape(-1, k).sum(1),
        )
        hist = np.bincount(local * d + inv[a:b], weights=w[a:b], minlength=(s1 - s0) * d).reshape(s1 - s0, d)
        cum = np.cumsum(hist, axis=1)
        cdf = cum / cum[:, -1:]
        total += float((np.abs(cdf[:, :-1] - f_data[None, :-1]) @ gaps).sum())
    return total / n_steps / float(lens.mean())


def _entry_keys(plan: Plan) -> np.ndarray:
    if plan.starts is None:
        return plan.indices
    # int64: stream plans hold int32 ids and starts, whose product would overflow
    return plan.indices.astype(np.int64) * (int(plan.starts.max()) + 1) + plan.starts


def cobatch_repeat(plan: Plan, next_plan: Plan) -> float:
    """Of the sample pairs that share a micro-batch in ``plan``, the fraction that share one in ``next_plan``.

    Computed without listing pairs: ``sum C(n_ab, 2) / sum C(n_a, 2)`` where ``n_a`` counts samples of
    micro-batch ``a`` and ``n_ab`` those in micro-batch ``a`` of this epoch and ``b`` of the next.
    """
    key_a, key_b = _entry_keys(plan), _entry_keys(next_plan)
    micro_a = np.repeat(np.arange(plan.n_micro, dtype=np.int64), np.diff(plan.offsets))
    micro_b = np.repeat(np.arange(next_plan.n_micro, dtype=np.int64), np.diff(next_plan.offsets))
    ia, ib = np.argsort(key_a, kind="stable"), np.argsort(key_b, kind="stable")
    if not np.array_equal(key_a[ia], key_b[ib]):
        raise ValueError("the two plans do not hold the same samples")
    ma, mb = micro_a[ia], micro_b[ib]
    n_a = np.diff(plan.offsets).astype(np.float64)
    pairs = float((n_a * (n_a - 1) / 2).sum())
    if pairs == 0:
        return 0.0
    _, n_ab = np.unique(ma * next_plan.n_micro + mb, return_counts=True)
    n_ab = n_ab.astype(np.float64)
    return float((n_ab * (n_ab - 1) / 2).sum() / pairs)


def step_tokens(plan: Plan) -> np.ndarray:
    """Real (non-padding) tokens of each step."""
    k = plan.config.micro_per_step
    return plan.shapes()["real"].reshape(plan.n_steps, k).sum(1)


def adjacent_corr(plan: Plan) -> float:
    """Pearson correlation of the mean sample length of step t and step t+1 (0 when undefined).

    Length-grouped orders make consecutive steps alike (high correlation), the signature of the loss
    sawtooth; a well-mixed plan sits near 0.
    """
    k = plan.config.micro_per_step
    sh = plan.shapes()
    tok = sh["real"].reshape(plan.n_steps, k).sum(1)
    cnt = sh["count"].reshape(plan.n_steps, k).sum(1)
    x = tok / cnt
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
    tok = step_tokens(plan)
    out = {
        "padding_efficiency": padding_efficiency(plan),
        "fill": fill(plan),
        "compute_efficiency": compute_efficiency(plan),
        "imbalance": imbalance(plan),
        "modeled_throughput": modeled_throughput(plan),
        "step_divergence": step_divergence(plan),
        "cobatch_repeat": None if next_plan is None else cobatch_repeat(plan, next_plan),
        "adjacent_corr": adjacent_corr(plan),
        "steps": plan.n_steps,
        "micro_batches": plan.n_micro,
        "tokens_per_step_min": float(tok.min()),
        "tokens_per_step_median": float(np.median(tok)),
        "tokens_per_step_max": float(tok.max()),
        "plan_seconds": plan.plan_seconds,
        "truncated": plan.truncated,
        "split": plan.split,
        "dropped": plan.dropped,
    }
    if plan.edges is not None:
        out["buckets"] = int(plan.edges.shape[0])
    return out
