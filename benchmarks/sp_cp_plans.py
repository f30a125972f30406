"""Padding and data-parallel rank imbalance of SP/CP plans (issue 35): SP 1/2/4/8 and CP 1/2/4 on seed_mix
and on a synthetic long tail (99.9% of samples under 1K tokens, a few of 32K-128K).

Each case plans one epoch (:func:`padfree.make_plan`, epoch 1) at a per-GPU budget of 16384 tokens (a row
holds ``sp x cp x 16384``), 8 data-parallel ranks x grad-accum 4, ``overlong="split"`` (documents over the
row are cut, as they must be without a larger group) and measures it with
:func:`padfree.core.metrics.plan_metrics`: padding efficiency (real tokens / computed slots, the SP/CP pads
included), the padding share, the fill of the group's row, the DP-rank imbalance of the modeled cost (the
padded work, default cost model) and the steps.

    PYTHONPATH=src python benchmarks/sp_cp_plans.py \\
        --lengths ../shared/data/lengths/seed_mix.mistral_v1.npy --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from padfree import PlanConfig, make_plan
from padfree.core import cost, steps
from padfree.core.metrics import plan_metrics
from padfree.core.plan import Plan

BUDGET = 16384
WORLD, ACCUM = 8, 4
SHARDS = [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (1, 4), (2, 2)]
STRATEGIES = ("packed", "bucketed")


def long_tail(n: int = 300_000, seed: int = 35) -> np.ndarray:
    """99.9% of samples lognormal under 1K tokens, 0.1% of 32K-128K (log-uniform)."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(5.3, 0.8, n).astype(np.int64) + 8, 1023)
    n_long = n // 1000
    where = rng.choice(n, n_long, replace=False)
    lengths[where] = np.exp(rng.uniform(np.log(32_768), np.log(131_072), n_long)).astype(np.int64)
    return lengths


def imbalance_floor(plan: Plan) -> float:
    """A lower bound on the imbalance of any assignment of each step's micro-batches to ranks (``grad_accum``
    each): with the step's micro-batch costs sorted down, ``c[0] >= c[1] >= ...``, some rank holds ``j + 1``
    of the ``j * world + 1`` costliest (pigeonhole), so the slowest rank costs at least ``(j + 1) *
    c[j * world] + (grad_accum - j - 1) * c[-1]``; the mean over steps of the largest such bound (or the
    mean) / the mean rank cost. Rows that hold one long document cost several short-document rows (their
    attention) and are indivisible: when a step holds more of them than there are ranks, no assignment
    evens it."""
    c = plan.config
    w, g = c.world_size, c.grad_accum
    costs = -np.sort(-plan.costs().reshape(plan.n_steps, w * g), axis=1)
    mean = costs.sum(axis=1) / w
    j = np.arange(g)
    bounds = (j + 1)[None, :] * costs[:, j * w] + (g - j - 1)[None, :] * costs[:, -1:]
    return float(np.mean(np.maximum(bounds.max(axis=1), mean) / mean))


def blind_imbalance(plan: Plan) -> float | None:
    """Packed: the DP-rank imbalance of the padded work had each step been given to ranks by the unpadded
    tokens (what a planner that ignores the SP/CP padding would do); ``None`` for padded strategies."""
    c = plan.config
    if not c.packed or not c.shard.active:
        return None
    blind = cost.micro_costs(cost.micro_shapes(plan.lengths, plan.offsets, True), c.cost)
    perm = steps.assign_ranks(blind, c.world_size, c.grad_accum)
    return cost.imbalance(cost.rank_costs(plan.costs()[perm], c.world_size, c.grad_accum))


def case(lengths: np.ndarray, strategy: str, sp: int, cp: int) -> dict:
    cfg = PlanConfig(
        strategy=strategy, budget=BUDGET, world_size=WORLD, grad_accum=ACCUM, overlong="split", seed=0,
        sp=sp, cp=cp,
    )  # fmt: skip
    t0 = time.perf_counter()
    plan = make_plan(lengths, cfg, 1)
    seconds = time.perf_counter() - t0
    m = plan_metrics(plan)
    return {
        "strategy": strategy,
        "sp": sp,
        "cp": cp,
        "row_tokens": cfg.shard.capacity(BUDGET),
        "padding_efficiency": m["padding_efficiency"],
        "padding_share": 1.0 - m["padding_efficiency"],
        "fill": m["fill"],
        "imbalance": m["imbalance"],
        "imbalance_floor": imbalance_floor(plan),
        "imbalance_padding_blind": blind_imbalance(plan),
        "compute_efficiency": m["compute_efficiency"],
        "steps": m["steps"],
        "split_samples": m["split"],
        "plan_seconds": seconds,
    }


def render(results: dict) -> str:
    lines = [
        "# SP/CP plans: padding and DP-rank imbalance",
        "",
        f"Per-GPU budget {BUDGET} tokens (a row holds sp x cp x {BUDGET}), {WORLD} data-parallel ranks x "
        f"grad-accum {ACCUM}, overlong split, epoch 1, default cost model. Padding efficiency counts the "
        "SP/CP pads (rows to a multiple of sp, packed documents to 2 x cp); imbalance: mean over steps of "
        "the most loaded DP rank's modeled (padded) cost / the mean; floor: a lower bound for any "
        "assignment of each step's micro-batches (pigeonhole over the costliest rows, `imbalance_floor`); "
        "padding-blind (packed): the steps given to ranks by unpadded tokens, measured on the padded work. "
        "`benchmarks/sp_cp_plans.py`.",
        "",
    ]
    for name, data in results["datasets"].items():
        lines += [
            f"## {name} ({data['samples']:,} samples, max {data['max']:,} tokens)",
            "",
            "| strategy | sp | cp | row tokens | padding eff. | padding share | fill | imbalance | floor | "
            "padding-blind | steps | split | plan s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in data["cases"]:
            blind = "-" if r["imbalance_padding_blind"] is None else f"{r['imbalance_padding_blind']:.4f}"
            lines.append(
                f"| {r['strategy']} | {r['sp']} | {r['cp']} | {r['row_tokens']:,} | "
                f"{r['padding_efficiency']:.5f} | {100 * r['padding_share']:.3f}% | {r['fill']:.4f} | "
                f"{r['imbalance']:.4f} | {r['imbalance_floor']:.4f} | {blind} | {r['steps']:,} | "
                f"{r['split_samples']:,} | {r['plan_seconds']:.2f} |"
            )
        lines.append("")
    lines += [
        "## Reading",
        "",
        "- Packed rows: SP alone pads only each row's tail (<= sp - 1 tokens of a 32K-131K row: "
        "0.001-0.002%); CP pads every document to 2 x cp (0.2% at CP 2, 0.5% at CP 4 on seed_mix; 0.4-1.0% "
        "on the long tail).",
        "- Bucketed rows: most of the drop with SP is the larger row (sp x budget tokens), not the width "
        "rounding: on seed_mix bucketed at a plain 131,072-token budget gives 0.96029, at SP 8 x 16,384 "
        "0.95593 (the plain-budget figure from a one-off make_plan at the same 8 x 4, split, epoch 1; "
        "not in this table).",
        "- DP-rank imbalance of packed plans stays within 0.006 of the floor: on the long tail, rows holding "
        "one 32K-128K document cost several rows of short ones (attention) and a step holds more of them "
        "than there are ranks, so no assignment evens it (raise grad-accum). Balancing by unpadded tokens "
        "(padding-blind) gives the same or worse: the pads are too few to move the assignment here.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--lengths", type=Path, default=Path("../shared/data/lengths/seed_mix.mistral_v1.npy"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    sets = {
        "seed_mix.mistral_v1": np.load(args.lengths).astype(np.int64),
        "long_tail (synthetic)": long_tail(),
    }
    results: dict = {"budget": BUDGET, "world_size": WORLD, "grad_accum": ACCUM, "datasets": {}}
    for name, lengths in sets.items():
        rows = []
        for strategy in STRATEGIES:
            for sp, cp in SHARDS:
                rows.append(case(lengths, strategy, sp, cp))
                print(name, rows[-1], flush=True)
        results["datasets"][name] = {
            "samples": int(lengths.shape[0]),
            "max": int(lengths.max()),
            "over_1k": float((lengths >= 1024).mean()),
            "cases": rows,
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sp_cp_plans.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "sp_cp_plans.md").write_text(render(results) + "\n")


if __name__ == "__main__":
    main()
