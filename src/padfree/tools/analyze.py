"""``padfree analyze``: every strategy planned on the same lengths and measured side by side."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from padfree.core.config import PlanConfig
from padfree.core.items import validate_lengths
from padfree.core.metrics import cobatch_repeat, dataset_summary, plan_metrics
from padfree.core.plan import Plan
from padfree.core.planner import make_plan

ROWS = [
    ("padding_efficiency", "padding efficiency", "{:.4f}"),
    ("fill", "budget fill", "{:.4f}"),
    ("compute_efficiency", "compute efficiency", "{:.4f}"),
    ("imbalance", "rank imbalance (max/mean)", "{:.4f}"),
    ("step_divergence", "step divergence (W1/mean)", "{:.4f}"),
    ("cobatch_repeat", "co-batch repeat e->e+1", "{:.4f}"),
    ("adjacent_corr", "adjacent-step corr", "{:+.3f}"),
    ("steps", "steps", "{:,}"),
    ("micro_batches", "micro-batches", "{:,}"),
    ("tokens_per_step_min", "tokens/step min", "{:,.0f}"),
    ("tokens_per_step_median", "tokens/step median", "{:,.0f}"),
    ("tokens_per_step_max", "tokens/step max", "{:,.0f}"),
    ("plan_seconds", "plan seconds (1 epoch)", "{:.3f}"),
]


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
                out["strategies"][name] = measure(lengths, cfg, path, on_window)[0]
                bar.advance(task)
    else:
        for name, cfg in configs.items():
            out["strategies"][name] = measure(lengths, cfg, path)[0]
    return out


def measure(
    lengths: np.ndarray,
    cfg: PlanConfig,
    path: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict, Plan]:
    """Plan epochs 0 and 1 and measure epoch 1: every :func:`~padfree.core.metrics.plan_metrics` metric,
    ``cobatch_repeat`` from epoch 0 to epoch 1. Returns the metrics and epoch 1's plan. ``padfree analyze``
    and ``padfree report`` measure plans with this one function."""
    p0 = make_plan(lengths, cfg, 0, path=path, progress=progress)
    p1 = make_plan(lengths, cfg, 1, path=path, progress=progress)
    return plan_metrics(p1) | {"cobatch_repeat": cobatch_repeat(p0, p1)}, p1


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
    for key, label, fmt in ROWS:
        cells = []
        for n in names:
            v = result["strategies"][n].get(key)
            cells.append("-" if v is None else fmt.format(v))
        table.add_row(label, *cells)
    Console().print(table)
