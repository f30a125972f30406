"""The options padfree's command line and its example training loops parse with: the one-line usage-error
parser, numbers with their stated ranges (docs/errors.md lists them all), the device check, the record
format option group, and the examples' data, plan and model options."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from padfree.core.config import (
    MAX_BUCKETS,
    MAX_BUDGET,
    MAX_MIX,
    MAX_RANKS,
    MAX_SEED,
    MAX_SHARD,
    OVERLONG,
    STRATEGIES,
    PlanConfig,
)
from padfree.core.strategies import REGISTRY
from padfree.errors import ConfigError, PadfreeError, one_line


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (no usage block) and exit code 2, as
    every padfree error is: the CLI and the examples parse with it. It never reads an abbreviation of a long
    option (``allow_abbrev=False``, forced): ``--sp 2`` must not silently become ``--split 2``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

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


def device_option(text: str) -> str:
    """An argparse ``type=`` for a script's ``--device``: :func:`check_device` when the options are parsed,
    its refusal a one-line usage error (exit 2) before any work."""
    try:
        return check_device(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--device ")) from None


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
TOKENS = Bounded(int, 1, 2**40)  # bench: tokens per run, between evals
POOL = Bounded(int, 1, 2**31 - 1)  # bench: samples drawn from
LR = Bounded(float, 0, 10, above=True)  # bench: peak learning rate
FRACTION = Bounded(float, 0, 1)  # bench: warm-up share
TOLERANCE = Bounded(float, 0, 1e6)  # check-packing: logit difference taken as noise
WORKERS = Bounded(int, 1, 256)  # lengths: processes
DOCS = Bounded(int, 2, 4096)  # check-drafter: documents in the packed row
MAX_TOKENS = Bounded(int, 2, 65536)  # check-drafter: tokens per document

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
    "--epoch-steps": Bounded(int, 1, 2**62),  # weighted sources: an epoch in optimizer steps
    "--epoch-tokens": Bounded(int, 1, 2**62),  # ... or in tokens
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


def add_path(
    p: argparse._ActionsContainer,
    flag: str,
    help_: str,
    default: Path | None = None,
    *,
    required: bool = False,
) -> None:
    """Add the file or folder option ``flag``: a :class:`~pathlib.Path` (``default`` when not given).

    >>> p = argparse.ArgumentParser()
    >>> add_path(p, "--cost", "cost model JSON")
    >>> p.parse_args(["--cost", "c.json"]).cost.suffix, p.parse_args([]).cost
    ('.json', None)
    """
    p.add_argument(flag, type=Path, default=default, required=required, help=help_)


# ----- records ---------------------------------------------------------------------------------------------
def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """The record-format options: ``padfree lengths`` and the training examples."""
    from padfree.data.reading import MODES

    p.add_argument(
        "--format",
        default="auto",
        choices=MODES,
        help="record format (default: detected per file from its first record or its columns)",
    )
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--field", default=None, help="every record is a document in this field (e.g. text)")
    kind.add_argument(
        "--messages", default=None, help="every record is a chat in this field (list of {role, content})"
    )
    p.add_argument(
        "--field-map",
        action="append",
        default=[],
        metavar="KEY=NAME",
        help="read field KEY under another NAME, e.g. conversations=dialog, from=speaker (repeatable)",
    )
    p.add_argument("--split", default=None, help="the split of a DatasetDict folder (save_to_disk)")
    p.add_argument(
        "--chat-template",
        action="store_true",
        help="render chats with the tokenizer's chat template (transformers folder); default rule: "
        "[BOS] + role\\ncontent\\n + [EOS] per message",
    )


def record_options(args: argparse.Namespace) -> dict[str, Any]:
    """The reader's keywords (``mode``, ``fields``, ``split``, ``chat_template``: those of
    :func:`padfree.data.count_lengths.count_lengths`) from the options of :func:`add_data_arguments`; a
    ``--field`` or ``--messages`` that contradicts ``--format`` is one :class:`ConfigError` line.

    >>> p = argparse.ArgumentParser()
    >>> add_data_arguments(p)
    >>> record_options(p.parse_args(["--field", "body"]))["mode"]
    'text'
    """
    from padfree.data.formats import parse_field_map
    from padfree.data.reading import field_map

    mode, field = args.format, None
    for flag, forced in (("field", "text"), ("messages", "messages")):
        value = getattr(args, flag)
        if value:
            if mode not in ("auto", forced):
                raise ConfigError(f"--{flag} reads {forced} records; it contradicts --format {mode}")
            mode, field = forced, value
    fields = field_map(mode, field, parse_field_map(args.field_map))
    return {"mode": mode, "fields": fields, "split": args.split, "chat_template": args.chat_template}


# ----- the example training loops' options ----------------------------------------------------------------
def example_parser(doc: str) -> argparse.ArgumentParser:
    """An example's argument parser: a bad option is one line and exit code 2, as in the ``padfree`` CLI."""
    return OneLineParser(description=doc.splitlines()[0])


def add_data_and_model_args(p: argparse.ArgumentParser, fixtures: Path, chunked: bool = False) -> None:
    """``--data``, ``--tokenizer``, the plan shape, the loss and a tiny model built from a config; ``--data``
    and ``--tokenizer`` default to the real samples and tokenizer in ``fixtures`` (the repository's
    ``fixtures/``), ``chunked``: the loop trains the strategies whose documents span chunks too (the
    registry's ``context``: ``chunked``), and takes ``--keep-chunks``."""
    p.add_argument(
        "--data",
        nargs="+",
        default=[str(fixtures / "samples/*.jsonl.gz")],
        help="files, globs or folders of records (.jsonl[.gz], .parquet, datasets folders): as "
        "`padfree lengths` reads them",
    )
    p.add_argument(
        "--tokenizer",
        default=str(fixtures / "tokenizers/llama_sp32k.model"),
        help="SentencePiece .model, tokenizer.json, or a transformers tokenizer folder",
    )
    add_data_arguments(p)
    p.add_argument(
        "--lengths",
        default=None,
        help="a lengths file made by `padfree lengths` on the same data and options: the plan uses it, and "
        "any sample whose tokens differ from it stops the run",
    )
    chunking = [name for name, spec in REGISTRY.items() if chunked and spec.context]  # they take chunks
    p.add_argument("--strategy", default="packed", choices=[*STRATEGIES, *chunking])
    if chunked:
        p.add_argument(
            "--keep-chunks",
            type=COUNT,
            default=0,
            help="chunked: chunks of a long document whose activations are kept instead of recomputed "
            "(default 0: one chunk's activations alive at a time)",
        )
    p.add_argument("--budget", type=NUMERIC["--budget"], default=2048, help="tokens per micro-batch")
    p.add_argument(
        "--overlong",
        default="error",
        choices=OVERLONG,
        help="samples longer than the budget, as in `padfree plan`: error (default), truncate, split, drop",
    )
    p.add_argument(
        "--grad-accum", type=NUMERIC["--grad-accum"], default=1, help="micro-batches per rank per step"
    )
    p.add_argument("--epochs", type=COUNT, default=1)
    p.add_argument("--seed", type=NUMERIC["--seed"], default=0)
    p.add_argument("--limit-samples", type=COUNT, default=None, help="use the first N samples")
    p.add_argument("--loss-on", default="assistant", choices=["assistant", "all"])
    p.add_argument("--model", default="tiny-llama", help="padfree.models name or a config directory")
    p.add_argument(
        "--model-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model config field, e.g. hidden_size=64 (repeatable)",
    )
    p.add_argument(
        "--vocab-size",
        type=NUMERIC["--vocab-size"],
        default=None,
        help="model vocabulary smaller than the tokenizer's: token ids are folded modulo it "
        "(a speed knob for CPU smoke tests; leave unset for real training)",
    )
    p.add_argument("--lr", type=Bounded(float, 0, 1e3, above=True), default=1e-3)


def training_data(args: argparse.Namespace) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """``(samples, lengths, loss_tokens)`` of the options :func:`add_data_and_model_args` added
    (:func:`padfree.data.samples.load_training_data`)."""
    from padfree.data.samples import load_training_data

    return load_training_data(
        args.data,
        args.tokenizer,
        lengths_file=args.lengths,
        limit=args.limit_samples,
        loss_on=args.loss_on,
        **record_options(args),
    )


def run_example(main: Callable[[], Any]) -> None:
    """Run ``main()`` and exit with its code; a padfree error (bad data, a lengths file that disagrees, a
    checkpoint directory owned by another run) is one line and exit 2."""
    try:
        code = main()
    except PadfreeError as exc:
        print(f"{Path(sys.argv[0]).name}: error: {one_line(str(exc))}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(code if isinstance(code, int) else 0)  # hf_trainer's main returns its Trainer


def model_overrides(args: argparse.Namespace) -> dict:
    """The ``--model-set KEY=VALUE`` overrides (a value parsed as JSON where it is JSON, else the string)
    plus ``--vocab-size``; an entry without ``=`` is a one-line :class:`ConfigError`."""
    out = {}
    for kv in args.model_set:
        if "=" not in kv:
            raise ConfigError(f"--model-set takes KEY=VALUE (got {kv!r})")
        k, v = kv.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    if args.vocab_size is not None:
        out["vocab_size"] = args.vocab_size
    return out


PLAN_OPTIONS = ("budget", "world_size", "grad_accum", "growth", "buckets", "mix", "seed", "overlong",
                "sp", "cp", "shapes")  # fmt: skip
"""The :class:`PlanConfig` fields the command line and the examples take as options, under the same names."""


def plan_config(args: argparse.Namespace, strategy: str | None = None, **given: Any) -> PlanConfig:
    """The plan of the options ``args`` holds (each of :data:`PLAN_OPTIONS` it has; the others keep their
    defaults) for ``strategy`` (default ``--strategy``), with ``given`` on top. Samples longer than the
    budget follow ``--overlong`` (default ``error``: the plan refuses them with one line, as ``padfree
    plan`` does)."""
    values = {k: getattr(args, k) for k in PLAN_OPTIONS if hasattr(args, k)}
    return PlanConfig(strategy=strategy or args.strategy, **{**values, **given})
