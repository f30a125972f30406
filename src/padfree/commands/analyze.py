"""``padfree analyze``: compare the strategies on one lengths file."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from padfree.commands.common import (
    add_plan_inputs,
    add_shard_options,
    add_source_options,
    add_strategies_option,
    config_from_args,
    load_lengths,
    sources_from_args,
    strategies_from_args,
)
from padfree.core.config import STRATEGIES
from padfree.core.strategies import REGISTRY

OVERLONG_WITH_CHUNKED = "truncate"
"""``--overlong`` when ``chunked`` is among the strategies and none is given: samples over the budget are
truncated by the other strategies (what ``chunked`` is compared against) and, over grad-accum x budget, by
chunked itself (which cannot split)."""

NAME = "analyze"
HELP = "compare the strategies on a lengths file: padding, balance, diversity, planning time"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_plan_inputs(p, required=False)
    add_shard_options(p)
    add_strategies_option(
        p,
        f"comma-separated strategies to compare (default {','.join(STRATEGIES)}; also: chunked, whose "
        "documents up to grad-accum x budget tokens train whole in chunks; with chunked, --overlong "
        "defaults to truncate, so the others truncate what chunked would train whole)",
    )
    p.set_defaults(overlong=None)  # error; truncate when chunked is compared (see run)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_source_options(p)


def run(args: argparse.Namespace) -> int:
    from padfree.advice.analyze import analyze_strategies, render_table, short_epoch

    names = strategies_from_args(args.strategies, REGISTRY)
    if args.overlong is None:  # chunked trains long documents whole: the others' default can only truncate
        args.overlong = OVERLONG_WITH_CHUNKED if any(REGISTRY[s].context for s in names) else "error"
    if args.source:
        return analyze_sources(args, names)
    configs = {s: config_from_args(args, s) for s in names}
    lengths, path, name = load_lengths(args)
    result = analyze_strategies(lengths, configs, path=path, progress=not args.json)
    result["dataset"]["name"] = name
    long_docs = long_documents(lengths, configs, result, path)
    if long_docs is not None:
        result["long_documents"] = long_docs
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render_table(result)
        if long_docs is not None:
            print(f"long documents: {long_docs['text']}")
    warning = short_epoch(result)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def long_documents(lengths: Any, configs: dict, result: dict, path: str | None) -> dict | None:
    """The report's word on samples over the budget (truncated, split, or chunked whole) when ``packed`` and
    ``chunked`` were both analyzed: which one wins, from the plans just measured."""
    from padfree.advice.report.chunked import chunked_numbers

    measured = result["strategies"]
    whole = [s for s in measured if REGISTRY[s].context]  # the strategy that trains long documents whole
    if "packed" not in measured or not whole:
        return None
    return chunked_numbers(lengths, configs["packed"], measured["packed"], path, chunked=measured[whole[0]])


def analyze_sources(args: argparse.Namespace, names: list[str]) -> int:
    """``--source``: the packed and bucketed plans of the weighted sources (the strategies that plan them),
    in numbers: padding, rank balance, each step's share error and each source's repetition."""
    from padfree.core import sources

    names = [s for s in names if s in ("packed", "bucketed")] or ["packed", "bucketed"]
    result: dict[str, Any] = {"strategies": {}}
    for s in names:
        cfg, lengths, loss = sources_from_args(args, config_from_args(args, s))
        data = sources.source_data(lengths, cfg, loss)
        plan, _ = sources.plan_sources(data, cfg, 0)
        result["strategies"][s] = sources.measure(plan, data)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    first = next(iter(result["strategies"].values()))
    print(f"weighted sources, unit {first['unit']}: share error in documents (a step's worst source)")
    print(f"{'strategy':<10}{'steps':>7}{'padding eff':>13}{'imbalance':>11}{'p99':>8}{'share err max':>15}")
    for s, m in result["strategies"].items():
        print(
            f"{s:<10}{m['steps']:>7}{m['padding_efficiency']:>13.4f}{m['imbalance_mean']:>11.4f}"
            f"{m['imbalance_p99']:>8.4f}{m['share_error_max']:>15.3f}"
        )
    for name, r in first["sources"].items():
        print(
            f"  {name}: weight {r['weight']:.3f}, {r['drawn']:,} of {r['samples']:,} samples drawn "
            f"({r['passes']:.2f} passes)"
        )
    return 0
