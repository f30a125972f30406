"""``padfree plan``: write one epoch's plan as JSON lines."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from padfree.commands.common import (
    add_plan_inputs,
    add_shard_options,
    add_source_options,
    check_output,
    config_from_args,
    load_lengths,
    sources_from_args,
    writing,
)
from padfree.errors import ConfigError
from padfree.options import add_number, add_path

NAME = "plan"
HELP = (
    'write one epoch\'s plan, one micro-batch a line: {"epoch", "step", "rank", "micro", "indices"}, plus '
    '"lengths" (tokens of each piece) on every line when a sample was truncated or split, "starts" when '
    "split or chunked"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_plan_inputs(p, required=False)
    for action in p._actions:  # required unless the plan is of weighted sources
        if action.dest == "lengths":
            action.help = (
                "lengths file (.npy, .txt one integer a line, .jsonl, .parquet); or --source options"
            )
    add_shard_options(p)
    add_source_options(p)
    p.add_argument(
        "--strategy",
        default="bucketed",
        help="sorted, random, bucketed, packed or chunked (default bucketed; chunked: documents up to "
        "grad-accum x budget tokens as consecutive chunks on one rank in one step, with starts)",
    )
    add_number(p, "--epoch", 0, "epoch to plan (default 0)")
    add_path(p, "--out", "output .jsonl ('-' for stdout, the default)", Path("-"))


def run(args: argparse.Namespace) -> int:
    from padfree.core.planner import make_plan

    cfg = config_from_args(args, args.strategy)
    to_stdout = str(args.out) == "-"
    if not to_stdout:
        check_output(args.out, "the plan")
    if args.source:
        return write_sources_plan(args, cfg)
    if args.lengths is None:
        raise ConfigError(
            "padfree plan: give a lengths file (or weighted sources: --source NAME=FILE:WEIGHT)"
        )
    lengths, path, _ = load_lengths(args)
    p = make_plan(lengths, cfg, args.epoch, path=path)
    cut = p.starts is None and p.truncated > 0  # one shape for the whole file: pieces' lengths on every line

    def lines():
        for j, rec in enumerate(p.records()):
            if cut:
                rec["lengths"] = p.lengths[p.offsets[j] : p.offsets[j + 1]].tolist()
            yield json.dumps(rec, separators=(",", ":")) + "\n"

    summary = f"{p.n_micro} micro-batches in {p.n_steps} steps"
    return write_lines(args, lines(), summary, p.n_samples, (p.truncated, p.split, p.dropped))


def write_sources_plan(args: argparse.Namespace, config: object) -> int:
    """``--source``: the plan of weighted sources, one micro-batch a line with each sample's ``"sources"``
    (its source's index); sample ids count through the sources in the order given. What the weights cost
    (passes over each source, the worst step's share error) goes to standard error."""
    from padfree.core import sources
    from padfree.core.config import PlanConfig

    assert isinstance(config, PlanConfig)
    cfg, lengths, loss = sources_from_args(args, config)
    data = sources.source_data(lengths, cfg, loss)
    p, _ = sources.plan_sources(data, cfg, args.epoch)
    cut = p.truncated > 0

    def lines():
        for j, rec in enumerate(p.records()):
            rec["sources"] = data.source_of(rec["indices"]).tolist()
            if cut:
                rec["lengths"] = p.lengths[p.offsets[j] : p.offsets[j + 1]].tolist()
            yield json.dumps(rec, separators=(",", ":")) + "\n"

    summary = f"{p.n_micro} micro-batches in {p.n_steps} steps"
    code = write_lines(args, lines(), summary, p.n_samples, (p.truncated, p.split, p.dropped))
    for line in sources.summary_lines(p, data):
        print(line, file=sys.stderr)
    return code


def write_lines(
    args: argparse.Namespace, lines: Iterable[str], summary: str, n_samples: int, report: tuple[int, int, int]
) -> int:
    """Write the plan's lines to ``--out`` (or standard output); no half-written file is left behind."""
    to_stdout = str(args.out) == "-"

    if to_stdout:  # an OSError here is standard output's: the CLI boundary names it
        for line in lines:
            sys.stdout.write(line)
        return 0
    created = not args.out.exists()
    try:
        with writing(args.out, "the plan"), args.out.open("w") as stream:
            for line in lines:
                stream.write(line)
    except BaseException:
        if created and args.out.is_file():  # no half-written plan left behind
            args.out.unlink()
        raise
    truncated, split, dropped = report
    print(
        f"{args.out}: {summary} for {n_samples} samples "
        f"(truncated {truncated}, split {split}, dropped {dropped})",
        file=sys.stderr,
    )
    return 0
