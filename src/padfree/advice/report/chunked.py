"""The report's word on long documents: what truncation and splitting cost them, and what ``chunked`` does."""

from __future__ import annotations

import numpy as np

from padfree.core.budget import Budget
from padfree.core.config import PlanConfig
from padfree.errors import ConfigError

RECOMPUTE = 1.0 / 3.0
"""A recomputed forward costs about a third of its chunk's forward+backward."""

CLOSE = 0.9
"""Chunked at this share of packed's modeled throughput (recompute counted) or more is called cheap."""


def chunked_numbers(
    lengths: np.ndarray,
    base: PlanConfig,
    packed: dict,
    path: str | None = None,
    chunked: dict | None = None,
) -> dict | None:
    """Samples over the budget under truncation, splitting and ``chunked`` (documents up to ``grad_accum``
    budgets trained whole, each chunk attending to its earlier chunks), with one sentence that says which
    wins; ``None`` when no sample is over the budget. ``packed`` are the packed plan's metrics, ``chunked``
    the chunked plan's where already measured (``padfree analyze``)."""
    from padfree.advice.analyze import measure

    lens = np.asarray(lengths, dtype=np.int64)
    budget, accum = base.budget, base.grad_accum
    over = lens > budget
    if not over.any():
        return None
    overlong = "truncate" if base.overlong in ("split", "error") else base.overlong
    cfg = base.with_(strategy="chunked", overlong=overlong)
    reach = Budget.of(cfg).reach
    dropped_by_truncation = int((lens[over] - budget).sum())
    cut_by_split = int(((lens[over] + budget - 1) // budget - 1).sum())
    out: dict = {
        "over_budget": int(over.sum()),
        "reach": reach,
        "truncation_tokens_lost": dropped_by_truncation,
        "truncation_share_lost": dropped_by_truncation / float(lens.sum()),
        "split_pieces_without_beginning": cut_by_split,
    }
    if accum < 2:
        out["text"] = (
            f"{out['over_budget']:,} samples are over the budget: truncation drops {dropped_by_truncation:,} "
            f"tokens, splitting cuts {cut_by_split:,} pieces off from their beginning; the chunked strategy "
            "trains a document of up to grad-accum budgets whole: raise grad-accum to use it"
        )
        return out
    try:
        m = chunked if chunked is not None else measure(lens, cfg, path)
    except ConfigError as exc:  # planned in memory only
        out["text"] = f"chunked not measured: {exc}"
        return out
    kept = np.minimum(lens, reach)
    chunks = (kept + budget - 1) // budget
    recomputed = float(((chunks - 1) * budget).sum()) / float(kept.sum())  # every chunk but the last
    ratio = m["modeled_throughput"] / (1.0 + RECOMPUTE * recomputed) / packed["modeled_throughput"]
    still_cut = int((lens > reach).sum())
    out |= {
        "chunked": {k: m[k] for k in ("modeled_throughput", "imbalance", "fill", "steps", "truncated")},
        "recomputed_share": recomputed,
        "throughput_vs_packed": ratio,
        "still_over_reach": still_cut,
    }
    verdict = (
        "it beats truncation and splitting at little cost: use --strategy chunked"
        if ratio >= CLOSE
        else f"it costs {1 - ratio:.0%} of packed's throughput: worth it where long documents' context "
        "matters"
    )
    out["text"] = (
        f"{out['over_budget']:,} samples are over the budget of {budget:,}: truncation drops "
        f"{dropped_by_truncation:,} tokens ({out['truncation_share_lost']:.1%}), splitting cuts "
        f"{cut_by_split:,} pieces off from their beginning. Chunked (up to {accum} x {budget:,} = {reach:,} "
        f"tokens a document, {still_cut:,} still over it) trains them whole, recomputing the forward of "
        f"{recomputed:.1%} of the tokens, at {ratio:.2f}x packed's modeled throughput: {verdict}"
    )
    return out
