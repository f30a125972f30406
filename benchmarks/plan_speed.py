"""Seconds to plan one epoch: padfree's four strategies vs peer samplers and packers, with padding.

    PYTHONPATH=src python benchmarks/plan_speed.py --out benchmarks/results

Datasets: the bundled seed_mix (902K samples) and 10M samples resampled from it with a fixed seed; with
``--held-out``, the real length sets vendored in ``fixtures/lengths`` (full texts, mistral_v1 tokenizer)
instead, and ``--lengths`` adds any length file. Samples longer than the budget are cut to it for every
method. Writes ``NAME.json`` and ``NAME.md`` (``--name``, default ``plan_speed``) under ``--out``. See
``lab.plan_speed`` for the protocol.

    PYTHONPATH=src python benchmarks/plan_speed.py --held-out --budget 4096 --grad-accum 2 \
        --name plan_speed_held_out --out benchmarks/results
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

from lab.plan_speed import Case, render_markdown, run_case_subprocess
from padfree.bench.machine import machine_info
from padfree.bench.peers import PEER_NAMES
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
    "hf_batch_rebalance": [{}],  # world size and grad accum follow --world-size and --grad-accum
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
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
    p.add_argument(
        "--held-out",
        action="store_true",
        help="plan the real length sets in fixtures/lengths (*.mistral_v1.npy) instead of seed_mix",
    )
    p.add_argument("--lengths", action="append", default=[], help="also plan this .npy length file")
    p.add_argument("--name", default="plan_speed", help="file name stem under --out")
    args = p.parse_args(argv)
    command = "python benchmarks/plan_speed.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    seed_mix = bundled_seed_mix().astype(np.int64)
    tmp = Path(tempfile.mkdtemp(prefix="padfree-plan-speed-"))
    sets = {} if args.held_out else {"seed_mix": seed_mix}
    extra = [Path(x) for x in args.lengths]
    if args.held_out:
        fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "lengths"
        extra = sorted(fixtures.glob("*.mistral_v1.npy")) + extra
    for f in extra:
        sets[f.name.removesuffix(".npy")] = np.minimum(np.load(f).astype(np.int64), args.budget)
    if args.big and not args.held_out:
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
            if s
        ]
        for peer in filter(None, args.peers.split(",")):
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
    out_json, out_md = args.out / f"{args.name}.json", args.out / f"{args.name}.md"
    if args.merge and out_json.is_file():
        result = _merge(json.loads(out_json.read_text()), result)
    out_json.write_text(json.dumps(result, indent=2) + "\n")
    out_md.write_text(render_markdown(result))
    print(f"wrote {out_json} and {out_md}")
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
