"""Sequence (SP) and context (CP) parallelism: how a micro-batch is padded so that it shards evenly.

A micro-batch of a plan with ``sp`` / ``cp`` > 1 is run by one data-parallel rank's group of ``sp * cp``
GPUs; the token budget stays per GPU, so one micro-batch may hold ``sp * cp * budget`` tokens
(:meth:`Shard.capacity`). What each parallelism needs:

- CP (ring attention, zigzag): every document is cut into ``2 * cp`` halves, so each document of a packed
  row is padded to a multiple of ``2 * cp`` (:attr:`Shard.doc_multiple`; the THD layout of
  :func:`padfree.torch.packed_layout` carries both the real and the padded boundaries);
- SP (Ulysses): the row is split into ``sp`` equal shards (``cp * sp`` with CP: each CP rank's share is split
  again), so the row's length is a multiple of :attr:`Shard.row_multiple`, its tail padded; that tail
  belongs to the row's last document's padded span.

Padded strategies (``count x width`` rows) pad every row's width to a multiple of ``row_multiple``.
Every such pad is computed, so it counts as padding in every metric (:func:`padded_rows`).

**Shapes a compiler keeps** (``shapes``, a plan option): ``torch.compile`` and CUDA graphs record one graph
per input shape, so every new row length is a recompile. With ``shapes`` every row's length (a padded
row's width, a packed row's total) is one of a small set: a multiple of a granularity (``shapes=512``), or
one of a declared ladder (``shapes=(1024, 2048, 4096)``, :func:`geometric_shapes`). The row is padded up to
the next one (:meth:`Shard.row_length`; a packed row's tail joins its last document's span, as the SP tail
does), that padding is computed and counts as padding, and the largest shape is the row's capacity.

>>> s = Shard(sp=4, cp=2)
>>> s.doc_multiple, s.row_multiple, s.capacity(100)
(4, 8, 800)
>>> s.sizes(np.array([5, 3, 8]), packed=True).tolist(), s.sizes(np.array([5, 3, 8]), packed=False).tolist()
([8, 4, 8], [8, 8, 8])
>>> Shard(shapes=(64, 128, 256)).row_length(np.array([1, 64, 65, 200])).tolist()
[64, 64, 128, 256]
>>> Shard(sp=2, shapes=48).row_length(np.array([1, 50])).tolist(), Shard(shapes=48).capacity(100)
([48, 96], 96)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from padfree.errors import ConfigError


def round_up(x: np.ndarray, m: int) -> np.ndarray:
    """``x`` rounded up to a multiple of ``m`` (int64)."""
    x = x.astype(np.int64, copy=False)
    return x if m == 1 else -(-x // m) * m


def geometric_shapes(first: int, top: int, ratio: float = 2.0, multiple: int = 1) -> tuple[int, ...]:
    """A ladder of row lengths ``first, first * ratio, ...`` up to ``top`` (included), each rounded up to a
    multiple of ``multiple`` (e.g. the SP/CP row multiple): what ``PlanConfig(shapes=...)`` takes.

    >>> geometric_shapes(512, 4096), geometric_shapes(1000, 3000, 1.5, multiple=64)
    ((512, 1024, 2048, 4096), (1024, 1536, 2304, 3008))
    """
    if not (isinstance(ratio, (int, float)) and ratio > 1.0 and math.isfinite(ratio)):
        raise ConfigError(f"a geometric ladder's ratio must be a number > 1 (got {ratio!r})")
    if not (1 <= int(first) <= int(top)) or int(multiple) < 1:
        raise ConfigError(
            f"a ladder needs 1 <= first <= top and multiple >= 1 (got {first}, {top}, {multiple})"
        )
    out, x = [], float(first)
    while x < top:
        out.append(int(round_up(np.array([math.ceil(x)]), int(multiple))[0]))
        x *= ratio
    out.append(int(round_up(np.array([int(top)]), int(multiple))[0]))
    return tuple(sorted(set(out)))


def check_shapes(
    shapes: object, multiple: int = 1, capacity: int | None = None
) -> int | tuple[int, ...] | None:
    """``shapes`` validated and normalized: ``None``; a granularity (an int >= 1); or the allowed row lengths
    (a sorted tuple of distinct ints, each a multiple of ``multiple``, one of them at most ``capacity``).
    Anything else is one :class:`ConfigError` line."""
    if shapes is None:
        return None
    if isinstance(shapes, (int, np.integer)) and not isinstance(shapes, bool):
        g = int(shapes)
        if not 1 <= g <= 2**24:
            raise ConfigError(f"shapes must be a granularity from 1 to {2**24} tokens (got {g})")
        step = math.lcm(g, multiple)
        if capacity is not None and step > capacity:
            raise ConfigError(
                f"shapes granularity {g} (with the SP/CP row multiple {multiple}: {step}) is over the row "
                f"capacity of {capacity} tokens; lower it or raise the budget"
            )
        return g
    if isinstance(shapes, (list, tuple)) and shapes:
        vals = list(shapes)
        if any(
            isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= 2**24 for v in vals
        ):
            raise ConfigError(f"shapes must be row lengths from 1 to {2**24} tokens (got {list(shapes)[:8]})")
        out = tuple(sorted({int(v) for v in vals}))
        bad = [v for v in out if v % multiple]
        if bad:
            raise ConfigError(
                f"shape {bad[0]} is not a multiple of the SP/CP row multiple {multiple}: every row length "
                "must shard evenly (geometric_shapes(..., multiple=) rounds a ladder for it)"
            )
        if capacity is not None and out[0] > capacity:
            raise ConfigError(
                f"the smallest shape {out[0]} is over the row capacity of {capacity} tokens; add a smaller "
                "shape or raise the budget"
            )
        return out
    raise ConfigError(
        "shapes must be None, a granularity (an integer: rows are multiples of it) or a list of allowed row "
        f"lengths (got {shapes!r})"
    )


@dataclass(frozen=True)
class Shard:
    """The SP and CP degrees of a plan (``1, 1``: no sharding, nothing is padded) and its ``shapes`` (the
    row lengths a compiler keeps: ``None``, a granularity or a sorted tuple of allowed lengths)."""

    sp: int = 1
    cp: int = 1
    shapes: int | tuple[int, ...] | None = None

    @property
    def active(self) -> bool:
        """Whether the row is sharded (SP or CP > 1)."""
        return self.sp * self.cp > 1

    @property
    def pads(self) -> bool:
        """Whether rows are padded beyond their real tokens (SP/CP, or declared shapes)."""
        return self.active or self.shapes is not None

    @property
    def step(self) -> int:
        """Every row length is a multiple of this: :attr:`row_multiple` (with a shapes granularity: their
        lcm)."""
        if isinstance(self.shapes, int):
            return math.lcm(self.row_multiple, self.shapes)
        return self.row_multiple

    def row_length(self, x: np.ndarray) -> np.ndarray:
        """The computed length of rows of ``x`` tokens: up to :attr:`step`, then to the next declared shape
        (a row over the largest one is a :class:`ConfigError`: the plan never makes one)."""
        r = round_up(np.asarray(x), self.step)
        if isinstance(self.shapes, tuple):
            allowed = np.asarray(self.shapes, dtype=np.int64)
            at = np.searchsorted(allowed, r, side="left")
            over = at >= allowed.shape[0]
            if over.any():
                i = int(np.argmax(over))
                raise ConfigError(
                    f"a row of {int(np.asarray(x).reshape(-1)[i])} tokens is over the largest declared "
                    f"shape {int(allowed[-1])}"
                )
            r = allowed[at]
        return r

    @property
    def group(self) -> int:
        """GPUs that share one micro-batch: ``sp * cp``."""
        return self.sp * self.cp

    @property
    def doc_multiple(self) -> int:
        """Each document of a packed row is padded to a multiple of this: ``2 * cp`` under CP, else 1."""
        return 2 * self.cp if self.cp > 1 else 1

    @property
    def row_multiple(self) -> int:
        """A row's length is a multiple of this: ``sp`` without CP, ``cp * lcm(2, sp)`` with it (a
        multiple of ``2 * cp`` whose CP shares split into ``sp`` equal parts)."""
        return self.cp * math.lcm(2, self.sp) if self.cp > 1 else self.sp

    def capacity(self, budget: int) -> int:
        """Tokens (padding included) one micro-batch may hold at a per-GPU ``budget``: ``sp * cp * budget``,
        rounded down to a multiple of :attr:`step` (with declared shapes: the largest one that fits)."""
        total = self.group * int(budget)
        if isinstance(self.shapes, tuple):
            fit = [s for s in self.shapes if s <= total]
            return fit[-1] if fit else self.shapes[0]
        return max(self.step, total // self.step * self.step)

    def sizes(self, length: np.ndarray, packed: bool) -> np.ndarray:
        """What each item takes of a micro-batch: a packed row's document padded to :attr:`doc_multiple`
        (rows are filled to at most :meth:`capacity`, itself a row length, so the tail fits), a padded row's
        width to its :meth:`row_length`. The lengths themselves when nothing is padded."""
        if not self.pads:
            return length
        return round_up(length, self.doc_multiple) if packed else self.row_length(length)


def padded_rows(lf: np.ndarray, starts: np.ndarray, shard: Shard) -> tuple[np.ndarray, np.ndarray]:
    """``(slots, attention)`` of packed rows under ``shard``: documents (float lengths ``lf``, rows starting
    at ``starts``) padded to :attr:`Shard.doc_multiple`, the row's tail to its :meth:`Shard.row_length`,
    added to its last document's span (attention: the sum of the padded spans squared)."""
    padded = round_up(lf.astype(np.int64), shard.doc_multiple).astype(np.float64)
    total = np.add.reduceat(padded, starts)
    slots = shard.row_length(total.astype(np.int64)).astype(np.float64)
    last = np.append(starts[1:], padded.shape[0]) - 1
    attn = np.add.reduceat(padded * padded, starts)
    tail = slots - total
    attn += 2.0 * padded[last] * tail + tail * tail  # (last + tail)^2 - last^2
    return slots, attn
