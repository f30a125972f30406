"""Collators: a micro-batch of dataset items becomes model inputs.

Items are dicts with ``input_ids`` and optionally ``labels`` (-100 where no loss) or ``loss_mask`` (1 where
loss), or bare sequences of token ids. Labels are *unshifted* (transformers' convention: the model predicts
``labels[t]`` from positions ``< t``), and the first token of every document gets ``-100``: nothing predicts
it. So ``(labels != -100).sum()`` is exactly the number of loss-bearing tokens of the micro-batch, the same
count the sampler derives from the plan (``length - 1`` per sample when every token is a label).

When the micro-batch comes from a :class:`~padfree.torch.feed.sampler.PlanBatchSampler` through a
:class:`~padfree.torch.feed.dataset.PlannedDataset`, each sample is cut to its planned piece (truncated or
split samples) and the batch carries the micro-batch's ``info``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from padfree.core.config import MAX_BUDGET, MAX_SHARD
from padfree.core.shard import Shard, check_shapes, round_up
from padfree.errors import ConfigError
from padfree.torch.feed.dataset import warn_if_unplanned

IGNORE = -100


class Batch(dict):
    """Model inputs (``model(**batch)``) plus, as attributes, ``info`` (the micro-batch's
    :class:`~padfree.torch.feed.sampler.MicroInfo` or ``None``), ``loss_tokens`` (labels != -100), ``tokens``
    (real, non-padding tokens) and, for a plan of weighted sources, ``source_ids``: each token's source (its
    index in ``config.sources``; -1 on padding), shaped like ``labels``, so the loss of a packed row splits
    by source (:func:`padfree.torch.source_losses`). ``None`` without sources."""

    info: object = None
    loss_tokens: int = 0
    tokens: int = 0
    source_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class Piece:
    """One item of a micro-batch cut to its planned piece: token ids, their labels (-100 where no loss,
    unshifted; the first token not yet masked), the dataset sample it comes from (``-1`` unknown) and the
    piece's offset in that sample (0 for a whole sample)."""

    input_ids: np.ndarray
    labels: np.ndarray
    sample_id: int
    start: int

    @property
    def loss_mask(self) -> np.ndarray:
        """Which tokens carry loss (the tokenization rule's mask)."""
        return self.labels != IGNORE


def planned_pieces(items: list) -> list[Piece]:
    """Every item of a micro-batch cut to its planned piece (``info.starts`` / ``info.lengths`` of a
    :class:`~padfree.torch.PlannedDataset` micro-batch), the one place both the plain and the drafter
    collators read items. Loss comes from ``labels`` (``!= -100``), else ``loss_mask``, else every token. A
    sample shorter than its planned piece is one :class:`ConfigError` naming it; a micro-batch that did not
    come through a :class:`PlannedDataset` while a plan is in use warns once."""
    warn_if_unplanned(items)
    info = getattr(items, "info", None)
    out = []
    for j, item in enumerate(items):
        sid = int(info.indices[j]) if info is not None and len(info.indices) > j else -1
        if isinstance(item, Mapping):
            if "input_ids" not in item:
                raise ConfigError(f"item {j}: a mapping without input_ids (the token ids of the sample)")
            ids = np.asarray(item["input_ids"]).reshape(-1)
            if item.get("labels") is not None:
                labels = np.asarray(item["labels"], dtype=np.int64).reshape(-1)
            elif item.get("loss_mask") is not None:
                mask = np.asarray(item["loss_mask"]).reshape(-1).astype(bool)
                labels = np.where(mask, ids, IGNORE) if mask.shape == ids.shape else mask.astype(np.int64)
            else:
                labels = ids
            if sid < 0 and item.get("sample_id") is not None:
                sid = int(item["sample_id"])
        else:
            ids = labels = np.asarray(item).reshape(-1)
        if ids.shape[0] and not np.issubdtype(ids.dtype, np.integer):
            raise ConfigError(f"item {j}: token ids must be integers (got {ids.dtype})")
        ids = ids.astype(np.int64, copy=False)
        labels = np.asarray(labels, dtype=np.int64)
        if labels.shape != ids.shape:
            raise ConfigError(f"item {j}: labels/loss_mask length {labels.shape[0]} != {ids.shape[0]} tokens")
        start = 0
        if info is not None:
            start = 0 if info.starts is None else int(info.starts[j])
            length = int(info.lengths[j])
            if start + length > ids.shape[0]:
                who = f"sample {sid}" if sid >= 0 else f"item {j}"
                raise ConfigError(
                    f"{who} has {ids.shape[0]} tokens but the plan expects at least {start + length}: "
                    "the lengths given to the sampler must be the dataset's token counts"
                )
            ids, labels = ids[start : start + length], labels[start : start + length]
        out.append(Piece(ids, labels, sid, start))
    return out


def pieces(items: list, chunked: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(input_ids, labels)`` of every item, cut to its planned piece, first label of each set to -100
    (``chunked``: not on a chunk that continues its document, which its earlier chunk predicts)."""
    out = []
    for p in planned_pieces(items):
        labels = p.labels.copy()
        if labels.shape[0] and not (chunked and p.start > 0):
            labels[0] = IGNORE
        out.append((p.input_ids, labels))
    return out


def packed_layout(lengths, *, sp: int = 1, cp: int = 1, shapes: int | tuple[int, ...] | None = None) -> dict:
    """Where the documents of one packed row sit, as transformers' padding-free path and flash-attention
    varlen read it: ``position_ids`` restarting at 0 per document ``(1, T)``, ``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` (int32 boundaries ``0 .. T``), ``max_length_q`` / ``max_length_k`` (the longest
    document) and ``seq_idx`` (int32 ``(1, T)``: each token's document, what Mamba-2 / causal-conv1d kernels
    take). The one computation of it, for :class:`PackCollator`, the leak probe and the drafter contract.

    With ``sp`` / ``cp`` > 1 (a plan's SP/CP degrees) the row is laid out for sharding, the THD layout of
    Transformer Engine (:mod:`padfree.core.shard`): each document padded to a multiple of ``2 * cp``, the row
    to a multiple of ``sp`` (``cp * lcm(2, sp)`` with CP), its tail in the last document's padded span.
    ``cu_seq_lens_q`` / ``_k`` then hold the real lengths' cumulative sums, ``cu_seq_lens_q_padded`` /
    ``_k_padded`` where each padded document starts (the last entry is the row's padded length), and
    ``position_ids``, ``seq_idx`` and ``max_length_q`` / ``_k`` follow the padded spans. ``sp = cp = 1``: the
    layout above, unchanged.

    With ``shapes`` (a plan's, :mod:`padfree.core.shard`) the row's length is the next declared shape, its
    tail in the last document's span (the tail is causal-after every real token, so none of them sees it);
    without SP/CP ``cu_seq_lens_q`` / ``_k`` then hold the padded spans.

    >>> lay = packed_layout([3, 2])
    >>> lay["position_ids"].tolist(), lay["cu_seq_lens_q"].tolist(), lay["max_length_q"]
    ([[0, 1, 2, 0, 1]], [0, 3, 5], 3)
    >>> lay["seq_idx"].tolist()
    [[0, 0, 0, 1, 1]]
    >>> thd = packed_layout([3, 2], cp=2)
    >>> thd["cu_seq_lens_q"].tolist(), thd["cu_seq_lens_q_padded"].tolist(), thd["max_length_q"]
    ([0, 3, 5], [0, 4, 8], 4)
    """
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    shard = Shard(int(sp), int(cp), shapes)
    spans = padded_spans(lens, shard) if shard.pads else lens
    cu = np.concatenate([[0], np.cumsum(spans)])
    pos = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], spans)
    cu_t = torch.from_numpy(cu.astype(np.int32))
    longest = int(spans.max()) if spans.shape[0] else 0
    out = {
        "position_ids": torch.from_numpy(pos)[None],
        "cu_seq_lens_q": cu_t,
        "cu_seq_lens_k": cu_t.clone(),
        "max_length_q": longest,
        "max_length_k": longest,
        "seq_idx": torch.from_numpy(np.repeat(np.arange(spans.shape[0], dtype=np.int32), spans))[None],
    }
    if shard.active:
        real = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        out["cu_seq_lens_q"], out["cu_seq_lens_k"] = real, real.clone()
        out["cu_seq_lens_q_padded"], out["cu_seq_lens_k_padded"] = cu_t, cu_t.clone()
    return out


def padded_spans(lens: np.ndarray, shard: Shard) -> np.ndarray:
    """Each document's padded span in a sharded packed row (see :func:`packed_layout`).

    >>> padded_spans(np.array([3, 2]), Shard(sp=4)).tolist()
    [3, 5]
    """
    spans = round_up(lens, shard.doc_multiple)
    if spans.shape[0]:
        spans = spans.copy()
        spans[-1] += int(shard.row_length(np.array([spans.sum()]))[0] - spans.sum())
    return spans


def _finish(
    batch: Batch, items: list, labels: torch.Tensor, tokens: int, source_ids: np.ndarray | None = None
) -> Batch:
    batch.info = getattr(items, "info", None)
    batch.loss_tokens = int((labels != IGNORE).sum())
    batch.tokens = tokens
    if source_ids is not None:
        batch.source_ids = torch.from_numpy(source_ids.astype(np.int64)).reshape(labels.shape)
    return batch


def item_sources(items: list) -> np.ndarray | None:
    """Each item's source (a plan of weighted sources: ``info.sources``), or ``None``."""
    info = getattr(items, "info", None)
    found = getattr(info, "sources", None)
    if found is None or len(found) != len(items):
        return None
    return np.asarray(found, dtype=np.int64)


class PadCollator:
    """One row per sample, right-padded to the longest (rounded up to ``pad_to_multiple_of``).

    Returns ``input_ids``, ``attention_mask`` (1 on real tokens) and ``labels`` (-100 on padding and on
    each row's first token). An empty micro-batch becomes one row of one padding token with no loss.

    ``shapes`` (the plan's ``shapes`` option): the width is the next declared row length, so a compiled model
    sees a small set of shapes.

    ``attention_mask=False`` leaves the mask out. Training a *causal* LM on right-padded rows needs none: a
    real token attends only to earlier positions, which are all real, and the pads after them carry no
    loss, so the logits and gradients at real tokens are the same (``tests/test_torch_collate.py``), while
    SDPA runs its ``is_causal`` kernel instead of a masked one, which cannot skip the upper triangle
    (1.5-2.4x the attention time at 1-4K tokens on CPU: ``benchmarks/results/sdpa_mask_cost.md``). Not for
    bidirectional models or decoding with a KV cache.

    >>> b = PadCollator(pad_token_id=0)([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    >>> b["input_ids"].tolist(), b["labels"].tolist(), b.loss_tokens
    ([[5, 6, 7], [8, 0, 0]], [[-100, 6, 7], [-100, -100, -100]], 2)
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
        attention_mask: bool = True,
        *,
        shapes: int | tuple[int, ...] | None = None,
    ) -> None:
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ConfigError(f"pad_to_multiple_of must be >= 1 (got {pad_to_multiple_of})")
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.attention_mask = attention_mask
        self.rows = Shard(shapes=check_shapes(shapes, pad_to_multiple_of or 1))

    def __call__(self, items: list) -> Batch:
        ps = pieces(items)
        n = [p[0].shape[0] for p in ps]
        width = max([1, *n])
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        if self.rows.pads:  # the next declared shape (a plan's shapes= option)
            width = int(self.rows.row_length(np.array([width]))[0])
        rows = max(1, len(ps))
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((rows, width), IGNORE, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for r, (ids, lab) in enumerate(ps):
            input_ids[r, : ids.shape[0]] = torch.from_numpy(ids)
            labels[r, : ids.shape[0]] = torch.from_numpy(lab)
            mask[r, : ids.shape[0]] = 1
        if not ps:
            mask[0, 0] = 1  # a placeholder token that attends to itself (no fully masked row), no loss
        if self.attention_mask:
            batch = Batch(input_ids=input_ids, attention_mask=mask, labels=labels)
        else:
            batch = Batch(input_ids=input_ids, labels=labels)
        src = item_sources(items)
        per_token = None
        if src is not None:
            per_token = np.full((rows, width), -1, np.int64)
            for r, length in enumerate(n):
                per_token[r, :length] = src[r]
        return _finish(batch, items, labels, sum(n), per_token)


class PackCollator:
    """The whole micro-batch (a packed bin) as one row, the way transformers' padding-free path and
    flash-attention varlen want it (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``).

    Returns ``input_ids``, ``labels`` (-100 on each document's first token), ``position_ids`` (restarting at
    0 per document), and ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 document boundaries, 0 ... total)
    with ``max_length_q`` / ``max_length_k`` (the longest document, a Python int). With ``sp`` / ``cp`` (the
    plan's) the row is padded for sharding and carries the THD layout (:func:`packed_layout`); with ``shapes``
    (the plan's) its length is the next declared row length.

    ``chunked=True`` (a ``chunked`` plan, trained with :func:`padfree.torch.execution.chunked.run_step`): a
    chunk that continues its document keeps its first label, which the document's earlier chunk predicts.

    >>> b = PackCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    >>> b["labels"].tolist(), b["position_ids"].tolist(), b["cu_seq_lens_q"].tolist(), b["max_length_q"]
    ([[-100, 6, 7, -100, 9]], [[0, 1, 2, 0, 1]], [0, 3, 5], 3)
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        chunked: bool = False,
        *,
        sp: int = 1,
        cp: int = 1,
        shapes: int | tuple[int, ...] | None = None,
    ) -> None:
        for v in (sp, cp):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SHARD:
                raise ConfigError(
                    f"PackCollator: sp and cp must be integers from 1 to {MAX_SHARD} "
                    f"(got sp={sp!r}, cp={cp!r})"
                )
        self.pad_token_id = pad_token_id
        self.chunked = chunked
        self.shard = Shard(sp, cp, check_shapes(shapes, Shard(sp, cp).row_multiple))

    def __call__(self, items: list) -> Batch:
        ps = pieces(items, self.chunked)
        n = [p[0].shape[0] for p in ps]
        real = int(sum(n))
        src = item_sources(items)
        per_token = None
        if real > 0:
            if src is not None:
                per_token = np.repeat(src, n)
            ps = [p for p in ps if p[0].shape[0] > 0]
            n = [p[0].shape[0] for p in ps]
            ids = np.concatenate([p[0] for p in ps])
            lab = np.concatenate([p[1] for p in ps])
        else:  # empty micro-batch: one placeholder token with no loss
            ids, lab, n = np.array([self.pad_token_id]), np.array([IGNORE]), [1]
            per_token = None if src is None else np.array([-1])
        sh = self.shard
        if sh.active:  # the padded row's size, before anything of that size is allocated
            padded = int(padded_spans(np.asarray(n, dtype=np.int64), sh).sum())
            if padded > MAX_BUDGET:
                raise ConfigError(
                    f"PackCollator(sp={sh.sp}, cp={sh.cp}): {len(n)} documents of {real} tokens pad to a row "
                    f"of {padded} tokens, over {MAX_BUDGET} (a plan's row holds at most sp x cp x budget <= "
                    f"{MAX_BUDGET}); collate the plan's micro-batches with the plan's sp and cp"
                )
        layout = packed_layout(n, sp=sh.sp, cp=sh.cp, shapes=sh.shapes)
        if sh.pads:  # each document at its padded span's start, pads without loss
            cu = layout["cu_seq_lens_q_padded" if sh.active else "cu_seq_lens_q"].numpy().astype(np.int64)
            lens = np.asarray(n, dtype=np.int64)
            at = np.repeat(cu[:-1], lens) + np.arange(ids.shape[0]) - np.repeat(np.cumsum(lens) - lens, lens)
            ids_p = np.full(int(cu[-1]), self.pad_token_id, dtype=np.int64)
            lab_p = np.full(int(cu[-1]), IGNORE, dtype=np.int64)
            ids_p[at], lab_p[at] = ids, lab
            ids, lab = ids_p, lab_p
            if per_token is not None:  # the placeholder of an empty row too
                src_p = np.full(int(cu[-1]), -1, dtype=np.int64)
                src_p[at] = per_token
                per_token = src_p
        labels = torch.from_numpy(lab.astype(np.int64))[None]
        batch = Batch(input_ids=torch.from_numpy(ids.astype(np.int64))[None], labels=labels, **layout)
        return _finish(batch, items, labels, real, per_token)
