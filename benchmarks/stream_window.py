"""Streams planned in a bounded window (issue 43, item 3): padding efficiency and rank imbalance of
:func:`padfree.core.lookahead.window_steps` on seed_mix read as a stream, for windows of 1, 2, 4 and 8 steps.

seed_mix (cl100k, 902K samples, capped at the budget) is read in its file order and in a shuffled order,
first ``--samples`` samples; 8 ranks x 4 micro-batches, budget 16384, packed and bucketed, the default cost
model. Fill: real tokens over the micro-batches' budgets (more steps for the same tokens when the window is
small). Imbalance: a step's most loaded rank over its mean (mean and p99 over steps). The in-memory plan of
the same samples is the reference. Peers (grain's first-fit packer, a lookahead buffer, lhotse) are not run
here: grain is not installed in this environment.

    PYTHONPATH=src python benchmarks/stream_window.py --lengths ../shared/data/lengths
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from padfree.core import cost
from padfree.core.config import DEFAULT_COST, PlanConfig
from padfree.core.lookahead import ArrayLengths, window_for_steps, window_steps
from padfree.core.planner import make_plan


def numbers(micro_lengths: list[np.ndarray], config: PlanConfig) -> dict:
    k = config.micro_per_step
    offsets = np.concatenate(([0], np.cumsum([m.shape[0] for m in micro_lengths])))
    lens = np.concatenate(micro_lengths)
    shapes = cost.micro_shapes(lens, offsets, config.packed)
    ranks = cost.rank_costs(cost.micro_costs(shapes, DEFAULT_COST), config.world_size, config.grad_accum)
    ratio = ranks.max(axis=1) / ranks.mean(axis=1)
    return {
        "steps": len(micro_lengths) // k,
        "padding_efficiency": round(float(shapes.real.sum() / shapes.slots.sum()), 4),
        "fill": round(float(shapes.real.sum() / (len(micro_lengths) * config.budget)), 4),
        "imbalance_mean": round(float(ratio.mean()), 4),
        "imbalance_p99": round(float(np.quantile(ratio, 0.99)), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--lengths", type=Path, default=Path("../shared/data/lengths"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--samples", type=int, default=200_000)
    args = ap.parse_args()
    budget = 16384
    seed = np.minimum(np.load(args.lengths / "seed_mix.cl100k.npy").astype(np.int64), budget)
    shuffled = np.random.default_rng(0).permutation(seed.shape[0])[: args.samples]
    orders = {"file_order": seed[: args.samples], "shuffled": seed[shuffled]}
    rows = []
    for order, lens in orders.items():
        for strategy in ("packed", "bucketed"):
            cfg = PlanConfig(strategy=strategy, budget=budget, world_size=8, grad_accum=4, seed=0)
            ref = make_plan(lens, cfg)
            m = numbers(np.split(ref.lengths, ref.offsets[1:-1]), cfg)
            rows.append({"order": order, "strategy": strategy, "window_steps": "all (in memory)", **m})
            print(json.dumps(rows[-1]))
            for w in (1, 2, 4, 8):
                window = window_for_steps(w, cfg, float(lens.mean()))
                t0 = time.perf_counter()
                steps = list(window_steps(ArrayLengths(lens), cfg, window))
                dt = time.perf_counter() - t0
                m = numbers([ln for s in steps for ln in s.lengths], cfg)
                rows.append({"order": order, "strategy": strategy, "window_steps": w, "window": window, **m,
                             "seconds": round(dt, 2)})  # fmt: skip
                print(json.dumps(rows[-1]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stream_window.json").write_text(json.dumps(rows, indent=1) + "\n")
    cols = ["window_steps", "window", "steps", "padding_efficiency", "fill", "imbalance_mean"]
    cols += ["imbalance_p99", "seconds"]
    lines = [
        "# Streams planned in a bounded window (seed_mix as a stream)",
        "",
        f"`PYTHONPATH=src python benchmarks/stream_window.py` (first {args.samples:,} samples, budget 16384, "
        "8 ranks x 4; a window of w steps holds w steps' worth of samples at the mean length).",
        "",
        "| order | strategy | " + " | ".join(cols) + " |",
        "|---|---|" + "---:|" * len(cols),
    ]
    for r in rows:
        cells = " | ".join(str(r.get(c, "-")) for c in cols)
        lines.append(f"| {r['order']} | {r['strategy']} | {cells} |")
    (args.out / "stream_window.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
