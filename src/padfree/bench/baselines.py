"""Simple baselines that padfree is compared with; not part of the planning core.

:func:`naive_bucketed` is the motivating case's own bucketing: length buckets each 25% wider than the
previous one, samples shuffled inside each bucket, cut greedily under the padded budget, then the
micro-batches shuffled. No noisy sort inside a bucket, no stratified step composition, no rank balancing.
"""

from __future__ import annotations

import numpy as np

from padfree.core import _kernels
from padfree.core.batching import cut
from padfree.core.buckets import bucket_of, growth_edges
from padfree.core.steps import spread_tail


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
    order, offsets = _kernels.gather_segments(order, offsets, rng.permutation(offsets.shape[0] - 1))
    return order, spread_tail(offsets, step_size)
