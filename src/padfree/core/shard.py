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
Every such pad is computed, so it counts as padding in every metric (:func:`padded_shapes`).

>>> s = Shard(sp=4, cp=2)
>>> s.doc_multiple, s.row_multiple, s.capacity(100)
(4, 8, 800)
>>> s.sizes(np.array([5, 3, 8]), packed=True).tolist(), s.sizes(np.array([5, 3, 8]), packed=False).tolist()
([8, 4, 8], [8, 8, 8])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def round_up(x: np.ndarray, m: int) -> np.ndarray:
    """``x`` rounded up to a multiple of ``m`` (int64)."""
    x = x.astype(np.int64, copy=False)
    return x if m == 1 else -(-x // m) * m


@dataclass(frozen=True)
class Shard:
    """The SP and CP degrees of a plan (``1, 1``: no sharding, nothing is padded)."""

    sp: int = 1
    cp: int = 1

    @property
    def active(self) -> bool:
        return self.sp * self.cp > 1

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
        rounded down to a multiple of :attr:`row_multiple`."""
        total = self.group * int(budget)
        return max(self.row_multiple, total // self.row_multiple * self.row_multiple)

    def sizes(self, length: np.ndarray, packed: bool) -> np.ndarray:
        """What each item takes of a micro-batch: a packed row's document padded to :attr:`doc_multiple`
        (rows are filled to a multiple of :attr:`row_multiple`, so the tail fits), a padded row's width to
        :attr:`row_multiple`. The lengths themselves when nothing is sharded."""
        if not self.active:
            return length
        return round_up(length, self.doc_multiple if packed else self.row_multiple)


def padded_rows(lf: np.ndarray, starts: np.ndarray, shard: Shard) -> tuple[np.ndarray, np.ndarray]:
    """``(slots, attention)`` of packed rows under ``shard``: documents (float lengths ``lf``, rows starting
    at ``starts``) padded to :attr:`Shard.doc_multiple`, the row's tail to :attr:`Shard.row_multiple`,
    added to its last document's span (attention: the sum of the padded spans squared)."""
    padded = round_up(lf.astype(np.int64), shard.doc_multiple).astype(np.float64)
    total = np.add.reduceat(padded, starts)
    slots = round_up(total.astype(np.int64), shard.row_multiple).astype(np.float64)
    last = np.append(starts[1:], padded.shape[0]) - 1
    attn = np.add.reduceat(padded * padded, starts)
    tail = slots - total
    attn += 2.0 * padded[last] * tail + tail * tail  # (last + tail)^2 - last^2
    return slots, attn
