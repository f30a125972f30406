"""The report's figures (matplotlib, imported only here): each returns a base64 PNG."""

from __future__ import annotations

import base64
import io

import numpy as np

from padfree.tools.report.decision import MAX_COBATCH_REPEAT

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
