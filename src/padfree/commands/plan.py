"""``padfree plan``: write one epoch's plan as JSON lines."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from padfree.commands.common import (
    add_plan_inputs,
    add_shard_options,
    check_output,
    config_from_args,
    load_lengths,
    writing,
)
from padfree.options import add_number

NAME = "plan"
HELP = (
    'write one epoch\'s plan, one micro-batch a line: {"epoch", "step", "rank", "micro", "indices"}, plus '
    '"lengths" (tokens of each piece) on every line when a sample was truncated or split, "starts" when '
    "split or chunked"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_plan_inputs(p, required=True)
    add_shard_options(p)
    p.add_argument(
        "--strategy",
        default="bucketed",
        help="sorted, random, bucketed, packed or chunked (default bucketed; chunked: documents up to "
        "grad-accum x budget tokens as consecutive chunks on one rank in one step, with starts)",
    )
    add_number(p, "--epoch", 0, "epoch to plan (default 0)")
    p.add_argument("--out", type=Path, default=Path("-"), help="output .jsonl ('-' for stdout, the default)")


def run(args: argparse.Namespace) -> int:
    from padfree.core.planner import make_plan

    cfg = config_from_args(args, args.strategy)
    to_stdout = str(args.out) == "-"
    if not to_stdout:
        check_output(args.out, "the plan")
    lengths, path, _ = load_lengths(args)
    p = make_plan(lengths, cfg, args.epoch, path=path)
    cut = p.starts is None and p.truncated > 0  # one shape for the whole file: pieces' lengths on every line

    def lines():
        for j, rec in enumerate(p.records()):
            if cut:
                rec["lengths"] = p.lengths[p.offsets[j] : p.offsets[j + 1]].tolist()
            yield json.dumps(rec, separators=(",", ":")) + "\n"

    if to_stdout:  # an OSError here is standard output's: the CLI boundary names it
        for line in lines():
            sys.stdout.write(line)
        return 0
    created = not args.out.exists()
    try:
        with writing(args.out, "the plan"), args.out.open("w") as stream:
            for line in lines():
                stream.write(line)
    except BaseException:
        if created and args.out.is_file():  # no half-written plan left behind
            args.out.unlink()
        raise
    if not to_stdout:
        print(
            f"{args.out}: {p.n_micro} micro-batches in {p.n_steps} steps for {p.n_samples} samples "
            f"(truncated {p.truncated}, split {p.split}, dropped {p.dropped})",
            file=sys.stderr,
        )
    return 0
