"""Predicted training throughput of each strategy at a cluster size, from the plan and the cost model.

Every rank runs its ``grad_accum`` micro-batches of a step, then all ranks wait for the slowest at the
gradient all-reduce: a step takes ``max over ranks of the summed micro-batch cost``. The epoch takes the
sum over steps; throughput is real tokens / epoch time. Costs are in token-equivalents; a cost file from
``padfree calibrate`` adds ``seconds_per_unit`` and turns them into seconds (otherwise only ratios and
tokens per cost unit are meaningful).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from padfree.core.config import CostModel, PlanConfig
from padfree.core.cost import imbalance, micro_costs, micro_shapes, rank_costs, step_costs
from padfree.core.plan import epoch_rng
from padfree.core.planner import make_plan

# The motivating case: measured on 8 GPUs, Ktok/s per strategy (sorted 32, bucketed 25.1, random 11.9).
MOTIVATING_KTOK_S = {"sorted": 32.0, "naive_bucketed": 25.1, "random": 11.9}


HELD_OUT_WARN = 0.25
"""A cost file whose held-out relative RMS error is above this makes ``simulate`` warn: strategies often
differ by 5-30% in predicted throughput, so a model off by more than a quarter on shapes it was not fitted
on cannot rank them reliably (a calibration on a quiet machine is within ~0.1)."""


def cost_warning(path: str | Path | None) -> str | None:
    """One line when the cost file records a held-out error above :data:`HELD_OUT_WARN`, else None."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    err = data.get("held_out_rel_rms")
    if err is None and isinstance(data.get("held_out"), dict):
        err = data["held_out"].get("rel_rms")
    if not isinstance(err, (int, float)) or err <= HELD_OUT_WARN:
        return None
    return (
        f"{path}: the cost model's held-out relative error is {err:.2f} (> {HELD_OUT_WARN}); predicted "
        "throughput may be off by that much: calibrate again with more --repeats, without --quick"
    )


def load_seconds_per_unit(path: str | Path | None) -> float | None:
    """``seconds_per_unit`` (or ``seconds_per_slot``) of a cost file, or None when absent."""
    if path is None:
        return None
    data = json.loads(Path(path).read_text())
    for key in ("seconds_per_unit", "seconds_per_slot"):
        v = data.get(key)
        if isinstance(v, (int, float)) and v > 0:
            return float(v)
    return None


def simulate_batches(
    lens: np.ndarray,
    offsets: np.ndarray,
    packed: bool,
    world_size: int,
    grad_accum: int,
    cost: CostModel,
    seconds_per_unit: float | None = None,
) -> dict:
    """Predicted time and throughput of micro-batches given in plan order (``lens`` in order, ``offsets``).

    >>> out = simulate_batches(np.array([10, 10, 20, 20]), np.array([0, 2, 4]), False, 2, 1,
    ...                        CostModel(a=1.0, b=0.0, c=0.0))
    >>> out["step_cost_total"], out["tokens_per_unit"]
    (40.0, 1.5)
    """
    shapes = micro_shapes(lens, offsets, packed)
    per_rank = rank_costs(micro_costs(shapes, cost), world_size, grad_accum)
    step = step_costs(per_rank)
    total = float(step.sum())
    tokens = float(shapes["real"].sum())
    out = {
        "tokens": tokens,
        "steps": int(step.shape[0]),
        "padding_efficiency": float(tokens / shapes["slots"].sum()),
        "imbalance": imbalance(per_rank),
        "step_cost_total": total,
        "tokens_per_unit": tokens / total,
    }
    if seconds_per_unit is not None:
        out["epoch_seconds"] = total * seconds_per_unit
        out["tokens_per_second"] = tokens / (total * seconds_per_unit)
        out["step_seconds_mean"] = total * seconds_per_unit / step.shape[0]
    return out


def simulate(
    lengths: np.ndarray,
    config: PlanConfig,
    strategies: tuple[str, ...] = ("sorted", "random", "bucketed", "packed"),
    seconds_per_unit: float | None = None,
    naive: bool = True,
    epoch: int = 0,
    path: str | None = None,
) -> dict:
    """Plan one epoch per strategy (``config`` gives budget, world size, grad accum and cost model) and
    predict each one's throughput; ``naive`` adds the motivating case's naive bucketing
    (:func:`padfree.bench.baselines.naive_bucketed`). Ratios are to ``sorted`` (the padding-free ceiling of
    length grouping) when it is among the strategies."""
    rows: dict[str, dict] = {}
    for s in strategies:
        plan = make_plan(lengths, config.with_(strategy=s), epoch, path=path)
        rows[s] = simulate_batches(
            plan.lengths,
            plan.offsets,
            plan.config.packed,
            config.world_size,
            config.grad_accum,
            config.cost,
            seconds_per_unit,
        )
    if naive:
        from padfree.bench.baselines import naive_bucketed
        from padfree.core.items import make_items, validate_lengths

        items = make_items(validate_lengths(lengths, path), config.budget, config.overlong, path)
        rng = epoch_rng(config.seed, epoch, "bucketed")
        order, offsets = naive_bucketed(
            items.length, config.budget, rng, config.growth, config.micro_per_step
        )
        rows["naive_bucketed"] = simulate_batches(
            items.length[order],
            offsets,
            False,
            config.world_size,
            config.grad_accum,
            config.cost,
            seconds_per_unit,
        )
    if "sorted" in rows:
        ref = rows["sorted"]["tokens_per_unit"]
        for r in rows.values():
            r["ratio_to_sorted"] = r["tokens_per_unit"] / ref
    return {
        "config": {
            "gpus": config.world_size,
            "grad_accum": config.grad_accum,
            "budget": config.budget,
            "seed": config.seed,
            "cost": {
                "a": config.cost.a,
                "b": config.cost.b,
                "c": config.cost.c,
                "source": config.cost.source,
            },
            "seconds_per_unit": seconds_per_unit,
        },
        "strategies": rows,
    }


def motivating_ratios() -> dict[str, float]:
    """The motivating case's measured throughput ratios to sorted: random 0.37, naive bucketed 0.78."""
    ref = MOTIVATING_KTOK_S["sorted"]
    return {k: v / ref for k, v in MOTIVATING_KTOK_S.items()}
