"""Compiled inner loops of the planner (numba), each a sequential scan that numpy cannot vectorize.

Everything here takes and returns plain numpy arrays, is deterministic, and has a pure-Python fallback
(the same code, uncompiled) when numba is not importable.
"""

from __future__ import annotations

import numpy as np

try:  # pragma: no cover - exercised by the import itself
    from numba import njit
except ImportError:  # pragma: no cover

    def njit(*args, **kwargs):  # type: ignore[no-redef]
        if args and callable(args[0]):
            return args[0]
        return lambda f: f


@njit(cache=True, nogil=True)
def cut_padded(lens: np.ndarray, segments: np.ndarray, budget: int) -> np.ndarray:
    """Greedy cut of an ordered run into micro-batches with ``count * longest <= budget``.

    A new micro-batch also starts wherever ``segments`` changes (bucket boundaries). Returns offsets
    (``len == n_micro + 1``). Every length must be ``<= budget``.
    """
    n = lens.shape[0]
    out = np.empty(n + 1, np.int64)
    k = 0
    out[0] = 0
    start = 0
    longest = 0
    for i in range(n):
        length = lens[i]
        m = longest if longest > length else length
        if i > start and ((i - start + 1) * m > budget or segments[i] != segments[i - 1]):
            k += 1
            out[k] = i
            start = i
            longest = length
        else:
            longest = m
    if n > 0:
        k += 1
        out[k] = n
    return out[: k + 1]


@njit(cache=True, nogil=True)
def merge_small(lens: np.ndarray, offsets: np.ndarray, budget: int) -> np.ndarray:
    """Group id of each micro-batch after merging small ones (padded slots <= budget/2) with the previous
    small one while the union still obeys ``count * longest <= budget``. Groups keep the order of their
    first member."""
    m = offsets.shape[0] - 1
    group = np.arange(m)
    open_g = -1
    open_cnt = 0
    open_max = 0
    for j in range(m):
        cnt = offsets[j + 1] - offsets[j]
        mx = 0
        for t in range(offsets[j], offsets[j + 1]):
            if lens[t] > mx:
                mx = lens[t]
        if 2 * cnt * mx > budget:
            continue
        both = mx if mx > open_max else open_max
        if open_g >= 0 and (open_cnt + cnt) * both <= budget:
            group[j] = open_g
            open_cnt += cnt
            open_max = both
        else:
            open_g = j
            open_cnt = cnt
            open_max = mx
    return group


@njit(cache=True, nogil=True)
def best_fit(lens: np.ndarray, budget: int) -> tuple:
    """Online best-fit bin packing in the given order: each item goes to the open bin with the least room
    that still fits it, else to a new bin (an item longer than ``budget`` gets a bin of its own). O(n log
    budget) with a segment tree over remaining capacity.

    Returns ``(bin_of_item, n_bins)``; bins are numbered in the order they were opened.
    """
    n = lens.shape[0]
    size = 1
    while size < budget + 1:
        size *= 2
    tree = np.zeros(2 * size, np.int64)  # number of open bins per remaining capacity
    head = np.full(budget + 1, -1, np.int64)  # a stack of bins per remaining capacity
    nxt = np.empty(n, np.int64)
    room = np.empty(n, np.int64)
    bin_of = np.empty(n, np.int64)
    n_bins = 0
    for i in range(n):
        length = lens[i]
        if length > budget:  # longer than the bins (a plan that leaves headroom): a bin of its own
            bin_of[i] = n_bins
            room[n_bins] = 0
            n_bins += 1
            continue
        # smallest remaining capacity >= length that has an open bin
        found = -1
        node = size + length
        if tree[node] > 0:
            found = length
        else:
            while node > 1:
                if (node & 1) == 0 and tree[node + 1] > 0:
                    node = node + 1
                    while node < size:
                        node = 2 * node if tree[2 * node] > 0 else 2 * node + 1
                    found = node - size
                    break
                node >>= 1
        if found < 0:
            b = n_bins
            n_bins += 1
            r = budget - length
        else:
            b = head[found]
            head[found] = nxt[b]
            node = size + found
            while node >= 1:
                tree[node] -= 1
                node >>= 1
            r = found - length
        bin_of[i] = b
        room[b] = r
        if r > 0:
            nxt[b] = head[r]
            head[r] = b
            node = size + r
            while node >= 1:
                tree[node] += 1
                node >>= 1
    return bin_of, n_bins


@njit(cache=True, nogil=True)
def counting_argsort(keys: np.ndarray, n_keys: int) -> np.ndarray:
    """Stable argsort of small non-negative integer keys (< n_keys) in O(n + n_keys)."""
    counts = np.zeros(n_keys + 1, np.int64)
    for i in range(keys.shape[0]):
        counts[keys[i] + 1] += 1
    for k in range(n_keys):
        counts[k + 1] += counts[k]
    out = np.empty(keys.shape[0], np.int64)
    for i in range(keys.shape[0]):
        k = keys[i]
        out[counts[k]] = i
        counts[k] += 1
    return out


@njit(cache=True, nogil=True)
def gather_segments(values: np.ndarray, offsets: np.ndarray, order: np.ndarray) -> tuple:
    """Concatenate segments ``values[offsets[j]:offsets[j+1]]`` for ``j`` in ``order``.

    Returns ``(new_values, new_offsets)``.
    """
    m = order.shape[0]
    new_off = np.empty(m + 1, np.int64)
    new_off[0] = 0
    for j in range(m):
        s = order[j]
        new_off[j + 1] = new_off[j] + offsets[s + 1] - offsets[s]
    out = np.empty(new_off[m], values.dtype)
    for j in range(m):
        s = order[j]
        a = offsets[s]
        w = new_off[j]
        for t in range(offsets[s + 1] - a):
            out[w + t] = values[a + t]
    return out, new_off


@njit(cache=True, nogil=True)
def balance_ranks(costs: np.ndarray, world: int, accum: int, max_rounds: int) -> np.ndarray:
    """Assign each step's ``world*accum`` micro-batches to ranks, ``accum`` each, minimizing the most
    loaded rank: LPT with a cardinality limit, then the best pairwise swap between any two ranks, repeated
    while it lowers the sum of squared rank loads.

    ``costs`` has ``n_steps * world * accum`` entries, step after step. Returns a permutation of the
    micro-batches such that, inside each step, rank r owns slots ``r*accum .. r*accum+accum-1``; each rank
    keeps its micro-batches in their original order.
    """
    k = world * accum
    n_steps = costs.shape[0] // k
    perm = np.empty(costs.shape[0], np.int64)
    rank_of = np.empty(k, np.int64)
    load = np.empty(world, np.float64)
    count = np.empty(world, np.int64)
    for s in range(n_steps):
        base = s * k
        c = costs[base : base + k]
        order = np.argsort(-c, kind="mergesort")
        load[:] = 0.0
        count[:] = 0
        for t in range(k):
            j = order[t]
            best = -1
            for r in range(world):
                if count[r] < accum and (best < 0 or load[r] < load[best]):
                    best = r
            rank_of[j] = best
            load[best] += c[j]
            count[best] += 1
        # improvement: swap pairs of micro-batches between ranks while that lowers the sum of squared
        # loads (each swap narrows the gap between two ranks; the maximum can only follow)
        for _ in range(max_rounds):
            best_gain = 0.0
            bi = -1
            bj = -1
            for i in range(k):
                p = rank_of[i]
                for j in range(k):
                    q = rank_of[j]
                    if q == p:
                        continue
                    gap = load[p] - load[q]
                    d = c[i] - c[j]
                    if d <= 0.0 or d >= gap:
                        continue
                    gain = d * (gap - d)  # half the drop in load[p]^2 + load[q]^2
                    if gain > best_gain:
                        best_gain = gain
                        bi = i
                        bj = j
            if bi < 0 or best_gain <= 1e-12 * (load[0] + 1.0) ** 2:
                break
            p = rank_of[bi]
            q = rank_of[bj]
            d = c[bi] - c[bj]
            load[p] -= d
            load[q] += d
            rank_of[bi] = q
            rank_of[bj] = p
        # write out: rank by rank, original order inside a rank
        fill = np.zeros(world, np.int64)
        for j in range(k):
            r = rank_of[j]
            perm[base + r * accum + fill[r]] = base + j
            fill[r] += 1
    return perm


@njit(cache=True, nogil=True)
def optimal_edges(values: np.ndarray, counts: np.ndarray, n_buckets: int) -> np.ndarray:
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


@njit(cache=True, nogil=True)
def balance_ranks_speeds(
    costs: np.ndarray, speeds: np.ndarray, world: int, accum: int, max_rounds: int
) -> np.ndarray:
    """:func:`balance_ranks` for ranks of different speeds: minimize the slowest rank's time ``load/speed``.

    LPT (each micro-batch, most costly first, to the rank that would finish it first among those with fewer
    than ``accum``), then the best pairwise swap while it lowers the sum of squared rank times. Same output
    layout as :func:`balance_ranks`.
    """
    k = world * accum
    n_steps = costs.shape[0] // k
    perm = np.empty(costs.shape[0], np.int64)
    rank_of = np.empty(k, np.int64)
    load = np.empty(world, np.float64)
    count = np.empty(world, np.int64)
    inv2 = 1.0 / (speeds * speeds)
    for s in range(n_steps):
        base = s * k
        c = costs[base : base + k]
        order = np.argsort(-c, kind="mergesort")
        load[:] = 0.0
        count[:] = 0
        for t in range(k):
            j = order[t]
            best = -1
            best_time = 0.0
            for r in range(world):
                if count[r] < accum:
                    finish = (load[r] + c[j]) / speeds[r]
                    if best < 0 or finish < best_time:
                        best = r
                        best_time = finish
            rank_of[j] = best
            load[best] += c[j]
            count[best] += 1
        scale = 0.0
        for r in range(world):
            scale = max(scale, load[r] / speeds[r])
        for _ in range(max_rounds):
            best_gain = 0.0
            bi = -1
            bj = -1
            for i in range(k):
                p = rank_of[i]
                for j in range(k):
                    q = rank_of[j]
                    if q == p:
                        continue
                    d = c[i] - c[j]
                    if d <= 0.0:
                        continue
                    lp = load[p]
                    lq = load[q]
                    gain = (lp * lp - (lp - d) * (lp - d)) * inv2[p] + (lq * lq - (lq + d) * (lq + d)) * inv2[
                        q
                    ]
                    if gain > best_gain:
                        best_gain = gain
                        bi = i
                        bj = j
            if bi < 0 or best_gain <= 1e-12 * (scale + 1.0) ** 2:
                break
            p = rank_of[bi]
            q = rank_of[bj]
            d = c[bi] - c[bj]
            load[p] -= d
            load[q] += d
            rank_of[bi] = q
            rank_of[bj] = p
        fill = np.zeros(world, np.int64)
        for j in range(k):
            r = rank_of[j]
            perm[base + r * accum + fill[r]] = base + j
            fill[r] += 1
    return perm


@njit(cache=True, nogil=True)
def recut_packed(
    lens: np.ndarray, weight: np.ndarray, bin_cost: float, speeds: np.ndarray, accum: int, budget: int
) -> np.ndarray:
    """Re-cut one packed step among ranks of different speeds: ``accum`` bins of ``budget`` tokens per rank.

    Items go, heaviest ``weight`` first, to the rank that would finish them first (its load, ``accum *
    bin_cost`` to start with, plus the item's weight, over its speed) among the ranks with a bin that still
    has room; inside that rank, to the bin with the least room that fits (best fit). Returns each item's bin
    (``rank * accum + j``), or an empty array when some item fits nowhere.
    """
    world = speeds.shape[0]
    n = lens.shape[0]
    order = np.argsort(-weight, kind="mergesort")
    room = np.full(world * accum, budget, np.int64)
    load = np.full(world, accum * bin_cost)
    bin_of = np.empty(n, np.int64)
    for t in range(n):
        i = order[t]
        length = lens[i]
        best = -1
        best_time = 0.0
        for r in range(world):
            fits = False
            for j in range(accum):
                if room[r * accum + j] >= length:
                    fits = True
                    break
            if fits:
                finish = (load[r] + weight[i]) / speeds[r]
                if best < 0 or finish < best_time:
                    best = r
                    best_time = finish
        if best < 0:
            return np.empty(0, np.int64)
        chosen = -1
        for j in range(accum):
            b = best * accum + j
            if room[b] >= length and (chosen < 0 or room[b] < room[chosen]):
                chosen = b
        room[chosen] -= length
        load[best] += weight[i]
        bin_of[i] = chosen
    return bin_of
