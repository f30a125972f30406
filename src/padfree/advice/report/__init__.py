"""``padfree report``: one self-contained HTML page (and its numbers as JSON) that turns a lengths file into
a batching decision.

The page shows the length histogram with the bucket edges, padding efficiency and modeled throughput per
strategy, the efficiency-diversity frontier (bucket growth factors and bucket counts against packed, sorted
and random), the per-rank load of the recommended plan, and a recommendation with its reasons in numbers.
Images are PNGs embedded as base64 data URIs; the page loads nothing from anywhere. matplotlib is imported
only in :mod:`.figures` (the ``report`` extra).

    decision.py  measure (through advice/analyze.measure) and choose   -> numbers (report.json)
    figures.py   numbers + lengths -> PNGs
    html.py      numbers + PNGs -> index.html
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from padfree.advice.report.decision import (
    BUCKET_COUNTS,
    GROWTHS,
    MIXES,
    Point,
    broken,
    build_report,
    limits,
    recommend,
)
from padfree.advice.report.figures import render_figures
from padfree.advice.report.html import render_html
from padfree.core.config import STRATEGIES, PlanConfig
from padfree.core.items import validate_lengths

__all__ = [
    "BUCKET_COUNTS",
    "GROWTHS",
    "MIXES",
    "Point",
    "broken",
    "build_report",
    "drafter_numbers",
    "limits",
    "recommend",
    "render_figures",
    "render_html",
    "write_report",
]


def drafter_numbers(
    lengths: np.ndarray,
    config: PlanConfig,
    anchors: np.ndarray | None,
    setup: dict,
    seconds_per_unit: float | None = None,
    path: str | None = None,
) -> dict:
    """The report's drafter section: ``setup`` (method, recipe, tokens, offline hidden-state cache size,
    memory model: what :func:`padfree.advice.drafter.priced_setup` returns) and, per strategy, the predicted
    throughput of the drafter setup (:func:`padfree.advice.simulate.simulate` with the drafter's anchors and
    cost model) and the activation peak its heaviest micro-batch takes; beside them what users run today,
    SpecForge-style random padded batches (a fixed sample count, tokens padded to the longest, anchor slots to
    the most anchors: :func:`padfree.baselines.fixed_count`), and the recommendation: the fastest padfree
    plan."""
    from padfree.advice.simulate import simulate, simulate_batches
    from padfree.baselines import fixed_count
    from padfree.core.items import make_items
    from padfree.drafter.memory import MemoryModel

    memory = MemoryModel(**setup["memory_model"])
    sim = simulate(
        lengths, config, STRATEGIES, seconds_per_unit, naive=False, path=path, anchors=anchors, memory=memory
    )
    keep = ("tokens_per_unit", "ratio_to_sorted", "padding_efficiency", "imbalance", "steps", "draft_blocks",
            "draft_block_efficiency", "tokens_per_second", "epoch_seconds", "peak_bytes",
            "peak_parts")  # fmt: skip
    rows = {s: {k: r[k] for k in keep if k in r} for s, r in sim["strategies"].items()}
    items = make_items(validate_lengths(lengths, path), config.budget, config.overlong, path)
    order, offsets = fixed_count(items.length, config.budget, np.random.default_rng([config.seed, 7]))
    k = config.micro_per_step
    whole = (offsets.shape[0] - 1) // k * k  # a partial last step out (their trainers drop it)
    if whole:
        offsets = offsets[: whole + 1]
    else:  # a short epoch, less than one step: that step, its missing micro-batches empty (idle ranks)
        offsets = np.concatenate([offsets, np.full(k - (offsets.shape[0] - 1), offsets[-1])])
    order = order[: int(offsets[-1])]
    base = simulate_batches(
        items.length[order], offsets, False, config.world_size, config.grad_accum, config.cost,
        seconds_per_unit, None, None if anchors is None else np.asarray(anchors)[items.sample_ids()[order]],
        memory,
    )  # fmt: skip
    base = {k: base[k] for k in keep if k in base}
    base["ratio_to_sorted"] = base["tokens_per_unit"] / sim["strategies"]["sorted"]["tokens_per_unit"]
    best = max(("packed", "bucketed"), key=lambda s: rows[s]["tokens_per_unit"])
    over = base["tokens_per_unit"] and rows[best]["tokens_per_unit"] / base["tokens_per_unit"]
    return {
        **setup,
        "cost": sim["config"]["cost"],
        "anchor_budget": config.anchor_budget,
        "world_size": config.world_size,
        "strategies": rows,
        "specforge_random": base,
        "recommendation": {"strategy": best, "over_specforge_random": over},
    }


PATH_NOTE = (
    "examples/train_drafter.py's tensors on any device, a GPU's included: a float32 drafter, attention run "
    "eagerly per document"
)
"""What the activation figures describe (the example trains with the same eager per-document attention on a
CPU and on a GPU; :mod:`padfree.drafter.memory`)."""

PARTS = {"draft_queries": "draft queries", "attention": "attention scores", "tokens": "per-token states"}


def memory_sentence(d: dict) -> str:
    """The drafter section's activation figure in words (the page and the terminal say it alike): the
    recommended plan's heaviest micro-batch, what holds its bytes, the path it describes, and either the
    ``--memory-gb`` bound it was planned within or the options that bound it (``report`` and
    ``examples/train_drafter.py`` both take them)."""
    rec = d["recommendation"]["strategy"]
    pick = d["strategies"][rec]
    parts = pick.get("peak_parts") or {}
    split = ", ".join(
        f"{parts[k] / 2**30:,.2f} GiB {name}" for k, name in PARTS.items() if parts.get(k, 0.0) > 0
    )
    text = (
        f"its heaviest micro-batch takes {pick['peak_bytes'] / 2**30:,.2f} GiB of activations"
        + (f" ({split})" if split else "")
        + f" by {d['memory_model']['source']}: {PATH_NOTE}"
    )
    if d.get("memory_gb") is not None:
        return text + f"; planned within --memory-gb {d['memory_gb']:g}"
    bounded = (
        "draft blocks (a document with more anchors than that needs --max-anchors, the error says how many)"
        if d.get("uses_anchors")
        else "attention scores"
    )
    return text + (
        f"; to fit a device, pass --memory-gb G (GiB a micro-batch's activations may take) to report and to "
        f"examples/train_drafter.py: it caps each micro-batch's {bounded}; or lower --budget"
    )


def write_report(
    out_dir: str | Path,
    lengths: np.ndarray,
    base: PlanConfig,
    *,
    t0: float | None = None,
    drafter: dict | None = None,
    sources: dict | None = None,
    **kwargs: object,
) -> dict:
    """Build the report and write ``out_dir/index.html`` and ``out_dir/report.json``; returns the numbers.
    ``drafter`` (:func:`drafter_numbers`) adds the drafter setup's section, ``sources``
    (:func:`padfree.core.sources.report_numbers`) the weighted sources' section.

    ``numbers["seconds"]`` is the wall time from ``t0`` (default: this call) to the page being rendered,
    so a caller that passes the start of its run (reading the lengths included) reports the run's time.
    """
    t0 = time.perf_counter() if t0 is None else t0
    numbers, _ = build_report(lengths, base, **kwargs)  # type: ignore[arg-type]
    if drafter is not None:
        numbers["drafter"] = drafter
    if sources is not None:  # weighted sources: each step's share per source and what the weights cost
        numbers["sources"] = sources
    lengths = validate_lengths(lengths, kwargs.get("path"), compact=True)  # type: ignore[arg-type]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = render_figures(lengths, numbers)
    numbers["seconds"] = round(time.perf_counter() - t0, 2)
    (out / "index.html").write_text(render_html(numbers, figures), encoding="utf-8")
    (out / "report.json").write_text(json.dumps(numbers, indent=2) + "\n", encoding="utf-8")
    return numbers
