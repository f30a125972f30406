"""``padfree analyze``: every strategy planned on the same lengths and measured side by side."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np

from padfree.advice.labels import pick
from padfree.core.config import PlanConfig
from padfree.core.items import validate_lengths
from padfree.core.metrics import CoBatchMap, EpochMeter, dataset_summary, item_counts
from padfree.core.mixing import SHORT_EPOCH_STEPS
from padfree.core.plan import Plan
from padfree.core.planner import plan_pieces

ROWS = pick(
    "padding_efficiency",
    "fill",
    "compute_efficiency",
    "imbalance",
    "step_divergence",
    "cobatch_repeat",
    "adjacent_corr",
    "steps",
    "micro_batches",
    "tokens_per_step_min",
    "tokens_per_step_median",
    "tokens_per_step_max",
    "plan_seconds",
)
"""The terminal table's rows."""

LONG_ROWS = pick("truncated", "split", "chunked")
"""Rows the table adds when a chunked plan is compared: what each strategy did to the long samples."""


def analyze_strategies(
    lengths: np.ndarray, configs: dict[str, PlanConfig], path: str | None = None, progress: bool = False
) -> dict:
    """Plan epochs 0 and 1 with each config and measure them.

    Returns ``{"dataset": {...}, "strategies": {name: metrics}}``; ``plan_seconds`` is epoch 1's (warm)
    planning time, ``cobatch_repeat`` compares epoch 0 with epoch 1.
    """
    lengths = validate_lengths(lengths, path, compact=True)  # int32 stays int32: huge inputs plan in windows
    out: dict = {"dataset": dataset_summary(lengths), "strategies": {}}
    if configs:
        first = next(iter(configs.values()))
        out["config"] = {
            "budget": first.budget,
            "world_size": first.world_size,
            "grad_accum": first.grad_accum,
            "seed": first.seed,
            **({"sp": first.sp, "cp": first.cp} if first.shard.active else {}),
            "cost": {"a": first.cost.a, "b": first.cost.b, "c": first.cost.c, "source": first.cost.source},
        }
    if progress:
        from rich.console import Console
        from rich.progress import Progress

        with Progress(transient=True, console=Console(stderr=True)) as bar:
            task = bar.add_task("planning", total=len(configs))
            windows = None

            def on_window(done: int, total: int) -> None:  # stream plans: per-window progress
                nonlocal windows
                if windows is None:
                    windows = bar.add_task("windows", total=2 * total)
                bar.advance(windows)

            for name, cfg in configs.items():
                bar.update(task, description=f"planning {name}")
                if windows is not None:
                    bar.reset(windows)
                out["strategies"][name] = measure(lengths, cfg, path, on_window)
                bar.advance(task)
    else:
        for name, cfg in configs.items():
            out["strategies"][name] = measure(lengths, cfg, path)
    return out


def measure(
    lengths: np.ndarray,
    cfg: PlanConfig,
    path: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Plan epochs 0 and 1 and measure epoch 1: every :func:`~padfree.core.metrics.plan_metrics` metric,
    ``cobatch_repeat`` from epoch 0 to epoch 1. ``padfree analyze`` and ``padfree report`` measure plans
    with this one function.

    Window by window: epoch 0 leaves only each item's micro-batch (:class:`~padfree.core.metrics.CoBatchMap`,
    4 bytes an item), epoch 1 is measured as it is planned (:class:`~padfree.core.metrics.EpochMeter`), so
    memory stays that of planning one epoch plus 4 bytes a sample. ``plan_seconds`` is epoch 1's planning
    time (warm: epoch 0 compiled and cached what it needed).
    """
    previous = None
    for piece in plan_pieces(lengths, cfg, 0, path=path, progress=progress):
        if previous is None:  # after the first piece: the lengths passed every check
            previous = CoBatchMap.for_lengths(lengths, cfg)
        previous.record(piece)
    meter = EpochMeter(cfg, item_counts(lengths, cfg), previous)
    planning = 0.0

    def timed() -> Iterator[Plan]:  # epoch 1's pieces, timing only their planning
        nonlocal planning
        pieces = plan_pieces(lengths, cfg, 1, path=path, progress=progress)
        while True:
            t = time.perf_counter()
            piece = next(pieces, None)
            planning += time.perf_counter() - t
            if piece is None:
                return
            yield piece

    out = meter.measure(timed())
    out["plan_seconds"] = planning
    return out


MIN_STEPS = SHORT_EPOCH_STEPS
"""Below this many steps an epoch is short: epoch-to-epoch and step-to-step statistics are noisy and
bucketed must trade padding for fresh partners (see :func:`short_epoch`)."""


def short_epoch(result: dict) -> str | None:
    """One sentence when the epoch is short (fewer than :data:`MIN_STEPS` steps for some strategy) that says
    what to change; None otherwise.

    The fix is fewer tokens per step: grad-accum first, then the budget (not below the longest sample,
    rounded up to 256). Steps are estimated as ``tokens / (world * grad_accum * budget * fill)`` with the
    strategy's measured fill.
    """
    strategies, c, d = result.get("strategies", {}), result.get("config"), result.get("dataset")
    if not strategies or not c or not d:
        return None
    name, fewest = min(((n, int(m["steps"])) for n, m in strategies.items()), key=lambda t: t[1])
    if fewest >= MIN_STEPS:
        return None
    budget, world, accum = int(c["budget"]), int(c["world_size"]), int(c["grad_accum"])
    per_budget = d["tokens"] / (world * max(strategies[name]["fill"], 1e-9))  # steps x accum x budget

    def steps(a: int, b: int) -> float:
        return per_budget / (a * b)

    new_accum = max(1, min(accum, int(per_budget / (MIN_STEPS * budget))))
    new_budget = budget
    if steps(new_accum, budget) < MIN_STEPS:
        floor = -(-min(budget, max(256, int(d["max"]))) // 256) * 256
        new_budget = max(floor, min(budget, int(per_budget / MIN_STEPS) // 256 * 256))
    opts = ([f"--grad-accum {new_accum}"] if new_accum != accum else []) + (
        [f"--budget {new_budget}"] if new_budget != budget else []
    )
    s = "s" if fewest != 1 else ""
    head = (
        f"short epoch: {fewest} step{s} ({name}: {world} ranks x {accum} micro-batches x {budget:,} tokens); "
        f"below {MIN_STEPS} steps the epoch-to-epoch numbers are noisy and bucketed trades padding for fresh "
        "partners"
    )
    after = steps(new_accum, new_budget)
    if not opts:
        return head + f"; no smaller step fits: the data is small for {world} ranks"
    if after < MIN_STEPS:
        small = f"the data is small for {world} ranks"
        return head + f"; even {' '.join(opts)} gives only ~{after:.0f} steps: {small}"
    return head + f"; {' '.join(opts)} gives ~{after:.0f} steps"


def render_table(result: dict) -> None:
    """Print the comparison as a rich table, strategies as columns."""
    from rich.console import Console
    from rich.table import Table

    d = result["dataset"]
    c = result.get("config", {})
    title = (
        f"{d.get('name', 'lengths')}: {d['samples']:,} samples, {d['tokens']:,} tokens, "
        f"p50 {d['p50']:.0f} / p99 {d['p99']:.0f} / max {d['max']:,}"
    )
    caption = (
        f"budget {c.get('budget')} tokens, world {c.get('world_size')} x grad-accum {c.get('grad_accum')}, "
        f"seed {c.get('seed')}"
    )
    table = Table(title=title, caption=caption)
    table.add_column("metric")
    names = list(result["strategies"])
    for n in names:
        table.add_column(n, justify="right")
    rows = ROWS
    if any("chunked" in m for m in result["strategies"].values()):  # what became of the long samples
        rows = ROWS + LONG_ROWS
    for m in rows:
        table.add_row(m.label, *(m.show(result["strategies"][n].get(m.key)) for n in names))
    Console().print(table)
