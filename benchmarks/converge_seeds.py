"""Summarize several `padfree bench --converge` runs (one per seed) into one table.

Each run's headline is its held-out loss at the token target relative to ``random``'s in the same run (same
seed: same initial weights, same held-out set). Across seeds this reports every run's difference and their
mean, standard deviation and worst case per strategy, so a claim like "within 0.5% of random" can be read
against the seed-to-seed spread.

    python benchmarks/converge_seeds.py benchmarks/results/converge_matched_seed*.json \
        --out benchmarks/results --name converge_matched_seeds
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def summarize(runs: list[dict]) -> dict:
    """``{"seeds", "rel_diff_vs_random": {name: [per seed]}, "loss": {...}, "stats": {name: {...}}}``;
    a strategy missing from a run is left out of that seed.

    >>> run = lambda seed, d: {"config": {"seed": seed}, "comparison": {
    ...     "final_rel_diff_vs_random": {"random": 0.0, "packed": d},
    ...     "loss_at_marks": {"random": [6.0], "packed": [6.0 * (1 + d)]}}}
    >>> s = summarize([run(0, 0.01), run(1, -0.03)])
    >>> round(s["stats"]["packed"]["mean"], 4), round(s["stats"]["packed"]["worst"], 4)
    (-0.01, 0.01)
    """
    seeds = [r["config"]["seed"] for r in runs]
    names: list[str] = []
    for r in runs:
        names += [n for n in r["comparison"]["final_rel_diff_vs_random"] if n not in names]
    rel = {n: [r["comparison"]["final_rel_diff_vs_random"].get(n) for r in runs] for n in names}
    loss = {n: [(r["comparison"]["loss_at_marks"].get(n) or [None])[-1] for r in runs] for n in names}
    stats = {}
    for n, v in rel.items():
        x = np.array([d for d in v if d is not None], dtype=np.float64)
        stats[n] = {
            "runs": int(x.size),
            "mean": float(x.mean()),
            "std": float(x.std(ddof=1)) if x.size > 1 else 0.0,
            "worst": float(x.max()),
            "best": float(x.min()),
        }
    return {"seeds": seeds, "rel_diff_vs_random": rel, "loss": loss, "stats": stats}


def markdown(s: dict, sources: list[str]) -> str:
    names = list(s["stats"])
    lines = [
        "# Convergence across seeds (held-out loss at the token target, relative to random)",
        "",
        "Runs: " + ", ".join(f"`{p}`" for p in sources),
        "",
        "| seed | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for i, seed in enumerate(s["seeds"]):
        cells = []
        for n in names:
            d, loss = s["rel_diff_vs_random"][n][i], s["loss"][n][i]
            cells.append("—" if d is None else f"{d:+.2%} ({loss:.4f})")
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    for key, label in (("mean", "mean"), ("std", "std (seeds)"), ("worst", "worst"), ("best", "best")):
        lines.append(
            f"| {label} | "
            + " | ".join(
                f"{s['stats'][n][key]:.2%}" if key == "std" else f"{s['stats'][n][key]:+.2%}" for n in names
            )
            + " |"
        )
    lines += ["", "Positive: higher (worse) held-out loss than random in the same run.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("runs", nargs="+", type=Path, help="converge JSON files (one per seed)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--name", default="converge_seeds")
    args = p.parse_args()
    runs = [json.loads(f.read_text()) for f in args.runs]
    s = summarize(runs)
    md = markdown(s, [str(f) for f in args.runs])
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(s, indent=2) + "\n")
        (args.out / f"{args.name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
