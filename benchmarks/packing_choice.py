"""Why padfree packs with best-fit over a shuffled order, not best-fit/first-fit decreasing.

For each real length file: bins used (vs the lower bound ceil(tokens / budget)), padding efficiency, how much
bin composition repeats from one epoch to the next (cobatch_repeat), and packing time. "Decreasing" orders
are re-shuffled among equal lengths every epoch, as a fair implementation would.

    .venv/bin/python benchmarks/packing_choice.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from padfree.core import kernels
from padfree.data.length_files import bundled_seed_mix

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "lengths"


def pack(lengths: np.ndarray, budget: int, method: str, rng: np.random.Generator) -> np.ndarray:
    """Bin id of every sample for one epoch."""
    perm = rng.permutation(lengths.shape[0])
    if method.endswith("decreasing"):
        perm = perm[np.argsort(-lengths[perm], kind="stable")]  # decreasing, random among ties
    if method.startswith("first_fit"):
        bin_of = first_fit(lengths[perm], budget)
    else:
        bin_of, _ = kernels.best_fit(lengths[perm], budget)
    out = np.empty_like(bin_of)
    out[perm] = bin_of
    return out


@kernels.njit(cache=True)
def first_fit(lens: np.ndarray, budget: int) -> np.ndarray:
    rooms = np.empty(lens.shape[0], np.int64)
    n = 0
    out = np.empty(lens.shape[0], np.int64)
    for i in range(lens.shape[0]):
        placed = -1
        for b in range(n):
            if rooms[b] >= lens[i]:
                placed = b
                break
        if placed < 0:
            placed = n
            rooms[n] = budget
            n += 1
        rooms[placed] -= lens[i]
        out[i] = placed
    return out


def repeat(bins_a: np.ndarray, bins_b: np.ndarray) -> float:
    n_a = np.bincount(bins_a).astype(np.float64)
    _, n_ab = np.unique(bins_a * (bins_b.max() + 1) + bins_b, return_counts=True)
    n_ab = n_ab.astype(np.float64)
    return float((n_ab * (n_ab - 1)).sum() / (n_a * (n_a - 1)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    datasets = {"seed_mix": bundled_seed_mix().astype(np.int64)}
    for name in ("self_instruct_t0", "python_stdlib_code", "hh_rlhf_harmless_test", "gsm8k"):
        p = SHARED / f"{name}.cl100k.npy"
        if p.exists():
            datasets[name] = np.minimum(np.load(p).astype(np.int64), args.budget)
    methods = ["best_fit_shuffled", "first_fit_shuffled", "best_fit_decreasing", "first_fit_decreasing"]
    rows = []
    for dname, lengths in datasets.items():
        lower = int(np.ceil(lengths.sum() / args.budget))
        for m in methods:
            if m.startswith("first_fit") and lengths.shape[0] > 200_000:
                sub = "skipped: O(n x bins) first-fit is too slow at this size"
                rows.append({"dataset": dname, "method": m, "note": sub})
                continue
            r0, r1 = np.random.default_rng([0, 0]), np.random.default_rng([0, 1])
            t = time.perf_counter()
            a = pack(lengths, args.budget, m, r0)
            secs = time.perf_counter() - t
            b = pack(lengths, args.budget, m, r1)
            n_bins = int(a.max()) + 1
            rows.append(
                {
                    "dataset": dname,
                    "method": m,
                    "samples": int(lengths.shape[0]),
                    "bins": n_bins,
                    "lower_bound": lower,
                    "padding_efficiency": float(lengths.sum() / (n_bins * args.budget)),
                    "cobatch_repeat": repeat(a, b),
                    "seconds": secs,
                }
            )
            print(json.dumps(rows[-1]))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "benchmarks/packing_choice.py", "budget": args.budget, "machine": platform.platform()}
    (args.out / "packing_choice.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# Packing algorithm choice (budget {args.budget})",
        "",
        "| dataset | method | bins | lower bound | padding eff. | cobatch repeat | seconds |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['dataset']} | {r['method']} | {r['note']} | | | | |")
        else:
            lines.append(
                f"| {r['dataset']} | {r['method']} | {r['bins']} | {r['lower_bound']} | "
                f"{r['padding_efficiency']:.4f} | {r['cobatch_repeat']:.4f} | {r['seconds']:.3f} |"
            )
    (args.out / "packing_choice.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
