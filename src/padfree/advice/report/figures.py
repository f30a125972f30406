"""The report's figures (matplotlib, imported only here): each returns a base64 PNG."""

from __future__ import annotations

import base64
import io

import numpy as np

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
    if numbers.get("sources"):
        figs["sources"] = ("Each source's share of every step", _fig_sources(plt, numbers["sources"]))
    return figs


def _fig_sources(plt, src: dict) -> str:  # noqa: ANN001
    """Each step's share of each source (stacked, in the weights' unit), its weight dashed."""
    shares = np.asarray(src["step_shares"], dtype=np.float64)
    frac = shares / np.maximum(shares.sum(axis=1, keepdims=True), 1e-300)
    fig, ax = plt.subplots(figsize=(10, 3.4))
    steps = np.arange(frac.shape[0])
    ax.stackplot(steps, frac.T, labels=list(src["sources"]), alpha=0.85)
    edge = np.cumsum([r["weight"] for r in src["sources"].values()])[:-1]
    for y in edge:
        ax.axhline(y, color="black", lw=0.8, ls="--")
    ax.set_xlim(0, max(frac.shape[0] - 1, 1))
    ax.set_ylim(0, 1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"share of the step ({src['unit']})")
    ax.legend(loc="upper right", fontsize=8, ncol=min(4, len(src["sources"])))
    return _png(plt, fig)


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
        f"{len(edges)} bucket upper edges (after merging sparse buckets) that {numbers['bucket_edges_of']} "
        "used in epoch 1, in orange",
        fontsize=10,
        loc="left",
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


_TAG = {"growth": ("growth", "g"), "buckets": ("buckets", "n"), "mix": ("mix", "m")}


def _fig_frontier(plt, numbers: dict) -> str:  # noqa: ANN001
    """Padding efficiency against step divergence and against co-batch repeat, one point per plan. Every
    point is drawn inside the axes; one far below the others (random, usually) sits on the bottom edge with
    its value written beside it; bucketed points carry a short tag placed clear of the others."""
    pts = numbers["frontier"]
    rec = numbers["recommendation"]["label"]
    effs = [p["padding_efficiency"] for p in pts]
    close = [p["padding_efficiency"] for p in pts if p["family"] != "random"] or effs
    span = max(close) - min(close) + 0.01
    y_lo, y_hi = max(0.0, min(close) - 0.12 * span), min(1.0, max(effs)) + 0.12 * span
    floor_y = y_lo + 0.03 * (y_hi - y_lo)

    def y_of(p: dict) -> float:
        return max(p["padding_efficiency"], floor_y)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, key, xlabel in (
        (axes[0], "step_divergence", "step divergence (W1 / mean length; lower = more representative)"),
        (axes[1], "cobatch_repeat", "co-batch repeat between epochs (log; lower = fresher partners)"),
    ):
        xs_all = [_floor(p[key], key) for p in pts]
        if key == "cobatch_repeat":
            ax.set_xscale("log")
            ax.set_xlim(min(xs_all) / 1.6, max(xs_all) * 1.6)
            ax.axvline(
                numbers["recommendation"]["criteria"]["cobatch_repeat_max"], color="#999", lw=0.8, ls="--"
            )
        else:
            lo, hi = min(xs_all), max(xs_all)
            ax.set_xlim(lo - 0.08 * (hi - lo + 1e-3), hi + 0.08 * (hi - lo + 1e-3))
            ax.axvline(
                numbers["recommendation"]["criteria"]["step_divergence_max"], color="#999", lw=0.8, ls="--"
            )
        ax.set_ylim(y_lo, y_hi)
        labels: list[tuple[str, float, float, str]] = []
        for fam, marker in (("growth", "o-"), ("buckets", "s-"), ("mix", "P-")):
            sort_key = _TAG[fam][0]
            series = sorted((p for p in pts if p["family"] == fam), key=lambda p: p["params"][sort_key])
            if not series:
                continue
            xs = [_floor(p[key], key) for p in series]
            ys = [y_of(p) for p in series]
            name = {
                "growth": "bucketed, growth factor (g)",
                "buckets": "bucketed, N optimal buckets (n)",
                "mix": "bucketed, explicit --mix (m)",
            }[fam]
            ax.plot(xs, ys, marker, color=_COLORS[fam], ms=6, lw=1, label=name)
            for p, x, yv in zip(series, xs, ys, strict=True):
                labels.append((f"{_TAG[fam][1]}{p['params'][sort_key]:g}", x, yv, _COLORS[fam]))
        for s, marker in (("packed", "D"), ("sorted", "^"), ("random", "v")):
            for p in (q for q in pts if q["family"] == s):
                x, yv = _floor(p[key], key), y_of(p)
                ax.plot([x], [yv], marker, color=_COLORS[s], ms=8, label=s, linestyle="none")
                below = f" {p['padding_efficiency']:.3f}, below" if yv != p["padding_efficiency"] else ""
                labels.append((s + below, x, yv, _COLORS[s]))
        for p in (q for q in pts if q["label"] == rec):
            ax.plot([_floor(p[key], key)], [y_of(p)], "o", ms=16, mfc="none", mec="black", mew=1.5,
                    label="recommended")  # fmt: skip
        _place_labels(fig, ax, labels)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_ylabel("padding efficiency")
        ax.grid(alpha=0.25)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, names, loc="lower center", ncol=4, frameon=False, fontsize=8.5, bbox_to_anchor=(0.5, -0.1)
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return _png(plt, fig)


def _place_labels(fig, ax, labels: list[tuple[str, float, float, str]]) -> None:  # noqa: ANN001
    """Write each label beside its point at the first of a few offsets whose box overlaps no label written
    before (boxes measured in display pixels), farther ones with a thin leader line; a label with no free
    place is left out (its point is still drawn, and the table lists every plan)."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    taken: list = []
    near = [(5, 3), (5, -11), (-5, 3), (-5, -11)]
    far = [(dx, dy) for r in (14, 26, 38) for dx, dy in ((5, r), (5, -r - 8), (-5, r), (-5, -r - 8))]
    far += [(dx, dy) for r in (24, 44) for dx, dy in ((r, -4), (-r, -4))]
    for text, x, y, color in sorted(labels, key=lambda t: (t[2], t[1])):
        for dx, dy in near + far:
            leader = {"arrowstyle": "-", "color": color, "lw": 0.5} if (dx, dy) in far else None
            ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=7.5,
                              color=color, ha="left" if dx > 0 else "right", arrowprops=leader)  # fmt: skip
            ann.update_positions(renderer)
            box = Text.get_window_extent(ann, renderer).expanded(1.05, 1.1)  # the text, not its leader
            if not any(box.overlaps(t) for t in taken):
                taken.append(box)
                break
            ann.remove()  # no free place: the point stays drawn, the table below the figure names it


def _floor(v: float, key: str) -> float:
    return max(float(v), 1e-6) if key == "cobatch_repeat" else float(v)


def _fig_rank_load(plt, numbers: dict) -> str:  # noqa: ANN001
    """Each rank's modeled cost in each step, relative to the step's mean rank: a heatmap (ranks x steps),
    readable at any number of ranks and steps, with integer ticks."""
    from matplotlib.ticker import MaxNLocator

    rl = numbers["rank_load"]
    cost = np.asarray(rl["cost"], dtype=np.float64)
    rel = cost / np.where(cost.mean(1, keepdims=True) > 0, cost.mean(1, keepdims=True), 1.0)
    n_steps, w = cost.shape
    dev = max(0.01, float(np.abs(rel - 1).max()))
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.22 * w))
    im = ax.imshow(rel.T, aspect="auto", cmap="RdBu_r", vmin=1 - dev, vmax=1 + dev, interpolation="nearest",
                   extent=(-0.5, n_steps - 0.5, w - 0.5, -0.5))  # fmt: skip
    if n_steps <= 24:
        ax.set_xticks(range(n_steps))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=12))
    if w <= 16:
        ax.set_yticks(range(w))
    else:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=16))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("rank")
    for side in ("top", "right"):
        ax.spines[side].set_visible(True)
    bar = fig.colorbar(im, ax=ax, pad=0.01, fraction=0.04, format="%.2f")
    bar.set_label("cost / step mean", fontsize=8.5)
    ax.set_title(
        f"{rl['label']}: {w} ranks, {'the first ' if rl['steps_shown'] < rl.get('steps', 0) else ''}"
        f"{rl['steps_shown']} step{'s' if rl['steps_shown'] != 1 else ''}; "
        "imbalance (max/mean, mean over steps) "
        f"{rl['imbalance']:.4f}",
        fontsize=10,
        loc="left",
    )
    return _png(plt, fig)
