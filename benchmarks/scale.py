"""Time and peak memory at 10M, 30M and 100M samples of planning one epoch (``--what plan``), of what
``padfree analyze`` does per strategy (``analyze``: plan epochs 0 and 1, measure every metric), of
``padfree report`` (``report``: every strategy, the frontier, the page), and of ``PlanBatchSampler``
(``sampler``: rank 0's sampler up to its first micro-batch, which plans the epoch).

Lengths are resampled (with replacement, fixed seed) from the bundled seed_mix and held as int32. Each
(size, what, strategy) runs in a fresh subprocess so that every peak RSS is its own. Writes ``NAME.json`` and
``NAME.md`` under ``--out``.

    PYTHONPATH=src python benchmarks/scale.py --out benchmarks/results
    PYTHONPATH=src python benchmarks/scale.py --sizes 100000000 --what plan,analyze,report,sampler \
        --name scale_100m --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

STRATEGIES = ("sorted", "random", "bucketed", "packed")


def _vm(field: str) -> float:
    """A field of /proc/self/status in MB (VmHWM: peak resident set, VmRSS: current)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # pragma: no cover


def resampled_lengths(n: int, seed: int = 0, chunk: int = 8_000_000) -> np.ndarray:
    """``n`` lengths drawn from seed_mix with replacement, as int32, built chunk by chunk."""
    from padfree.data.length_files import bundled_seed_mix

    base = bundled_seed_mix().astype(np.int32)
    rng = np.random.default_rng(seed)
    out = np.empty(n, np.int32)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        out[a:b] = base[rng.integers(0, base.shape[0], b - a)]
    return out


def worker(n: int, strategy: str, mode: str, args: argparse.Namespace) -> dict:
    from padfree import PlanConfig, make_plan
    from padfree.core.planner import STREAM_THRESHOLD

    lengths = resampled_lengths(n, args.data_seed)
    rss_before = _vm("VmRSS")
    cfg = PlanConfig(
        strategy="bucketed" if strategy == "all" else strategy,
        budget=args.budget,
        world_size=args.world_size,
        grad_accum=args.grad_accum,
        seed=args.seed,
    )
    if args.what != "plan":
        return other_worker(lengths, cfg, strategy, args) | {"rss_before_mb": round(rss_before, 1)}
    stream = {"auto": None, "stream": True, "memory": False}[mode]
    t, c = time.perf_counter(), time.process_time()
    plan = make_plan(lengths, cfg, 0, stream=stream, window=args.window)
    seconds, cpu = time.perf_counter() - t, time.process_time() - c
    peak = _vm("VmHWM")
    k = cfg.micro_per_step
    counts = np.diff(plan.offsets)
    ok = (
        plan.n_micro % k == 0
        and int(counts.sum()) == n
        and int(np.bincount(plan.indices, minlength=n).max()) == 1
    )
    sh = plan.shapes()
    return {
        "samples": n,
        "what": "plan",
        "strategy": strategy,
        "mode": mode,
        "path": "stream" if stream or (stream is None and n > STREAM_THRESHOLD) else "memory",
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu, 3),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "peak_rss_mb": round(peak, 1),
        "rss_before_mb": round(rss_before, 1),
        "lengths_mb": round(lengths.nbytes / 2**20, 1),
        "plan_mb": round(
            (plan.indices.nbytes + plan.lengths.nbytes + plan.offsets.nbytes) / 2**20,
            1,
        ),
        "micro_batches": plan.n_micro,
        "steps": plan.n_steps,
        "padding_efficiency": round(float(sh.real.sum() / sh.slots.sum()), 5),
        "exactly_once": bool(ok),
    }


def other_worker(lengths: np.ndarray, cfg, strategy: str, args: argparse.Namespace) -> dict:
    """``analyze`` (one strategy), ``report`` (all of them) or ``sampler`` on ``lengths``: time and peak."""
    import tempfile

    from padfree.core.planner import STREAM_THRESHOLD

    n = int(lengths.shape[0])
    t, c = time.perf_counter(), time.process_time()
    extra: dict = {}
    if args.what == "analyze":
        from padfree.advice.analyze import analyze_strategies

        m = analyze_strategies(lengths, {strategy: cfg})["strategies"][strategy]
        extra = {k: m[k] for k in ("padding_efficiency", "step_divergence", "cobatch_repeat", "imbalance")}
        extra["micro_batches"] = m["micro_batches"]
    elif args.what == "report":
        from padfree.advice.report import write_report

        growths = tuple(float(g) for g in args.report_growths.split(","))
        counts = tuple(int(b) for b in args.report_bucket_counts.split(","))
        with tempfile.TemporaryDirectory() as out:
            numbers = write_report(out, lengths, cfg, growths=growths, bucket_counts=counts)
        extra = {
            "recommended": numbers["recommendation"]["label"],
            "frontier_points": len(numbers["frontier"]),
        }
    elif args.what == "sampler":
        from padfree.torch import PlanBatchSampler

        sampler = PlanBatchSampler(lengths, cfg, rank=0, world_size=cfg.world_size)
        first = next(iter(sampler))
        extra = {"micro_batches_of_rank0": len(sampler) + 1, "first_micro_batch_samples": len(first)}
    else:
        raise SystemExit(f"unknown --what {args.what!r}")
    seconds, cpu = time.perf_counter() - t, time.process_time() - c
    return {
        "samples": n,
        "what": args.what,
        "strategy": strategy,
        "mode": "auto",
        "path": "stream" if n > STREAM_THRESHOLD else "memory",  # the sampler follows make_plan's threshold
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu, 3),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "peak_rss_mb": round(_vm("VmHWM"), 1),
        "lengths_mb": round(lengths.nbytes / 2**20, 1),
        **extra,
    }


def _markdown(rows: list[dict], meta: dict) -> str:
    out = [
        "# Planning time and peak memory at scale",
        "",
        f"`{meta['command']}` on {meta['machine']}; budget {meta['budget']}, world {meta['world_size']} x "
        f"grad-accum {meta['grad_accum']}, window {meta['window']:,} samples; lengths resampled from "
        "seed_mix (int32). Peak RSS is the whole process (Python, numpy, numba, the lengths array); "
        "`before` is the RSS once the lengths exist. Wall time depends on what else runs on the machine "
        "(`load`: 1-minute load average); CPU time (user + system of the process) does not.",
        "",
        "| samples | strategy | path | wall s | CPU s | CPU s per 10M | load | peak RSS MB | before MB | "
        "plan MB | micro-batches | padding eff. | exactly once |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    plans = [r for r in rows if r.get("what", "plan") == "plan"]
    others = [r for r in rows if r.get("what", "plan") != "plan"]
    if not plans:
        out = out[:-3]
    for r in plans:
        per10m = r["cpu_seconds"] / r["samples"] * 1e7
        out.append(
            f"| {r['samples']:,} | {r['strategy']} | {r['path']} | {r['seconds']:.1f} | "
            f"{r['cpu_seconds']:.1f} | {per10m:.2f} | {r['load_avg_1min']:.1f} | {r['peak_rss_mb']:,.0f} | "
            f"{r['rss_before_mb']:,.0f} | {r['plan_mb']:,.0f} | {r['micro_batches']:,} | "
            f"{r['padding_efficiency']:.4f} | {r['exactly_once']} |"
        )
    if others:
        out += [
            "",
            "`analyze`: what `padfree analyze` does for one strategy (plan epochs 0 and 1, every metric). "
            f"`report`: `padfree report` (every strategy, the frontier of growths {meta['report_growths']}, "
            f"bucket counts {meta['report_bucket_counts']} and the default mixes, the page). `sampler`: "
            "rank 0's `PlanBatchSampler` up to its first micro-batch (it plans the epoch then).",
            "",
            "| samples | what | strategy | path | wall s | CPU s | load | peak RSS MB | before MB | result |",
            "|---:|---|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in others:
            keep = (
                "padding_efficiency",
                "step_divergence",
                "cobatch_repeat",
                "recommended",
                "frontier_points",
            )
            res = ", ".join(
                f"{k} {r[k]:.4g}" if isinstance(r[k], float) else f"{k} {r[k]}" for k in keep if k in r
            )
            out.append(
                f"| {r['samples']:,} | {r['what']} | {r['strategy']} | {r['path']} | {r['seconds']:.1f} | "
                f"{r['cpu_seconds']:.1f} | {r['load_avg_1min']:.1f} | {r['peak_rss_mb']:,.0f} | "
                f"{r['rss_before_mb']:,.0f} | {res} |"
            )
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--sizes", default="10000000,30000000,100000000")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--modes", default="auto", help="auto (make_plan decides), stream, memory")
    ap.add_argument("--what", default="plan", help="comma-separated: plan, analyze, report, sampler")
    ap.add_argument("--report-growths", default="1.1,1.25,1.5,2.0", help="report: the frontier's growths")
    ap.add_argument("--report-bucket-counts", default="2,4,8,16,32", help="report: its bucket counts")
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="scale", help="output file stem (default scale: scale.json, scale.md)")
    ap.add_argument("--worker", nargs=3, metavar=("N", "STRATEGY", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--results", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        n, strategy, mode = args.worker
        print(json.dumps(worker(int(n), strategy, mode, args)))
        return 0
    from padfree.core.stream import DEFAULT_WINDOW

    args.window = args.window or DEFAULT_WINDOW
    passthrough = [
        f"--budget={args.budget}",
        f"--world-size={args.world_size}",
        f"--grad-accum={args.grad_accum}",
        f"--seed={args.seed}",
        f"--data-seed={args.data_seed}",
        f"--window={args.window}",
        f"--report-growths={args.report_growths}",
        f"--report-bucket-counts={args.report_bucket_counts}",
    ]
    # compile (and cache) the numba kernels once, outside the measured runs
    subprocess.run(
        [sys.executable, __file__, "--worker", "200000", "bucketed", "stream", "--window=100000"],
        check=True,
        capture_output=True,
    )
    rows = []
    runs = [
        (n, what, mode if what == "plan" else "auto", s)
        for n in (int(x) for x in args.sizes.split(","))
        for what in args.what.split(",")
        for mode in (args.modes.split(",") if what == "plan" else ["auto"])
        for s in (["all"] if what == "report" else args.strategies.split(","))
    ]
    for n, what, mode, s in runs:
        res = subprocess.run(
            [sys.executable, __file__, "--worker", str(n), s, mode, f"--what={what}", *passthrough],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            print(res.stderr, file=sys.stderr)
            return 1
        row = json.loads(res.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{n:>11,} {what:<8} {s:<9} {row['path']:<6} {row['seconds']:7.1f} s "
            f"peak {row['peak_rss_mb']:8,.0f} MB (before {row['rss_before_mb']:,.0f} MB)",
            flush=True,
        )
    meta = {
        "command": "PYTHONPATH=src python benchmarks/scale.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"numpy {np.__version__}",
        "budget": args.budget,
        "world_size": args.world_size,
        "grad_accum": args.grad_accum,
        "window": args.window,
        "report_growths": args.report_growths,
        "report_bucket_counts": args.report_bucket_counts,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(_markdown(rows, meta))
    print(f"wrote {args.out / args.name}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
