"""Length bucket edges: a geometric grid (each bucket ``growth`` times wider) or padding-optimal edges.

An edge list holds bucket *upper* edges, ascending; a length ``L`` falls in the first bucket whose upper
edge is ``>= L``.
"""

from __future__ import annotations

import numpy as np

from padfree.core.kernels import njit
from padfree.errors import ConfigError

MAX_DP_CELLS = 2**25
"""The most cells of ``optimal_edges``' split table, ``(buckets + 1) * (distinct lengths + 1)`` (int64:
256 MiB)."""


def growth_edges(lengths: np.ndarray, growth: float, phase: float = 0.0) -> np.ndarray:
    """Upper edges ``ceil(min * growth**(k + phase))`` for k = 0, 1, ... until the longest length is covered.

    ``phase`` in [0, 1) shifts the whole grid (per-epoch jitter), so a bucket boundary does not sit between
    the same two lengths every epoch.

    >>> growth_edges(np.array([100, 120, 200]), 1.25).tolist()
    [100, 125, 157, 196, 245]
    """
    lo = float(lengths.min())
    hi = float(lengths.max())
    n = int(np.ceil(np.log(hi / lo) / np.log(growth) - phase)) + 2
    with np.errstate(over="ignore"):  # a huge growth overshoots in float; capped before the cast
        raw = lo * growth ** (np.arange(n, dtype=np.float64) + phase)
    edges = np.ceil(np.minimum(raw, 2.0**62) - 1e-9).astype(np.int64)
    edges = np.unique(np.maximum(edges, int(lo)))
    last = int(np.searchsorted(edges, hi, side="left"))
    return edges[: last + 1]


def optimal_edges(lengths: np.ndarray, n_buckets: int, counts: np.ndarray | None = None) -> np.ndarray:
    """The ``n_buckets`` upper edges that minimize total padding when every sample is padded to its bucket's
    upper edge: ``sum_i (edge(b_i) - L_i)``. Exact (dynamic programming over the D distinct lengths with
    divide-and-conquer optimization, O(n_buckets * D log D)). With ``counts``, ``lengths`` are the distinct
    lengths (ascending) and ``counts`` how many samples have each (a histogram instead of every sample).

    >>> optimal_edges(np.array([10, 10, 11, 50, 52, 100]), 3).tolist()
    [11, 52, 100]
    >>> optimal_edges(np.array([10, 11, 50, 52, 100]), 3, counts=np.array([2, 1, 1, 1, 1])).tolist()
    [11, 52, 100]
    """
    if counts is None:
        values, counts = np.unique(lengths, return_counts=True)
    else:  # ``lengths`` are already the distinct lengths, ascending, and ``counts`` their multiplicities
        values = np.asarray(lengths)
    k = min(int(n_buckets), values.shape[0])
    if (k + 1) * (values.shape[0] + 1) > MAX_DP_CELLS:
        most = max(1, MAX_DP_CELLS // (values.shape[0] + 1) - 1)
        mib = (k + 1) * (values.shape[0] + 1) * 8 / 2**20
        raise ConfigError(
            f"{n_buckets} padding-optimal buckets over {values.shape[0]:,} distinct lengths need a "
            f"{mib:,.0f} MiB table (limit {MAX_DP_CELLS * 8 // 2**20} MiB): use at most {most} buckets, "
            "or --growth"
        )
    return _optimal_edges_dp(values.astype(np.int64), counts.astype(np.int64), int(n_buckets))


def padding_of_edges(lengths: np.ndarray, edges: np.ndarray) -> int:
    """Total padding ``sum(edge(b_i) - L_i)`` of an edge list (the quantity ``optimal_edges`` minimizes)."""
    b = np.searchsorted(edges, lengths, side="left")
    return int((edges[b] - lengths).sum())


def jitter_edges(edges: np.ndarray, rng: np.random.Generator, spread: float) -> np.ndarray:
    """Move every inner edge by a random factor in ``[1 - spread/2, 1 + spread/2]`` (the last edge stays)."""
    if edges.size <= 1:
        return edges
    f = 1.0 + spread * (rng.random(edges.size - 1) - 0.5)
    inner = np.round(edges[:-1] * f).astype(np.int64)
    return np.unique(np.minimum(np.append(inner, edges[-1]), edges[-1]))


def bucket_of(lengths: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Bucket index of each length under upper ``edges`` (``np.searchsorted(edges, lengths)``; through a
    table of every length up to the longest when that table is no larger than the lengths themselves).

    >>> bucket_of(np.array([1, 4, 5, 9]), np.array([4, 8, 16])).tolist()
    [0, 0, 1, 2]
    """
    top = int(lengths.max()) + 1 if lengths.size else 0
    if 0 < top <= lengths.shape[0] and int(lengths.min()) >= 0:
        return np.searchsorted(edges, np.arange(top), side="left").astype(np.int64)[lengths]
    return np.searchsorted(edges, lengths, side="left").astype(np.int64)


@njit(cache=True, nogil=True)
def _optimal_edges_dp(values: np.ndarray, counts: np.ndarray, n_buckets: int) -> np.ndarray:
    """Bucket upper edges minimizing total padding ``sum(bucket_max - length)`` over all samples.

    ``values`` are the distinct lengths (ascending) with their ``counts``. Exact dynamic programming over
    distinct lengths, ``f[k][j] = min_i f[k-1][i] + cost(i, j)``, solved with divide-and-conquer
    optimization (the cost is Monge, so the optimal split point is monotone in ``j``):
    O(n_buckets * D log D) time for D distinct lengths instead of O(n_buckets * D^2).
    Returns the chosen upper edges (a subset of ``values``, ascending, the last is ``values[-1]``).
    """
    d = values.shape[0]
    kmax = min(n_buckets, d)
    cnt = np.zeros(d + 1, np.float64)
    tot = np.zeros(d + 1, np.float64)
    for i in range(d):
        cnt[i + 1] = cnt[i] + counts[i]
        tot[i + 1] = tot[i] + counts[i] * values[i]
    inf = np.inf
    prev = np.full(d + 1, inf)
    prev[0] = 0.0
    arg = np.zeros((kmax + 1, d + 1), np.int64)
    cur = np.full(d + 1, inf)
    stack = np.empty((4 * (d + 2) + 64, 4), np.int64)
    for k in range(1, kmax + 1):
        cur[:] = inf
        top = 0
        stack[0, 0] = 1
        stack[0, 1] = d
        stack[0, 2] = 0
        stack[0, 3] = d - 1
        top = 1
        while top > 0:
            top -= 1
            lo = stack[top, 0]
            hi = stack[top, 1]
            olo = stack[top, 2]
            ohi = stack[top, 3]
            if lo > hi:
                continue
            mid = (lo + hi) // 2
            best = inf
            bi = olo
            upper = ohi if ohi < mid - 1 else mid - 1
            for i in range(olo, upper + 1):
                if prev[i] == inf:
                    continue
                v = prev[i] + values[mid - 1] * (cnt[mid] - cnt[i]) - (tot[mid] - tot[i])
                if v < best:
                    best = v
                    bi = i
            cur[mid] = best
            arg[k, mid] = bi
            stack[top, 0] = lo
            stack[top, 1] = mid - 1
            stack[top, 2] = olo
            stack[top, 3] = bi
            top += 1
            stack[top, 0] = mid + 1
            stack[top, 1] = hi
            stack[top, 2] = bi
            stack[top, 3] = ohi
            top += 1
        prev, cur = cur, prev
    edges = np.empty(kmax, np.int64)
    j = d
    k = kmax
    n = 0
    while k > 0 and j > 0:
        edges[n] = values[j - 1]
        n += 1
        j = arg[k, j]
        k -= 1
    return edges[:n][::-1].copy()
