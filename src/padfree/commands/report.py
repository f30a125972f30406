"""``padfree report``: a self-contained HTML page (plus report.json) from a lengths file to a decision."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from padfree.commands.common import (
    add_drafter_arguments,
    add_plan_inputs,
    add_source_options,
    bounded_list,
    check_output,
    config_from_args,
    drafter_from_args,
    load_lengths,
    sources_from_args,
    writing,
)
from padfree.errors import ConfigError, one_line
from padfree.options import BUCKETS, GROWTH, MIX, add_path

NAME = "report"
HELP = (
    "write DIR/index.html (self-contained: histogram, strategies, efficiency-diversity frontier, rank "
    "load, recommendation) and DIR/report.json"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_plan_inputs(p, required=False)
    add_path(p, "--out", "output folder for index.html and report.json", required=True)
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
    add_drafter_arguments(p, "add a drafter setup's section: predicted throughput per strategy, cache size")
    p.add_argument(
        "--no-packing",
        action="store_true",
        help="the model's attention cannot keep packed documents apart: recommend a padded plan",
    )
    p.add_argument(
        "--model",
        default=None,
        help="your model (a folder with config.json, or a tiny-* name): run `padfree check-packing --model` "
        "on it and let its verdict decide packing (default: packing assumed, the check named in the page)",
    )
    add_source_options(p)


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
    from padfree.advice.report import write_report

    growths = bounded_list(args.growths, GROWTH, "--growths", most=16)
    counts = bounded_list(args.bucket_counts, BUCKETS, "--bucket-counts", most=16)
    mixes = bounded_list(args.mixes, MIX, "--mixes", most=16)
    base = config_from_args(args, "bucketed")
    for g in growths:
        base.with_(growth=g)  # the growth's bucket count at this budget, checked before any work
    check_output(args.out, "the report", folder=True)
    if args.model is not None and args.no_packing:
        raise ConfigError(
            "report: --model runs the packing check that decides packing; give --no-packing instead"
        )
    packing_check = None if args.model is None else packing_verdict(args.model)
    mixed = None
    if args.source:  # the report of all sources' samples together, and the weighted plan's section
        from padfree.core import sources

        strategy = "bucketed" if args.no_packing else "packed"
        cfg, per_source, loss = sources_from_args(args, base.with_(strategy=strategy))
        data = sources.source_data(per_source, cfg, loss)
        mixed = sources.report_numbers(sources.plan_sources(data, cfg, 0)[0], data)
        lengths, path, name = data.lengths, None, " + ".join(data.names)
    else:
        lengths, path, name = load_lengths(args)
    drafter = None
    if args.drafter is not None:
        from padfree.advice.report import drafter_numbers
        from padfree.advice.simulate import load_seconds_per_unit

        cfg, anchors, setup = drafter_from_args(args, base, lengths)
        spu = load_seconds_per_unit(args.cost)
        drafter = drafter_numbers(lengths, cfg, anchors, setup, spu, path)
    with writing(args.out, "the report"):
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
            packing_check=packing_check,
            t0=t0,
            drafter=drafter,
            sources=mixed,
        )
    if drafter is not None:
        print(f"{args.out / 'index.html'}: {drafter_line(numbers['drafter'])}", file=sys.stderr)
    print(f"{args.out / 'index.html'}: {numbers['recommendation']['text']}", file=sys.stderr)
    if numbers.get("chunked"):
        print(f"long documents: {numbers['chunked']['text']}", file=sys.stderr)
    print(f"({time.perf_counter() - t0:.1f} s; numbers in {args.out / 'report.json'})", file=sys.stderr)
    return 0


def packing_verdict(model: str) -> dict:
    """``padfree check-packing --model MODEL`` (padfree's varlen attention, float32, CPU) as the report
    records it: ``{"model", "exact", "detail"}``. A model the check cannot build or run is one line (exit
    2) that says how to go on: check it alone, or pass --no-packing."""
    from padfree.checks.packing import check_packing

    if Path(model).is_dir():
        from padfree.models import read_config_json

        read_config_json(Path(model))  # a missing or broken config is the user's file: named, exit 2
    try:
        r = check_packing(model)
    except ConfigError as exc:
        raise ConfigError(
            f"report --model {model}: the packing check cannot run ({one_line(str(exc))}); run `padfree "
            "check-packing --model` on it alone, or pass --no-packing for a padded plan"
        ) from None
    if r.leaked:
        why = (
            f"changing document 1 moves later documents by {r.probe_diff:.3g}"
            if r.probe_leaked
            else f"packed vs alone differ by {r.max_logit_diff:.3g} > {r.tolerance:g}"
        )
        return {"model": model, "exact": False, "detail": f"LEAK on {r.family}, path {r.path}: {why}"}
    detail = f"OK on {r.family}, path {r.path}: packed vs alone {r.max_logit_diff:.3g} <= {r.tolerance:g}"
    return {"model": model, "exact": True, "detail": detail}


def drafter_line(d: dict) -> str:
    """The drafter setup's recommendation in one line, as the page leads with it: the plan, its predicted
    throughput against SpecForge-style random padded batches and its heaviest micro-batch's activations
    (:func:`padfree.advice.report.memory_sentence`)."""
    from padfree.advice.report import memory_sentence

    rec, base = d["recommendation"], d["specforge_random"]
    return (
        f"drafter {d['method']} (recipe {d.get('recipe', '')}): use {rec['strategy']}, predicted "
        f"{rec['over_specforge_random']:.2f}x the throughput of SpecForge-style random padded batches "
        f"(their tokens {base['padding_efficiency']:.1%} real); {memory_sentence(d)}"
    )
