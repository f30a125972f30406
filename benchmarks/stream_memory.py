"""Streams planned in bounded memory (issue 43 goal: 100M streamed samples in < 1 GB resident beyond the
window): peak RSS of :func:`padfree.core.lookahead.window_steps` over N synthetic streamed samples, each N in
its own process, with the fill and rank imbalance of the steps measured on the fly (nothing kept per sample).

The stream: sample ``i``'s length is seed_mix's length at a splitmix64 hash of ``i`` (seekable, drawn
anew at every position, the seed_mix distribution capped at the budget). 8 ranks x 4 micro-batches, budget
16384, packed, a window of 4 steps. Resident memory: the process's peak RSS (``ru_maxrss``) minus its RSS
after imports and loading the length table, before the first sample is read.

    PYTHONPATH=src python benchmarks/stream_memory.py --counts 1000000,10000000,100000000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BUDGET = 16384


def rss_mib() -> float:
    """This process's resident memory now (MiB), from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def splitmix(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class SyntheticLengths:
    """``n`` streamed lengths drawn from ``table`` at hashed positions: seekable, O(1) memory."""

    def __init__(self, table: np.ndarray, n: int) -> None:
        self.table, self.n, self.name = table, n, f"synthetic x{n}"

    def read(self, start: int, count: int) -> np.ndarray:
        stop = min(start + count, self.n)
        if stop <= start:
            return np.zeros(0, np.int64)
        pos = np.arange(start, stop, dtype=np.uint64)
        return self.table[(splitmix(pos) % np.uint64(self.table.shape[0])).astype(np.int64)]


def one(n: int, lengths_dir: Path) -> dict:
    """Plan ``n`` streamed samples in this process; the numbers."""
    with np.errstate(over="ignore"):
        from padfree.core import cost
        from padfree.core.config import DEFAULT_COST, PlanConfig
        from padfree.core.lookahead import window_for_steps, window_steps

        table = np.minimum(np.load(lengths_dir / "seed_mix.cl100k.npy").astype(np.int64), BUDGET)
        cfg = PlanConfig(strategy="packed", budget=BUDGET, world_size=8, grad_accum=4, seed=0)
        window = window_for_steps(4, cfg, float(table.mean()))
        stream = SyntheticLengths(table, n)
        stream.read(0, 16)  # the kernels' first call
        base = rss_mib()
        t0 = time.perf_counter()
        steps = samples = tokens = 0
        ratios = []
        for st in window_steps(stream, cfg, window):
            lens = np.concatenate(st.lengths)
            offsets = np.concatenate(([0], np.cumsum([m.shape[0] for m in st.lengths])))
            shapes = cost.micro_shapes(lens, offsets, True)
            ranks = cost.rank_costs(cost.micro_costs(shapes, DEFAULT_COST), 8, 4)[0]
            ratios.append(float(ranks.max() / ranks.mean()))
            steps, samples, tokens = steps + 1, samples + lens.shape[0], tokens + int(lens.sum())
        seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    r = np.asarray(ratios)
    return {
        "samples": n,
        "planned": samples,
        "window": window,
        "steps": steps,
        "fill": round(tokens / (steps * 32 * BUDGET), 5),
        "imbalance_mean": round(float(r.mean()), 5),
        "imbalance_p99": round(float(np.quantile(r, 0.99)), 5),
        "rss_before_mib": round(base, 1),
        "peak_rss_mib": round(peak, 1),
        "beyond_start_mib": round(peak - base, 1),
        "seconds": round(seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--lengths", type=Path, default=Path("../shared/data/lengths"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--counts", default="1000000,10000000,100000000")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: one count
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.lengths)))
        return
    rows = []
    for n in (int(c) for c in args.counts.split(",")):
        cmd = [sys.executable, __file__, "--one", str(n), "--lengths", str(args.lengths)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "stream_memory.json").write_text(json.dumps(rows, indent=1) + "\n")
    cols = ["samples", "window", "steps", "fill", "imbalance_mean", "imbalance_p99", "rss_before_mib",
            "peak_rss_mib", "beyond_start_mib", "seconds"]  # fmt: skip
    lines = [
        "# Streams planned in bounded memory (synthetic seed_mix-distributed stream)",
        "",
        "`PYTHONPATH=src python benchmarks/stream_memory.py` (packed, budget 16384, 8 ranks x 4, a window of "
        "4 steps; each count in its own process; MiB; seconds on the shared 2-core machine).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---:|" * len(cols),
    ]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    (args.out / "stream_memory.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
