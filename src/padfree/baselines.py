"""The field's batchings that padfree is compared with (simulate, report, benchmarks); not part of the
planning core. Each returns ``(order, offsets)``: sample ids micro-batch after micro-batch, and the
boundaries.

- :func:`naive_bucketed`: the motivating case's own bucketing: length buckets each 25% wider than the previous
  one, samples shuffled inside each bucket, cut greedily under the padded budget, then the micro-batches
  shuffled. No noisy sort inside a bucket, no stratified step composition, no rank balancing.
- :func:`fixed_count`: SpecForge's batches: a fixed sample count per micro-batch, random order, padded.
- :func:`sorted_fixed_count`: the field's globally length-sorted batches of a fixed sample count (HF
  ``group_by_length`` at its tightest), micro-batches in random order.
- :func:`multipack`: speculators' / axolotl's multipack: best fit decreasing over shuffled windows, bins in
  random order.
"""

from __future__ import annotations

import numpy as np

from padfree.core import kernels
from padfree.core.batching import cut
from padfree.core.buckets import bucket_of, growth_edges
from padfree.core.steps import spread_tail

Batches = tuple[np.ndarray, np.ndarray]


def naive_bucketed(
    length: np.ndarray, budget: int, rng: np.random.Generator, growth: float = 1.25, step_size: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """``(order, offsets)`` of naive bucketing (see module docstring); the micro-batch count is made a
    multiple of ``step_size`` by splitting the last micro-batches (as padfree does) so ranks get equal counts.

    >>> import numpy as np
    >>> # buckets {10}, {11, 12}, {30, 31}, {90}; 30 and 31 exceed the budget together
    >>> order, offsets = naive_bucketed(np.array([10, 11, 12, 30, 31, 90]), 40, np.random.default_rng(0))
    >>> sorted(order.tolist()), len(offsets) - 1
    ([0, 1, 2, 3, 4, 5], 5)
    """
    length = np.asarray(length, dtype=np.int64)
    b = bucket_of(length, growth_edges(length, growth))
    perm = rng.permutation(length.shape[0])
    order = perm[np.argsort(b[perm], kind="stable")]  # grouped by bucket, shuffled inside
    offsets = cut(length[order], budget, b[order])
    order, offsets = kernels.gather_segments(order, offsets, rng.permutation(offsets.shape[0] - 1))
    return order, spread_tail(offsets, step_size)


def samples_per_batch(lengths: np.ndarray, budget: int) -> int:
    """The fixed sample count of the field's batchings: ``budget // mean length`` (at least 1), so that a
    micro-batch holds on average the budget's real tokens (rounded down)."""
    return max(1, int(budget // float(lengths.mean())))


def fixed_count(lengths: np.ndarray, budget: int, rng: np.random.Generator) -> Batches:
    """SpecForge's batches: :func:`samples_per_batch` samples each, random order (padded to the longest)."""
    n = lengths.shape[0]
    count = samples_per_batch(lengths, budget)
    return rng.permutation(n), np.append(np.arange(0, n, count), n).astype(np.int64)


def sorted_fixed_count(lengths: np.ndarray, budget: int, rng: np.random.Generator) -> Batches:
    """Globally length-sorted batches of :func:`samples_per_batch` samples each (ties in random order), the
    micro-batches in random order (padded to their longest)."""
    n = lengths.shape[0]
    count = samples_per_batch(lengths, budget)
    order = rng.permutation(n)
    order = order[np.argsort(lengths[order], kind="stable")]
    offsets = np.append(np.arange(0, n, count), n).astype(np.int64)
    return kernels.gather_segments(order, offsets, rng.permutation(offsets.shape[0] - 1))


def multipack(lengths: np.ndarray, budget: int, rng: np.random.Generator, window: int = 4096) -> Batches:
    """First-fit-decreasing-like packing (best fit on lengths sorted longest first) over shuffled windows of
    samples, bins in random order: the multipack idea (speculators, axolotl)."""
    perm = rng.permutation(lengths.shape[0])
    orders, sizes = [], []
    for a in range(0, perm.shape[0], window):
        chunk = perm[a : a + window]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        bin_of, n_bins = kernels.best_fit(lengths[chunk].astype(np.int64), int(budget))
        orders.append(chunk[kernels.counting_argsort(bin_of, int(n_bins))])
        sizes.append(np.bincount(bin_of, minlength=n_bins))
    order = np.concatenate(orders)
    count = np.concatenate(sizes)
    offsets = np.concatenate(([0], np.cumsum(count))).astype(np.int64)
    return kernels.gather_segments(order, offsets, rng.permutation(count.shape[0]))
