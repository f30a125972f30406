"""Peak memory and time of PlanBatchSampler on huge epochs (30M and 100M samples), per strategy.

Lengths are resampled from the bundled seed_mix as int32 (``scale.resampled_lengths``). Each (size,
strategy) runs in a fresh subprocess so that every peak RSS (VmHWM) is its own. A run: build rank 0's
sampler (8 ranks x grad-accum 4), plan the epoch (``len``), yield 100 steps, save the state, then resume it
at 16 ranks (the rest of the epoch re-planned window by window) and yield one step. Writes
``sampler_scale.json`` and ``sampler_scale.md`` under ``--out``.

    PYTHONPATH=src python benchmarks/sampler_scale.py --sizes 30000000 100000000 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from scale import _vm, resampled_lengths  # benchmarks/scale.py (the script's folder is on sys.path)


def worker(n: int, strategy: str, args: argparse.Namespace) -> dict:
    from padfree import PlanConfig
    from padfree.torch import PlanBatchSampler

    lengths = resampled_lengths(n, args.data_seed)
    rss_before = _vm("VmRSS")
    cfg = PlanConfig(strategy=strategy, budget=args.budget, grad_accum=4, seed=0, overlong="truncate")
    t0 = time.perf_counter()
    sampler = PlanBatchSampler(lengths, cfg, rank=0, world_size=8)
    steps = sampler.steps_in_epoch
    plan_s = time.perf_counter() - t0
    it = iter(sampler)
    t = time.perf_counter()
    for _ in range(100 * 4):
        next(it)
    yield_s = (time.perf_counter() - t) / 100
    state = sampler.state_dict()
    peak_plan = _vm("VmHWM")
    rss_plan = _vm("VmRSS")
    del it, sampler
    t = time.perf_counter()
    other = PlanBatchSampler(lengths, cfg, rank=0, world_size=16)
    other.load_state_dict(state)
    next(iter(other))
    resume_s = time.perf_counter() - t
    return {
        "samples": n,
        "strategy": strategy,
        "steps_in_epoch": steps,
        "plan_seconds": round(plan_s, 1),
        "yield_step_ms": round(yield_s * 1e3, 3),
        "elastic_resume_seconds": round(resume_s, 1),
        "rss_before_mb": round(rss_before, 1),
        "rss_after_plan_mb": round(rss_plan, 1),
        "peak_rss_plan_mb": round(peak_plan, 1),
        "peak_rss_with_elastic_resume_mb": round(_vm("VmHWM"), 1),
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--sizes", type=int, nargs="+", default=[30_000_000, 100_000_000])
    p.add_argument("--strategies", nargs="+", default=["bucketed", "packed"])
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--worker", nargs=2, metavar=("N", "STRATEGY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), args.worker[1], args)))
        return 0
    rows = []
    for n in args.sizes:
        for strategy in args.strategies:
            cmd = [sys.executable, __file__, "--worker", str(n), strategy, "--budget", str(args.budget),
                   "--data-seed", str(args.data_seed)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    meta = {"budget": args.budget, "world_size": 8, "grad_accum": 4, "cpus": os.cpu_count(),
            "python": platform.python_version(), "command": " ".join(["python", *sys.argv])}  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sampler_scale.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        lines = [
            "| samples | strategy | plan s | peak RSS (plan) MB | peak RSS (+ elastic resume) MB | "
            "elastic resume s | yield/step ms |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['samples']:,} | {r['strategy']} | {r['plan_seconds']} | "
                f"{r['peak_rss_plan_mb']:,.0f} | {r['peak_rss_with_elastic_resume_mb']:,.0f} | "
                f"{r['elastic_resume_seconds']} | "
                f"{r['yield_step_ms']} |"
            )
        (out / "sampler_scale.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
