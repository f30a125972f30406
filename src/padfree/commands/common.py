"""What the commands share: the planning options and how they become a :class:`PlanConfig`, and how outputs
are checked and written so that every failure is one line naming the file (the option types with their
stated ranges, which the examples parse with too, are :mod:`padfree.options`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from padfree.core.config import DEFAULT_COST, OVERLONG, STRATEGIES, CostModel, PlanConfig
from padfree.drafter.options import add_recipe_arguments, recipe_from_args
from padfree.errors import ConfigError, InputError, OutputError
from padfree.options import Bounded, add_number, add_path, plan_config

if TYPE_CHECKING:
    from padfree.drafter.setup import TargetShape


def bounded_list(text: str, kind: Bounded, option: str, most: int = 32) -> tuple:
    """Up to ``most`` comma-separated values, each in ``kind``'s range (else a one-line ConfigError)."""
    parts = [v.strip() for v in text.split(",") if v.strip()]
    if not parts or len(parts) > most:
        raise ConfigError(f"{option} takes 1 to {most} comma-separated values (got {len(parts)})")
    try:
        return tuple(kind(v) for v in parts)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{option}: each value {exc}") from None


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
    add_path(p, "--cost", "cost model JSON from `padfree calibrate`")


def add_shard_options(p: argparse.ArgumentParser) -> None:
    """``--sp`` / ``--cp``: plan for sequence / context parallelism (``plan`` and ``analyze``)."""
    add_number(
        p, "--sp", 1, "sequence-parallel degree: rows padded to a multiple of it; --world-size counts "
        "data-parallel ranks and --budget stays per GPU, a row holds sp x cp x budget tokens (default 1)",
    )  # fmt: skip
    add_number(
        p, "--cp", 1, "context-parallel degree: packed documents padded to a multiple of 2 x cp (default 1)"
    )
    p.add_argument(
        "--shapes",
        type=shapes_option,
        default=None,
        help="row lengths a compiler keeps: a granularity (512: every row a multiple of it) or the allowed "
        "lengths (1024,2048,4096); rows are padded up to the next one, counted as padding",
    )


def shapes_option(text: str) -> int | tuple[int, ...]:
    """``--shapes``: ``512`` (a granularity) or ``1024,2048,4096`` (the allowed row lengths)."""
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer or a comma-separated list of integers (got {text[:40]!r})"
        ) from None
    if any(not 1 <= v <= 2**24 for v in vals):
        raise argparse.ArgumentTypeError(f"row lengths must be from 1 to {2**24} (got {text[:40]!r})")
    return vals[0] if len(vals) == 1 and "," not in text else tuple(vals)


def add_plan_inputs(p: argparse.ArgumentParser, required: bool) -> None:
    """The lengths file and the planning options: what ``plan``, ``analyze``, ``simulate`` and ``report`` read
    first."""
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


# ----- weighted sources (padfree.core.sources) -----------------------------------------------------------
def add_source_options(p: argparse.ArgumentParser) -> None:
    """``--source NAME=FILE:WEIGHT`` (repeated), ``--unit``, ``--epoch-steps`` / ``--epoch-tokens``: plan a
    weighted mixture of length files instead of one (:func:`sources_from_args` reads them)."""
    g = p.add_argument_group("weighted sources (instead of one lengths file)")
    g.add_argument(
        "--source",
        action="append",
        default=None,
        metavar="NAME=FILE:WEIGHT",
        help="a named lengths file and its weight; repeat it for every source. Every step then holds each "
        "source's share of the step in --unit, within one document (loss tokens from FILE.assistant.npy "
        "beside a .npy when present)",
    )
    g.add_argument(
        "--unit", default="tokens", help="what a weight counts: documents, tokens or loss (default tokens)"
    )
    add_number(g, "--epoch-steps", None, "an epoch of sources in optimizer steps")
    add_number(g, "--epoch-tokens", None, "an epoch of sources in tokens (default: every source's tokens)")


def parse_source(text: str) -> tuple[str, Path, float]:
    """``NAME=FILE:WEIGHT`` as ``(name, file, weight)``; a malformed one is one line naming the rule."""
    name, eq, rest = text.partition("=")
    file, colon, weight = rest.rpartition(":")
    if not eq or not colon or not name or not file:
        raise ConfigError(f"--source {text!r}: write it NAME=FILE:WEIGHT (e.g. chat=chat.npy:0.6)")
    try:
        w = float(weight)
    except ValueError:
        raise ConfigError(f"source {name!r}: weight must be a finite number > 0 (got {weight!r})") from None
    return name, Path(file), w


def sources_from_args(
    args: argparse.Namespace, config: PlanConfig
) -> tuple[PlanConfig, dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """``config`` with the sources of ``--source``, ``--unit`` and the epoch length, each source's lengths
    and, when every ``.npy`` source has its ``.assistant.npy`` beside it, their loss tokens."""
    from padfree.data.length_files import assistant_path, read_lengths, read_loss_counts

    if getattr(args, "lengths", None) is not None:
        raise ConfigError("give one lengths file or --source NAME=FILE:WEIGHT options, not both")
    parsed = [parse_source(t) for t in args.source]
    cfg = config.with_(
        sources=tuple((n, w) for n, _, w in parsed),
        unit=args.unit,
        epoch_steps=args.epoch_steps,
        epoch_tokens=args.epoch_tokens,
    )
    lengths: dict[str, np.ndarray] = {}
    loss: dict[str, np.ndarray] = {}
    for name, file, _ in parsed:
        if name in lengths:
            raise ConfigError(f"source {name!r}: named twice (source names must be unique)")
        check_input(file, f"lengths of source {name!r}")
        try:
            arr = read_lengths(file, field=args.field, column=args.column)
        except InputError as exc:
            raise InputError(f"source {name!r}: {exc.rule}", path=str(file)) from None
        if arr.shape[0] == 0:
            raise ConfigError(f"source {name!r}: empty (a source needs at least one sample)")
        lengths[name] = arr
        aux = assistant_path(file) if file.suffix == ".npy" else None
        if aux is not None and aux.exists():
            loss[name] = np.minimum(read_loss_counts(aux, arr), np.maximum(arr - 1, 0))
    return cfg, lengths, loss if len(loss) == len(lengths) else None


def add_strategies_option(p: argparse.ArgumentParser, help_: str) -> None:
    """``--strategies`` (default: every strategy), read by :func:`strategies_from_args`."""
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=help_)


def strategies_from_args(text: str, known: Iterable[str]) -> list[str]:
    """``--strategies``: comma-separated names, each one of ``known`` (else a one-line ConfigError)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in known]
    if bad or not names:
        choices = ", ".join(known)
        raise ConfigError(f"unknown strategy {bad[0] if bad else '(none)'!r}: choose from {choices}")
    return names


def config_from_args(args: argparse.Namespace, strategy: str) -> PlanConfig:
    """The plan options (:func:`add_plan_options`, :func:`add_shard_options`) as a :class:`PlanConfig` of
    ``strategy``, its cost model read from ``--cost``."""
    cost: CostModel = DEFAULT_COST if args.cost is None else CostModel.load(args.cost)
    return plan_config(args, strategy, cost=cost)


TARGET_DEFAULTS = {"hidden": 4096, "layers": 32, "vocab": 128256}
"""The target a drafter setup assumes without ``--target`` or its size options (a Llama-3-8B's shape)."""


def add_drafter_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """The drafter-setup options (``--drafter`` and its shape, anchors and cache), shared by ``simulate``
    and ``report``; :func:`drafter_from_args` reads them."""
    from padfree.drafter.methods import METHODS

    d = p.add_argument_group("drafter setup (a frozen target + a DFlash or EAGLE-3 drafter)")
    d.add_argument("--drafter", choices=list(METHODS), default=None, help=what)
    add_path(
        d,
        "--assistant",
        "loss-bearing tokens per sample (.npy, e.g. NAME.assistant.npy; default: beside --lengths when "
        "present, else every token but the first)",
    )
    add_number(d, "--anchor-budget", None, "DFlash blocks per micro-batch at most")
    add_path(
        d,
        "--target",
        "the target's local transformers folder: its config.json gives the hidden size, layers, "
        "vocabulary, heads and MLP width (instead of --target-hidden, --target-layers, --vocab)",
    )
    add_number(d, "--target-hidden", None, f"target hidden size (default {TARGET_DEFAULTS['hidden']})")
    add_number(d, "--target-layers", None, f"target layers (default {TARGET_DEFAULTS['layers']})")
    add_number(d, "--vocab", None, f"vocabulary (default {TARGET_DEFAULTS['vocab']})")
    add_number(
        d,
        "--cache-layers",
        None,
        "target layers an offline hidden-state cache keeps per token (default: DFlash 5, EAGLE-3 3, "
        "plus the last layer for the targets' logits)",
    )
    add_number(d, "--cache-bytes", 2, "bytes per cached value (default 2: bf16)")
    add_number(d, "--draft-layers", 5, "drafter layers (default 5, speculators' DFlash default)")
    d.add_argument(
        "--memory-gb",
        type=Bounded(float, 0, 2**20, above=True),
        default=None,
        help="activation memory a micro-batch may take (GiB): bounds each micro-batch's draft blocks "
        "(DFlash) or attention (EAGLE-3) by padfree.drafter.memory's model; the report says each plan's peak",
    )
    add_recipe_arguments(p)


def target_from_args(args: argparse.Namespace) -> TargetShape:
    """The target of a drafter setup: ``--target DIR``'s config.json, else ``--target-hidden``,
    ``--target-layers``, ``--vocab`` or their defaults with the common shapes
    (:meth:`~padfree.drafter.setup.TargetShape.common`). Both at once is a one-line :class:`ConfigError`."""
    from padfree.advice.drafter import target_of_folder
    from padfree.drafter.setup import TargetShape

    given = {"hidden": args.target_hidden, "layers": args.target_layers, "vocab": args.vocab}
    if args.target is None:
        return TargetShape.common(**{k: TARGET_DEFAULTS[k] if v is None else v for k, v in given.items()})
    flags = {"hidden": "--target-hidden", "layers": "--target-layers", "vocab": "--vocab"}
    both = [flags[k] for k, v in given.items() if v is not None]
    if both:
        raise ConfigError(f"{both[0]} and --target: the target folder's config.json gives its sizes")
    return target_of_folder(Path(args.target))


def drafter_from_args(
    args: argparse.Namespace, config: PlanConfig, lengths: np.ndarray
) -> tuple[PlanConfig, np.ndarray | None, dict]:
    """The drafter setup of ``--drafter`` and its options (:func:`add_drafter_arguments`)
    (:func:`padfree.drafter.setup.drafter_setup`): its plan config, per-sample anchors and report
    (:func:`padfree.advice.drafter.priced_setup`).
    ``--assistant`` defaults to the loss counts beside ``--lengths`` when present."""
    from padfree.advice.drafter import priced_setup
    from padfree.data.length_files import assistant_path, read_loss_counts
    from padfree.drafter.setup import drafter_setup

    recipe = recipe_from_args(args, args.drafter)
    aux = args.assistant
    if aux is None and args.lengths is not None and assistant_path(Path(args.lengths)).exists():
        aux = assistant_path(Path(args.lengths))
    lengths = np.asarray(lengths, dtype=np.int64)
    target = target_from_args(args)
    if args.cache_layers is not None and args.cache_layers > target.layers:
        source = "--target" if args.target is not None else "--target-layers"
        raise ConfigError(
            f"--cache-layers {args.cache_layers}: the target has {target.layers} layers "
            f"({source}); a hidden-state cache keeps at most one per layer"
        )
    setup = drafter_setup(
        recipe,
        config,
        target=target,
        lengths=lengths,
        loss_counts=None if aux is None else read_loss_counts(aux, lengths),
        memory_gb=args.memory_gb,
        anchor_budget=args.anchor_budget,
        draft_layers=args.draft_layers,
        cost=None if args.cost is None else config.cost,
    )
    report = priced_setup(
        setup,
        lengths,
        cache_layers=args.cache_layers,
        cache_bytes=args.cache_bytes,
        target_name=None if args.target is None else str(args.target),
        loss_counts_name=None if aux is None else str(aux),
    )
    return setup.config, setup.anchors, report
