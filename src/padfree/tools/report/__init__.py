"""``padfree report``: one self-contained HTML page (and its numbers as JSON) that turns a lengths file into
a batching decision.

The page shows the length histogram with the bucket edges, padding efficiency and modeled throughput per
strategy, the efficiency-diversity frontier (bucket growth factors and bucket counts against packed, sorted
and random), the per-rank load of the recommended plan, and a recommendation with its reasons in numbers.
Images are PNGs embedded as base64 data URIs; the page loads nothing from anywhere. matplotlib is imported
only in :mod:`.figures` (the ``report`` extra).

    decision.py  measure (through tools/analyze.measure) and choose   -> numbers (report.json)
    figures.py   numbers + lengths -> PNGs
    html.py      numbers + PNGs -> index.html
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from padfree.core.config import STRATEGIES, PlanConfig
from padfree.core.items import validate_lengths
from padfree.tools.report.decision import (
    BUCKET_COUNTS,
    GROWTHS,
    MIXES,
    Point,
    broken,
    build_report,
    limits,
    recommend,
)
from padfree.tools.report.figures import render_figures
from padfree.tools.report.html import render_html

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
    """The report's drafter section: ``setup`` (method, tokens, offline hidden-state cache size: what
    ``padfree.commands.simulate.drafter_setup`` returns) and, per strategy, the predicted throughput of the
    drafter setup (:func:`padfree.tools.simulate.simulate` with the drafter's anchors and cost model)."""
    from padfree.tools.simulate import simulate

    sim = simulate(lengths, config, STRATEGIES, seconds_per_unit, naive=False, path=path, anchors=anchors)
    keep = ("tokens_per_unit", "ratio_to_sorted", "padding_efficiency", "imbalance", "steps", "draft_blocks",
            "draft_block_efficiency", "tokens_per_second", "epoch_seconds")  # fmt: skip
    rows = {s: {k: r[k] for k in keep if k in r} for s, r in sim["strategies"].items()}
    return {**setup, "cost": sim["config"]["cost"], "anchor_budget": config.anchor_budget, "strategies": rows}


def write_report(
    out_dir: str | Path,
    lengths: np.ndarray,
    base: PlanConfig,
    *,
    t0: float | None = None,
    drafter: dict | None = None,
    **kwargs: object,
) -> dict:
    """Build the report and write ``out_dir/index.html`` and ``out_dir/report.json``; returns the numbers.
    ``drafter`` (:func:`drafter_numbers`) adds the drafter setup's section.

    ``numbers["seconds"]`` is the wall time from ``t0`` (default: this call) to the page being rendered,
    so a caller that passes the start of its run (reading the lengths included) reports the run's time.
    """
    t0 = time.perf_counter() if t0 is None else t0
    numbers, _ = build_report(lengths, base, **kwargs)  # type: ignore[arg-type]
    if drafter is not None:
        numbers["drafter"] = drafter
    lengths = validate_lengths(lengths, kwargs.get("path"), compact=True)  # type: ignore[arg-type]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = render_figures(lengths, numbers)
    numbers["seconds"] = round(time.perf_counter() - t0, 2)
    (out / "index.html").write_text(render_html(numbers, figures), encoding="utf-8")
    (out / "report.json").write_text(json.dumps(numbers, indent=2) + "\n", encoding="utf-8")
    return numbers
