"""``padfree report``: one self-contained HTML page (and its numbers as JSON) that turns a lengths file into
a batching decision.

The page shows the length histogram with the bucket edges, padding efficiency and modeled throughput per
strategy, the efficiency-diversity frontier (bucket growth factors and bucket counts against packed, sorted
and random), the per-rank load of the recommended plan, and a recommendation with its reasons in numbers.
Images are PNGs embedded as base64 data URIs; the page loads nothing from anywhere. matplotlib is imported
only here (the ``report`` extra).

Modeled throughput of a plan = real tokens / sum over steps of the modeled cost of the step's most loaded
rank (a synchronous step waits for its slowest rank), reported relative to ``sorted``.
"""

from __future__ import annotations

import base64
import html
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path

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


# --- rendering --------------------------------------------------------------------------------------------


def write_report(
    out_dir: str | Path,
    lengths: np.ndarray,
    base: PlanConfig,
    **kwargs: object,
) -> dict:
    """Build the report and write ``out_dir/index.html`` and ``out_dir/report.json``; returns the numbers."""
    numbers, plans = build_report(lengths, base, **kwargs)  # type: ignore[arg-type]
    lengths = validate_lengths(lengths, kwargs.get("path"))  # type: ignore[arg-type]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = render_figures(lengths, numbers)
    (out / "index.html").write_text(render_html(numbers, figures), encoding="utf-8")
    (out / "report.json").write_text(json.dumps(numbers, indent=2) + "\n", encoding="utf-8")
    return numbers


_COLORS = {
    "sorted": "#7f7f7f",
    "random": "#d62728",
    "packed": "#2ca02c",
    "growth": "#1f77b4",
    "buckets": "#ff7f0e",
    "mix": "#9467bd",
}


def render_figures(lengths: np.ndarray, numbers: dict) -> dict[str, tuple[str, str]]:
    """The page's figures: ``{key: (title, base64 PNG)}``."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.spines.top": False, "axes.spines.right": False})
    figs = {
        "histogram": ("Length histogram and bucket edges", _fig_histogram(plt, lengths, numbers)),
        "strategies": ("Padding efficiency and modeled throughput", _fig_strategies(plt, numbers)),
        "frontier": ("Efficiency-diversity frontier", _fig_frontier(plt, numbers)),
        "rank_load": ("Rank load per step", _fig_rank_load(plt, numbers)),
    }
    return figs


def _png(plt, fig) -> str:  # noqa: ANN001
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _fig_histogram(plt, lengths: np.ndarray, numbers: dict) -> str:  # noqa: ANN001
    lo, hi = max(1, int(lengths.min())), int(lengths.max())
    bins = np.unique(np.geomspace(lo, hi + 1, 80).round().astype(np.int64))
    if bins.size < 2:
        bins = np.array([lo, hi + 1])
    counts, _ = np.histogram(lengths, bins=bins)
    tokens, _ = np.histogram(lengths, bins=bins, weights=lengths.astype(np.float64))
    fig, ax = plt.subplots(figsize=(10, 3.8))
    ax.bar(bins[:-1], counts, width=np.diff(bins), align="edge", color="#9ecae1", edgecolor="#6baed6", lw=0.3)
    ax.set_xscale("log")
    ax.set_xlabel("sample length (tokens, log scale)")
    ax.set_ylabel("samples", color="#3182bd")
    ax2 = ax.twinx()
    centers = np.sqrt(bins[:-1] * np.maximum(bins[1:] - 1, bins[:-1]))
    ax2.plot(centers, tokens / tokens.sum(), color="#08306b", lw=1.4, label="share of tokens")
    ax2.set_ylabel("share of tokens", color="#08306b")
    ax2.spines["right"].set_visible(True)
    edges = numbers["bucket_edges"]
    for e in edges:
        ax.axvline(e, color="#e6550d", lw=0.6, alpha=0.55)
    ax.set_title(
        f"{len(edges)} bucket upper edges of {numbers['bucket_edges_of']} in orange", fontsize=10, loc="left"
    )
    ax2.legend(loc="upper right", frameon=False)
    return _png(plt, fig)


def _fig_strategies(plt, numbers: dict) -> str:  # noqa: ANN001
    names = list(numbers["strategies"])
    front = {p["label"]: p for p in numbers["frontier"]}
    labels = [numbers["strategy_labels"][s] for s in names]
    pad = [front[lab]["padding_efficiency"] for lab in labels]
    thr = [front[lab]["relative_throughput"] for lab in labels]
    fig, axes = plt.subplots(1, 2, figsize=(10, 2.9))
    y = np.arange(len(names))
    for ax, vals, title in (
        (axes[0], pad, "padding efficiency (real / computed tokens)"),
        (axes[1], thr, "modeled throughput, relative to sorted"),
    ):
        colors = [_COLORS.get(s, _COLORS["growth"]) for s in names]
        ax.barh(y, vals, color=colors)
        ax.set_yticks(y, labels)
        ax.invert_yaxis()
        ax.set_xlim(0, max(1.05, max(vals) * 1.12))
        ax.set_title(title, fontsize=10, loc="left")
        for yi, v in zip(y, vals, strict=True):
            ax.text(v + 0.01, yi, f"{v:.3f}", va="center", fontsize=9)
    fig.tight_layout()
    return _png(plt, fig)


def _fig_frontier(plt, numbers: dict) -> str:  # noqa: ANN001
    pts = numbers["frontier"]
    rec = numbers["recommendation"]["label"]
    # zoom on the plans worth choosing; a far worse one (random, usually) is drawn on the bottom edge
    effs = [p["padding_efficiency"] for p in pts]
    good = [v for v in effs if v >= 0.8] or effs
    y_lo = max(0.0, min(good) - 0.15 * (max(good) - min(good) + 0.01))
    y_hi = max(effs) + 0.1 * (max(effs) - y_lo)

    def y_of(p: dict) -> float:
        return max(p["padding_efficiency"], y_lo + 0.03 * (y_hi - y_lo))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, xlabel in (
        (axes[0], "step_divergence", "step divergence (W1 / mean length; lower = more representative)"),
        (axes[1], "cobatch_repeat", "co-batch repeat between epochs (log; lower = fresher partners)"),
    ):
        for fam, marker in (("growth", "o-"), ("buckets", "s-")):
            sort_key = "growth" if fam == "growth" else "buckets"
            series = sorted((p for p in pts if p["family"] == fam), key=lambda p: p["params"][sort_key])
            if not series:
                continue
            xs = [_floor(p[key], key) for p in series]
            ys = [y_of(p) for p in series]
            name = "bucketed, growth factor" if fam == "growth" else "bucketed, N optimal buckets"
            ax.plot(xs, ys, marker, color=_COLORS[fam], ms=5, lw=1, label=name)
            if key == "step_divergence":  # on the log co-batch axis the points crowd: the table has them
                for p, x, yv in zip(series, xs, ys, strict=True):
                    tag = f"{p['params'][sort_key]:g}"
                    ax.annotate(tag, (x, yv), textcoords="offset points", xytext=(4, -10), fontsize=7.5)
        retried = [p for p in pts if p["family"] == "mix"]
        if retried:
            ax.plot(
                [_floor(p[key], key) for p in retried],
                [y_of(p) for p in retried],
                "P",
                color=_COLORS["mix"],
                ms=8,
                linestyle="none",
                label="bucketed, larger --mix",
            )
        for s, marker in (("packed", "D"), ("sorted", "^"), ("random", "v")):
            for p in (q for q in pts if q["family"] == s):
                x, yv = _floor(p[key], key), y_of(p)
                ax.plot([x], [yv], marker, color=_COLORS[s], ms=8, label=s, linestyle="none")
                if yv != p["padding_efficiency"]:
                    ax.annotate(
                        f"{s}: {p['padding_efficiency']:.3f} (below the axis)",
                        (x, yv),
                        textcoords="offset points",
                        xytext=(-8, 4) if key == "step_divergence" else (8, 4),
                        ha="right" if key == "step_divergence" else "left",
                        fontsize=8,
                        color=_COLORS[s],
                    )
        for p in (q for q in pts if q["label"] == rec):
            ax.plot(
                [_floor(p[key], key)],
                [y_of(p)],
                "o",
                ms=16,
                mfc="none",
                mec="black",
                mew=1.5,
                label="recommended",
            )
        if key == "cobatch_repeat":
            ax.set_xscale("log")
            ax.axvline(MAX_COBATCH_REPEAT, color="#999", lw=0.8, ls="--")
        else:
            ax.axvline(
                numbers["recommendation"]["criteria"]["step_divergence_max"], color="#999", lw=0.8, ls="--"
            )
        ax.set_ylim(y_lo, y_hi)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_ylabel("padding efficiency")
        ax.grid(alpha=0.25)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="lower center", ncol=6, frameon=False, fontsize=8.5, bbox_to_anchor=(0.5, -0.06)
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return _png(plt, fig)


def _floor(v: float, key: str) -> float:
    return max(float(v), 1e-6) if key == "cobatch_repeat" else float(v)


def _fig_rank_load(plt, numbers: dict) -> str:  # noqa: ANN001
    rl = numbers["rank_load"]
    cost = np.asarray(rl["cost"], dtype=np.float64)
    steps = np.arange(cost.shape[0])
    fig, ax = plt.subplots(figsize=(10, 3.4))
    w = cost.shape[1]
    if w <= 16:
        for r in range(w):
            ax.plot(steps, cost[:, r], lw=0.7, alpha=0.7)
    else:
        ax.fill_between(
            steps, cost.min(1), cost.max(1), color="#9ecae1", alpha=0.6, label="min-max over ranks"
        )
    ax.plot(steps, cost.max(1), color="black", lw=1.2, label="most loaded rank")
    ax.plot(steps, cost.mean(1), color="#e6550d", lw=1.0, ls="--", label="mean rank")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("modeled cost per rank\n(token-equiv.; axis not from 0)")
    ax.set_title(
        f"{rl['label']}: {w} ranks, first {rl['steps_shown']} steps, imbalance (max/mean) "
        f"{rl['imbalance']:.4f}",
        fontsize=10,
        loc="left",
    )
    lo, hi = float(cost.min()), float(cost.max())
    pad = max(0.05 * (hi - lo), 0.01 * hi)
    ax.set_ylim(lo - pad, hi + 3 * pad)  # not from 0: the differences between ranks are the point
    ax.legend(loc="lower right", frameon=False, fontsize=8.5)
    return _png(plt, fig)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,Helvetica,Arial,sans-serif;max-width:1120px;
margin:24px auto;padding:0 18px;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.25em;margin-top:1.8em;border-bottom:1px solid #ddd}
.sub{color:#666;margin-top:0}.rec{background:#f2f8f2;border-left:5px solid #2ca02c;padding:10px 16px}
.rec .pick{font-size:1.15em;font-weight:600}.rec ul{margin:.4em 0}
table{border-collapse:collapse;font-size:.88em;margin:8px 0}
th,td{padding:3px 9px;text-align:right;border-bottom:1px solid #eee}
th:first-child,td:first-child{text-align:left}
th{background:#fafafa}tr.chosen td{background:#fff6d5;font-weight:600}
img{max-width:100%;display:block;margin:6px 0}.note{color:#555;font-size:.9em}
"""

_SCRIPT = """
(function(){
  function count(){
    var imgs=document.images, n=0;
    for(var i=0;i<imgs.length;i++){ if(imgs[i].complete && imgs[i].naturalWidth>0){ n++; } }
    document.body.setAttribute('data-images-loaded', String(n));
    document.body.setAttribute('data-images-total', String(imgs.length));
  }
  if(document.readyState==='complete'){ count(); } else { window.addEventListener('load', count); }
})();
"""

_COLUMNS = [
    ("padding_efficiency", "padding eff.", "{:.4f}"),
    ("relative_throughput", "throughput vs sorted", "{:.3f}"),
    ("step_divergence", "step divergence", "{:.3f}"),
    ("cobatch_repeat", "co-batch repeat", "{:.4f}"),
    ("adjacent_corr", "adjacent corr", "{:+.3f}"),
    ("imbalance", "rank imbalance", "{:.4f}"),
    ("steps", "steps", "{:,}"),
]


def render_html(numbers: dict, figures: dict[str, tuple[str, str]]) -> str:
    """The page: inline CSS, base64 images, and one inline script that records how many images loaded."""
    e = html.escape
    d, c, rec = numbers["dataset"], numbers["config"], numbers["recommendation"]
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>padfree report: {e(str(d.get('name', '')))}</title><style>{_CSS}</style></head><body>",
        f"<h1>padfree report: {e(str(d.get('name', '')))}</h1>",
        f"<p class='sub'>{d['samples']:,} samples, {d['tokens']:,} tokens; length p50 {d['p50']:.0f}, "
        f"p90 {d['p90']:.0f}, p99 {d['p99']:.0f}, max {d['max']:,}. Budget {c['budget']:,} tokens per "
        f"micro-batch, world size {c['world_size']} x grad-accum {c['grad_accum']}, seed {c['seed']}, "
        f"cost model a={c['cost']['a']:g} b={c['cost']['b']:.3g} c={c['cost']['c']:g} "
        f"({e(str(c['cost']['source']))}).</p>",
        "<h2 id='recommendation'>Recommendation</h2><div class='rec'>",
        f"<p class='pick'>{e(rec['label'])}</p><p>{e(rec['why'])}.</p><ul>",
        *[f"<li>{e(r)}</li>" for r in rec["reasons"]],
        "</ul>",
    ]
    if rec.get("alternative"):
        parts.append(f"<p>{e(rec['alternative']['text'])}</p>")
    if rec.get("near_miss"):
        parts.append(f"<p>Close but rejected: {e(rec['near_miss'])}</p>")
    crit = rec["criteria"]
    parts.append(
        f"<p class='note'>Rules: co-batch repeat &le; {crit['cobatch_repeat_max']}, adjacent-step "
        f"correlation &le; {crit['adjacent_corr_max']}, step divergence &le; random's "
        f"({crit['step_divergence_max']:.3f}). "
        f"{len(rec['eligible'])} of {len(numbers['frontier'])} plans pass. Packing supported: "
        f"{'yes' if numbers['packing_supported'] else 'no'}.</p></div>"
    )
    cap = {
        "histogram": "Samples per length (bars) and share of tokens (line); orange lines are the bucket "
        "upper edges of the recommended bucketed plan (else of --growth/--buckets).",
        "strategies": "Modeled throughput = real tokens / sum over steps of the most loaded rank's modeled "
        "cost, relative to length-sorted batches.",
        "frontier": "Each point is one plan (epoch 1, co-batch repeat against epoch 0). Up and to the left "
        "is better; dashed lines mark random's step divergence and the co-batch repeat limit.",
        "rank_load": "Modeled cost of every rank in each step of the recommended plan; a step lasts as long "
        "as its most loaded rank.",
    }
    for key, (title, b64) in figures.items():
        parts.append(f"<h2 id='{key}'>{e(title)}</h2>")
        parts.append(f"<img alt='{e(title)}' src='data:image/png;base64,{b64}'>")
        parts.append(f"<p class='note'>{e(cap.get(key, ''))}</p>")
        if key == "strategies":
            front = {p["label"]: p for p in numbers["frontier"]}
            parts.append(_table(numbers, [front[lab] for lab in numbers["strategy_labels"].values()]))
        if key == "frontier":
            parts.append(_table(numbers, numbers["frontier"]))
    parts.append(
        f"<p class='note'>Generated by padfree in {numbers['seconds']:.1f} s; the numbers are in "
        "report.json beside this page.</p>"
    )
    parts.append(f"<script>{_SCRIPT}</script></body></html>")
    return "\n".join(parts)


def _table(numbers: dict, rows: list[dict]) -> str:
    rec = numbers["recommendation"]["label"]
    head = "".join(f"<th>{e}</th>" for e in ["plan", *[lab for _, lab, _ in _COLUMNS]])
    body = []
    for p in rows:
        cells = "".join(f"<td>{'-' if p.get(k) is None else fmt.format(p[k])}</td>" for k, _, fmt in _COLUMNS)
        cls = " class='chosen'" if p["label"] == rec else ""
        body.append(f"<tr{cls}><td>{html.escape(p['label'])}</td>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
