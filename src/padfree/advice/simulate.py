"""Predicted training throughput of each strategy at a cluster size, from the plan and the cost model.

Every rank runs its ``grad_accum`` micro-batches of a step, then all ranks wait for the slowest at the
gradient all-reduce: a step takes ``max over ranks of the summed micro-batch cost``. The epoch takes the
sum over steps; throughput is real tokens / epoch time. Costs are in token-equivalents; a cost file from
``padfree calibrate`` adds ``seconds_per_unit`` and turns them into seconds (otherwise only ratios and
tokens per cost unit are meaningful).

Ranks of different speeds (``speeds``: each rank's time factor, 1.5 = that rank takes 1.5x as long) and a
cost the plan does not know (``true_cost``: what micro-batches really cost; the plan balances by
``config.cost``): a step then costs ``max over ranks of (true cost of the rank's micro-batches x its
factor)``. *Static* is the plan's own assignment; *dynamic* is what ``PlanBatchSampler(balance="dynamic")``
converges to once its refit has found the true cost and the speeds: every step given to ranks by
:func:`padfree.core.balance.step_layout` with them (packed steps re-cut, from a plan that fills its bins to
the sampler's default headroom).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from padfree.core.config import MAX_COST, STRATEGIES, CostModel, PlanConfig, read_cost_file
from padfree.core.cost import imbalance, micro_costs, micro_shapes, rank_costs, step_costs
from padfree.core.plan import epoch_rng
from padfree.core.planner import make_plan
from padfree.core.refit import SPEED_RATIO
from padfree.drafter.memory import MemoryModel
from padfree.errors import ConfigError

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
        data = read_cost_file(path)
    except ConfigError:  # load_seconds_per_unit says what is wrong with it
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
    """``seconds_per_unit`` (or ``seconds_per_slot``) of a cost file, or None when absent; a value that is
    not a number in ``(0, 1e30]`` is a :class:`ConfigError`."""
    if path is None:
        return None
    data = read_cost_file(path)
    for key in ("seconds_per_unit", "seconds_per_slot"):
        v = data.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= MAX_COST:
            raise ConfigError(f"{path}: {key} must be a number > 0 and <= {MAX_COST:g} (got {v!r})")
        return float(v)
    return None


SPEED_FACTORS = (1e-3, 1e3)
"""The range of each ``--speeds`` factor (and the slowest at most :data:`padfree.core.refit.SPEED_RATIO` times
the fastest): step costs stay finite and within what dynamic balancing can learn."""


def parse_speeds(text: str, world_size: int | None = None) -> np.ndarray:
    """Per-rank time factors from ``"1,1,1.5"`` (each in :data:`SPEED_FACTORS`, the slowest at most 400x the
    fastest; as many as ``world_size`` when given).

    >>> parse_speeds("1,1,1.5").tolist()
    [1.0, 1.0, 1.5]
    """
    try:
        out = np.array([float(x) for x in text.split(",")], dtype=np.float64)
    except ValueError:
        raise ConfigError(f"--speeds takes comma-separated numbers, one per rank (got {text!r})") from None
    lo, hi = SPEED_FACTORS
    if out.size == 0 or not np.all(np.isfinite(out) & (out >= lo) & (out <= hi)):
        raise ConfigError(f"--speeds: every factor must be a number from {lo:g} to {hi:g} (got {text!r:.80})")
    if out.max() > SPEED_RATIO * out.min():
        raise ConfigError(
            f"--speeds: the slowest rank is {out.max() / out.min():.4g}x the fastest; at most "
            f"{SPEED_RATIO:g}x (the range dynamic balancing fits)"
        )
    if world_size is not None and out.size != world_size:
        raise ConfigError(f"--speeds gives {out.size} ranks but the world size is {world_size}")
    return out


def simulate_batches(
    lens: np.ndarray,
    offsets: np.ndarray,
    packed: bool,
    world_size: int,
    grad_accum: int,
    cost: CostModel,
    seconds_per_unit: float | None = None,
    speeds: np.ndarray | None = None,
    anchors: np.ndarray | None = None,
    memory: MemoryModel | None = None,
) -> dict:
    """Predicted time and throughput of micro-batches given in plan order (``lens`` in order, ``offsets``;
    a drafter plan's ``anchors`` in the same order add its blocks to the costs and ``draft_blocks``; a drafter
    ``memory`` model adds ``peak_bytes``, the heaviest micro-batch's activations, and ``peak_parts``, what
    holds them: :meth:`~padfree.drafter.memory.MemoryModel.parts_of`).

    >>> out = simulate_batches(np.array([10, 10, 20, 20]), np.array([0, 2, 4]), False, 2, 1,
    ...                        CostModel(a=1.0, b=0.0, c=0.0))
    >>> out["step_cost_total"], out["tokens_per_unit"]
    (40.0, 1.5)
    """
    shapes = micro_shapes(lens, offsets, packed, anchors)  # a re-cut step may leave a micro-batch empty
    per_rank = rank_costs(micro_costs(shapes, cost), world_size, grad_accum)
    if speeds is not None:
        per_rank = per_rank * speeds[None, :]
    step = step_costs(per_rank)
    total = float(step.sum())
    tokens = float(shapes.real.sum())
    out: dict[str, Any] = {
        "tokens": tokens,
        "steps": int(step.shape[0]),
        "padding_efficiency": float(tokens / shapes.slots.sum()),
        "imbalance": imbalance(per_rank),
        "step_cost_total": total,
        "tokens_per_unit": tokens / total,
    }
    if shapes.anchors is not None and shapes.blocks is not None:
        out["draft_blocks"] = float(shapes.anchors.sum())
        out["draft_block_efficiency"] = float(shapes.anchors.sum() / max(float(shapes.blocks.sum()), 1.0))
    if memory is not None:
        peaks = memory.micro_bytes(shapes)
        out["peak_bytes"] = float(peaks.max())
        out["peak_parts"] = memory.parts_of(shapes, int(np.argmax(peaks)))
    if seconds_per_unit is not None:
        out["epoch_seconds"] = total * seconds_per_unit
        out["tokens_per_second"] = tokens / (total * seconds_per_unit)
        out["step_seconds_mean"] = total * seconds_per_unit / step.shape[0]
    return out


def simulate_dynamic(
    lengths: np.ndarray,
    config: PlanConfig,
    speeds: np.ndarray,
    true_cost: CostModel,
    seconds_per_unit: float | None = None,
    epoch: int = 0,
    path: str | None = None,
) -> dict:
    """Predicted throughput under dynamic balancing that has learned ``true_cost`` and the ranks' time
    factors ``speeds``: the sampler's plan (packed: bins filled to its default headroom), each step given
    to ranks by :func:`padfree.core.balance.step_layout` (speed-aware assignment; packed steps re-cut
    within the budget).

    >>> cfg = PlanConfig(strategy="packed", budget=100, world_size=2, grad_accum=1,
    ...                  cost=CostModel(1.0, 0.0, 0.0))
    >>> slow = np.array([1.0, 1.5])
    >>> row = simulate(np.ones(1700), cfg, ("packed",), naive=False, speeds=slow)["strategies"]["packed"]
    >>> round(row["dynamic_over_static"], 3)  # 1.25 needs the fast rank at 1.2x the mean bin; room: 1.18x
    1.214
    """
    from padfree.core.balance import Balance, default_headroom, dynamic_budget, step_layout
    from padfree.core.items import make_items, validate_lengths
    from padfree.core.replay import Segment, replay

    w, g = config.world_size, config.grad_accum
    items = make_items(validate_lengths(lengths, path), config.budget, config.overlong, path)
    budget = dynamic_budget(config, headroom=default_headroom(w))  # the sampler's own plan: unassigned steps
    plan, _ = replay(items, config, epoch, [Segment(w, g, 0, budget)])
    rel = 1.0 / speeds
    balance = Balance(true_cost.coefficients, tuple(rel / rel.mean()), fitted=True, recut=True)
    k = w * g
    lens, offs = plan.lengths, plan.offsets.astype(np.int64)
    out_lens, out_offs = [], [np.zeros(1, dtype=np.int64)]
    for s in range(plan.n_steps):
        a0, a1 = int(offs[s * k]), int(offs[(s + 1) * k])
        order, step_offs = step_layout(lens[a0:a1], offs[s * k : (s + 1) * k + 1] - a0, config, balance)
        out_lens.append(lens[a0:a1][order])
        out_offs.append(step_offs[1:] + a0)
    new_lens = np.concatenate(out_lens) if out_lens else lens[:0]
    return simulate_batches(
        new_lens, np.concatenate(out_offs), config.packed, w, g, true_cost, seconds_per_unit, speeds
    )


def simulate(
    lengths: np.ndarray,
    config: PlanConfig,
    strategies: tuple[str, ...] = STRATEGIES,
    seconds_per_unit: float | None = None,
    naive: bool = True,
    epoch: int = 0,
    path: str | None = None,
    speeds: np.ndarray | None = None,
    true_cost: CostModel | None = None,
    anchors: np.ndarray | None = None,
    memory: MemoryModel | None = None,
) -> dict:
    """Plan one epoch per strategy (``config`` gives budget, world size, grad accum and cost model) and
    predict each one's throughput; ``naive`` adds the motivating case's naive bucketing
    (:func:`padfree.baselines.naive_bucketed`). Ratios are to ``sorted`` (the padding-free ceiling of
    length grouping) when it is among the strategies. With ``speeds`` (per-rank time factors) or
    ``true_cost`` (what micro-batches really cost, default ``config.cost``), every strategy's row is its
    static plan under them, and ``dynamic`` / ``dynamic_over_static`` what dynamic balancing predicts.
    ``anchors`` (a drafter setup's draft blocks per sample) go to every plan (``config.anchor_budget``) and
    to the costs (the drafter terms of ``config.cost``); dynamic balancing is then not simulated."""
    if anchors is not None and (speeds is not None or true_cost is not None):
        raise ConfigError("a drafter setup (anchors) is simulated with equal ranks and the plan's own cost")
    rows: dict[str, dict] = {}
    cost = true_cost or config.cost
    dynamic = speeds is not None or true_cost is not None
    factors = np.ones(config.world_size) if speeds is None else np.asarray(speeds, dtype=np.float64)
    for s in strategies:
        plan = make_plan(lengths, config.with_(strategy=s), epoch, path=path, anchors=anchors)
        rows[s] = simulate_batches(
            plan.lengths,
            plan.offsets,
            plan.config.packed,
            config.world_size,
            config.grad_accum,
            cost,
            seconds_per_unit,
            factors if dynamic else None,
            plan.anchors,
            memory,
        )
        if dynamic:
            dyn = simulate_dynamic(
                lengths, config.with_(strategy=s), factors, cost, seconds_per_unit, epoch, path
            )
            rows[s]["dynamic"] = dyn
            rows[s]["dynamic_over_static"] = (
                rows[s]["step_cost_total"] / dyn["step_cost_total"] * (dyn["tokens"] / rows[s]["tokens"])
            )
    if naive:
        from padfree.baselines import naive_bucketed
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
            cost,
            seconds_per_unit,
            factors if dynamic else None,
            None if anchors is None else np.asarray(anchors)[items.sample_ids()[order]],
            memory,
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
                "d": config.cost.d,
                "e": config.cost.e,
                "source": config.cost.source,
            },
            "anchor_budget": config.anchor_budget,
            "seconds_per_unit": seconds_per_unit,
            "speeds": None if speeds is None else factors.tolist(),
            "true_cost": None if true_cost is None else {"a": cost.a, "b": cost.b, "c": cost.c},
        },
        "strategies": rows,
    }


def motivating_ratios() -> dict[str, float]:
    """The motivating case's measured throughput ratios to sorted: random 0.37, naive bucketed 0.78."""
    ref = MOTIVATING_KTOK_S["sorted"]
    return {k: v / ref for k, v in MOTIVATING_KTOK_S.items()}
