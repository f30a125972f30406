"""Where a micro-batch is formed: one function per strategy, items in, micro-batches out.

Each function returns ``(order, offsets, strata)``: ``order`` lists item ids so that micro-batch ``j`` is
``order[offsets[j]:offsets[j+1]]``; micro-batches come in the strategy's epoch order; ``strata`` (or
``None``) tells the step composer which bucket each micro-batch belongs to.

Padded strategies obey ``count * longest <= budget``; ``packed`` obeys ``sum(lengths) <= budget``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from padfree.core import _cuts, kernels
from padfree.core.buckets import bucket_of, growth_edges, jitter_edges, optimal_edges
from padfree.core.kernels import njit
from padfree.core.mixing import Mix, merge_buckets


class Batches(NamedTuple):
    """Micro-batch ``j`` is ``order[offsets[j]:offsets[j+1]]``; ``strata`` (or None) are the groups the step
    composer spreads evenly."""

    order: np.ndarray
    offsets: np.ndarray
    strata: np.ndarray | None


class Formed(NamedTuple):
    """What a strategy's ``form`` returns: :class:`Batches` and ``edges``, the bucket upper edges used after
    merging sparse buckets (or None)."""

    order: np.ndarray
    offsets: np.ndarray
    strata: np.ndarray | None
    edges: np.ndarray | None


class Laid(NamedTuple):
    """What a strategy's own ``layout`` returns: one epoch in plan order, steps given to ranks, as the
    :class:`~padfree.core.plan.Plan` holds it: the ``sample`` id, ``lengths`` and ``starts`` (first token
    inside its sample) of each entry, and the micro-batch ``offsets``."""

    sample: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray


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
    return _cuts.cut_padded(lengths_in_order, seg, int(budget))


def sorted_batches(length: np.ndarray, budget: int, rng: np.random.Generator) -> Batches:
    """Sort once by length (ties by index), cut; only the order of micro-batches changes per epoch."""
    order = kernels.counting_argsort(length, int(length.max()) + 1)
    offsets = cut(length[order], budget)
    perm = rng.permutation(offsets.shape[0] - 1)
    order, offsets = kernels.gather_segments(order, offsets, perm)
    return Batches(order, offsets, None)


def random_batches(length: np.ndarray, budget: int, rng: np.random.Generator) -> Batches:
    """A fresh permutation every epoch, cut under the padded budget.

    The greedy cut closes a micro-batch early whenever the next sample would overflow it, leaving some
    micro-batches with few slots; those are merged pairwise (in order) while the union still fits. Without
    this, a step's ranks cannot be balanced: a rank must take ``grad_accum`` micro-batches, and one holding a
    small one idles while the others finish.
    """
    order = rng.permutation(length.shape[0])
    offsets = cut(length[order], budget)
    return Batches(*merge_groups(order, offsets, _cuts.merge_small(length[order], offsets, budget)), None)


def merge_groups(order: np.ndarray, offsets: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate the micro-batches that share a group id (ids are micro-batch numbers)."""
    m = offsets.shape[0] - 1
    if np.array_equal(group, np.arange(m)):
        return order, offsets
    micro_of_item = np.repeat(np.arange(m), np.diff(offsets))
    regroup = kernels.counting_argsort(group[micro_of_item], m)
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


def bucketed_batches(
    length: np.ndarray, budget: int, rng: np.random.Generator, edges: np.ndarray, mix: Mix
) -> Formed:
    """Cut micro-batches inside each length bucket from a noisy length order; returns ``(order, offsets,
    strata, used_edges)``, ``used_edges`` being the upper edges of the buckets after merging.

    Buckets too small for their window merge first (:func:`padfree.core.mixing.merge_buckets`). Inside a
    bucket, item ``i`` gets the key ``x_i + W_b * u_i`` where ``x_i`` is its position in length order
    counted in tokens (the tokens of the bucket's shorter samples; ties in random order), ``u_i ~ U(0, 1)``
    is fresh every epoch and ``W_b = window_b * budget`` is the bucket's window of micro-batches' worth of
    tokens (``mix``: uniform, or chosen from the data, see :mod:`padfree.core.mixing`). Sorting by that key
    and cutting keeps each micro-batch's lengths close (little padding) while a sample's micro-batch
    partners are drawn from about ``window_b`` micro-batches' worth of samples of similar length, so two
    samples share a micro-batch again with probability about ``(2/3) / window_b``. The cut gives each
    bucket as many micro-batches as the greedy cut and evens their sizes (``_cuts.cut_even``). Strata
    are bucket ids.
    """
    n = length.shape[0]
    b_in = bucket_of(length, edges)
    n_in = int(b_in.max()) + 1
    longest_in = np.zeros(n_in, np.int64)
    np.maximum.at(longest_in, b_in, length)
    group = merge_buckets(np.bincount(b_in, weights=length, minlength=n_in), longest_in, budget, mix)
    b = group[b_in]
    n_buckets = int(b.max()) + 1
    used_edges = edges[: group.shape[0]][np.searchsorted(group, np.arange(n_buckets), side="right") - 1]
    longest_b = np.zeros(n_buckets, np.int64)
    np.maximum.at(longest_b, b, length)
    w_b = mix.window(np.maximum(1, budget // np.maximum(longest_b, 1))) * float(budget)
    # tokens before each item in (bucket, length) order, ties at random, without sorting
    top = int(length.max()) + 2
    per_len = np.bincount(length, minlength=top)
    tok_less = np.concatenate(([0], np.cumsum(per_len * np.arange(top, dtype=np.int64))))[:-1]
    bucket_tokens = np.bincount(b, weights=length, minlength=n_buckets)
    bucket_start = np.concatenate(([0.0], np.cumsum(bucket_tokens)))[:-1]
    u = rng.random((2, n))
    span = float(bucket_tokens.max() + w_b.max()) + 1.0
    # b * span + x + w_b[b] * u[1], x = tok_less[length] - bucket_start[b] + u[0] * per_len[length] * length
    key = bucket_keys(length, b, u, tok_less, per_len, bucket_start, w_b, span)
    order = argsort_in_groups(key, b, n_buckets)  # np.argsort(key, kind="stable"), in O(n)
    offsets = _cuts.cut_even(length[order], b[order], int(budget), False)
    strata = b[order[offsets[:-1]]]
    return Formed(order, offsets, strata, used_edges)


@njit(cache=True, nogil=True)
def bucket_keys(
    length: np.ndarray,
    b: np.ndarray,
    u: np.ndarray,
    tok_less: np.ndarray,
    per_len: np.ndarray,
    bucket_start: np.ndarray,
    w_b: np.ndarray,
    span: float,
) -> np.ndarray:
    """The bucketed sort key of every item, in one pass: ``b * span + x + w_b[b] * u[1]`` with ``x =
    tok_less[length] - bucket_start[b] + u[0] * (per_len[length] * length)`` (``padfree.core.batching.
    bucketed_batches`` says what they are), each operation as numpy does it on whole arrays."""
    n = length.shape[0]
    key = np.empty(n)
    for i in range(n):
        ln = length[i]
        g = b[i]
        x = (float(tok_less[ln]) - bucket_start[g]) + u[0, i] * float(per_len[ln] * ln)
        key[i] = (float(g) * span + x) + w_b[g] * u[1, i]
    return key


@njit(cache=True, nogil=True)
def argsort_in_groups(key: np.ndarray, group: np.ndarray, n_groups: int) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` in expected O(n) when the keys follow their groups (every key of
    group ``g`` below every key of group ``g + 1``; ``group`` in ``0 .. n_groups - 1``): items are dealt to
    bins, each group's own bins spanning its keys (a monotone map of the key, so bins are in key order,
    about 8 items a bin), then each bin is sorted stably (insertion sort, merge sort when large). Keys that
    do not follow their groups, or are not finite, get the merge sort of the whole array."""
    n = key.shape[0]
    first = np.zeros(n_groups + 1, np.int64)  # bins of group g: first[g] .. first[g+1]-1
    lo = np.full(n_groups, np.inf)
    hi = np.full(n_groups, -np.inf)
    for i in range(n):
        g = group[i]
        first[g + 1] += 1
        k = key[i]
        if not (k > -np.inf and k < np.inf):
            return np.argsort(key, kind="mergesort")
        if k < lo[g]:
            lo[g] = k
        if k > hi[g]:
            hi[g] = k
    prev = -np.inf
    scale = np.zeros(n_groups)
    for g in range(n_groups):
        size = first[g + 1]
        if size > 0:
            if not lo[g] > prev:
                return np.argsort(key, kind="mergesort")
            prev = hi[g]
        n_bins = (size + 7) // 8
        if hi[g] > lo[g]:
            scale[g] = n_bins / (hi[g] - lo[g])
        first[g + 1] = first[g] + n_bins
    total = first[n_groups]
    bin_of = np.empty(n, np.int64)
    ends = np.zeros(total + 1, np.int64)
    for i in range(n):
        g = group[i]
        j = first[g] + min(int((key[i] - lo[g]) * scale[g]), first[g + 1] - first[g] - 1)
        bin_of[i] = j
        ends[j + 1] += 1
    for j in range(total):
        ends[j + 1] += ends[j]
    out = np.empty(n, np.int64)
    sorted_key = np.empty(n, key.dtype)
    fill = ends[:total].copy()
    for i in range(n):
        j = bin_of[i]
        out[fill[j]] = i
        sorted_key[fill[j]] = key[i]
        fill[j] += 1
    for j in range(total):
        a, e = ends[j], ends[j + 1]
        if e - a > 64:
            inner = np.argsort(sorted_key[a:e], kind="mergesort")
            part = out[a:e][inner]
            keys = sorted_key[a:e][inner]
            out[a:e] = part
            sorted_key[a:e] = keys
        else:
            for t in range(a + 1, e):  # insertion sort: stable, the deal kept index order
                x = out[t]
                kx = sorted_key[t]
                u = t
                while u > a and sorted_key[u - 1] > kx:
                    out[u] = out[u - 1]
                    sorted_key[u] = sorted_key[u - 1]
                    u -= 1
                out[u] = x
                sorted_key[u] = kx
    return out


def packed_batches(length: np.ndarray, budget: int, rng: np.random.Generator) -> Batches:
    """A fresh permutation, then online best-fit into bins of ``budget`` tokens; bins in random order.

    Best-fit over the shuffled order (not decreasing): a "decreasing" sort makes bin composition nearly the
    same every epoch, while the shuffled order reaches the same bin count and a new composition each epoch.
    """
    perm = rng.permutation(length.shape[0])
    bin_of, n_bins = kernels.best_fit(length[perm], int(budget))
    grouped = kernels.counting_argsort(bin_of, int(n_bins))
    order = perm[grouped]
    offsets = np.concatenate(([0], np.cumsum(np.bincount(bin_of, minlength=n_bins)))).astype(np.int64)
    order, offsets = kernels.gather_segments(order, offsets, rng.permutation(n_bins))
    return Batches(order, offsets, None)
