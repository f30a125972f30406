"""What both examples share: the bundled real fixtures they default to and the data/model options."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from padfree import STRATEGIES, PlanConfig
from padfree.core.config import OVERLONG
from padfree.errors import PadfreeError, one_line
from padfree.options import (
    COUNT,
    NUMERIC,
    Bounded,
    OneLineParser,
    add_data_arguments,
    assistant_path,
    format_options,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
"""Real chat, math, code and document samples and a 32K SentencePiece tokenizer, vendored in the repo."""


def parser(doc: str) -> argparse.ArgumentParser:
    """The examples' argument parser: a bad option is one line and exit code 2, as in the ``padfree`` CLI."""
    return OneLineParser(description=doc.splitlines()[0])


def add_data_and_model_args(p: argparse.ArgumentParser, chunked: bool = False) -> None:
    """``--data``, ``--tokenizer``, the plan shape, the loss and a tiny model built from a config
    (``chunked``: the loop trains the ``chunked`` strategy too, and takes ``--keep-chunks``)."""
    p.add_argument(
        "--data",
        nargs="+",
        default=[str(FIXTURES / "samples/*.jsonl.gz")],
        help="files, globs or folders of records (.jsonl[.gz], .parquet, datasets folders): as "
        "`padfree lengths` reads them",
    )
    p.add_argument(
        "--tokenizer",
        default=str(FIXTURES / "tokenizers/llama_sp32k.model"),
        help="SentencePiece .model, tokenizer.json, or a transformers tokenizer folder",
    )
    add_data_arguments(p)
    p.add_argument(
        "--lengths",
        default=None,
        help="a lengths file made by `padfree lengths` on the same data and options: the plan uses it, and "
        "any sample whose tokens differ from it stops the run",
    )
    p.add_argument("--strategy", default="packed", choices=[*STRATEGIES, *(["chunked"] if chunked else [])])
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


def load_training_data(args: argparse.Namespace) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """``(samples, lengths, loss_tokens)``: the samples tokenized by padfree's one rule
    (:func:`padfree.data.samples.load_samples`), whole; with ``--lengths`` the plan gets the file's lengths
    (each checked against its sample). Samples longer than ``--budget`` follow ``--overlong``, as in
    ``padfree plan``: the plan refuses them (``error``), or the collator cuts each to its planned piece."""
    from padfree.data.length_files import read_lengths
    from padfree.data.samples import check_lengths, load_samples, loss_tokens_of

    mode, names = format_options(args)
    samples = load_samples(
        args.data,
        args.tokenizer,
        args.limit_samples,
        args.loss_on,
        None,
        mode=mode,
        fields=names,
        split=args.split,
        chat_template=args.chat_template,
    )
    loss_tokens = loss_tokens_of(samples)
    if not args.lengths:
        return samples, np.array([len(s["input_ids"]) for s in samples], np.int64), loss_tokens
    lengths = read_lengths(args.lengths)[: args.limit_samples]
    check_lengths(samples, lengths, args.lengths)
    aux = assistant_path(Path(args.lengths))
    if args.loss_on == "assistant" and aux.exists():
        loss_file = np.load(aux, allow_pickle=False)[: args.limit_samples]  # may hold zeros: not read_lengths
        check_lengths(samples, loss_file, str(aux), "loss-bearing tokens")
    return samples, lengths, loss_tokens


def planned_tokens(lengths: np.ndarray, budget: int, overlong: str) -> int:
    """Tokens the plan trains on once ``overlong`` has been applied to ``lengths``.

    >>> planned_tokens(np.array([3, 10, 5]), 4, "truncate"), planned_tokens(np.array([3, 10, 5]), 4, "drop")
    (11, 3)
    """
    if overlong == "truncate":
        return int(np.minimum(lengths, budget).sum())
    if overlong == "drop":
        return int(lengths[lengths <= budget].sum())
    return int(lengths.sum())


def dropped_samples(lengths: np.ndarray, budget: int, overlong: str) -> np.ndarray:
    """The samples ``--overlong drop`` leaves out (those longer than the budget; none under other policies).

    >>> dropped_samples(np.array([3, 10, 5]), 4, "drop").tolist(), dropped_samples(np.array([10]), 4, "split")
    ([1, 2], array([], dtype=int64))
    """
    if overlong != "drop":
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.asarray(lengths) > budget).astype(np.int64)


def overlong_line(lengths: np.ndarray, budget: int, overlong: str, limit: str | None = None) -> str | None:
    """The one line that says what ``--overlong`` did to the samples longer than ``budget`` tokens, where the
    plan cuts them (None when there are none; under ``error`` the plan has refused them already). ``limit``
    says what sets that cut (default: ``the budget of N tokens``).

    >>> print(overlong_line(np.array([3, 10, 5]), 4, "truncate"))  # doctest: +NORMALIZE_WHITESPACE
    --overlong truncate: 2 of 3 samples are longer than the budget of 4 tokens (longest 10): truncated to
    4 tokens, 7 of 18 tokens not trained (38.9%)
    """
    over = lengths > budget
    n = int(over.sum())
    if n == 0 or overlong == "error":
        return None
    total = int(lengths.sum())
    lost = total - planned_tokens(lengths, budget, overlong)
    what = {
        "truncate": f"truncated to {budget} tokens, {lost} of {total} tokens not trained",
        "split": f"split into pieces of at most {budget} tokens, every token trained",
        "drop": f"dropped, {lost} of {total} tokens not trained",
    }[overlong]
    limit = limit or f"the budget of {budget} tokens"
    pct = f" ({100.0 * lost / total:.1f}%)" if lost else ""
    return (
        f"--overlong {overlong}: {n} of {lengths.shape[0]} samples are longer than {limit} "
        f"(longest {int(lengths.max())}): {what}{pct}"
    )


def run_example(main) -> None:  # noqa: ANN001
    """Run ``main()`` and exit with its code; a padfree error (bad data, a lengths file that disagrees, a
    checkpoint directory owned by another run) is one line and exit 2."""
    try:
        code = main()
    except PadfreeError as exc:
        print(f"{Path(sys.argv[0]).name}: error: {one_line(str(exc))}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(code if isinstance(code, int) else 0)  # hf_trainer's main returns its Trainer


def model_overrides(args: argparse.Namespace) -> dict:
    """The ``--model-set`` overrides (values parsed as JSON) plus ``--vocab-size``."""
    overrides = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.model_set)}
    if args.vocab_size:
        overrides["vocab_size"] = args.vocab_size
    return overrides


def plan_config(args: argparse.Namespace) -> PlanConfig:
    """The plan both examples train with: samples longer than the budget follow ``--overlong`` (default
    ``error``: the plan refuses them with one line, as ``padfree plan`` does)."""
    return PlanConfig(
        strategy=args.strategy,
        budget=args.budget,
        grad_accum=args.grad_accum,
        seed=args.seed,
        overlong=args.overlong,
    )
