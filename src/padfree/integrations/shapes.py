"""The few shapes a compiled drafter meets: the row lengths and anchor-slot widths of a :class:`ShapeSet`,
rows padded to one of them (:func:`pad_rows`) and a row's anchors laid out in slots (:func:`anchor_slots`), as
the feed, the speculators collate and the SpecForge loader lay them out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from padfree.errors import ConfigError


def _steps(top: int, n: int, multiple: int) -> tuple[int, ...]:
    """``n`` values evenly spaced up to ``top``, each rounded up to ``multiple`` (capped at ``top``)."""
    if n < 1 or multiple < 1 or top < 1:
        raise ConfigError(f"shape set: need a top, a count and a multiple >= 1 (got {top}, {n}, {multiple})")
    return tuple(sorted({min(top, -(-(top * (i + 1) // n) // multiple) * multiple) for i in range(n)}))


def _smallest(allowed: tuple[int, ...], n: int, what: str) -> int:
    i = int(np.searchsorted(np.asarray(allowed), n))
    if i == len(allowed):
        raise ConfigError(f"{what} {n} exceeds the largest allowed shape {allowed[-1]}")
    return allowed[i]


@dataclass(frozen=True)
class ShapeSet:
    """The row lengths and DFlash anchor slots a fed model may see, so that a compiled model meets a handful
    of shapes instead of one per batch.

    Attributes:
        lengths: allowed row lengths, ascending; a row is padded to the smallest one that holds it.
        anchors: allowed anchor-slot widths, ascending (one width: a fixed anchor count, as speculators'
            ``max_anchors``); empty: each row keeps its own anchor count.

    >>> s = ShapeSet.spread(8192, n=4, anchors=1024)
    >>> s.lengths, s.anchors, s.width(3000), s.anchor_width(700)
    ((2048, 4096, 6144, 8192), (1024,), 4096, 1024)
    >>> ShapeSet.spread(2048, n=2, anchors=512, anchor_steps=4).anchors
    (128, 256, 384, 512)
    """

    lengths: tuple[int, ...]
    anchors: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("lengths", "anchors"):
            vs = getattr(self, name)
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vs) or (
                name == "lengths" and not vs
            ):
                raise ConfigError(f"shape set: {name} must be integers >= 1 (got {vs!r})")
            if list(vs) != sorted(set(vs)):
                raise ConfigError(f"shape set: {name} must rise strictly (got {vs!r})")

    @classmethod
    def spread(
        cls,
        longest: int,
        n: int = 4,
        *,
        multiple: int = 64,
        anchors: int | None = None,
        anchor_steps: int = 1,
    ) -> ShapeSet:
        """``n`` row lengths evenly spaced up to ``longest`` and ``anchor_steps`` anchor widths up to
        ``anchors``, each rounded up to ``multiple`` (Model-Optimizer#1069 rounds to 1024-token buckets for
        this reason)."""
        widths = () if anchors is None else _steps(anchors, anchor_steps, min(multiple, anchors))
        return cls(_steps(longest, n, multiple), widths)

    def width(self, n: int) -> int:
        """The smallest allowed row length that holds ``n`` positions."""
        return _smallest(self.lengths, n, "a row of length")

    def anchor_width(self, n: int) -> int:
        """The anchor slots of a row holding ``n`` anchors (at least 1)."""
        if not self.anchors:
            return max(1, n)
        if n > self.anchors[-1]:
            raise ConfigError(
                f"a row holds {n} anchors, more than the largest anchor width {self.anchors[-1]}: plan with "
                f"anchor_budget={self.anchors[-1]} so no micro-batch holds more"
            )
        return _smallest(self.anchors, max(1, n), "an anchor count")


def slot_width(shapes: ShapeSet | None, n: int) -> int:
    """The anchor slots of a row holding ``n`` anchors: the shape set's width, or ``n`` itself (at least 1)
    without one."""
    return shapes.anchor_width(n) if shapes is not None else max(1, n)


def anchor_slots(rows: Sequence[np.ndarray | torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anchors, valid)``, each ``[len(rows), width]``: every row's anchor positions first, then padding
    (position 0, ``valid`` False, which the drafters' losses mask out).

    >>> a, v = anchor_slots([np.array([3, 9]), np.array([5])], 3)
    >>> a.tolist(), v.tolist()
    ([[3, 9, 0], [5, 0, 0]], [[True, True, False], [True, False, False]])
    """
    anchors = torch.zeros((len(rows), width), dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, a in enumerate(rows):
        n = len(a)
        if n > width:
            raise ConfigError(f"a row holds {n} anchors, more than {width} anchor slots")
        anchors[r, :n] = torch.as_tensor(a, dtype=torch.long).reshape(-1)
        valid[r, :n] = True
    return anchors, valid


def pad_rows(tensors: dict, length: int, width: int) -> dict:
    """``tensors`` with every ``(B, length, ...)`` tensor padded to ``width`` positions: ``document_ids`` with
    -1 (no document), the rest with 0; other values as they are.

    >>> row = {"input_ids": torch.ones(1, 2, dtype=torch.long), "document_ids": torch.zeros(1, 2)}
    >>> out = pad_rows(row, 2, 4)
    >>> out["input_ids"].tolist(), out["document_ids"].tolist()
    ([[1, 1, 0, 0]], [[0.0, 0.0, -1.0, -1.0]])
    """
    out = dict(tensors)
    if width <= length:
        return out
    for k, v in tensors.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == length:
            fill = -1 if k == "document_ids" else 0
            pad = torch.full((v.shape[0], width - length, *v.shape[2:]), fill, dtype=v.dtype, device=v.device)
            out[k] = torch.cat([v, pad], dim=1)
    return out
