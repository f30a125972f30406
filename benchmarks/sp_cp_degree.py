"""Modeled gain of a per-micro-batch SP/CP degree (issue 35 item 5, verl's dynamic CP) over the fixed full
degree, on seed_mix and a synthetic 128K long tail, at groups of G = 2, 4, 8 GPUs (SP or CP).

Each case plans epoch 1 both ways at the same per-GPU budget, 8 data-parallel ranks x grad-accum 4,
``overlong="split"``, default cost model: the fixed plan (:func:`padfree.make_plan`, every row over the
group) and :func:`lab.degree.plan_degrees` (documents over the per-GPU budget at degree G, the
rest in degree-1 rows, one per GPU). Both are costed per GPU by :mod:`lab.degree`: a row at degree
``d`` costs ``(a*slots + b*attention) / d + c + s*slots/d`` (``d > 1``), a degree-1 phase its costliest
row; an epoch costs the sum over steps of its slowest DP rank. ``s`` (token-equivalents per token a GPU
holds) is the one communication term, swept; the gain is fixed epoch cost / per-micro-batch epoch cost.

    PYTHONPATH=src python benchmarks/sp_cp_degree.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from lab.degree import GroupPlan, epoch_cost, fixed_costs, plan_degrees, row_costs
from padfree import PlanConfig, make_plan
from padfree.core import cost
from padfree.data.length_files import bundled_seed_mix

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sp_cp_plans import long_tail  # noqa: E402  (the same synthetic long tail as the SP/CP plan benchmark)

WORLD, ACCUM = 8, 4
GROUPS = (2, 4, 8)
COMM = (0.0, 0.05, 0.1, 0.25, 0.5)
NO_FILL_COMM = 0.1
SETS = {  # name: (per-GPU budget)
    "seed_mix (bundled, cl100k)": 4096,
    "long_tail (synthetic, 128K)": 16384,
}


def imbalance(costs: np.ndarray) -> float:
    return cost.imbalance(cost.rank_costs(costs, WORLD, ACCUM))


def degree_stats(gp: GroupPlan) -> dict:
    """Share of tokens at degree G, phases, idle rows and the GPUs' wait inside degree-1 phases."""
    row_deg = gp.row_degrees()
    tokens = np.add.reduceat(gp.lengths.astype(np.float64), gp.row_offsets[:-1]) if gp.lengths.size else []
    tokens = np.where(np.diff(gp.row_offsets) > 0, tokens, 0.0)
    per_row = _row_costs(gp)
    one = gp.degree == 1
    phase_max = np.repeat(np.maximum.reduceat(per_row, gp.first_row[:-1]), np.diff(gp.first_row))
    in_one = row_deg == 1
    wait = float((phase_max - per_row)[in_one].sum() / max(phase_max[in_one].sum(), 1e-12))
    return {
        "phases": gp.n_phases,
        "steps": gp.n_steps,
        "phases_degree_g": int((~one).sum()),
        "token_share_degree_g": float(tokens[row_deg > 1].sum() / tokens.sum()),
        "idle_rows": int((np.diff(gp.row_offsets) == 0).sum()),
        "degree1_wait": wait,
    }


def _row_costs(gp: GroupPlan) -> np.ndarray:
    return row_costs(gp.lengths, gp.row_offsets, gp.row_degrees(), gp.config, gp.comm)


def case(lengths: np.ndarray, budget: int, sp: int, cp: int) -> dict:
    cfg = PlanConfig(
        strategy="packed", budget=budget, world_size=WORLD, grad_accum=ACCUM, overlong="split", seed=0,
        sp=sp, cp=cp,
    )  # fmt: skip
    t0 = time.perf_counter()
    fixed = make_plan(lengths, cfg, 1)
    fixed_s = time.perf_counter() - t0
    out: dict = {"sp": sp, "cp": cp, "group": sp * cp, "budget": budget, "fixed_steps": fixed.n_steps}
    gains, imb = {}, {}
    for s in COMM:
        t0 = time.perf_counter()
        gp = plan_degrees(lengths, cfg, 1, comm=s)
        seconds = time.perf_counter() - t0
        f_cost, d_cost = fixed_costs(fixed, s), gp.costs()
        gains[str(s)] = epoch_cost(f_cost, WORLD, ACCUM) / epoch_cost(d_cost, WORLD, ACCUM)
        imb[str(s)] = {"fixed": imbalance(f_cost), "per_batch": imbalance(d_cost)}
        if s == NO_FILL_COMM:
            out.update(degree_stats(gp))
            out["plan_seconds"] = {"fixed": fixed_s, "per_batch": seconds}
    alone = plan_degrees(lengths, cfg, 1, comm=NO_FILL_COMM, fill=False)
    a_cost = alone.costs()
    out["gain"] = gains
    out["imbalance"] = imb
    out["no_fill"] = {
        "comm": NO_FILL_COMM,
        "gain": epoch_cost(fixed_costs(fixed, NO_FILL_COMM), WORLD, ACCUM) / epoch_cost(a_cost, WORLD, ACCUM),
        "imbalance": imbalance(a_cost),
        **degree_stats(alone),
    }
    return out


def render(results: dict) -> str:
    comm_cols = " | ".join(f"gain s={s}" for s in COMM)
    lines = [
        "# Per-micro-batch SP/CP degree: modeled gain over the fixed full degree",
        "",
        f"{WORLD} data-parallel ranks x grad-accum {ACCUM}, each rank a group of G = sp x cp GPUs, overlong "
        "split, epoch 1, default cost model (`CostModel.from_shape()`, h4096 l32). Fixed: every micro-batch "
        "one row of up to G x budget tokens over the group (`make_plan`). Per-batch: documents over the "
        "per-GPU budget in degree-G rows (short documents fill their room), the rest in degree-1 rows, G "
        "of them a phase, GPU g running the g-th (`lab.degree.plan_degrees`). Cost per GPU of a "
        "degree-d row: (a x slots + b x attention) / d + c + s x slots / d for d > 1 (slots, attention of "
        "the row padded for SP/CP; attention per document); a degree-1 phase costs its costliest row; an "
        "epoch the sum over steps of the slowest DP rank. Gain = fixed / per-batch epoch cost. "
        "`benchmarks/sp_cp_degree.py`.",
        "",
        "`s` is the communication a sharded row adds per token a GPU holds, in token-equivalents (one "
        "token's forward + backward = 1). Ulysses, not overlapped: 8 all-to-alls per layer (4 forward, 4 "
        "backward) of 2h bytes per token, (G-1)/G of it leaving the GPU, against 72 h^2 FLOPs per token "
        "per layer: s = (2/9)(G-1)/G x F / (BW x h). At F = 400 TFLOP/s reached, h = 4096: NVLink "
        "(~300 GB/s per GPU) s ~ 0.07 (G-1)/G; across nodes (50 GB/s per GPU) s ~ 0.43 (G-1)/G. Ring CP "
        "overlaps its key/value passes with attention, which short documents cannot hide: its s is larger "
        "for short rows than for long ones (not modeled apart). s = 0 isolates what the schedule alone "
        "does (CP padding saved, the degree-1 phases' wait, DP balance).",
        "",
    ]
    for name, data in results["datasets"].items():
        lines += [
            f"## {name}: {data['samples']:,} samples, max {data['max']:,} tokens, per-GPU budget "
            f"{data['budget']:,} ({100 * data['token_share_over_budget']:.1f}% of tokens in documents over "
            "it)",
            "",
            f"| sp | cp | G | {comm_cols} | tokens at G | phases at G / all | idle rows | degree-1 wait | "
            f"imbalance fixed / per-batch (s={NO_FILL_COMM}) | no fill: gain, imbalance, tokens at G |",
            "|---|---|---|" + "---|" * len(COMM) + "---|---|---|---|---|---|",
        ]
        for r in data["cases"]:
            g = " | ".join(f"{r['gain'][str(s)]:.4f}" for s in COMM)
            im = r["imbalance"][str(NO_FILL_COMM)]
            nf = r["no_fill"]
            lines.append(
                f"| {r['sp']} | {r['cp']} | {r['group']} | {g} | {100 * r['token_share_degree_g']:.1f}% | "
                f"{r['phases_degree_g']:,} / {r['phases']:,} | {r['idle_rows']} | "
                f"{100 * r['degree1_wait']:.2f}% | {im['fixed']:.4f} / {im['per_batch']:.4f} | "
                f"{nf['gain']:.4f}, {nf['imbalance']:.4f}, {100 * nf['token_share_degree_g']:.1f}% |"
            )
        lines.append("")
    lines += ["## Reading", ""] + reading(results) + [""]
    return "\n".join(lines)


def reading(results: dict) -> list[str]:
    """What the tables say, with their figures."""
    out = []
    for name, data in results["datasets"].items():
        cases = data["cases"]
        lo = {s: min(r["gain"][str(s)] for r in cases) for s in COMM}
        hi = {s: max(r["gain"][str(s)] for r in cases) for s in COMM}
        one = [1 - r["token_share_degree_g"] for r in cases]
        out.append(
            f"- {name}: {100 * min(one):.0f}-{100 * max(one):.0f}% of the tokens run at degree 1; the gain "
            f"is {lo[0.0]:.3f}-{hi[0.0]:.3f} at s = 0, {lo[0.1]:.3f}-{hi[0.1]:.3f} at s = 0.1 and "
            f"{lo[0.5]:.3f}-{hi[0.5]:.3f} at s = 0.5: about 1 + s x that share (the communication those "
            "tokens no longer pay), plus under CP the document padding to 2 x cp they no longer carry, less "
            "what the degree-1 phases' wait and the DP balance cost."
        )
    out += [
        "- The gain is what the stated per-token term gives back, no more: in this model a document's work "
        "(attention per document) is the same at any degree, so nothing else is saved. verl's +60.6% "
        "(Qwen3-30B-A3B SFT) would take s ~ 0.8-1.5 on these shapes: overheads a sharded short row pays "
        "beyond bandwidth (kernels on G-times shorter shards, per-step latency of a ring) that a per-token "
        "term only stands in for; measure s on the cluster (a fixed-degree and a degree-1 step time) "
        "before counting on more than the bandwidth figure.",
        "- Degree-1 phases are nearly even (wait under 0.1%: the costliest G rows together). The DP "
        "imbalance stays close to the fixed plan's; on the long tail at G = 8 (25 steps) rows holding a "
        "32K-128K document dominate both plans' steps (see `sp_cp_plans.md`: the floor is in the rows).",
        "- Fill (short documents in the degree-G rows' room) against no fill: on the long tail filling wins "
        "(every phase about a full row of work keeps the DP ranks even); on seed_mix, where the long "
        "documents are 4K-8K and fill their rows already, keeping every short document at degree 1 gains "
        "a little more at G = 4, 8. `plan_degrees(fill=...)` chooses.",
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    data_sets = {
        "seed_mix (bundled, cl100k)": bundled_seed_mix().astype(np.int64),
        "long_tail (synthetic, 128K)": long_tail(),
    }
    results: dict = {"world_size": WORLD, "grad_accum": ACCUM, "comm": list(COMM), "datasets": {}}
    for name, lengths in data_sets.items():
        budget = SETS[name]
        rows = []
        for g in GROUPS:
            for sp, cp in ((g, 1), (1, g)):
                rows.append(case(lengths, budget, sp, cp))
                print(name, json.dumps(rows[-1]), flush=True)
        results["datasets"][name] = {
            "samples": int(lengths.shape[0]),
            "max": int(lengths.max()),
            "budget": budget,
            "token_share_over_budget": float(lengths[lengths > budget].sum() / lengths.sum()),
            "cases": rows,
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sp_cp_degree.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "sp_cp_degree.md").write_text(render(results) + "\n")


if __name__ == "__main__":
    main()
