"""The report's decision: measure the strategies and a frontier of bucketed plans, then choose one plan and
say why in numbers.

Modeled throughput of a plan = real tokens / sum over steps of the modeled cost of the step's most loaded
rank (a synchronous step waits for its slowest rank), reported relative to ``sorted``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from padfree.core.batching import bucket_edges
from padfree.core.config import STRATEGIES, PlanConfig
from padfree.core.cost import imbalance
from padfree.core.items import make_items, validate_lengths
from padfree.core.plan import Plan
from padfree.core.planner import make_plan
from padfree.tools.analyze import analyze_strategies, measure

GROWTHS = (1.1, 1.25, 1.5, 2.0)
BUCKET_COUNTS = (2, 4, 8, 16, 32)
MAX_COBATCH_REPEAT = 0.01
MAX_ADJACENT_CORR = 0.1
RANK_STEPS = 200
MIX_RETRIES = 3
_DEFAULT_MIX = PlanConfig().mix


@dataclass(frozen=True)
class Point:
    """One measured plan configuration of the frontier."""

    label: str
    family: str  # "growth", "buckets", or a strategy name
    config: PlanConfig
    metrics: dict

    def to_json(self) -> dict:
        c = self.config
        params = {"strategy": c.strategy}
        if c.strategy == "bucketed":
            params |= {"buckets": c.buckets} if c.buckets is not None else {"growth": c.growth}
            params["mix"] = c.mix
        return {"label": self.label, "family": self.family, "params": params, **_clean(self.metrics)}


def build_report(
    lengths: np.ndarray,
    base: PlanConfig,
    *,
    name: str = "lengths",
    path: str | None = None,
    growths: tuple[float, ...] = GROWTHS,
    bucket_counts: tuple[int, ...] = BUCKET_COUNTS,
    packing: bool = True,
) -> tuple[dict, dict[str, Plan]]:
    """Measure the strategies and the frontier and choose a plan. Returns ``(numbers, plans)`` where
    ``plans`` holds the epoch-1 plan of the recommendation (``"recommended"``)."""
    t0 = time.perf_counter()
    lengths = validate_lengths(lengths, path)
    configs = {s: base.with_(strategy=s) for s in STRATEGIES}
    result = analyze_strategies(lengths, configs, path=path)
    result["dataset"]["name"] = name
    points: list[Point] = []
    for s in STRATEGIES:  # analyze's numbers (modeled throughput included)
        m = result["strategies"][s]
        fam = s
        if s == "bucketed":
            fam = "buckets" if base.buckets is not None else "growth"
        points.append(Point(_label(configs[s]), fam, configs[s], m))
    done = {_label(configs["bucketed"])}
    sweep = [base.with_(strategy="bucketed", growth=float(g), buckets=None) for g in growths]
    sweep += [base.with_(strategy="bucketed", buckets=int(n)) for n in bucket_counts]
    for cfg in sweep:
        if _label(cfg) in done:
            continue
        done.add(_label(cfg))
        m, _ = measure(lengths, cfg, path)
        points.append(Point(_label(cfg), "buckets" if cfg.buckets is not None else "growth", cfg, m))
    rand = result["strategies"]["random"]["step_divergence"]
    for _ in range(MIX_RETRIES):  # a faster bucketed plan that only misses co-batch repeat: retry, 2x mix
        ok_padded = [p for p in points if p.config.strategy != "packed" and not _broken(p.metrics, rand)]
        floor = max((p.metrics["modeled_throughput"] for p in ok_padded), default=0.0)
        near = [
            p
            for p in points
            if p.config.strategy == "bucketed"
            and p.metrics["modeled_throughput"] > floor
            and _broken(p.metrics, rand)
            and all(r.startswith("co-batch") for r in _broken(p.metrics, rand))
        ]
        if not near:
            break
        best = max(near, key=lambda p: p.metrics["modeled_throughput"])
        cfg = best.config.with_(mix=best.config.mix * 2)
        while _label(cfg) in done:  # that one was tried (and missed too): double again
            cfg = cfg.with_(mix=cfg.mix * 2)
        done.add(_label(cfg))
        m, _ = measure(lengths, cfg, path)
        points.append(Point(_label(cfg), "mix", cfg, m))
    ref = result["strategies"]["sorted"]["modeled_throughput"]
    for p in points:
        p.metrics["relative_throughput"] = p.metrics["modeled_throughput"] / ref
    rec = recommend(points, packing)
    chosen = next(p for p in points if p.label == rec["label"])
    plan = make_plan(lengths, chosen.config, 1, path=path)
    items = make_items(lengths, base.budget, base.overlong, path)
    # the recommended bucketed plan's edges; the --growth/--buckets edges when the pick is not bucketed
    edge_cfg = chosen.config if chosen.config.strategy == "bucketed" else base.with_(strategy="bucketed")
    edges = bucket_edges(items.length, edge_cfg.growth, edge_cfg.buckets, None)
    rc = plan.rank_costs()
    numbers = {
        "dataset": result["dataset"],
        "config": result["config"] | {"growth": base.growth, "buckets": base.buckets, "mix": base.mix},
        "bucket_edges": edges.tolist(),
        "bucket_edges_of": _label(edge_cfg),
        "strategies": {s: _clean(result["strategies"][s]) for s in STRATEGIES},
        "strategy_labels": {s: _label(configs[s]) for s in STRATEGIES},
        "frontier": [p.to_json() for p in points],
        "recommendation": rec,
        "rank_load": {
            "label": chosen.label,
            "steps_shown": int(min(RANK_STEPS, rc.shape[0])),
            "cost": rc[:RANK_STEPS].round(1).tolist(),
            "imbalance": imbalance(rc),
        },
        "packing_supported": packing,
        "seconds": 0.0,
    }
    numbers["seconds"] = round(time.perf_counter() - t0, 2)
    return numbers, {"recommended": plan}


def recommend(points: list[Point], packing: bool) -> dict:
    """Choose a plan: among plans with ``cobatch_repeat <= 0.01``, ``adjacent_corr <= 0.1`` and
    ``step_divergence`` no worse than random's, packed when the model's attention can keep packed documents
    apart (``packing``), else the padded plan with the highest modeled throughput."""
    rand = next(p for p in points if p.config.strategy == "random").metrics["step_divergence"]
    sorted_m = next(p for p in points if p.config.strategy == "sorted").metrics

    failing = {p.label: _broken(p.metrics, rand) for p in points}
    eligible = [p for p in points if not failing[p.label]]
    padded = [p for p in eligible if p.config.strategy != "packed"]
    packed = [p for p in eligible if p.config.strategy == "packed"]
    best_padded = max(padded, key=lambda p: p.metrics["modeled_throughput"], default=None)
    relaxed = False
    if packing and packed:
        chosen = packed[0]
    elif best_padded is not None:
        chosen = best_padded
    else:  # nothing passes: the padded plan breaking the fewest rules, then the fastest
        relaxed = True
        pool = [p for p in points if p.config.strategy != "packed" or packing]
        chosen = min(pool, key=lambda p: (len(failing[p.label]), -p.metrics["modeled_throughput"]))
    m = chosen.metrics
    reasons = [
        f"padding efficiency {m['padding_efficiency']:.4f} (random: "
        f"{_metric(points, 'random', 'padding_efficiency'):.4f}, "
        f"sorted: {sorted_m['padding_efficiency']:.4f})",
        f"modeled throughput {m['relative_throughput']:.3f} x sorted "
        f"({m['relative_throughput'] / _metric(points, 'random', 'relative_throughput'):.2f} x random)",
        f"co-batch repeat between epochs {m['cobatch_repeat']:.4f} (limit {MAX_COBATCH_REPEAT}; "
        f"sorted: {sorted_m['cobatch_repeat']:.3f})",
        f"step divergence {m['step_divergence']:.3f} (random: {rand:.3f}, sorted: "
        f"{sorted_m['step_divergence']:.3f})",
        f"adjacent-step correlation {m['adjacent_corr']:+.3f} (limit {MAX_ADJACENT_CORR}), "
        f"rank imbalance {m['imbalance']:.4f}",
    ]
    if chosen.config.strategy == "packed":
        why = (
            "it meets every rule and the model's attention can keep packed documents apart (assumed; pass "
            "--no-packing if it cannot), so bins of whole documents carry no padding and mix lengths freely"
        )
    elif relaxed:
        why = "no plan meets every rule; this one breaks the fewest: " + "; ".join(failing[chosen.label])
    else:
        why = f"the highest modeled throughput among the {len(padded)} padded plans that meet every rule"
        if not packing:
            why += " (packing is off: the model's attention cannot keep packed documents apart)"
    alt = None
    if chosen.config.strategy == "packed" and best_padded is not None:
        bm = best_padded.metrics
        alt = {
            "label": best_padded.label,
            "params": best_padded.to_json()["params"],
            "text": f"If the attention cannot keep packed documents apart: {best_padded.label} "
            f"(padding efficiency {bm['padding_efficiency']:.4f}, throughput "
            f"{bm['relative_throughput']:.3f} x sorted, co-batch repeat {bm['cobatch_repeat']:.4f}).",
        }
    # a faster padded plan that just misses a rule is worth naming, with the knob that fixes it
    padded_pick = best_padded if chosen.config.strategy == "packed" or relaxed else chosen
    floor = -1.0 if padded_pick is None else padded_pick.metrics["modeled_throughput"]
    misses = [
        p
        for p in points
        if p.config.strategy == "bucketed" and failing[p.label] and p.metrics["modeled_throughput"] > floor
    ]
    near_miss = None
    if misses:
        nm = max(misses, key=lambda p: p.metrics["modeled_throughput"])
        fixes = []
        if nm.metrics["cobatch_repeat"] > MAX_COBATCH_REPEAT:
            tried = [
                p
                for p in points
                if p.family == "mix" and p.config.with_(mix=nm.config.mix) == nm.config and p is not nm
            ]
            if tried:
                last = max(tried, key=lambda p: p.config.mix)
                fixes.append(
                    f"raising --mix to {last.config.mix} gave co-batch repeat "
                    f"{last.metrics['cobatch_repeat']:.4f} at "
                    f"{last.metrics['relative_throughput']:.3f} x sorted"
                )
            else:
                fixes.append(f"a larger --mix (now {nm.config.mix}) lowers co-batch repeat")
        if nm.metrics["step_divergence"] > rand + 1e-12 or nm.metrics["adjacent_corr"] > MAX_ADJACENT_CORR:
            fixes.append("fewer, wider buckets (larger growth) mix lengths more within a step")
        near_miss = (
            f"{nm.label} would reach {nm.metrics['relative_throughput']:.3f} x sorted but breaks: "
            + "; ".join(failing[nm.label])
            + (f" ({'; '.join(fixes)})" if fixes else "")
            + "."
        )
    c = chosen.config
    text = (
        f"Use {chosen.label} with budget {c.budget} tokens, world size {c.world_size} x grad-accum "
        f"{c.grad_accum}: {why}. " + "; ".join(reasons) + "."
    )
    if near_miss and chosen.config.strategy != "packed":
        text += " Note: " + near_miss
    return {
        "label": chosen.label,
        "params": chosen.to_json()["params"] | {"budget": c.budget},
        "why": why,
        "reasons": reasons,
        "text": text,
        "alternative": alt,
        "near_miss": near_miss,
        "eligible": [p.label for p in eligible],
        "rejected": {k: v for k, v in failing.items() if v},
        "criteria": {
            "cobatch_repeat_max": MAX_COBATCH_REPEAT,
            "adjacent_corr_max": MAX_ADJACENT_CORR,
            "step_divergence_max": rand,
        },
    }


def _metric(points: list[Point], strategy: str, key: str) -> float:
    return float(next(p for p in points if p.config.strategy == strategy).metrics[key])


def _broken(m: dict, random_divergence: float) -> list[str]:
    """The recommendation rules a plan's metrics break, each with its numbers."""
    bad = []
    if m["cobatch_repeat"] > MAX_COBATCH_REPEAT:
        bad.append(f"co-batch repeat {m['cobatch_repeat']:.4f} > {MAX_COBATCH_REPEAT}")
    if m["adjacent_corr"] > MAX_ADJACENT_CORR:
        bad.append(f"adjacent-step correlation {m['adjacent_corr']:+.3f} > {MAX_ADJACENT_CORR}")
    if m["step_divergence"] > random_divergence + 1e-12:
        bad.append(f"step divergence {m['step_divergence']:.3f} > random's {random_divergence:.3f}")
    return bad


def _label(cfg: PlanConfig) -> str:
    """``sorted``, ``bucketed (growth 1.25)``, ``bucketed (8 optimal buckets, mix 256)``..."""
    if cfg.strategy != "bucketed":
        return cfg.strategy
    mix = "" if cfg.mix == _DEFAULT_MIX else f", mix {cfg.mix}"
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
