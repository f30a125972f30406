"""``padfree calibrate``: time training steps of a model over padded shapes and fit the cost model."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from padfree.commands.common import bounded_list, check_output, writing
from padfree.drafter.methods import METHODS
from padfree.drafter.methods import get as get_method
from padfree.drafter.options import add_recipe_arguments, recipe_from_args
from padfree.errors import ConfigError
from padfree.options import BUDGET, add_number, add_path, check_device
from padfree.progress import bars_wanted, progress_bar

NAME = "calibrate"
HELP = "time forward+backward+AdamW over padded shapes on this machine; fit time = a*slots + b*attention + c"

QUICK: dict[str, Any] = {
    "budget": 256,
    "lengths": [32, 64, 128, 256],
    "fractions": (1.0, 0.5),
    "repeats": 1,
    "warmup": 0,
}
"""``--quick``: 7 + 3 held-out shapes, each timed once after a single priming step of the largest (11 steps;
a full warm-up round made it 20)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", default="tiny-llama", help="built-in tiny model or a directory with config.json"
    )
    p.add_argument("--attn", default="sdpa", help="attention implementation (default sdpa)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    add_number(p, "--budget", None, "slots of the largest shape (default 1024 on cpu, 16384 on cuda)")
    p.add_argument(
        "--lengths",
        default=None,
        help="comma-separated row lengths, 1 to 64 of them, none above the budget (default: 64, 128, ... "
        "<= 4096; --quick: 32, 64, 128, 256)",
    )
    add_number(p, "--repeats", 3, "timed steps per shape, median kept (default 3)")
    add_number(p, "--warmup", 1, "untimed steps per shape first (default 1)")
    add_number(p, "--seed", 0, "weights and token ids seed (default 0)")
    add_number(p, "--threads", None, "torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny grid (budget 256, one timed step per shape, no warm-up round): rough, check its "
        "held-out error",
    )
    add_path(p, "--out", "cost file to write (default cost.json)", Path("cost.json"))
    p.add_argument(
        "--drafter",
        choices=list(METHODS),
        default=None,
        help="time a drafter step instead (a frozen tiny target's forward + a one-layer drafter's loss, "
        "backward and update, on the CPU): DFlash shapes also vary the anchors and the fit adds "
        "d*blocks + e*reach",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    p.add_argument(
        "--quiet", action="store_true", help="no progress bar (there is none off a terminal or under CI)"
    )
    add_recipe_arguments(p)


def run(args: argparse.Namespace) -> int:
    from padfree.advice.calibrate import calibrate

    check_output(args.out, "the cost model")
    # read before anything is built, with --quick too (it used to drop them unread)
    asked = list(bounded_list(args.lengths, BUDGET, "--lengths", most=64)) if args.lengths else None
    try:
        import torch
    except ImportError:
        raise ConfigError("calibrate needs torch and transformers: pip install 'padfree[torch,hf]'") from None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = check_device(args.device)
    budget, lengths, fractions, repeats, warmup = _shapes(args, device, asked)
    step, anchors_per_token = _timed_step(args, device)
    progress = None
    if not args.json:

        def progress(i, s, t):
            print(f"  {s.count:>5d} x {s.length:<6d} {t * 1e3:9.1f} ms", flush=True)

    # a bar of timed steps on a terminal: the rounds say nothing until the end
    with progress_bar("calibrating: timed steps", None, enabled=bars_wanted(args.quiet)) as advance:

        def counted(*call):
            out = step(*call)
            advance()
            return out

        cal = calibrate(
            counted,
            budget,
            lengths,
            fractions=fractions,
            repeats=repeats,
            warmup=warmup,
            prime=bool(args.quick),
            source=f"calibrate {args.drafter or args.model} {args.attn} {device}",
            meta={
                "model": args.model,
                "attn": args.attn,
                "device": device,
                "threads": torch.get_num_threads(),
                "step": "forward+backward+AdamW step (the update's time is inside c)"
                if args.drafter is None
                else f"{args.drafter}: target forward (no grad), drafter loss, backward, AdamW (update in c)",
                "drafter": args.drafter,
                "command": "padfree " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            },
            progress=progress,
            anchors_per_token=anchors_per_token,
        )
    with writing(args.out, "the cost model"):
        cal.save(args.out)
    if args.json:
        coefs = {k: getattr(cal.cost, k) for k in ("a", "b", "c", "d", "e")}
        print(json.dumps({**coefs, **cal.to_json()}, indent=2))
        return 0
    _print_fit(cal, args.out, anchors_per_token is not None)
    return 0


def _shapes(args: argparse.Namespace, device: str, asked: list[int] | None) -> tuple:
    """The budget, row lengths, fill fractions, repeats and warm-up rounds to time (``--quick``: fewer)."""
    from padfree.advice.calibrate import default_lengths

    fractions = (1.0, 0.5, 0.25)
    repeats, warmup = args.repeats, args.warmup
    if args.quick:
        warmup = min(warmup, QUICK["warmup"])
        budget, lengths, fractions, repeats = (
            QUICK["budget"],
            QUICK["lengths"],
            QUICK["fractions"],
            min(repeats, QUICK["repeats"]),
        )
    else:
        budget = args.budget or (16384 if device.startswith("cuda") else 1024)
        lengths = default_lengths(budget)
    if args.budget and args.quick:
        budget = args.budget
    if asked is not None:
        lengths = asked
        over = [v for v in asked if v > budget]
        if over:
            raise ConfigError(
                f"--lengths: {over[0]} is above the budget {budget} (a row must fit the budget)"
            )
    return budget, lengths, fractions, repeats, warmup


def _timed_step(args: argparse.Namespace, device: str) -> tuple:
    """The step to time (a model's training step, or a drafter's) and the anchors per token it is timed at."""
    from padfree.advice.calibrate import torch_train_step

    anchors_per_token = None
    if args.drafter is not None:
        from padfree.advice.calibrate import torch_drafter_step

        if device != "cpu":
            raise ConfigError("calibrate --drafter times the reference drafters on the CPU: use --device cpu")
        recipe = recipe_from_args(args, args.drafter)
        step = torch_drafter_step(args.drafter, seed=args.seed, recipe=recipe)
        # anchors per token around the recipe's density (every valid position: about one per token)
        rate = recipe.anchor_density
        anchors_per_token = (rate / 4, rate / 2, rate) if get_method(args.drafter).uses_anchors else None
    else:
        step = torch_train_step(args.model, attn=args.attn, device=device, seed=args.seed)
    return step, anchors_per_token


def _print_fit(cal: Any, out: Path, drafter: bool) -> None:
    """The fitted cost model and its fit, held-out error included, as the terminal shows them."""
    from padfree.advice.simulate import HELD_OUT_WARN

    f, h = cal.fit, cal.held_out
    print(
        f"cost model (token-equivalents): a = 1, b = {cal.cost.b:.4g} per L^2, "
        f"c = {cal.cost.c:.4g} per micro-batch"
    )
    print(
        f"seconds per slot: {cal.seconds_per_slot:.4g} ({1 / cal.seconds_per_slot:,.0f} slots/s at b = c = 0)"
    )
    if drafter:
        print(f"drafter terms: d = {cal.cost.d:.4g} per draft block, e = {cal.cost.e:.4g} per unit of reach")
    print(f"fit on {f['n']} shapes: relative RMS {f['rel_rms']:.3f}, max {f['max_rel']:.3f}")
    if h["n"]:
        print(f"held out {h['n']} shapes: relative RMS {h['rel_rms']:.3f}, max {h['max_rel']:.3f}")
    print(f"wrote {out}")
    if h["n"] and h["rel_rms"] > HELD_OUT_WARN:
        print(
            f"warning: held-out relative error {h['rel_rms']:.2f} > {HELD_OUT_WARN}: predictions from this "
            "cost file are rough; calibrate on a quieter machine, with more --repeats or without --quick",
            file=sys.stderr,
        )
