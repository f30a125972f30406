"""The report's decision: measure the strategies and a frontier of bucketed plans, then choose one plan and
say why in numbers.

Every plan is measured with :func:`padfree.advice.analyze.measure` (epoch 1; co-batch repeat from epoch 0).
Modeled throughput = real tokens / sum over steps of the modeled cost of the step's most loaded rank (a
synchronous step waits for its slowest rank), reported relative to ``sorted``.

The rule (docs/lengths-and-report.md, "The decision"): a plan must not freeze its composition, must keep
its steps' length mix within :data:`DIVERGENCE_RATIO` of a random shuffle's, and its co-batch repeat and
adjacent-step correlation within limits that scale with its epoch but never reach a value the metric
cannot exceed (:func:`limits`); the fastest such padded plan wins (packed, when the attention allows it).
Random is never picked when a plan that does not freeze models :data:`SPEEDUP` times its throughput.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from padfree.advice.analyze import analyze_strategies, measure, short_epoch
from padfree.advice.report.chunked import chunked_numbers
from padfree.core.config import STRATEGIES, PlanConfig
from padfree.core.items import validate_lengths
from padfree.core.mixing import REPEAT_CAP, REPEAT_FLOOR, repeat_limit
from padfree.core.plan import Plan
from padfree.core.planner import plan_pieces
from padfree.core.strategies import REGISTRY

GROWTHS = (1.1, 1.25, 1.5, 2.0)
BUCKET_COUNTS = (2, 4, 8, 16, 32)
MIXES = (4, 16, 64)
"""Explicit noise windows swept at the base growth, beside the automatic one."""
FROZEN = 0.5
"""Co-batch repeat at or above this: the plan's composition is frozen (sorted reaches 0.8-1.0). Such a plan
is never recommended while another exists."""
ADJACENT_FLOOR = 0.1
ADJACENT_MIN_STEPS = 8
"""Adjacent-step correlation is judged from this many steps on (its limit 2 / sqrt(steps - 1) is then at
most 0.76, a correlation that can be exceeded); on shorter epochs it is noise and not judged."""
DIVERGENCE_RATIO = 1.2
"""A plan mixes its steps like a shuffle when its step divergence is at most this times random's."""
SPEEDUP = 1.5
"""Random is never picked when a plan that does not freeze its composition models this times its
throughput: the best-mixing such plan is, with its mixing gap said in numbers."""
RANK_STEPS = 200


@dataclass(frozen=True)
class Point:
    """One measured plan configuration of the frontier."""

    label: str
    family: str  # "growth", "buckets", "mix", or a strategy name
    config: PlanConfig
    metrics: dict

    def to_json(self) -> dict:
        c = self.config
        params: dict[str, object] = {"strategy": c.strategy}
        if REGISTRY[c.strategy].bucketed:
            params |= {"buckets": c.buckets} if c.buckets is not None else {"growth": c.growth}
            params["mix"] = "auto" if c.mix is None else c.mix
        return {"label": self.label, "family": self.family, "params": params, **_clean(self.metrics)}


def limits(steps: int, micro_per_step: int) -> dict:
    """The rules' limits for a plan whose epoch has ``steps`` steps of ``micro_per_step`` micro-batches.

    - co-batch repeat <= ``min(0.25, max(0.01, micro_per_step / steps))``
      (:func:`padfree.core.mixing.repeat_limit`, the limit bucketed's automatic window also aims under): a
      pair sharing a micro-batch is 1 of ``micro_per_step`` micro-batch pairs among a sample's step
      partners, and a random order puts any pair in one step with probability ~``1 / steps``; a repeat
      ``r`` adds ~``r / micro_per_step`` to that, so this bound keeps pairs sharing a step again within
      twice a random order's rate; on short epochs, where that allows anything, it stops at
      :data:`~padfree.core.mixing.REPEAT_CAP`;
    - adjacent-step correlation <= ``max(0.1, 2 / sqrt(steps - 1))``: two standard errors of the
      correlation of a random order's step means; ``None`` (not judged) below :data:`ADJACENT_MIN_STEPS`
      steps, where it could not be exceeded.

    Every limit can be exceeded: a fraction's is below 1, a correlation's below 1.

    >>> limits(1000, 32)["cobatch_repeat_max"], round(limits(1000, 32)["adjacent_corr_max"], 3)
    (0.032, 0.1)
    >>> limits(4, 32)
    {'cobatch_repeat_max': 0.25, 'adjacent_corr_max': None}
    """
    adj = max(ADJACENT_FLOOR, 2.0 / math.sqrt(steps - 1)) if steps >= ADJACENT_MIN_STEPS else None
    return {
        "cobatch_repeat_max": repeat_limit(steps, micro_per_step),
        "adjacent_corr_max": adj,
    }


def broken(m: dict, micro_per_step: int, random_divergence: float) -> list[str]:
    """The rules a plan's metrics break, each with its numbers (by how much it misses the limit)."""
    lim = limits(int(m["steps"]), micro_per_step)
    bad = []
    rep = m["cobatch_repeat"]
    if rep >= FROZEN:
        bad.append(
            f"co-batch repeat {rep:.4f} >= {FROZEN}: frozen composition (the same micro-batches every epoch)"
        )
    elif rep > lim["cobatch_repeat_max"]:
        bad.append(
            f"co-batch repeat {rep:.4f} > {lim['cobatch_repeat_max']:.4g} "
            f"(= min({REPEAT_CAP}, max({REPEAT_FLOOR}, {micro_per_step} micro-batches per step / "
            f"{m['steps']} steps)))"
        )
    if lim["adjacent_corr_max"] is not None and m["adjacent_corr"] > lim["adjacent_corr_max"]:
        bad.append(f"adjacent-step correlation {m['adjacent_corr']:+.3f} > {lim['adjacent_corr_max']:.3f}")
    ratio = m["step_divergence"] / random_divergence if random_divergence > 0 else math.inf
    if m["step_divergence"] > DIVERGENCE_RATIO * random_divergence + 1e-12:
        bad.append(
            f"step divergence {m['step_divergence']:.3f} = {ratio:.2f} x random's {random_divergence:.3f} "
            f"(limit {DIVERGENCE_RATIO} x)"
        )
    return bad


def frozen(m: dict) -> bool:
    """Whether a plan's composition is frozen (co-batch repeat >= :data:`FROZEN`)."""
    return m["cobatch_repeat"] is not None and m["cobatch_repeat"] >= FROZEN


def build_report(
    lengths: np.ndarray,
    base: PlanConfig,
    *,
    name: str = "lengths",
    path: str | None = None,
    growths: tuple[float, ...] = GROWTHS,
    bucket_counts: tuple[int, ...] = BUCKET_COUNTS,
    mixes: tuple[int, ...] = MIXES,
    packing: bool = True,
    packing_check: dict | None = None,
) -> tuple[dict, dict[str, Plan]]:
    """Measure the strategies and the frontier and choose a plan. Returns ``(numbers, plans)`` where
    ``plans`` holds the epoch-1 plan of the recommendation (``"recommended"``) and the bucketed plan whose
    edges the histogram draws (``"edges"``); of an epoch planned window by window, their first window (no
    whole plan of a huge epoch is ever held: every number comes from :func:`measure`, window by window).
    ``packing_check``: the verdict of ``padfree check-packing`` on the user's model (``{"model", "exact",
    "detail"}``, :func:`packing_note`), which then decides ``packing`` and is said in the recommendation."""
    t0 = time.perf_counter()
    if packing_check is not None:
        packing = bool(packing_check["exact"])
    lengths = validate_lengths(lengths, path, compact=True)  # int32 stays int32 (100M: 400 MB, not 800)
    configs = {s: base.with_(strategy=s) for s in STRATEGIES}
    result = analyze_strategies(lengths, configs, path=path)
    result["dataset"]["name"] = name
    points = [
        Point(_label(configs[s]), _family(configs[s]), configs[s], result["strategies"][s])
        for s in STRATEGIES
    ]
    done = {p.label for p in points}
    bucketed = base.with_(strategy="bucketed")
    sweep = [bucketed.with_(growth=float(g), buckets=None, mix=None) for g in growths]
    sweep += [bucketed.with_(buckets=int(n), mix=None) for n in bucket_counts]
    sweep += [bucketed.with_(mix=int(x)) for x in mixes]
    for cfg in sweep:
        if _label(cfg) not in done:
            done.add(_label(cfg))
            points.append(Point(_label(cfg), _family(cfg), cfg, measure(lengths, cfg, path)))
    ref = result["strategies"]["sorted"]["modeled_throughput"]
    for p in points:
        p.metrics["relative_throughput"] = p.metrics["modeled_throughput"] / ref
    rec = recommend(points, packing, base.micro_per_step, packing_check)
    rec["short_epoch"] = short_epoch(result)
    if rec["short_epoch"]:
        rec["text"] += " " + rec["short_epoch"][0].upper() + rec["short_epoch"][1:] + "."
    chosen = next(p for p in points if p.label == rec["label"])
    plan, rc_parts = None, []
    for piece in plan_pieces(lengths, chosen.config, 1, path=path):  # the first RANK_STEPS steps' rank load
        plan = piece if plan is None else plan
        rc_parts.append(piece.rank_costs()[:RANK_STEPS])
        if sum(r.shape[0] for r in rc_parts) >= RANK_STEPS:
            break
    rc = np.concatenate(rc_parts)
    assert plan is not None  # plan_pieces yields at least one piece
    # make_plan's edges: the in-memory plan's, or window 0's on the window path
    own_edges = REGISTRY[chosen.config.strategy].bucketed
    edge_plan = plan if own_edges else next(plan_pieces(lengths, bucketed, 1, path=path))
    numbers = {
        "dataset": result["dataset"],
        "config": result["config"] | {"growth": base.growth, "buckets": base.buckets, "mix": base.mix},
        "bucket_edges": [] if edge_plan.edges is None else edge_plan.edges.tolist(),
        "bucket_edges_of": _label(edge_plan.config),
        "strategies": {s: _clean(result["strategies"][s]) for s in STRATEGIES},
        "strategy_labels": {s: _label(configs[s]) for s in STRATEGIES},
        "frontier": [p.to_json() for p in points],
        "recommendation": rec,
        "rank_load": {
            "label": chosen.label,
            "steps_shown": int(min(RANK_STEPS, rc.shape[0])),
            "steps": int(chosen.metrics["steps"]),
            "cost": rc[:RANK_STEPS].round(1).tolist(),
            "imbalance": chosen.metrics["imbalance"],
        },
        "packing_supported": packing,
        "packing_check": packing_check,
        "chunked": chunked_numbers(lengths, base, result["strategies"]["packed"], path),
        "measure_seconds": round(time.perf_counter() - t0, 2),
    }
    return numbers, {"recommended": plan, "edges": edge_plan}


def packing_note(check: dict | None) -> str:
    """Where the packing assumption comes from, for the recommendation: the check run on the user's model
    (``check``), or how to run it.

    >>> packing_note(None)[:60]
    'not checked on your model: run `padfree check-packing --mode'
    >>> packing_note({"model": "m/", "exact": True, "detail": "OK"})
    'checked: `padfree check-packing --model m/` says OK'
    """
    if check is None:
        return (
            "not checked on your model: run `padfree check-packing --model DIR` on it, or give "
            "`padfree report --model DIR` to run it here; pass --no-packing if it leaks"
        )
    return f"checked: `padfree check-packing --model {check['model']}` says {check['detail']}"


def recommend(
    points: list[Point], packing: bool, micro_per_step: int, packing_check: dict | None = None
) -> dict:
    """Choose a plan (the rule of docs/lengths-and-report.md, "The decision").

    1. Eligible: plans that break no rule of :func:`broken` (composition not frozen, co-batch repeat and
       adjacent-step correlation within :func:`limits` of their epoch, step divergence at most
       :data:`DIVERGENCE_RATIO` x random's).
    2. Pick packed when the model's attention keeps packed documents apart (``packing``) and it is eligible,
       else the eligible padded plan with the highest modeled throughput.
    3. If padded plans that do not freeze their composition (co-batch repeat < :data:`FROZEN`) model >=
       :data:`SPEEDUP` x the throughput of that padded pick (and of random: random is never picked while
       one does), pick the one of them that breaks the fewest other rules and whose steps mix best (lowest
       step divergence): a mixing gap that buys 1.5x the throughput is worth it, and the gap is said in
       numbers, as the price of few micro-batches per step.
    4. Otherwise the plan that breaks the fewest rules, never a frozen one while another exists.

    The fastest rejected plan that beats the padded pick is named with the rules it breaks (by how much),
    and what rejecting it costs (its throughput over the pick's).
    """
    rand_p = _by(points, "random")
    rand = rand_p.metrics["step_divergence"]
    sorted_m = _by(points, "sorted").metrics
    failing = {p.label: broken(p.metrics, micro_per_step, rand) for p in points}
    eligible = [p for p in points if not failing[p.label]]
    padded = [p for p in eligible if not p.config.packed]
    packed = [p for p in eligible if p.config.packed]
    best_padded = max(padded, key=_speed, default=None)
    # a plan that trades some mixing for >= SPEEDUP x the throughput of the pick so far (random's at least)
    floor = SPEEDUP * max(_speed(rand_p), -1.0 if best_padded is None else _speed(best_padded))
    fast = [
        p
        for p in points
        if not p.config.packed and p is not rand_p and not frozen(p.metrics) and _speed(p) >= floor
    ]
    traded = None
    if fast:

        def other_rules(p: Point) -> int:
            return sum(not r.startswith("step divergence") for r in failing[p.label])

        traded = min(fast, key=lambda p: (other_rules(p), p.metrics["step_divergence"], -_speed(p)))
        best_padded = traded
    if packing and packed:
        chosen = packed[0]
    elif best_padded is not None:
        chosen = best_padded
    else:  # random meets every rule by construction, so only a custom point set gets here
        pool = [p for p in points if not frozen(p.metrics)] or points
        chosen = min(pool, key=lambda p: (len(failing[p.label]), -_speed(p)))
    m = chosen.metrics
    lim = limits(int(m["steps"]), micro_per_step)
    rm = rand_p.metrics
    reasons = _reasons(m, rm, sorted_m, rand, lim, micro_per_step)
    gap = _gap(chosen, rand, micro_per_step)
    why = _why(chosen, traded, rand_p, failing[chosen.label], len(padded), gap, packing, packing_check)
    alt = _alternative(best_padded, rand) if chosen.config.packed else None
    padded_pick = best_padded if chosen.config.packed else chosen
    near_miss = _near_miss(points, failing, padded_pick, packing)
    c = chosen.config
    text = (
        f"Use {chosen.label} with budget {c.budget} tokens, world size {c.world_size} x grad-accum "
        f"{c.grad_accum}: {why}. " + "; ".join(reasons) + "."
    )
    if near_miss and not chosen.config.packed:
        text += " Note: " + near_miss
    return {
        "label": chosen.label,
        "params": chosen.to_json()["params"] | {"budget": c.budget},
        "why": why,
        "reasons": reasons,
        "text": text,
        "alternative": alt,
        "near_miss": near_miss,
        "mixing_gap": gap,
        "packing_check": packing_check,
        "eligible": [p.label for p in eligible],
        "rejected": {k: v for k, v in failing.items() if v},
        "criteria": {
            "cobatch_repeat_max": lim["cobatch_repeat_max"],
            "adjacent_corr_max": lim["adjacent_corr_max"],
            "step_divergence_max": DIVERGENCE_RATIO * rand,
            "frozen_repeat": FROZEN,
            "speedup": SPEEDUP,
            "rule": f"co-batch repeat < {FROZEN} (else frozen) and <= min({REPEAT_CAP}, max({REPEAT_FLOOR}, "
            "micro-batches per step / steps)); adjacent-step correlation <= max(0.1, 2 / sqrt(steps - 1)) "
            f"from {ADJACENT_MIN_STEPS} steps; step divergence <= {DIVERGENCE_RATIO} x random's; a plan that "
            f"does not freeze and models >= {SPEEDUP} x the throughput of the best plan meeting every rule "
            "(random's at least) is picked in its place",
        },
    }


def _why(
    chosen: Point,
    traded: Point | None,
    rand_p: Point,
    broken_rules: list[str],
    n_padded: int,
    gap: str | None,
    packing: bool,
    packing_check: dict | None,
) -> str:
    """Why ``chosen`` was picked, in the words of the rule that picked it."""
    if chosen.config.packed:
        why = (
            f"it meets every rule and the model's attention can keep packed documents apart "
            f"({packing_note(packing_check)}), so bins of whole documents carry no padding and mix lengths "
            "freely"
        )
    elif chosen is traded:
        why = (
            f"it models {_speed(chosen) / _speed(rand_p):.2f} x random's throughput, >= {SPEEDUP} x that of "
            "every plan that meets every rule, without freezing its composition, and its steps mix best of "
            f"such plans" + (f": {gap}" if gap else "")
        )
    elif broken_rules:
        why = "no plan meets every rule; this one breaks the fewest: " + "; ".join(broken_rules)
    else:
        why = f"the highest modeled throughput among the {n_padded} padded plans that meet every rule"
        if gap:
            why += f"; {gap}"
    if not packing:  # whichever padded plan: why not packed
        why = (
            "packing is off: the model's attention cannot keep packed documents apart"
            + (f" ({packing_note(packing_check)})" if packing_check is not None else "")
            + f"; {why}"
        )
    return why


def _reasons(m: dict, rm: dict, sorted_m: dict, rand: float, lim: dict, micro_per_step: int) -> list[str]:
    """The chosen plan's numbers beside random's and sorted's, each against its rule's limit."""
    return [
        f"padding efficiency {m['padding_efficiency']:.4f} (random: {rm['padding_efficiency']:.4f}, "
        f"sorted: {sorted_m['padding_efficiency']:.4f})",
        f"modeled throughput {m['relative_throughput']:.3f} x sorted "
        f"({m['relative_throughput'] / rm['relative_throughput']:.2f} x random)",
        f"co-batch repeat between epochs {m['cobatch_repeat']:.4f} (limit {lim['cobatch_repeat_max']:.4g} at "
        f"{m['steps']} steps of {micro_per_step} micro-batches; sorted: {sorted_m['cobatch_repeat']:.3f})",
        f"step divergence {m['step_divergence']:.3f} = {_ratio(m['step_divergence'], rand):.2f} x random's "
        f"{rand:.3f} (limit {DIVERGENCE_RATIO} x; sorted: {sorted_m['step_divergence']:.3f})",
        f"adjacent-step correlation {m['adjacent_corr']:+.3f} ("
        + (
            f"limit {lim['adjacent_corr_max']:.3g}"
            if lim["adjacent_corr_max"] is not None
            else f"not judged below {ADJACENT_MIN_STEPS} steps"
        )
        + f"), rank imbalance {m['imbalance']:.4f}",
    ]


def _alternative(best_padded: Point | None, rand: float) -> dict | None:
    """The padded plan to fall back on if the attention cannot keep packed documents apart."""
    if best_padded is None:
        return None
    bm = best_padded.metrics
    return {
        "label": best_padded.label,
        "params": best_padded.to_json()["params"],
        "text": f"If the attention cannot keep packed documents apart: {best_padded.label} "
        f"(padding efficiency {bm['padding_efficiency']:.4f}, throughput "
        f"{bm['relative_throughput']:.3f} x sorted, co-batch repeat {bm['cobatch_repeat']:.4f}, step "
        f"divergence {_ratio(bm['step_divergence'], rand):.2f} x random's).",
    }


def _ratio(x: float, ref: float) -> float:
    return x / ref if ref > 0 else math.inf


def _gap(p: Point, rand: float, micro_per_step: int) -> str | None:
    """The sentence on a padded plan whose steps mix worse than a random shuffle's, or None."""
    if p.config.packed or p.metrics["step_divergence"] <= rand:  # random's own is rand
        return None
    return (
        f"its steps mix {_ratio(p.metrics['step_divergence'], rand):.2f} x worse than a random shuffle's "
        f"(step divergence {p.metrics['step_divergence']:.3f} vs {rand:.3f}), the price of {micro_per_step} "
        "micro-batches per step: each padded micro-batch holds one narrow band of lengths, so a step samples "
        "the length distribution at only that many points; more micro-batches per step (--grad-accum) "
        "narrow the gap"
    )


def _near_miss(points: list[Point], failing: dict, pick: Point | None, packing: bool) -> str | None:
    """The fastest rejected plan that beats the padded pick (packed only when packing is allowed), with the
    rules it breaks and by how much, what rejecting it costs, and the knob that fixes them. A plan that does
    not freeze its composition is named before a faster frozen one (a knob can fix the first, not the
    second), which is then named in one clause."""
    floor = -1.0 if pick is None else _speed(pick)
    misses = [
        p for p in points if failing[p.label] and _speed(p) > floor and (packing or not p.config.packed)
    ]
    if not misses:
        return None
    nm = max([p for p in misses if not frozen(p.metrics)] or misses, key=_speed)
    fastest = max(misses, key=_speed)
    also = (
        ""
        if fastest is nm or pick is None
        else f" {fastest.label} would reach {_speed(fastest) / _speed(pick):.2f} x the pick's throughput but "
        "freezes its composition."
    )
    fixes = []
    rules = failing[nm.label]
    if REGISTRY[nm.config.strategy].bucketed:
        if any(r.startswith("co-batch") for r in rules):
            fixes.append("a wider noise window (a larger --mix) lowers co-batch repeat")
        if any(r.startswith("step divergence") for r in rules):
            fixes.append("more micro-batches per step (--grad-accum) lower step divergence")
    cost = (
        ""
        if pick is None
        else f" ({_speed(nm) / _speed(pick):.2f} x the pick's throughput: rejecting it costs "
        f"{1 - _speed(pick) / _speed(nm):.0%} of the modeled throughput)"
    )
    return (
        f"{nm.label} would reach {nm.metrics['relative_throughput']:.3f} x sorted{cost}, padding efficiency "
        f"{nm.metrics['padding_efficiency']:.4f}, but breaks: "
        + "; ".join(rules)
        + (f" ({'; '.join(fixes)})" if fixes else "")
        + "."
        + also
    )


def _speed(p: Point) -> float:
    return float(p.metrics["modeled_throughput"])


def _by(points: list[Point], strategy: str) -> Point:
    return next(p for p in points if p.config.strategy == strategy)


def _family(cfg: PlanConfig) -> str:
    if not REGISTRY[cfg.strategy].bucketed:
        return cfg.strategy
    if cfg.mix is not None:
        return "mix"
    return "buckets" if cfg.buckets is not None else "growth"


def _label(cfg: PlanConfig) -> str:
    """``sorted``, ``bucketed (growth 1.25)``, ``bucketed (8 optimal buckets, mix 16)``..."""
    if not REGISTRY[cfg.strategy].bucketed:
        return cfg.strategy
    mix = "" if cfg.mix is None else f", mix {cfg.mix}"
    if cfg.buckets is not None:
        return f"bucketed ({cfg.buckets} optimal buckets{mix})"
    return f"bucketed (growth {cfg.growth:g}{mix})"


def _clean(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, float):
            v = round(v, 6)
        out[k] = v
    return out
