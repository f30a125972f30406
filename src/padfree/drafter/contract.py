"""The document contract of a drafter micro-batch: one description of where each document sits in the rows,
shared by the frozen target's forward and the drafter (its anchors, masks, labels and losses).

A micro-batch is a list of tokenized samples (token ids + the tokenization rule's loss mask, 1 on assistant
tokens). ``layout="packed"`` lays them back to back in one row; ``layout="padded"`` gives each its own row,
right-padded to the longest. Either way every position of the rows has::

    packed row (3 documents, T = 11)
    position       0  1  2  3  4 | 5  6 | 7  8  9 10
    input_ids      a0 a1 a2 a3 a4| b0 b1| c0 c1 c2 c3
    document_ids   0  0  0  0  0 | 1  1 | 2  2  2  2
    position_ids   0  1  2  3  4 | 0  1 | 0  1  2  3        restart per document
    doc_remaining  5  4  3  2  1 | 2  1 | 4  3  2  1        tokens of the document from here to its end
    loss_mask      0  0  1  1  1 | 1  1 | 0  1  1  1        tokenization rule (assistant tokens)
    cu_seq_lens    [0, 5, 7, 11]

    padded rows (same documents): one per row, padding has document_ids -1, doc_remaining 0, no loss
    row 0          a0 a1 a2 a3 a4
    row 1          b0 b1 .  .  .
    row 2          c0 c1 c2 c3 .

``doc_remaining[t]`` is the number of the document's tokens at positions ``>= t`` (``length - position``), so
position ``t + j`` lies in the same document exactly when ``j < doc_remaining[t]``: a label, a block slot or
a test-time-training shift ``j`` positions ahead is in bounds iff that holds. Drafters always work on the
*flat* view (rows concatenated, ``(1, R * W)``), where padding is just positions of document ``-1``.

>>> c = build_contract([([5, 6, 7, 8, 9], [0, 0, 1, 1, 1]), ([3, 4], [1, 1])])
>>> c.document_ids.tolist(), c.doc_remaining.tolist(), c.cu_seq_lens.tolist()
([[0, 0, 0, 0, 0, 1, 1]], [[5, 4, 3, 2, 1, 2, 1]], [0, 5, 7])
>>> p = build_contract([([5, 6, 7], [1, 1, 1]), ([3], [1])], layout="padded")
>>> p.input_ids.tolist(), p.document_ids.tolist(), p.attention_mask.tolist()
([[5, 6, 7], [3, 0, 0]], [[0, 0, 0], [1, -1, -1]], [[1, 1, 1], [1, 0, 0]])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from padfree.core.shard import Shard, check_shapes
from padfree.errors import ConfigError, InputError
from padfree.torch.feed.collate import packed_layout

LAYOUTS = ("packed", "padded")


@dataclass(frozen=True)
class Contract:
    """Rows of a drafter micro-batch and where each document sits in them (see the module docstring).

    Attributes:
        layout: ``"packed"`` (one row) or ``"padded"`` (one row per document).
        input_ids, position_ids, document_ids, doc_remaining: ``(R, W)`` int64.
        loss_mask: ``(R, W)`` bool, the tokenization rule's mask (False on padding).
        attention_mask: ``(R, W)`` int64, 1 on real tokens (padded layout), else ``None``.
        cu_seq_lens: int32 document boundaries in the flat view, ``0 .. T`` (packed layout), else ``None``.
        doc_starts, doc_lengths: each document's first flat position and its token count.
        sample_ids: the dataset sample of each document (``-1`` when unknown); starts: the offset of each
            document's piece inside its sample (0 for a whole sample).
    """

    layout: str
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    doc_remaining: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor | None
    cu_seq_lens: torch.Tensor | None
    doc_starts: tuple[int, ...]
    doc_lengths: tuple[int, ...]
    sample_ids: tuple[int, ...]
    starts: tuple[int, ...]
    shapes: int | tuple[int, ...] | None = None

    @property
    def n_docs(self) -> int:
        return len(self.doc_lengths)

    @property
    def width(self) -> int:
        """Flat positions (``R * W``), padding included."""
        return int(self.input_ids.numel())

    def flat(self, name: str) -> torch.Tensor:
        """Field ``name`` as one flat row ``(1, R * W)``."""
        return getattr(self, name).reshape(1, -1)

    def doc_slice(self, d: int) -> slice:
        """The flat positions of document ``d``."""
        return slice(self.doc_starts[d], self.doc_starts[d] + self.doc_lengths[d])

    def segments(self) -> list[slice]:
        """Flat ranges that attention never crosses, in order, covering every position: each document of a
        packed row, each padded row (its padding included: what a padded batch computes)."""
        if self.layout == "packed":
            docs = [self.doc_slice(d) for d in range(self.n_docs)]
            end = self.doc_starts[-1] + self.doc_lengths[-1] if docs else 0
            return docs + ([slice(end, self.width)] if end < self.width else [])  # a shapes= tail
        w = int(self.input_ids.shape[1])
        return [slice(r * w, (r + 1) * w) for r in range(int(self.input_ids.shape[0]))]

    def target_inputs(self) -> dict:
        """Keyword arguments for a transformers causal LM: packed rows carry ``cu_seq_lens_*`` (padfree's
        per-document attention and flash-attention varlen read them), padded rows an ``attention_mask``."""
        if self.layout == "packed":
            return {"input_ids": self.input_ids, **packed_layout(self.doc_lengths, shapes=self.shapes)}
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}


def _as_doc(j: int, doc) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = doc
    ids = np.asarray(ids).reshape(-1)
    mask = np.asarray(mask).reshape(-1)
    if ids.shape != mask.shape:
        raise InputError(f"loss mask has {mask.shape[0]} entries for {ids.shape[0]} tokens", sample=j)
    if ids.shape[0] == 0:
        raise InputError("empty document (no tokens)", sample=j)
    if not np.issubdtype(ids.dtype, np.integer) or (ids < 0).any():
        raise InputError("token ids must be non-negative integers", sample=j)
    return ids.astype(np.int64), mask.astype(bool)


def build_contract(
    docs: Sequence,
    *,
    layout: str = "packed",
    pad_token_id: int = 0,
    sample_ids: Sequence[int] | None = None,
    starts: Sequence[int] | None = None,
    shapes: int | tuple[int, ...] | None = None,
) -> Contract:
    """The contract of ``docs`` (a sequence of ``(input_ids, loss_mask)`` pairs) laid out as ``layout``.

    ``shapes`` (a plan's, :mod:`padfree.core.shard`): the packed row's length, or the padded rows' width, is
    the next declared row length (the extra positions are padding: document -1, no loss).

    ``sample_ids`` / ``starts`` record which dataset sample (and which piece of it) each document is; the
    DFlash anchors are drawn from them. A document with no token, a mask of another length or a negative
    token id is an :class:`~padfree.errors.InputError` naming the document."""
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)} (got {layout!r})")
    if not docs:
        raise ConfigError("a drafter micro-batch needs at least one document")
    pairs = [_as_doc(j, d) for j, d in enumerate(docs)]
    n = len(pairs)
    sids = tuple(int(s) for s in sample_ids) if sample_ids is not None else (-1,) * n
    offs = tuple(int(s) for s in starts) if starts is not None else (0,) * n
    if len(sids) != n or len(offs) != n:
        raise ConfigError(f"{n} documents but {len(sids)} sample ids and {len(offs)} starts")
    lens = np.array([p[0].shape[0] for p in pairs], np.int64)
    rows_of = Shard(shapes=check_shapes(shapes))
    if layout == "packed":
        rows, width = 1, int(rows_of.row_length(np.array([lens.sum()]))[0])
        doc_starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    else:
        rows, width = n, int(rows_of.row_length(np.array([lens.max()]))[0])
        doc_starts = np.arange(n, dtype=np.int64) * width
    size = rows * width
    ids = np.full(size, pad_token_id, np.int64)
    doc = np.full(size, -1, np.int64)
    pos = np.zeros(size, np.int64)
    mask = np.zeros(size, bool)
    # every real position: its flat index, document and position inside the document (vectorized)
    d_of = np.repeat(np.arange(n), lens)
    p_of = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    flat = doc_starts[d_of] + p_of
    ids[flat] = np.concatenate([p[0] for p in pairs])
    mask[flat] = np.concatenate([p[1] for p in pairs])
    doc[flat] = d_of
    pos[flat] = p_of
    remaining = np.zeros(size, np.int64)
    remaining[flat] = lens[d_of] - p_of

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(x.reshape(rows, width))

    cu = None
    attn = None
    if layout == "packed":
        cu = packed_layout(lens)["cu_seq_lens_q"]
    else:
        attn = t((doc >= 0).astype(np.int64))
    return Contract(
        layout=layout,
        input_ids=t(ids),
        position_ids=t(pos),
        document_ids=t(doc),
        doc_remaining=t(remaining),
        loss_mask=t(mask),
        attention_mask=attn,
        cu_seq_lens=cu,
        doc_starts=tuple(int(s) for s in doc_starts),
        doc_lengths=tuple(int(x) for x in lens),
        sample_ids=sids,
        starts=offs,
        shapes=rows_of.shapes,
    )
