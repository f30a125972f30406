"""``padfree simulate``: predicted throughput of each strategy on N GPUs from the plan and the cost model."""

from __future__ import annotations

import argparse
import json
import sys

from padfree.commands.common import (
    add_drafter_arguments,
    add_plan_inputs,
    add_strategies_option,
    config_from_args,
    drafter_from_args,
    load_lengths,
    strategies_from_args,
)
from padfree.core.config import STRATEGIES
from padfree.options import add_number, add_path

NAME = "simulate"
HELP = "predict each strategy's training throughput on N GPUs (ranks wait for the slowest every step)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_plan_inputs(p, required=False)
    add_number(p, "--gpus", None, "GPUs (ranks); overrides --world-size")
    add_strategies_option(p, "comma-separated strategies")
    p.add_argument("--no-naive", action="store_true", help="leave out the naive bucketing baseline")
    p.add_argument(
        "--speeds",
        default=None,
        help="per-rank time factors, e.g. 1,1,1,1,1,1,1,1.5 (the last rank 1.5x slower); sets the world size "
        "and adds what dynamic balancing predicts",
    )
    add_path(
        p,
        "--true-cost",
        "cost model JSON of what micro-batches really cost (the plan still balances by --cost or the "
        "default); adds what dynamic balancing predicts once it has learned it",
    )
    add_drafter_arguments(p, "simulate a drafter setup")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    from padfree.advice.simulate import (
        cost_warning,
        load_seconds_per_unit,
        motivating_ratios,
        parse_speeds,
        simulate,
    )
    from padfree.core.config import CostModel

    if args.gpus is not None:
        args.world_size = args.gpus
    speeds = None
    if args.speeds is not None:
        speeds = parse_speeds(args.speeds, args.gpus)
        args.world_size = speeds.size
    true_cost = CostModel.load(args.true_cost) if args.true_cost is not None else None
    names = strategies_from_args(args.strategies, STRATEGIES)
    cfg = config_from_args(args, names[0])
    spu = load_seconds_per_unit(args.true_cost or args.cost)  # a bad file is a one-line ConfigError
    warning = cost_warning(args.cost)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    lengths, path, name = load_lengths(args)
    anchors, drafter = None, None
    if args.drafter is not None:
        cfg, anchors, drafter = drafter_from_args(args, cfg, lengths)
    result = simulate(
        lengths,
        cfg,
        tuple(names),
        seconds_per_unit=spu,
        naive=not args.no_naive,
        path=path,
        speeds=speeds,
        true_cost=true_cost,
        anchors=anchors,
    )
    result["dataset"] = name
    if drafter is not None:
        result["drafter"] = drafter
    seed_mix = args.lengths is None
    if seed_mix:
        result["motivating_measured_ratio_to_sorted"] = motivating_ratios()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _render(result, seed_mix and drafter is None)
    if drafter is not None:
        blocks = (
            f"{drafter['draft_blocks']:,} {drafter['title']} blocks per epoch; "
            if drafter["uses_anchors"]
            else ""
        )
        print(
            f"drafter {drafter['method']}: {blocks}offline "
            f"hidden-state cache {drafter['cache_bytes'] / 2**30:,.1f} GiB ({drafter['tokens']:,} tokens x "
            f"{drafter['cache_layers']} layers x {drafter['hidden']} x "
            f"{drafter['cache_bytes_per_value']} bytes)"
        )
    return 0


def _render(result: dict, seed_mix: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    c = result["config"]
    spu = c["seconds_per_unit"]
    title = f"{result['dataset']}: predicted throughput on {c['gpus']} GPUs x grad-accum {c['grad_accum']}"
    speeds = f"; rank time factors {c['speeds']}" if c.get("speeds") else ""
    caption = (
        f"budget {c['budget']}, cost a={c['cost']['a']:.3g} b={c['cost']['b']:.3g} c={c['cost']['c']:.3g} "
        f"({c['cost']['source']}); "
        + (
            f"{spu:.3g} s per unit"
            if spu
            else "no seconds per unit: relative only (pass --cost from calibrate)"
        )
        + speeds
        + (
            f"; true cost a={c['true_cost']['a']:.3g} b={c['true_cost']['b']:.3g} c={c['true_cost']['c']:.3g}"
            if c.get("true_cost")
            else ""
        )
    )
    table = Table(title=title, caption=caption)
    for col in ("strategy", "pad eff", "imbalance", "tok/unit" if not spu else "tok/s"):
        table.add_column(col, justify="right" if col != "strategy" else "left")
    table.add_column("vs sorted", justify="right")
    dynamic = any("dynamic" in r for r in result["strategies"].values())
    if dynamic:
        for col in ("dynamic imbalance", "dynamic / static"):
            table.add_column(col, justify="right")
    seed_mix = seed_mix and not dynamic  # the motivating case's ratios are for equal ranks
    measured = result.get("motivating_measured_ratio_to_sorted", {})
    if seed_mix:
        table.add_column("measured", justify="right")
    for name, r in result["strategies"].items():
        thr = f"{r['tokens_per_second']:,.0f}" if spu else f"{r['tokens_per_unit']:.4f}"
        cells = [name, f"{r['padding_efficiency']:.4f}", f"{r['imbalance']:.4f}", thr]
        cells.append(f"{r['ratio_to_sorted']:.3f}" if "ratio_to_sorted" in r else "-")
        if dynamic:
            d = r.get("dynamic")
            cells += [f"{d['imbalance']:.4f}", f"{r['dynamic_over_static']:.3f}"] if d else ["-", "-"]
        if seed_mix:
            cells.append(f"{measured[name]:.2f}" if name in measured and name != "sorted" else "")
        table.add_row(*cells)
    Console().print(table)
    if seed_mix:
        Console().print(
            "measured: the motivating case's ratios to sorted (random 11.9/32 Ktok/s, naive bucketed "
            "25.1/32 Ktok/s); "
            "padfree's bucketed is expected to beat naive bucketing."
        )
