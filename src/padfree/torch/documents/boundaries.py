"""Where the documents of a packed row begin and end, read once from a call's keywords into one object.

Every attention and token-mixer path of padfree takes its boundaries from :func:`read_boundaries`, never from
the keywords themselves, so no two paths can read one row two ways. A row laid out for SP/CP (THD: each
document padded, ``cu_seq_lens_q_padded``) is split at its padded spans (each document's pads sit after its
real tokens, inside its span, so causal attention and causal mixers leave the real tokens exact); an empty
document (two equal entries in ``cu_seq_lens_q``) holds no token and is dropped.

>>> b = read_boundaries({"cu_seq_lens_q": torch.tensor([0, 3, 3, 5])}, 1, 5)
>>> b.spans, b.real, b.packed, b.cu_seqlens().tolist(), b.seq_idx().tolist(), b.max_length
((3, 2), (3, 2), True, [0, 3, 5], [[0, 0, 0, 1, 1]], 3)
>>> b.position_ids().tolist()
[[0, 1, 2, 0, 1]]
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from padfree.errors import ConfigError


@dataclass(frozen=True)
class Boundaries:
    """Every form of a packed call's document boundaries.

    Attributes:
        spans: tokens each document takes along the rows flattened (its padded span on a THD row).
        real: real tokens of each document (equal to ``spans`` unless the row is laid out for SP/CP).
        rows: rows of the batch the boundaries were read for.
    """

    spans: tuple[int, ...]
    real: tuple[int, ...]
    rows: int

    @classmethod
    def whole_rows(cls, batch: int, seq: int) -> Boundaries:
        """One document per row: what a call without boundaries holds."""
        return cls((seq,) * batch, (seq,) * batch, batch)

    @property
    def total(self) -> int:
        """Tokens the boundaries cover (all rows)."""
        return sum(self.spans)

    @property
    def packed(self) -> bool:
        """More documents than rows: the row's tokens must be kept apart."""
        return len(self.spans) > self.rows

    @property
    def padded(self) -> bool:
        """Documents padded inside their spans (THD)."""
        return self.real != self.spans

    @property
    def max_length(self) -> int:
        """The longest span."""
        return max(self.spans, default=0)

    def covers(self, batch: int, seq: int) -> bool:
        """Whether these boundaries cover a ``batch x seq`` call exactly (not a shard of the row)."""
        return self.total == batch * seq

    def cu_seqlens(self, padded: bool = True, device: torch.device | str | None = None) -> torch.Tensor:
        """int32 cumulative boundaries ``[0, n0, n0+n1, ...]`` of the spans (``padded``) or real lengths."""
        lens = torch.tensor((0, *(self.spans if padded else self.real)), dtype=torch.int64)
        return lens.cumsum(0).to(device=device, dtype=torch.int32)

    def seq_idx(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int32 ``(1, T)``: each token's document (what Mamba-2 / causal-conv1d kernels take)."""
        idx = torch.arange(len(self.spans), dtype=torch.int32)
        return idx.repeat_interleave(torch.tensor(self.spans)).to(device)[None]

    def position_ids(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 ``(1, T)``: positions restarting at 0 at every document's span."""
        cu = self.cu_seqlens().to(torch.int64)
        pos = torch.arange(self.total, dtype=torch.int64) - cu[:-1].repeat_interleave(
            torch.tensor(self.spans)
        )
        return pos.to(device)[None]

    def document_starts(self) -> list[int]:
        """The flat token index where each document's span starts."""
        return self.cu_seqlens()[:-1].tolist()


def lengths_from_cu(cu_seq_lens: torch.Tensor | Sequence[int]) -> list[int]:
    """Document lengths from cumulative boundaries ``[0, l0, l0+l1, ...]``.

    >>> lengths_from_cu(torch.tensor([0, 3, 5, 9], dtype=torch.int32))
    [3, 2, 4]
    """
    cu = torch.as_tensor(cu_seq_lens).reshape(-1)
    return torch.diff(cu).tolist()


def lengths_from_position_ids(position_ids: torch.Tensor) -> list[int]:
    """Document lengths of the flattened rows of ``position_ids`` (B, T): a document starts at every row start
    and wherever the position does not continue by +1 (the rule transformers uses to detect packing).

    >>> lengths_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    [3, 2, 4]
    >>> lengths_from_position_ids(torch.tensor([[0, 1, 2], [0, 1, 2]]))
    [3, 3]
    """
    pos = position_ids if position_ids.dim() == 2 else position_ids.reshape(1, -1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = torch.diff(pos, dim=-1) != 1
    idx = torch.nonzero(starts.reshape(-1)).reshape(-1)
    ends = torch.cat([idx[1:], idx.new_tensor([pos.numel()])])
    return (ends - idx).tolist()


_SOURCES = ("cu_seq_lens_q_padded", "cu_seq_lens_q", "cu_seq_lens_k_padded", "cu_seq_lens_k", "position_ids")
_cache = threading.local()


def row_keywords(kwargs: dict) -> dict:
    """The keywords of a call that :func:`read_boundaries` reads (its tensors, as they came): what to keep to
    read a call's boundaries later."""
    return {k: kwargs[k] for k in _SOURCES if isinstance(kwargs.get(k), torch.Tensor)}


def read_boundaries(kwargs: dict, batch: int, seq: int, who: str = "padfree") -> Boundaries | None:
    """The boundaries of a ``batch x seq`` call from its keywords: ``cu_seq_lens_q_padded`` (a THD row's
    spans, its real lengths from ``cu_seq_lens_q``), else ``cu_seq_lens_q``, else restarting ``position_ids``
    (``None`` without any of them: one document per row). Empty documents are dropped; keys boundaries
    other than the queries', or boundaries that go backwards, are refused in one line naming ``who``.
    Read once per set of tensors (every layer of a forward gets the same ones)."""
    present = tuple(row_keywords(kwargs).items())
    key = (tuple((k, id(t), t._version) for k, t in present), batch, seq)
    hits: list = getattr(_cache, "hits", None) or []
    for k, refs, bounds in hits:
        if k == key and all(r() is t for r, (_, t) in zip(refs, present, strict=True)):
            return bounds
    bounds = _read(dict(present), batch, seq, who)
    # a few sets: the model's call, its layers' and its attention's keywords alternate within one forward
    _cache.hits = [(key, tuple(weakref.ref(t) for _, t in present), bounds), *hits[:3]]
    return bounds


def _read(kw: dict, batch: int, seq: int, who: str) -> Boundaries | None:
    padded, cu = kw.get("cu_seq_lens_q_padded"), kw.get("cu_seq_lens_q")
    if padded is None and cu is None:
        pos = kw.get("position_ids")
        if pos is None or pos.dim() > 2 or pos.shape[-1] != seq:
            return None
        if pos.dim() == 2 and pos.shape[0] not in (1, batch):
            raise ConfigError(f"{who}: position_ids hold {pos.shape[0]} rows, the batch {batch}")
        lengths = lengths_from_position_ids(pos.reshape(-1, seq).expand(batch, -1))
        return Boundaries(tuple(lengths), tuple(lengths), batch)
    for side in ("", "_padded"):
        q, k = kw.get(f"cu_seq_lens_q{side}"), kw.get(f"cu_seq_lens_k{side}")
        if q is not None and k is not None and k is not q and not torch.equal(k.to(q.device), q):
            raise ConfigError(
                f"{who}: cu_seq_lens_k{side} differs from cu_seq_lens_q{side} (self-attention only)"
            )
    source = padded if padded is not None else cu
    assert source is not None  # one of them, or the positions above
    spans = lengths_from_cu(source)
    real = spans if cu is None or padded is None else lengths_from_cu(cu)
    name = "cu_seq_lens_q" if padded is None else "cu_seq_lens_q_padded"
    if len(real) != len(spans):
        raise ConfigError(
            f"{who}: cu_seq_lens_q holds {len(real)} documents, cu_seq_lens_q_padded {len(spans)}"
        )
    for what, lens in ((name, spans), ("cu_seq_lens_q", real)):
        bad = next((i for i, n in enumerate(lens) if n < 0), None)
        if bad is not None:
            raise ConfigError(f"{who}: {what} goes backwards at document {bad} ({lens[bad]} tokens)")
    if any(r > s for r, s in zip(real, spans, strict=True)):
        raise ConfigError(
            f"{who}: a document of cu_seq_lens_q is longer than its span in cu_seq_lens_q_padded"
        )
    keep = [
        i for i, n in enumerate(spans) if n > 0
    ]  # an empty document holds no token: nothing to keep apart
    return Boundaries(tuple(spans[i] for i in keep), tuple(real[i] for i in keep), batch)
