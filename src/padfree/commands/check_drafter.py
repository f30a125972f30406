"""``padfree check-drafter``: do the documents of a packed drafter row stay apart (target, anchors, masks,
labels, losses)?"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from padfree.commands.common import add_output_options, check_input
from padfree.drafter.methods import METHODS
from padfree.drafter.options import add_recipe_arguments, recipe_from_args
from padfree.options import DOCS, MAX_TOKENS

MAX_ROW = 32768
"""Most tokens in the checked row: its dense masks hold row x row entries."""

NAME = "check-drafter"
HELP = (
    "pack real documents into one row and run a tiny frozen target and a reference DFlash or EAGLE-3 "
    "drafter on the row and on each document alone; print the target hidden-state difference, each "
    "document's anchors and loss, and the cross-document attention pairs and labels; exit 1 (LEAK) if "
    "anything differs"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=list(METHODS), default="dflash", help="drafter (default dflash)")
    p.add_argument("--data", nargs="+", default=None, help="data files (default: the bundled fixtures)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer for --data (SentencePiece, tokenizer.json, folder)"
    )
    p.add_argument("--docs", type=DOCS, default=6, help="documents in the packed row (default 6, at least 2)")
    p.add_argument(
        "--max-tokens",
        type=MAX_TOKENS,
        default=160,
        help="tokens kept of each document, around its first loss-bearing ones (160)",
    )
    p.add_argument(
        "--target",
        default="tiny-llama",
        help="the frozen target: a built-in tiny family (tiny-llama, default), a directory with config.json "
        "(random weights: hybrid families too, e.g. a Qwen3.5 or LFM2 config) or a target folder with "
        "weights",
    )
    p.add_argument(
        "--layout",
        choices=["packed", "padded"],
        default="packed",
        help="packed (default: one row, per-document attention) or padded (a row per document)",
    )
    p.add_argument(
        "--leaky",
        action="store_true",
        help="build the batch as row-level packers do (anchors chosen per row, labels and the EAGLE-3 shift "
        "across the row): deliberately wrong, to see the leak caught",
    )
    add_output_options(p, "print the result as one JSON object", "seed for weights and anchors (default 0)")
    add_recipe_arguments(p)


def supervised_window(doc: dict, size: int) -> dict:
    """``size`` consecutive tokens of a document that hold its first loss-bearing tokens (a quarter of the
    window before them as context), so a long unsupervised prompt does not leave the check nothing to compare.

    >>> import numpy as np
    >>> d = {"input_ids": np.arange(10), "loss_mask": np.array([0] * 7 + [1] * 3, dtype=np.int8)}
    >>> supervised_window(d, 4)["input_ids"].tolist(), supervised_window(d, 20)["input_ids"].tolist()[:2]
    ([6, 7, 8, 9], [0, 1])
    """
    import numpy as np

    n = len(doc["input_ids"])
    if n <= size:
        return doc
    first = int(np.argmax(np.asarray(doc["loss_mask"]) > 0)) if np.any(doc["loss_mask"]) else 0
    start = max(0, min(first - size // 4, n - size))
    return {k: v[start : start + size] for k, v in doc.items()}


SCAN = 20
"""check-drafter reads up to ``SCAN x --docs`` documents to find ``--docs`` that train."""


def drafting_documents(docs: list[dict], n: int, recipe) -> tuple[list[dict], int]:
    """The first ``n`` of ``docs`` with at least one supervised draft position under ``recipe`` (DFlash: an
    anchor its rule allows; EAGLE-3: a loss token after the first), and how many were passed over. A
    document with none trains nothing packed or alone, so it has nothing to compare (the speculators DFlash
    recipe, for one, anchors no answer shorter than its 16-token margin at a document's end).

    >>> import numpy as np
    >>> from padfree.drafter import recipes
    >>> short = {"input_ids": np.arange(20), "loss_mask": np.r_[np.zeros(12), np.ones(8)].astype(np.int8)}
    >>> long = {"input_ids": np.arange(40), "loss_mask": np.r_[np.zeros(8), np.ones(32)].astype(np.int8)}
    >>> kept, skipped = drafting_documents([short, long], 2, recipes.get("speculators", "dflash"))
    >>> [len(d["input_ids"]) for d in kept], skipped
    ([40], 1)
    """
    import numpy as np

    from padfree.drafter.check import drafts

    keep = np.flatnonzero(drafts(recipe, docs))[:n]
    passed = int(keep[-1] + 1 - keep.size) if keep.size else len(docs)
    return [docs[i] for i in keep], passed


def run(args: argparse.Namespace) -> int:
    from padfree.drafter.check import check_drafter, fixture_documents
    from padfree.errors import ConfigError

    if args.docs * args.max_tokens > MAX_ROW:
        raise ConfigError(
            f"check-drafter: --docs x --max-tokens = {args.docs * args.max_tokens} tokens in a row; at most "
            f"{MAX_ROW} (the check builds dense row x row masks)"
        )
    if (args.data is None) != (args.tokenizer is None):
        raise ConfigError("check-drafter: --data and --tokenizer go together")
    if args.tokenizer is not None:  # as `padfree lengths`: a FIFO or device would block its reader
        check_input(Path(args.tokenizer), "tokenizer")
    recipe = recipe_from_args(args, args.method)
    if args.data is None:
        samples = fixture_documents(args.docs, args.max_tokens)
        source = "bundled fixtures (chats and documents, llama_sp32k)"
    else:
        from padfree.data.samples import load_samples

        read = [
            supervised_window(d, args.max_tokens)
            for d in load_samples(args.data, args.tokenizer, limit=SCAN * args.docs)
        ]
        samples, passed = drafting_documents(read, args.docs, recipe)
        if len(samples) < 2:
            from padfree.drafter.check import why_nothing_drafts

            why = f" ({why_nothing_drafts(recipe, read)})" if read and not samples else ""
            raise ConfigError(
                f"check-drafter: {', '.join(args.data)}: {len(samples)} of the first {len(read)} documents "
                f"have a supervised draft position under recipe {recipe.name} (--max-tokens "
                f"{args.max_tokens}){why}; at least 2 are needed to compare packed with alone"
            )
        source = ", ".join(args.data) + (
            f" ({passed} documents without a supervised draft position passed over)" if passed else ""
        )
    r = check_drafter(
        args.method,
        samples,
        recipe=recipe,
        leaky=args.leaky,
        seed=args.seed,
        layout=args.layout,
        target=args.target,
    )
    if args.json:
        docs = [dataclasses.asdict(d) for d in r.docs]
        keys = (
            "method",
            "recipe",
            "leaky",
            "layout",
            "ok",
            "path",
            "max_hidden_diff",
            "target_probe",
            "anchors_identical",
            "cross_pairs",
        )
        more = ("cross_inputs", "cross_labels", "cross_supervised", "docs_differ", "reason")
        print(json.dumps({**{k: getattr(r, k) for k in keys + more}, "docs": docs}))
        return 0 if r.ok else 1
    how = "row-level (leaky)" if r.leaky else "per document"
    spec = METHODS[r.method]
    print(f"method:          {spec.describe(r.block_size, r.ttt)}, recipe {r.recipe}")
    rows = "one packed row" if r.layout == "packed" else "padded rows"
    print(f"data:            {source}; {len(r.docs)} documents in {rows}, batch built {how}")
    print(f"target path:     {r.path}")
    print(f"target hidden states, max |packed - alone|: {r.max_hidden_diff:.3g}")
    print(f"target probe:    changing document 1 moves later documents' logits by {r.target_probe:.3g}")
    print(
        "doc  tokens  loss-tok  anchors(packed/alone)  same  loss num packed / alone      den packed / alone"
    )
    for d in r.docs:
        if spec.uses_anchors:
            same = "yes" if d.anchors_packed == d.anchors_alone else "NO"
            anchors = f"{len(d.anchors_packed):>9} / {len(d.anchors_alone):<9}  {same:>4}"
        else:  # no anchors: every position drafts
            anchors = f"{'-':>9} / {'-':<9}  {'-':>4}"
        print(
            f"{d.sample_id:>3}  {d.tokens:>6}  {d.loss_tokens:>8}  {anchors}"
            f"  {d.num_packed:>10.6g} / {d.num_alone:<10.6g}  {d.den_packed:>6g} / {d.den_alone:g}"
        )
    if spec.uses_anchors:
        print(f"anchor sets identical:            {'yes' if r.anchors_identical else 'NO'}")
    print(f"losses identical per document:    {'yes' if r.losses_match else 'NO'}")
    print(f"cross-document (query, key) pairs: {r.cross_pairs}")
    if spec.shifted_inputs:
        print(f"shifted inputs from another document: {r.cross_inputs}")
    print(f"labels crossing a document end:    {r.cross_labels}")
    print(f"  of inputs/labels crossing, supervised on this data: {r.cross_supervised}")
    if r.ok:
        print("OK: every document trains as if it were alone")
        return 0
    print(f"LEAK: {r.reason}")
    return 1
