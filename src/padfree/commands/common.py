"""What the commands share: the planning options and how they become a :class:`PlanConfig`, the numeric
option types with their stated ranges (docs/errors.md lists them all), and how outputs are checked and
written so that every failure is one line naming the file."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import numpy as np

from padfree.core.config import (
    DEFAULT_COST,
    MAX_BUCKETS,
    MAX_BUDGET,
    MAX_MIX,
    MAX_RANKS,
    MAX_SEED,
    MAX_SHARD,
    OVERLONG,
    CostModel,
    PlanConfig,
)
from padfree.errors import ConfigError, InputError, OutputError, one_line


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (no usage block) and exit code 2, as
    every padfree error is: the CLI and the examples parse with it."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {one_line(message)}", file=sys.stderr)
        raise SystemExit(2)


class Bounded:
    """An argparse ``type=``: an integer (``kind=int``) or a finite number (``kind=float``) from ``lo`` to
    ``hi`` (``lo`` excluded when ``above``). Anything else is a one-line usage error, exit 2:
    ``padfree plan: error: argument --budget: must be an integer from 1 to 16777216 (got '0')``.

    >>> Bounded(int, 1, 8)("3"), Bounded(float, 1, 2, above=True).range
    (3, 'a number > 1 and <= 2')
    """

    def __init__(self, kind: type, lo: float, hi: float, *, above: bool = False) -> None:
        self.kind, self.lo, self.hi, self.above = kind, lo, hi, above
        self.__name__ = self.range  # argparse names the type in some messages

    @property
    def range(self) -> str:
        if self.kind is int:
            return f"an integer from {self.lo} to {self.hi}"
        return f"a number {'>' if self.above else '>='} {self.lo:g} and <= {self.hi:g}"

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except (ValueError, OverflowError):
            value = None
        ok = value is not None and (
            (value > self.lo if self.above else value >= self.lo)
            and value <= self.hi
            and (self.kind is int or math.isfinite(value))
        )
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {self.range} (got {text[:40]!r})")
        return value

    def __repr__(self) -> str:
        return f"Bounded({self.range})"


def bounded_list(text: str, kind: Bounded, option: str, most: int = 32) -> tuple:
    """Up to ``most`` comma-separated values, each in ``kind``'s range (else a one-line ConfigError)."""
    parts = [v.strip() for v in text.split(",") if v.strip()]
    if not parts or len(parts) > most:
        raise ConfigError(f"{option} takes 1 to {most} comma-separated values (got {len(parts)})")
    try:
        return tuple(kind(v) for v in parts)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{option}: each value {exc}") from None


def check_device(text: str | None, option: str = "--device") -> str:
    """The torch device ``text`` names, checked on this machine before any work (``None``: ``cuda`` when
    there is one, else ``cpu``): a name torch does not know, a device type padfree does not run on (``meta``,
    ``mps``...) or a CUDA device this machine lacks is one :class:`ConfigError` line naming ``option``."""
    import torch

    if text is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"{option} {text[:40]!r}: not a device name (cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return text
    if dev.type != "cuda":
        raise ConfigError(f"{option} {text}: padfree runs on cpu or cuda, not on {dev.type} devices")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(f"{option} {text}: no CUDA device on this machine (use --device cpu)")
    if dev.index is not None and dev.index >= count:
        raise ConfigError(
            f"{option} {text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return text


BUDGET = Bounded(int, 1, MAX_BUDGET)
RANKS = Bounded(int, 1, MAX_RANKS)
GROWTH = Bounded(float, 1, 1e9, above=True)
BUCKETS = Bounded(int, 1, MAX_BUCKETS)
MIX = Bounded(int, 1, MAX_MIX)
SEED = Bounded(int, 0, MAX_SEED)
THREADS = Bounded(int, 1, 1024)
COUNT = Bounded(int, 1, 10**6)  # timed steps, repeats, samples
WARM = Bounded(int, 0, 10**6)  # untimed steps
VOCAB = Bounded(int, 2, 2**24)
BLOCK = Bounded(int, 2, 1024)  # DFlash block size
TTT = Bounded(int, 1, 64)  # EAGLE-3 test-time-training steps
ANCHORS = Bounded(int, 1, 2**31 - 1)
WIDTH = Bounded(int, 1, 2**20)
LAYERS = Bounded(int, 1, 4096)
BYTES = Bounded(int, 1, 16)
SHARD = Bounded(int, 1, MAX_SHARD)  # SP / CP degrees

NUMERIC: dict[str, Bounded] = {
    "--budget": BUDGET,
    "--world-size": RANKS,
    "--grad-accum": RANKS,
    "--gpus": RANKS,
    "--growth": GROWTH,
    "--buckets": BUCKETS,
    "--sp": SHARD,
    "--cp": SHARD,
    "--mix": MIX,
    "--seed": SEED,
    "--epoch": SEED,
    "--threads": THREADS,
    "--repeats": COUNT,
    "--steps": COUNT,
    "--warmup": WARM,
    "--vocab": VOCAB,
    "--vocab-size": VOCAB,
    "--block-size": BLOCK,
    "--ttt": TTT,
    "--max-anchors": ANCHORS,
    "--anchor-budget": ANCHORS,
    "--target-hidden": WIDTH,
    "--target-layers": LAYERS,
    "--cache-layers": LAYERS,
    "--cache-bytes": BYTES,
    "--draft-layers": LAYERS,
}
"""The range of each numeric option that more than one command defines, or that a command shares with the
plan options: one name, one range, in every command (docs/errors.md lists them)."""


def add_number(
    p: argparse._ActionsContainer, flag: str, default: int | float | None, help_: str | None = None
) -> None:
    """Add the numeric option ``flag`` with its range from :data:`NUMERIC`.

    >>> p = argparse.ArgumentParser()
    >>> add_number(p, "--seed", 0, "seed (default 0)")
    >>> p.parse_args(["--seed", "7"]).seed
    7
    """
    p.add_argument(flag, type=NUMERIC[flag], default=default, help=help_)


def add_output_options(p: argparse._ActionsContainer, json_help: str, seed_help: str) -> None:
    """``--json`` then ``--seed`` (default 0), as the checking commands end their options."""
    p.add_argument("--json", action="store_true", help=json_help)
    add_number(p, "--seed", 0, seed_help)


# ----- inputs and outputs ----------------------------------------------------------------------------------
def check_input(path: Path, what: str) -> None:
    """An input that exists is a regular file or a folder: a FIFO or device would block or never end (a
    missing one is left to its reader, which says what it looked for)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise InputError(f"cannot read the {what} ({exc.strerror or exc})", path=str(path)) from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise InputError(
            f"the {what} is not a regular file or folder (a pipe or device cannot be read)", path=str(path)
        )


def check_output(path: Path, what: str, *, folder: bool = False) -> None:
    """Refuse, before any work, an output that cannot be written: its folder missing, a file where a folder
    should be, a read-only or unwritable place, or a folder where a file should be (``folder=False``)."""
    target = path if folder else path.parent
    probe = target
    while not probe.exists() and probe != probe.parent:  # the nearest existing ancestor will hold it
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise OutputError(f"cannot write {what}: {probe} is a file, not a folder", path=str(path))
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {what}: {probe} is read-only or not writable", path=str(path))
    if not folder and path.is_dir():
        raise OutputError(f"cannot write {what}: it is a folder", path=str(path))


@contextlib.contextmanager
def writing(path: Path, what: str) -> Iterator[None]:
    """Turn an OSError while writing ``what`` to ``path`` (a full device, a vanished folder...) into one
    :class:`OutputError` line naming the file."""
    try:
        yield
    except OSError as exc:
        name = exc.filename if exc.filename else path
        raise OutputError(f"cannot write {what} ({exc.strerror or exc})", path=str(name)) from None


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
    add_number(p, "--budget", 16384, "tokens per micro-batch (default 16384)")
    add_number(p, "--world-size", 8, "ranks / GPUs (default 8)")
    add_number(p, "--grad-accum", 4, "micro-batches per rank per step (default 4)")
    add_number(p, "--growth", 1.25, "bucketed: bucket width growth (default 1.25)")
    add_number(p, "--buckets", None, "bucketed: N padding-optimal buckets instead")
    add_number(
        p,
        "--mix",
        None,
        "bucketed: noise window in micro-batches, every bucket (default: chosen from the data, "
        "see docs/planning.md)",
    )
    add_number(p, "--seed", 0, "seed (default 0)")
    p.add_argument("--overlong", default="error", help=f"samples over the budget: {', '.join(OVERLONG)}")
    p.add_argument("--cost", type=Path, default=None, help="cost model JSON from `padfree calibrate`")


def add_shard_options(p: argparse.ArgumentParser) -> None:
    """``--sp`` / ``--cp``: plan for sequence / context parallelism (``plan`` and ``analyze``)."""
    add_number(
        p, "--sp", 1, "sequence-parallel degree: rows padded to a multiple of it; --world-size counts "
        "data-parallel ranks and --budget stays per GPU, a row holds sp x cp x budget tokens (default 1)",
    )  # fmt: skip
    add_number(
        p, "--cp", 1, "context-parallel degree: packed documents padded to a multiple of 2 x cp (default 1)"
    )


def add_plan_inputs(p: argparse.ArgumentParser, required: bool) -> None:
    """The lengths file and the planning options: what ``plan``, ``simulate`` and ``report`` read first."""
    add_lengths_argument(p, required)
    add_plan_options(p)


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
        sp=getattr(args, "sp", 1),
        cp=getattr(args, "cp", 1),
    )


# ----- drafter recipes -------------------------------------------------------------------------------------
def _optional_int(kind: Bounded):
    """An argparse type: ``kind``, or ``none`` for no value (a recipe field that may be off)."""

    def parse(text: str) -> int | float | str:
        return "none" if text.strip().lower() == "none" else kind(text)

    parse.__name__ = f"{kind.range} or none"
    return parse


def _yes_no(text: str) -> bool:
    t = text.strip().lower()
    if t in ("yes", "true", "on", "1"):
        return True
    if t in ("no", "false", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"must be yes or no (got {text[:40]!r})")


def add_recipe_arguments(p: argparse.ArgumentParser) -> None:
    """``--recipe`` and one option per recipe field (:class:`padfree.drafter.recipes.Recipe`), each left unset
    (``None``: the recipe's own value) unless given: ``--recipe speculators --block-size 8``."""
    from padfree.drafter import recipes

    g = p.add_argument_group("drafter recipe (default: the recipe's own value for every field)")
    g.add_argument(
        "--recipe",
        choices=list(recipes.NAMES),
        default=recipes.DEFAULT,
        help=f"the published recipe to train as (default {recipes.DEFAULT}; docs/drafters.md)",
    )
    for name, rule in recipes.FIELDS.items():
        flag = "--" + name.replace("_", "-")
        if rule.kind == "choice":
            g.add_argument(flag, choices=list(rule.choices), default=None, help=rule.help)
        elif rule.kind == "bool":
            g.add_argument(flag, type=_yes_no, default=None, metavar="yes|no", help=rule.help)
        else:  # a number: one range for the option and the recipe (NUMERIC's where other commands share it)
            kind = NUMERIC.get(flag) or Bounded(int if rule.kind == "int" else float, rule.lo, rule.hi,
                                                above=rule.above)  # fmt: skip
            g.add_argument(
                flag, type=_optional_int(kind) if rule.optional else kind, default=None, help=rule.help
            )


def recipe_from_args(args: argparse.Namespace, method: str):
    """The recipe ``--recipe`` names for ``method`` with every given field option applied (``none`` turns an
    optional field off)."""
    from padfree.drafter import recipes

    changes = {k: getattr(args, k, None) for k in recipes.FIELDS}
    base = recipes.get(args.recipe, method)
    off = {k: None for k, v in changes.items() if v == "none"}
    changed = recipes.override(base, **{k: v for k, v in changes.items() if v != "none"})
    return dataclasses.replace(changed, **off) if off else changed  # type: ignore[arg-type]
