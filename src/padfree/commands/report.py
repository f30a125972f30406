"""``padfree report``: a self-contained HTML page (plus report.json) from a lengths file to a decision."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from padfree.commands.common import add_lengths_argument, add_plan_options, config_from_args, load_lengths
from padfree.errors import ConfigError

NAME = "report"
HELP = (
    "write DIR/index.html (self-contained: histogram, strategies, efficiency-diversity frontier, rank "
    "load, recommendation) and DIR/report.json"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_lengths_argument(p, required=False)
    add_plan_options(p)
    p.add_argument("--out", type=Path, required=True, help="output folder for index.html and report.json")
    p.add_argument(
        "--growths",
        default="1.1,1.25,1.5,2.0",
        help="frontier: bucket growth factors (default 1.1,1.25,1.5,2.0)",
    )
    p.add_argument(
        "--bucket-counts", default="2,4,8,16,32", help="frontier: optimal bucket counts (default 2,4,8,16,32)"
    )
    p.add_argument(
        "--mixes",
        default="4,16,64",
        help="frontier: explicit bucketed noise windows beside the automatic one (default 4,16,64)",
    )
    p.add_argument(
        "--no-packing",
        action="store_true",
        help="the model's attention cannot keep packed documents apart: recommend a padded plan",
    )


def _numbers(text: str, kind: type, option: str) -> tuple:
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{option} must be comma-separated numbers (got {text!r})") from None
    return values


def _process_started() -> float:
    """``time.perf_counter()`` at this process's start (Linux ``/proc``; elsewhere: now), so the time the
    command prints is the run's wall time, interpreter start and imports included."""
    now = time.perf_counter()
    try:
        after_comm = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return now - max(0.0, uptime - int(after_comm[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return now


def run(args: argparse.Namespace) -> int:
    t0 = _process_started()
    from padfree.tools.report import write_report

    growths = _numbers(args.growths, float, "--growths")
    counts = _numbers(args.bucket_counts, int, "--bucket-counts")
    mixes = _numbers(args.mixes, int, "--mixes")
    if any(g <= 1 for g in growths) or any(n < 1 for n in counts) or any(x < 1 for x in mixes):
        raise ConfigError("--growths must be > 1, --bucket-counts and --mixes >= 1")
    base = config_from_args(args, "bucketed")
    lengths, path, name = load_lengths(args)
    numbers = write_report(
        args.out,
        lengths,
        base,
        name=name,
        path=path,
        growths=growths,
        bucket_counts=counts,
        mixes=mixes,
        packing=not args.no_packing,
        t0=t0,
    )
    print(f"{args.out / 'index.html'}: {numbers['recommendation']['text']}", file=sys.stderr)
    print(f"({time.perf_counter() - t0:.1f} s; numbers in {args.out / 'report.json'})", file=sys.stderr)
    return 0
