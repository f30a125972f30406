"""Options shared by the planning commands, and how they become a :class:`PlanConfig`."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from padfree.core.config import DEFAULT_COST, OVERLONG, CostModel, PlanConfig


def add_lengths_argument(p: argparse.ArgumentParser, required: bool) -> None:
    help_ = "lengths file (.npy, .txt one integer a line, .jsonl, .parquet)"
    if required:
        p.add_argument("lengths", type=Path, help=help_)
    else:
        p.add_argument("lengths", type=Path, nargs="?", help=help_ + "; default: the bundled 902K seed_mix")
    p.add_argument("--field", default="length", help=".jsonl: the field holding the length (default: length)")
    p.add_argument(
        "--column", default="length", help=".parquet: the column holding the length (default: length)"
    )


def add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=int, default=16384, help="tokens per micro-batch (default 16384)")
    p.add_argument("--world-size", type=int, default=8, help="ranks / GPUs (default 8)")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per rank per step (default 4)")
    p.add_argument("--growth", type=float, default=1.25, help="bucketed: bucket width growth (default 1.25)")
    p.add_argument("--buckets", type=int, default=None, help="bucketed: N padding-optimal buckets instead")
    p.add_argument(
        "--mix",
        type=int,
        default=None,
        help="bucketed: noise window in micro-batches, every bucket (default: chosen from the data, "
        "see docs/planning.md)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--overlong", default="error", help=f"samples over the budget: {', '.join(OVERLONG)}")
    p.add_argument("--cost", type=Path, default=None, help="cost model JSON from `padfree calibrate`")


def load_lengths(args: argparse.Namespace) -> tuple[np.ndarray, str | None, str]:
    """Returns ``(lengths, path or None, display name)``."""
    from padfree.data.length_files import bundled_seed_mix, read_lengths

    if args.lengths is None:
        return bundled_seed_mix().astype(np.int64), None, "seed_mix (bundled)"
    return (
        read_lengths(args.lengths, field=args.field, column=args.column),
        str(args.lengths),
        str(args.lengths),
    )


def config_from_args(args: argparse.Namespace, strategy: str) -> PlanConfig:
    cost: CostModel = DEFAULT_COST if args.cost is None else CostModel.load(args.cost)
    return PlanConfig(
        strategy=strategy,
        budget=args.budget,
        world_size=args.world_size,
        grad_accum=args.grad_accum,
        growth=args.growth,
        buckets=args.buckets,
        mix=args.mix,
        seed=args.seed,
        overlong=args.overlong,
        cost=cost,
    )
