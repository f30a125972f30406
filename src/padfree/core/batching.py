"""Where a micro-batch is formed: one function per strategy, items in, micro-batches out.

Each function returns ``(order, offsets, strata)``: ``order`` lists item ids so that micro-batch ``j`` is
``order[offsets[j]:offsets[j+1]]``; micro-batches come in the strategy's epoch order; ``strata`` (or
``None``) tells the step composer which bucket each micro-batch belongs to.

Padded strategies obey ``count * longest <= budget``; ``packed`` obeys ``sum(lengths) <= budget``.
"""

from __future__ import annotations

import numpy as np

from padfree.core import _kernels
from padfree.core.buckets import bucket_of, growth_edges, jitter_edges, optimal_edges

Batches = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]

_ZEROS_CACHE: dict[int, np.ndarray] = {}


def _no_segments(n: int) -> np.ndarray:
    z = _ZEROS_CACHE.get(n)
    if z is None:
        z = np.zeros(n, np.int8)
        _ZEROS_CACHE.clear()
        _ZEROS_CACHE[n] = z
    return z


def cut(lengths_in_order: np.ndarray, budget: int, segments: np.ndarray | None = None) -> np.ndarray:
    """Offsets of the greedy padded cut: consecutive runs with ``count * longest <= budget``.

    >>> cut(np.array([4, 4, 4, 9, 2]), budget=12).tolist()
    [0, 3, 4, 5]
    """
    seg = _no_segments(lengths_in_order.shape[0]) if segments is None else segments
    return _kernels.cut_padded(lengths_in_order, seg, int(budget))


def sorted_batches(length: np.ndarray, budget: int, rng: np.random.Generator) -> Batches:
    """Sort once by length (ties by index), cut; only the order of micro-batches changes per epoch."""
    order = _kernels.counting_argsort(length, int(length.max()) + 1)
    offsets = cut(length[order], budget)
    perm = rng.permutation(offsets.shape[0] - 1)
    order, offsets = _kernels.gather_segments(order, offsets, perm)
    return order, offsets, None


def random_batches(length: np.ndarray, budget: int, rng: np.random.Generator) -> Batches:
    """A fresh permutation every epoch, cut under the padded budget.

    The greedy cut closes a micro-batch early whenever the next sample would overflow it, leaving some
    micro-batches with few slots; those are merged pairwise (in order) while the union still fits. Without
    this, a step's ranks cannot be balanced: a rank must take ``grad_accum`` micro-batches, and one holding a
    small one idles while the others finish.
    """
    order = rng.permutation(length.shape[0])
    offsets = cut(length[order], budget)
    return (*merge_groups(order, offsets, _kernels.merge_small(length[order], offsets, budget)), None)


def merge_groups(order: np.ndarray, offsets: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate the micro-batches that share a group id (ids are micro-batch numbers)."""
    m = offsets.shape[0] - 1
    if np.array_equal(group, np.arange(m)):
        return order, offsets
    micro_of_item = np.repeat(np.arange(m), np.diff(offsets))
    regroup = _kernels.counting_argsort(group[micro_of_item], m)
    sizes = np.bincount(group, weights=np.diff(offsets), minlength=m).astype(np.int64)
    sizes = sizes[sizes > 0]
    return order[regroup], np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)


def bucket_edges(
    length: np.ndarray, growth: float, n_buckets: int | None, rng: np.random.Generator | None
) -> np.ndarray:
    """This epoch's bucket upper edges: the growth grid with a random phase, or the padding-optimal edges
    moved by up to +-5% (the last edge stays). ``rng=None`` gives the unjittered edges."""
    if n_buckets is not None:
        edges = optimal_edges(length, n_buckets)
        return edges if rng is None else jitter_edges(edges, rng, 0.10)
    return growth_edges(length, growth, 0.0 if rng is None else float(rng.random()))


def merge_small_buckets(b: np.ndarray, length: np.ndarray, budget: int, mix: int) -> np.ndarray:
    """Merge neighbouring buckets, shortest first, until each holds ``mix`` micro-batches' worth of samples
    (``mix * (budget // longest)``); a short remainder joins the bucket below it. Returns dense bucket ids.

    Without this, a sparse bucket of short samples fits in one or two micro-batches and those samples would
    meet the same partners every epoch. Merging costs little padding: such buckets carry few tokens.
    """
    n_in = int(b.max()) + 1
    n_b = np.bincount(b, minlength=n_in)
    longest = np.zeros(n_in, np.int64)
    np.maximum.at(longest, b, length)
    new_id = np.zeros(n_in, np.int64)
    cur, acc, acc_max, last_closed = 0, 0, 0, -1
    for k in range(n_in):  # loops over buckets (dozens), not samples
        new_id[k] = cur
        if n_b[k] == 0:
            continue
        acc += int(n_b[k])
        acc_max = max(acc_max, int(longest[k]))
        if acc >= mix * max(1, budget // acc_max):
            last_closed = cur
            cur, acc, acc_max = cur + 1, 0, 0
    if acc > 0 and last_closed >= 0:  # remainder at the long end joins the bucket below it
        new_id[new_id == cur] = last_closed
    new_id = np.unique(new_id, return_inverse=True)[1]
    return new_id[b]


def bucketed_batches(
    length: np.ndarray, budget: int, rng: np.random.Generator, edges: np.ndarray, mix: int
) -> Batches:
    """Cut micro-batches inside each length bucket from a noisy length order.

    Inside a bucket, item ``i`` gets the key ``rank_i + w_b * u_i`` where ``rank_i`` is its position in
    length order (ties broken at random), ``u_i ~ U(0, 1)`` is fresh every epoch and ``w_b = mix * m_b`` is
    ``mix`` micro-batches' worth of samples (``m_b = budget // longest_b``). Sorting by that key and cutting
    greedily keeps each micro-batch's lengths close (little padding) while a sample's micro-batch
    neighbours are drawn from about ``mix`` micro-batches' worth of samples of similar length, so two
    samples share a micro-batch again with probability about ``1/mix``. A bucket smaller than ``w_b`` is
    simply shuffled. Strata are bucket ids.
    """
    n = length.shape[0]
    b = merge_small_buckets(bucket_of(length, edges), length, budget, mix)
    n_buckets = int(b.max()) + 1
    n_b = np.bincount(b, minlength=n_buckets)
    longest_b = np.zeros(n_buckets, np.int64)
    np.maximum.at(longest_b, b, length)
    m_b = np.maximum(1, budget // np.maximum(longest_b, 1))
    w_b = (mix * m_b).astype(np.float64)
    # rank inside the bucket in length order, ties at random, without sorting
    top = int(length.max()) + 2
    per_len = np.bincount(length, minlength=top)
    less = np.concatenate(([0], np.cumsum(per_len)))[:-1]  # items with length < L
    bucket_start = np.concatenate(([0], np.cumsum(n_b)))[:-1]
    u = rng.random((2, n))
    rank = less[length] - bucket_start[b] + u[0] * per_len[length]
    span = float((n_b + w_b).max()) + 1.0
    key = b * span + rank + w_b[b] * u[1]
    order = np.argsort(key, kind="stable")
    offsets = cut(length[order], budget, b[order])
    strata = b[order[offsets[:-1]]]
    return order, offsets, strata


def packed_batches(length: np.ndarray, budget: int, rng: np.random.Generator) -> Batches:
    """A fresh permutation, then online best-fit into bins of ``budget`` tokens; bins in random order.

    Best-fit over the shuffled order (not decreasing): a "decreasing" sort makes bin composition nearly the
    same every epoch, while the shuffled order reaches the same bin count and a new composition each epoch.
    """
    perm = rng.permutation(length.shape[0])
    bin_of, n_bins = _kernels.best_fit(length[perm], int(budget))
    grouped = _kernels.counting_argsort(bin_of, int(n_bins))
    order = perm[grouped]
    offsets = np.concatenate(([0], np.cumsum(np.bincount(bin_of, minlength=n_bins)))).astype(np.int64)
    order, offsets = _kernels.gather_segments(order, offsets, rng.permutation(n_bins))
    return order, offsets, None
