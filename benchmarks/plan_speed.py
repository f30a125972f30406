"""Seconds to plan one epoch: padfree's four strategies vs peer samplers and packers, with padding.

    PYTHONPATH=src python benchmarks/plan_speed.py --out benchmarks/results

Datasets: the bundled seed_mix (902K samples) and 10M samples resampled from it with a fixed seed. Writes
``plan_speed.json`` and ``plan_speed.md`` under ``--out``. See ``padfree.bench.plan_speed`` for the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from padfree.bench.machine import machine_info
from padfree.bench.peers import PEER_NAMES
from padfree.bench.plan_speed import Case, render_markdown, run_case_subprocess
from padfree.core.config import STRATEGIES
from padfree.core.metrics import dataset_summary
from padfree.data.length_files import bundled_seed_mix

# peer variants: the settings each peer's own users get by default, plus one more where it matters
VARIANTS = {
    "hf_group_by_length": [{}],
    "hf_flattening": [{}],
    "trl_bfd": [{"map_batch_size": 1000}, {"map_batch_size": None}],
    "lhotse_dynamic_bucketing": [
        {"num_buckets": 30, "buffer_size": 60000},
        {"num_buckets": 10, "buffer_size": 20000},
    ],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--big", type=int, default=10_000_000, help="samples of the resampled set (0: skip)")
    p.add_argument("--cap", type=float, default=300.0, help="seconds allowed for one epoch of one method")
    p.add_argument("--peers", default=",".join(PEER_NAMES))
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--merge",
        action="store_true",
        help="rerun only the chosen cases and replace their rows in the existing --out/plan_speed.json",
    )
    p.add_argument("--datasets", default=None, help="comma-separated dataset names to run (default: all)")
    args = p.parse_args(argv)
    command = "python benchmarks/plan_speed.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    seed_mix = bundled_seed_mix().astype(np.int64)
    tmp = Path(tempfile.mkdtemp(prefix="padfree-plan-speed-"))
    sets = {"seed_mix": seed_mix}
    if args.big:
        rng = np.random.default_rng(20_261_129)
        sets[f"seed_mix_resampled_{args.big // 1_000_000}M"] = rng.choice(
            seed_mix, size=args.big, replace=True
        )
    result = {
        "command": command,
        "machine": machine_info(),
        "config": {
            "budget": args.budget,
            "world_size": args.world_size,
            "grad_accum": args.grad_accum,
            "seed": args.seed,
            "cap_s": args.cap,
        },
        "datasets": {},
        "results": [],
    }
    common = {"budget": args.budget, "world_size": args.world_size, "grad_accum": args.grad_accum}
    chosen = set(args.datasets.split(",")) if args.datasets else set(sets)
    for name, lengths in sets.items():
        if name not in chosen:
            continue
        path = tmp / f"{name}.npy"
        np.save(path, lengths)
        result["datasets"][name] = dataset_summary(lengths)
        cases = [
            Case(name, str(path), s, "padfree", {}, seed=args.seed, cap_s=args.cap, **common)
            for s in args.strategies.split(",")
        ]
        for peer in args.peers.split(","):
            for settings in VARIANTS[peer]:
                cases.append(
                    Case(name, str(path), peer, "peer", settings, seed=args.seed, cap_s=args.cap, **common)
                )
        for case in cases:
            t = time.perf_counter()
            row = run_case_subprocess(case)
            row["wall_seconds"] = time.perf_counter() - t
            result["results"].append(row)
            shown = (
                f"{row['seconds']:.3f} s, eff {row['padding_efficiency']:.4f}"
                if row["status"] == "ok"
                else row["status"]
            )
            print(f"{name:28s} {case.method:26s} {row['variant'][:40]:40s} {shown}", flush=True)
    result["machine"]["load_average_end"] = list(os.getloadavg())
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge and (args.out / "plan_speed.json").is_file():
        result = _merge(json.loads((args.out / "plan_speed.json").read_text()), result)
    (args.out / "plan_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "plan_speed.md").write_text(render_markdown(result))
    print(f"wrote {args.out / 'plan_speed.json'} and {args.out / 'plan_speed.md'}")
    return 0


def _merge(old: dict, new: dict) -> dict:
    """The old results with the rows of the rerun cases replaced (matched by dataset, method, variant)."""
    key = lambda r: (r["dataset"], r["method"], r["variant"])  # noqa: E731
    fresh = {key(r): r | {"rerun": new["command"]} for r in new["results"]}
    rows = [fresh.pop(key(r), r) for r in old["results"]] + list(fresh.values())
    reruns = old.get("reruns", []) + [{"command": new["command"], "machine": new["machine"]}]
    return old | {"results": rows, "reruns": reruns, "datasets": old["datasets"] | new["datasets"]}


if __name__ == "__main__":
    sys.exit(main())
