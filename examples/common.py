"""What both examples share: the bundled real fixtures they default to and the data/model options."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from padfree import STRATEGIES

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
"""Real chat, math, code and document samples and a 32K SentencePiece tokenizer, vendored in the repo."""


def add_data_and_model_args(p: argparse.ArgumentParser) -> None:
    """``--data``, ``--tokenizer``, the plan shape, the loss and a tiny model built from a config."""
    p.add_argument(
        "--data", default=str(FIXTURES / "samples/*.jsonl.gz"), help="glob of .jsonl(.gz) files of records"
    )
    p.add_argument(
        "--tokenizer",
        default=str(FIXTURES / "tokenizers/llama_sp32k.model"),
        help="SentencePiece .model, tokenizer.json, or a transformers tokenizer folder",
    )
    p.add_argument("--strategy", default="packed", choices=STRATEGIES)
    p.add_argument("--budget", type=int, default=2048, help="tokens per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per rank per optimizer step")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-samples", type=int, default=None, help="use the first N samples")
    p.add_argument("--loss-on", default="assistant", choices=["assistant", "all"])
    p.add_argument("--model", default="tiny-llama", help="padfree.testing.models name or a config directory")
    p.add_argument(
        "--model-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model config field, e.g. hidden_size=64 (repeatable)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="model vocabulary smaller than the tokenizer's: token ids are folded modulo it "
        "(a speed knob for CPU smoke tests; leave unset for real training)",
    )
    p.add_argument("--lr", type=float, default=1e-3)


def model_overrides(args: argparse.Namespace) -> dict:
    """The ``--model-set`` overrides (values parsed as JSON) plus ``--vocab-size``."""
    overrides = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.model_set)}
    if args.vocab_size:
        overrides["vocab_size"] = args.vocab_size
    return overrides
