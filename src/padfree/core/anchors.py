"""Drafter anchors: which positions of a document open a DFlash block, chosen per document, reproducibly.

A DFlash drafter is trained on blocks: an *anchor* ``a`` opens a block of ``block_size`` query tokens (the
anchor's token, then mask tokens) and block position ``k`` predicts token ``a + k``. This module decides,
for one document, the positions that may be anchors, how many are drawn, and which ones, from the
document's loss mask alone, so that a document gets the same anchors whatever it is packed with, on any
rank, at any world size, after any resume. Pure numpy (no torch): the planner counts anchors with it.

**Valid anchors.** ``a`` is valid when the loss mask holds at ``a`` and at ``a + 1`` (the block's first
prediction is supervised; ``eligibility="self"``: at ``a`` alone, as speculators does), ``a + margin < len``
(speculators keeps ``margin = block_size`` positions at the end free) and, under ``partial=False``, the whole
block fits in the document (``a + block_size <= len``). Under ``partial=True`` (the default) a block may run
past the document's end: its positions past the end carry no label and no loss, and never read or predict
another document. That is the **short-document rule**: a document shorter than a block still gets (partial)
blocks, never a silent zero. With ``partial=False`` such documents get no anchor, and :func:`anchor_counts`
lets a caller count and report them (``n == 0``).

**Quota.** A document with ``n`` valid positions gets
``min(n, max_anchors, ceil(density * n))`` anchors: the published recipes take every valid position
(``density=1``) up to 512 per sample (:mod:`padfree.drafter.recipes`); a lower density draws proportionally,
at least one when the document has any valid position.

**Choice.** The anchors are the ``quota`` valid positions with the smallest keys of the document's own
generator (:func:`padfree.core.document_rng.document_rng`, keyed by ``(seed, epoch, sample_id, start)``;
``start``: the offset of a split sample's piece), returned sorted. Nothing else enters: not the pack, the
rank, the world size or the step.

>>> mask = np.array([0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1], dtype=np.int8)
>>> valid_anchor_positions(mask, 4).tolist()
[2, 3, 4, 5, 6, 9, 10]
>>> valid_anchor_positions(mask, 4, partial=False).tolist()
[2, 3, 4, 5, 6]
>>> policy = AnchorPolicy(block_size=4, density=0.5)
>>> int(anchor_quota(np.array([7]), policy)[0])
4
>>> a = choose_anchors(mask, policy, seed=0, epoch=0, sample_id=17)
>>> len(a), bool(np.isin(a, valid_anchor_positions(mask, 4)).all())
(4, True)
>>> np.array_equal(a, choose_anchors(mask, policy, seed=0, epoch=0, sample_id=17))
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from padfree.core.document_rng import document_rng
from padfree.errors import ConfigError, InputError

__all__ = [
    "AnchorPolicy",
    "anchor_counts",
    "anchor_quota",
    "choose_anchors",
    "valid_anchor_positions",
    "valid_counts",
]


@dataclass(frozen=True, slots=True)
class AnchorPolicy:
    """How many DFlash anchors a document gets, and where they may sit.

    Attributes:
        block_size: query tokens per block (16 in the published recipes); block position ``k`` predicts
            token ``anchor + k``, so a block supervises up to ``block_size - 1`` tokens.
        max_anchors: cap per document (512 in the published recipes).
        density: anchors per valid position before the cap (default ``1 / block_size``: about as many draft
            query tokens as supervised tokens).
        partial: ``True``: a block may run past the document's end (those positions carry no loss), so
            documents shorter than a block get partial blocks. ``False``: the whole block must fit in the
            document; shorter documents get no anchor (count them with :func:`anchor_counts`).
        eligibility: ``"pair"``: ``mask[a] and mask[a + 1]`` (SpecForge); ``"self"``: ``mask[a]``
        (speculators). margin: positions after an anchor that must lie in the document (``a + margin < len``).
    """

    block_size: int = 16
    max_anchors: int = 512
    density: float | None = None
    partial: bool = True
    eligibility: str = "pair"
    margin: int = 0

    def __post_init__(self) -> None:
        if self.eligibility not in ("pair", "self"):
            raise ConfigError(f"anchor policy: eligibility must be pair or self (got {self.eligibility!r})")
        for name, low in (("block_size", 2), ("max_anchors", 1), ("margin", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"anchor policy: {name} must be an integer >= {low} (got {v!r})")
        d = self.density
        if d is not None and not (isinstance(d, int | float) and math.isfinite(d) and 0 < d <= 1):
            raise ConfigError(f"anchor policy: density must be in (0, 1] (got {d!r})")

    @property
    def rate(self) -> float:
        """The density in force: ``density``, or ``1 / block_size`` when unset."""
        return 1.0 / self.block_size if self.density is None else float(self.density)


def _mask(loss_mask) -> np.ndarray:
    m = np.asarray(loss_mask)
    if m.ndim != 1:
        raise InputError(f"a loss mask must be one-dimensional (got shape {m.shape})")
    return m.astype(bool, copy=False)


def _last(n: int, block_size: int, partial: bool, eligibility: str, margin: int) -> int:
    """How many leading positions of a document of ``n`` tokens may hold an anchor at all."""
    last = n - 1 if eligibility == "pair" else n  # a + 1 < n
    last = min(last, n - margin)  # a + margin < n
    if not partial:
        last = min(last, n - block_size + 1)  # a + block_size <= n
    return max(0, last)


def valid_anchor_positions(
    loss_mask, block_size: int, *, partial: bool = True, eligibility: str = "pair", margin: int = 0
) -> np.ndarray:
    """Positions ``a`` of one document where a block may open (the rule in the module docstring). Sorted
    int64."""
    m = _mask(loss_mask)
    n = m.shape[0]
    ok = m.copy()
    if eligibility == "pair":
        ok[:-1] &= m[1:]
    return np.flatnonzero(ok[: _last(n, block_size, partial, eligibility, margin)]).astype(np.int64)


def valid_counts(
    loss_mask, offsets, block_size: int, *, partial: bool = True, eligibility: str = "pair", margin: int = 0
) -> np.ndarray:
    """How many valid anchor positions each document of a flat dataset has (vectorized): document ``i`` is
    ``loss_mask[offsets[i]:offsets[i + 1]]``. Equal to ``len(valid_anchor_positions(doc))`` per document.

    >>> valid_counts(np.array([1, 1, 1, 0, 1, 1]), np.array([0, 2, 6]), 4).tolist()
    [1, 1]
    >>> m, off = np.array([1, 1, 1, 0, 1, 1]), np.array([0, 2, 6])
    >>> valid_counts(m, off, 4, eligibility="self", margin=1).tolist()
    [1, 2]
    """
    m = _mask(loss_mask)
    off = np.asarray(offsets, dtype=np.int64)
    if off.ndim != 1 or off.shape[0] < 1 or off[0] != 0 or off[-1] != m.shape[0] or (np.diff(off) < 0).any():
        raise InputError("offsets must rise from 0 to the mask's length")
    n = m.shape[0]
    ok = m.copy()
    if eligibility == "pair" and n > 1:
        ok[:-1] &= m[1:]
    doc = np.repeat(np.arange(off.shape[0] - 1), np.diff(off))
    end = off[1:][doc] if n else np.zeros(0, np.int64)
    pos = np.arange(n, dtype=np.int64)
    if eligibility == "pair":
        ok &= pos + 1 < end  # a + 1 inside the same document
    ok &= pos + margin < end
    if not partial:
        ok &= pos + block_size <= end
    return np.bincount(doc[ok], minlength=off.shape[0] - 1).astype(np.int64)


def anchor_quota(n_valid, policy: AnchorPolicy) -> np.ndarray:
    """Anchors drawn per document from its count of valid positions:
    ``min(n, max_anchors, ceil(density * n))`` (int64). Depends on counts only, so a planner can use it.

    >>> anchor_quota(np.array([0, 1, 16, 17, 100_000]), AnchorPolicy()).tolist()
    [0, 1, 1, 2, 512]
    """
    n = np.asarray(n_valid, dtype=np.int64)
    q = np.ceil(n * policy.rate).astype(np.int64)
    return np.minimum(np.minimum(q, n), policy.max_anchors)


def anchor_counts(loss_mask, offsets, policy: AnchorPolicy) -> np.ndarray:
    """Anchors per sample of a flat dataset (``loss_mask`` flat, sample ``i`` at
    ``offsets[i]:offsets[i + 1]``, e.g. :class:`padfree.data.tokenization.Encoded`'s ``mask`` and
    ``offsets``); zero marks a document that gets no block (no two consecutive supervised tokens, or shorter
    than a block under ``partial=False``). Vectorized; equals ``len(choose_anchors(...))`` per sample."""
    valid = valid_counts(
        loss_mask,
        offsets,
        policy.block_size,
        partial=policy.partial,
        eligibility=policy.eligibility,
        margin=policy.margin,
    )
    return anchor_quota(valid, policy)


def choose_anchors(
    loss_mask, policy: AnchorPolicy, *, seed: int, epoch: int, sample_id: int, start: int = 0
) -> np.ndarray:
    """The anchors of one document (sorted int64 positions in the document), a pure function of its loss
    mask, ``policy`` and ``(seed, epoch, sample_id, start)``: ``start`` is the offset of a split sample's
    piece in its sample (0 for a whole sample), so two pieces of one sample draw independently."""
    rng = document_rng(seed, epoch, sample_id, start, "anchors")
    valid = valid_anchor_positions(
        loss_mask,
        policy.block_size,
        partial=policy.partial,
        eligibility=policy.eligibility,
        margin=policy.margin,
    )
    q = int(anchor_quota(np.array([valid.shape[0]]), policy)[0])
    if q == 0:
        return valid[:0]
    if q == valid.shape[0]:
        return valid
    keys = rng.random(valid.shape[0])
    return np.sort(valid[np.argsort(keys, kind="stable")[:q]])
