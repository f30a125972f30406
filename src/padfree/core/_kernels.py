"""Compiled inner loops of the planner (numba), each a sequential scan that numpy cannot vectorize.

Everything here takes and returns plain numpy arrays, is deterministic, and has a pure-Python fallback
(the same code, uncompiled) when numba is not importable.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np


def writable_cache_dir(candidates: list[Path]) -> Path | None:
    """The first of ``candidates`` that is (or can be made) a folder a file can be created in; else None."""
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=d).close()
            return d
        except OSError:
            continue
    return None


def _numba_cache_fallback() -> None:
    """numba caches compiled kernels beside this file, else in ``~/.cache/numba``, and fails at import when
    neither is writable (a read-only install and a home folder that is not writable). Then use a folder in
    the temporary directory instead (``NUMBA_CACHE_DIR``, when set, is the user's choice and is kept)."""
    import numba
    from numba.misc.appdirs import AppDirs

    if numba.config.CACHE_DIR:  # type: ignore[attr-defined]
        return
    usual = [
        Path(__file__).parent / "__pycache__",
        Path(AppDirs(appname="numba", appauthor=False).user_cache_dir),
    ]
    if writable_cache_dir(usual) is None:
        fallback = (
            Path(tempfile.gettempdir()) / f"padfree-numba-{os.getuid() if hasattr(os, 'getuid') else 0}"
        )
        if writable_cache_dir([fallback]) is not None:
            numba.config.CACHE_DIR = str(fallback)  # type: ignore[attr-defined]


try:  # pragma: no cover - exercised by the import itself
    from numba import njit

    _numba_cache_fallback()
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
def balance_ranks(
    costs: np.ndarray, world: int, accum: int, max_rounds: int, speeds: np.ndarray, uniform: bool
) -> np.ndarray:
    """Assign each step's ``world*accum`` micro-batches to ranks, ``accum`` each, minimizing the slowest
    rank's time ``load / speed``: LPT with a cardinality limit (each micro-batch, most costly first, to the
    rank that would finish it first), then the best pairwise swap between any two ranks, repeated while it
    lowers the sum of squared rank times (a swap narrows the gap between two ranks; the maximum can only
    follow).

    ``costs`` has ``n_steps * world * accum`` entries, step after step; ``uniform`` says every speed is 1
    (then the arithmetic is the plain-load one, so a plan does not depend on rounding through speeds).
    Returns a permutation of the micro-batches such that, inside each step, rank r owns slots
    ``r*accum .. r*accum+accum-1``; each rank keeps its micro-batches in their original order.
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
            best_key = 0.0
            for r in range(world):
                if count[r] < accum:
                    key = load[r] if uniform else (load[r] + c[j]) / speeds[r]
                    if best < 0 or key < best_key:
                        best = r
                        best_key = key
            rank_of[j] = best
            load[best] += c[j]
            count[best] += 1
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
                    # half the drop in sum(load^2 / speed^2); with unit speeds d * (gap - d)
                    if uniform:
                        gain = d * ((load[p] - load[q]) - d)
                    else:
                        gain = d * ((inv2[p] * load[p] - inv2[q] * load[q]) - d * (inv2[p] + inv2[q]) / 2.0)
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


@njit(cache=True, nogil=True)
def recut_padded(
    lens: np.ndarray, offsets: np.ndarray, speeds: np.ndarray, accum: int, budget: int, cost: np.ndarray
) -> np.ndarray:
    """Re-cut one assigned padded step among ranks of different speeds by moving whole rows.

    ``lens[offsets[q]:offsets[q+1]]`` is micro-batch ``q``, run by rank ``q // accum``; a micro-batch costs
    ``count * (a*L + b*L*L)`` plus ``c`` (``cost = (a, b, c)``, ``L`` its longest), a rank's time is its
    cost over its speed. While the slowest rank's time can be lowered, the move that leaves the two ranks
    it touches with the lowest slower time is made: the shortest row not yet moved of one of the slowest
    rank's micro-batches (one that keeps another original row, so its longest does not change) into a
    micro-batch of another rank that stays within ``count * longest <= budget``. Moved rows stay where they
    land. Returns each row's micro-batch.
    """
    a, b, c = cost[0], cost[1], cost[2]
    world = speeds.shape[0]
    k = offsets.shape[0] - 1
    n = lens.shape[0]
    bin_of = np.empty(n, np.int64)
    asc = np.empty(n, np.int64)  # each micro-batch's rows, shortest first
    count = np.zeros(k, np.int64)
    longest = np.zeros(k, np.int64)
    left = np.zeros(k, np.int64)  # original rows not yet moved
    nxt = np.zeros(k, np.int64)  # position in asc of the next to move
    load = np.full(world, accum * c)
    for q in range(k):
        s0, e0 = offsets[q], offsets[q + 1]
        part = np.argsort(lens[s0:e0], kind="mergesort")
        for t in range(e0 - s0):
            asc[s0 + t] = s0 + part[t]
            bin_of[s0 + t] = q
            if lens[s0 + t] > longest[q]:
                longest[q] = lens[s0 + t]
        count[q] = e0 - s0
        left[q] = e0 - s0
        nxt[q] = s0
        load[q // accum] += count[q] * (a * longest[q] + b * longest[q] * longest[q])
    for _ in range(n):
        slow = 0
        for r in range(1, world):
            if load[r] / speeds[r] > load[slow] / speeds[slow]:
                slow = r
        now = load[slow] / speeds[slow]
        best_src = -1
        best_dst = -1
        best_max = now
        best_dst_time = 0.0
        for src in range(slow * accum, (slow + 1) * accum):
            if left[src] < 2:
                continue
            length = lens[asc[nxt[src]]]
            ls = longest[src]
            src_time = (load[slow] - (a * ls + b * ls * ls)) / speeds[slow]
            for dst in range(k):
                r = dst // accum
                if r == slow:
                    continue
                ld = longest[dst] if longest[dst] > length else length
                if (count[dst] + 1) * ld > budget:
                    continue
                lo = longest[dst]
                added = (count[dst] + 1) * (a * ld + b * ld * ld) - count[dst] * (a * lo + b * lo * lo)
                dst_time = (load[r] + added) / speeds[r]
                worst = src_time if src_time > dst_time else dst_time
                if worst < best_max or (best_src >= 0 and worst == best_max and dst_time < best_dst_time):
                    best_src, best_dst, best_max, best_dst_time = src, dst, worst, dst_time
        if best_src < 0:
            break
        row = asc[nxt[best_src]]
        nxt[best_src] += 1
        left[best_src] -= 1
        count[best_src] -= 1
        ls = longest[best_src]
        load[slow] -= a * ls + b * ls * ls
        r = best_dst // accum
        lo = longest[best_dst]
        ld = lo if lo > lens[row] else lens[row]
        load[r] += (count[best_dst] + 1) * (a * ld + b * ld * ld) - count[best_dst] * (a * lo + b * lo * lo)
        count[best_dst] += 1
        longest[best_dst] = ld
        bin_of[row] = best_dst
    return bin_of


@njit(cache=True, nogil=True)
def _place_bins(
    bin_of: np.ndarray,
    count: np.ndarray,
    base: int,
    n: int,
    first: int,
    perm: np.ndarray,
    new_off: np.ndarray,
) -> None:
    """Lay out a step's re-cut micro-batches: the ``n`` entries from ``base`` go to their bins ``bin_of`` in
    bin order, stably (each micro-batch keeps its entries' order); ``count`` entries per bin; the bins'
    offsets go to ``new_off[first + 1 :]``."""
    k = count.shape[0]
    fill = np.empty(k, np.int64)
    fill[0] = base
    for q in range(1, k):
        fill[q] = fill[q - 1] + count[q - 1]
    for q in range(k):
        new_off[first + q + 1] = fill[q] + count[q]
    for i in range(n):
        q = bin_of[i]
        perm[fill[q]] = base + i
        fill[q] += 1


@njit(cache=True, nogil=True)
def even_padded_steps(
    lens: np.ndarray, offsets: np.ndarray, world: int, accum: int, budget: int, cost: np.ndarray, tol: float
) -> tuple:
    """Even out the ranks of every assigned padded step of equal-speed ranks by moving whole rows.

    Step ``s`` is micro-batches ``s*world*accum ..`` of ``offsets`` (rank ``r`` owns its ``r``-th ``accum``
    of them), a micro-batch costing ``count * (a*L + b*L*L) + c`` (``cost = (a, b, c)``, ``L`` its longest).
    A step whose slowest rank costs more than ``1 + tol`` times the mean is re-cut by :func:`recut_padded`
    at equal speeds (every micro-batch within ``count * longest <= budget``), and the re-cut kept only when
    it lowers the slowest rank's cost. The step keeps its rows (only their micro-batches change), each
    micro-batch its rows' order. Returns ``(perm, new_offsets)``: the rows in their new order (indices into
    ``lens``) and the new micro-batch boundaries.
    """
    a, b, c = cost[0], cost[1], cost[2]
    k = world * accum
    n_steps = (offsets.shape[0] - 1) // k
    perm = np.arange(lens.shape[0])
    new_off = offsets.copy()
    ones = np.ones(world)
    load = np.empty(world)
    local = np.empty(k + 1, np.int64)
    longest_q = np.empty(k, np.int64)
    shortest_q = np.empty(k, np.int64)
    for s in range(n_steps):
        base = offsets[s * k]
        end = offsets[(s + 1) * k]
        if end - base < 2:
            continue
        load[:] = 0.0
        for q in range(k):
            s0, e0 = offsets[s * k + q], offsets[s * k + q + 1]
            longest = 0
            shortest = budget + 1
            for i in range(s0, e0):
                if lens[i] > longest:
                    longest = lens[i]
                if lens[i] < shortest:
                    shortest = lens[i]
            longest_q[q] = longest
            shortest_q[q] = shortest
            load[q // accum] += (e0 - s0) * (a * longest + b * longest * longest) + c
        before = load.max()
        if not before > (1.0 + tol) * load.mean():
            continue
        # the re-cut's first move takes a shortest row of one of the slowest rank's micro-batches (one that
        # keeps another row); where no micro-batch of another rank has room for the shortest of them, it
        # makes none (the same answer, without the re-cut's set-up)
        slow = int(np.argmax(load))
        movable = budget + 1
        for q in range(slow * accum, (slow + 1) * accum):
            if offsets[s * k + q + 1] - offsets[s * k + q] >= 2 and shortest_q[q] < movable:
                movable = shortest_q[q]
        room = False
        for q in range(k):
            if q // accum != slow:
                ld = longest_q[q] if longest_q[q] > movable else movable
                if (offsets[s * k + q + 1] - offsets[s * k + q] + 1) * ld <= budget:
                    room = True
                    break
        if not room:
            continue
        for q in range(k + 1):
            local[q] = offsets[s * k + q] - base
        part = lens[base:end]
        bin_of = recut_padded(part, local, ones, accum, budget, cost)
        count = np.zeros(k, np.int64)
        longest_b = np.zeros(k, np.int64)
        for i in range(end - base):
            q = bin_of[i]
            count[q] += 1
            if part[i] > longest_b[q]:
                longest_b[q] = part[i]
        load[:] = 0.0
        for q in range(k):
            ln = longest_b[q]
            load[q // accum] += count[q] * (a * ln + b * ln * ln) + c
        if not load.max() < before:
            continue
        _place_bins(bin_of, count, base, end - base, s * k, perm, new_off)
    return perm, new_off


@njit(cache=True, nogil=True)
def permute_in_place(values: np.ndarray, order: np.ndarray, seen: np.ndarray) -> None:
    """``values[i] = values[order[i]]`` (the values before) for every ``i``, in place, cycle by cycle.

    ``seen`` is a zeroed uint8 scratch array as long as ``values`` (left all ones).
    """
    for i in range(values.shape[0]):
        if seen[i]:
            continue
        first = values[i]
        j = i
        while True:
            seen[j] = 1
            k = order[j]
            if k == i:
                values[j] = first
                break
            values[j] = values[k]
            j = k


@njit(cache=True, nogil=True)
def _greedy(lens: np.ndarray, a: int, e: int, limit: int, packed: bool, out: np.ndarray, k: int) -> int:
    """Greedy cut of ``lens[a:e]`` with piece cost (``sum`` if packed, else ``count * longest``) <= ``limit``
    (a single item always forms a piece). Writes piece ends to ``out[k:]``; returns the new ``k``."""
    cnt = 0
    longest = 0
    total = 0
    for i in range(a, e):
        length = lens[i]
        m = longest if longest > length else length
        c = total + length if packed else (cnt + 1) * m
        if cnt > 0 and c > limit:
            out[k] = i
            k += 1
            cnt = 1
            longest = length
            total = length
        else:
            cnt += 1
            longest = m
            total += length
    out[k] = e
    return k + 1


@njit(cache=True, nogil=True)
def _sum_max(lens: np.ndarray, a: int, e: int) -> tuple:
    """The sum and the largest of ``lens[a:e]`` (0 and 0 when empty), in one pass."""
    total = 0
    most = 0
    for i in range(a, e):
        total += lens[i]
        if lens[i] > most:
            most = lens[i]
    return total, most


@njit(cache=True, nogil=True)
def _even_segment(
    lens: np.ndarray, a: int, e: int, budget: int, max_pieces: int, packed: bool, out: np.ndarray, k: int
) -> int:
    """Cut ``lens[a:e]`` into at most ``max_pieces`` pieces of cost <= ``budget`` whose costs are as even as
    a contiguous cut allows: the smallest limit whose greedy cut needs <= ``max_pieces`` pieces (binary
    search), then one backward pass that moves items from each piece into the next while that lowers the
    larger of the two costs (the greedy cut leaves its slack at the end). Writes piece ends to ``out[k:]``
    and returns the new ``k``; the caller checks that the greedy cut under ``budget`` fits ``max_pieces``."""
    total, lo = _sum_max(lens, a, e)
    lo = lo if lo > 1 else 1
    # a piece costs at least the sum of its lengths: no limit below total / max_pieces fits (same answer,
    # fewer rounds)
    least = (total + max_pieces - 1) // max_pieces
    if least > lo:
        lo = least if least < budget else budget
    hi = budget
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy(lens, a, e, mid, packed, out, k) - k <= max_pieces:
            hi = mid
        else:
            lo = mid + 1
    k_end = _greedy(lens, a, e, lo, packed, out, k)
    # backward pass: pieces p-1 = [s, m) and p = [m, end)
    for p in range(k_end - 1, k, -1):
        end = out[p]
        m = out[p - 1]
        s = a if p - 1 == k else out[p - 2]
        cnt_q = end - m
        sum_q, max_q = _sum_max(lens, m, end)
        # prefix maxima and sums of piece p-1
        pre_max = np.empty(m - s, np.int64)
        pre_sum = np.empty(m - s, np.int64)
        run_max = 0
        run_sum = 0
        for i in range(s, m):
            if lens[i] > run_max:
                run_max = lens[i]
            run_sum += lens[i]
            pre_max[i - s] = run_max
            pre_sum[i - s] = run_sum
        cut = m
        while cut - s > 1:
            item = lens[cut - 1]
            new_q_max = max_q if max_q > item else item
            if packed:
                cost_p = pre_sum[cut - 1 - s]
                cost_q = sum_q
                new_p = pre_sum[cut - 2 - s]
                new_q = sum_q + item
            else:
                cost_p = (cut - s) * pre_max[cut - 1 - s]
                cost_q = cnt_q * max_q
                new_p = (cut - 1 - s) * pre_max[cut - 2 - s]
                new_q = (cnt_q + 1) * new_q_max
            old = cost_p if cost_p > cost_q else cost_q
            new = new_p if new_p > new_q else new_q
            if new >= old or new_q > budget:
                break
            cut -= 1
            cnt_q += 1
            max_q = new_q_max
            sum_q += item
        out[p - 1] = cut
    return k_end


@njit(cache=True, nogil=True)
def cut_even(lens: np.ndarray, segments: np.ndarray, budget: int, packed: bool) -> np.ndarray:
    """Like :func:`cut_padded` (a new piece wherever ``segments`` changes), with the same number of pieces
    per segment as the greedy cut but costs as even as a contiguous cut allows (see ``_even_segment``): no
    segment ends in a nearly empty micro-batch. Returns offsets."""
    n = lens.shape[0]
    out = np.empty(n + 1, np.int64)
    out[0] = 0
    k = 1
    a = 0
    scratch = np.empty(n + 1, np.int64)
    while a < n:
        e = a + 1
        while e < n and segments[e] == segments[a]:
            e += 1
        pieces = _greedy(lens, a, e, budget, packed, scratch, 0)
        k = _even_segment(lens, a, e, budget, pieces, packed, out, k)
        a = e
    return out[:k]


@njit(cache=True, nogil=True)
def cut_into(lens: np.ndarray, n_pieces: int, budget: int, packed: bool) -> np.ndarray:
    """Offsets of at most ``n_pieces`` contiguous pieces of ``lens`` with costs <= ``budget`` and as even as
    a contiguous cut allows; empty when even the greedy cut under ``budget`` needs more pieces."""
    n = lens.shape[0]
    out = np.empty(n + 1, np.int64)
    out[0] = 0
    if n == 0 or _greedy(lens, 0, n, budget, packed, out, 1) - 1 > n_pieces:
        return out[:0]
    k = _even_segment(lens, 0, n, budget, n_pieces, packed, out, 1)
    return out[:k]


@njit(cache=True, nogil=True)
def lpt_bins(lens: np.ndarray, n_bins: int, budget: int) -> np.ndarray:
    """Packed rows: deal items, longest first, each to the least loaded of ``n_bins`` bins; returns each
    item's bin, or an empty array if some item would overflow the budget (the caller then cuts
    contiguously). Loads end within one item of each other."""
    order = np.argsort(-lens, kind="mergesort")
    load = np.zeros(n_bins, np.int64)
    bin_of = np.empty(lens.shape[0], np.int64)
    for t in range(lens.shape[0]):
        i = order[t]
        best = 0
        for b in range(1, n_bins):
            if load[b] < load[best]:
                best = b
        if load[best] + lens[i] > budget:
            return np.empty(0, np.int64)
        load[best] += lens[i]
        bin_of[i] = best
    return bin_of


CANDIDATES = 16
"""Items of the slowest rank that one round of :func:`even_packed_steps` tries (and 4x as many partners):
a step of more is sampled, at a rotating offset."""

ROUNDS_PER_MICRO = 4
"""Rounds (changes tried) of :func:`even_packed_steps` per micro-batch of a step, at most (plus 64)."""


@njit(cache=True, nogil=True)
def even_packed_steps(
    size: np.ndarray,
    weight: np.ndarray,
    offsets: np.ndarray,
    world: int,
    accum: int,
    cap: int,
    bin_cost: float,
    tol: float,
) -> tuple:
    """Even out the ranks of every assigned packed step of equal-speed ranks by moving and swapping items
    between its micro-batches.

    Step ``s`` is micro-batches ``s*world*accum ..`` of ``offsets`` (rank ``r`` owns its ``r``-th ``accum``
    of them); an item costs ``weight`` (its share of a packed row's cost) and takes ``size`` of the row's
    ``cap``; a micro-batch costs the sum of its items' weights plus ``bin_cost``. Where a step's slowest rank
    costs more than ``1 + tol`` times the mean, the best of these, repeated while one lowers the slowest
    rank: move one of its items into another rank's micro-batch with room, or swap it for a lighter item of
    another rank's micro-batch when both stay within ``cap``; a change is made only when both ranks it
    touches end below the slowest rank's cost (so the sum of squared rank costs falls: it ends). The step
    keeps its items; every micro-batch keeps the order of its items. Returns ``(perm, new_offsets)``: the
    items in their new order (indices into ``size``) and the new micro-batch boundaries.
    """
    k = world * accum
    n_steps = (offsets.shape[0] - 1) // k
    perm = np.arange(size.shape[0])
    new_off = offsets.copy()
    load = np.empty(world)
    room = np.empty(k, np.int64)
    cnt = np.empty(k, np.int64)
    for s in range(n_steps):
        base = offsets[s * k]
        end = offsets[(s + 1) * k]
        n = end - base
        if n < 2:
            continue
        bin_of = np.empty(n, np.int64)
        load[:] = accum * bin_cost
        for q in range(k):
            room[q] = cap
            cnt[q] = offsets[s * k + q + 1] - offsets[s * k + q]
            for i in range(offsets[s * k + q] - base, offsets[s * k + q + 1] - base):
                bin_of[i] = q
                load[q // accum] += weight[base + i]
                room[q] -= size[base + i]
        if not load.max() > (1.0 + tol) * load.mean():
            continue
        changed = False
        mine = np.empty(n, np.int64)
        others = np.empty(n, np.int64)
        goal = (1.0 + tol) * load.mean()
        least = tol * load.mean() / 4.0  # a change must win at least this much
        misses = 0
        for it in range(min(4 * n, ROUNDS_PER_MICRO * k + 64)):
            p = 0
            for r in range(1, world):
                if load[r] > load[p]:
                    p = r
            top = load[p]
            if not top > goal:
                break
            n_mine = 0
            n_others = 0
            for i in range(n):
                if bin_of[i] // accum == p:
                    mine[n_mine] = i
                    n_mine += 1
                else:
                    others[n_others] = i
                    n_others += 1
            # a step of many small items: a rotating sample of candidates bounds each round's work
            step_i = max(1, n_mine // CANDIDATES)
            step_j = max(1, n_others // (4 * CANDIDATES))
            best = top
            bi = -1
            bj = -1
            bv = -1
            for a in range(it % step_i, n_mine, step_i):
                i = mine[a]
                u = bin_of[i]
                wi = weight[base + i]
                si = size[base + i]
                for v in range(k):  # a move (that leaves its micro-batch an item)
                    q = v // accum
                    if q == p or room[v] < si or cnt[u] < 2:
                        continue
                    worst = max(top - wi, load[q] + wi)
                    if worst < best:
                        best, bi, bj, bv = worst, i, -1, v
                for b in range(it % step_j, n_others, step_j):  # a swap
                    j = others[b]
                    v = bin_of[j]
                    q = v // accum
                    d = wi - weight[base + j]
                    if d <= 0.0:
                        continue
                    sj = size[base + j]
                    if room[u] + si < sj or room[v] + sj < si:
                        continue
                    worst = max(top - d, load[q] + d)
                    if worst < best:
                        best, bi, bj, bv = worst, i, j, v
            if bi < 0 or not best < top - least:
                misses += 1
                if misses >= max(step_i, step_j):
                    break
                continue  # the next round samples other candidates
            misses = 0
            u = bin_of[bi]
            q = bv // accum
            d = weight[base + bi]
            room[u] += size[base + bi]
            room[bv] -= size[base + bi]
            bin_of[bi] = bv
            if bj < 0:
                cnt[u] -= 1
                cnt[bv] += 1
            else:
                d -= weight[base + bj]
                room[bv] += size[base + bj]
                room[u] -= size[base + bj]
                bin_of[bj] = u
            load[p] -= d
            load[q] += d
            changed = True
        if not changed:
            continue
        _place_bins(bin_of, cnt, base, n, s * k, perm, new_off)
    return perm, new_off


@njit(cache=True, nogil=True)
def _lpt_ratio(
    c: np.ndarray, world: int, accum: int, load: np.ndarray, count: np.ndarray, rank_of: np.ndarray
) -> float:
    """Slowest rank / mean rank of one step's micro-batch costs ``c`` dealt, costliest first, each to the
    least loaded rank with fewer than ``accum`` (the first phase of :func:`balance_ranks`); ``rank_of[:k]``,
    ``load`` and ``count`` are left as dealt (``rank_of`` is ``2k`` long, its second half scratch)."""
    k = c.shape[0]
    order = rank_of[k:]  # scratch: the costs' order, costliest first (insertion sort: a step is short)
    for t in range(k):
        x = t
        while x > 0 and c[order[x - 1]] < c[t]:
            order[x] = order[x - 1]
            x -= 1
        order[x] = t
    load[:] = 0.0
    count[:] = 0
    for t in range(k):
        best = -1
        for r in range(world):
            if count[r] < accum and (best < 0 or load[r] < load[best]):
                best = r
        load[best] += c[order[t]]
        count[best] += 1
        rank_of[order[t]] = best
    mean = load.mean()
    return load.max() / mean if mean > 0 else 1.0


NEAREST = 3
"""Members of a column tried on each side of the cost a swap aims at (:func:`level_steps`)."""

LEVEL_PASSES = 2
"""Passes of :func:`level_steps` over the steps."""

LEVEL_ALL_STEPS = 32
"""An epoch of at most this many steps is levelled trying every swap of a step's members (each step
has more weight in the epoch's mean, and there are few to try)."""


@njit(cache=True, nogil=True)
def level_steps(costs: np.ndarray, ids: np.ndarray, world: int, accum: int, tol: float) -> np.ndarray:
    """Swap micro-batches of the same column between steps so that each step's ranks can be balanced.

    Row ``t`` of ``costs`` (shape ``(n_steps, world*accum)``) is step ``t``'s micro-batch costs, column ``j``
    its member of length stratum ``j``; ``ids`` names the micro-batches. For each step whose ranks, dealt
    costliest first (:func:`_lpt_ratio`), end more than ``1 + tol`` above their mean, in order: a member of
    its slowest rank may be swapped for a cheaper one of the same column in another step, or a member of its
    fastest rank for a costlier one, the cost aimed at being the one that brings that rank to the mean (the
    :data:`NEAREST` members on each side of it, found in the column's sorted costs); of these, the swap that
    most lowers the sum of the two steps' ratios is made, when one does. Two passes. Every step keeps one
    member of each column (a column's costs are only exchanged between steps). Returns the new ``ids``.
    """
    n_steps, k = costs.shape
    c = costs.copy()
    out = ids.copy()
    if n_steps < 2:
        return out
    load = np.empty(world)
    count = np.empty(world, np.int64)
    rank_of = np.empty(2 * k, np.int64)
    scratch = np.empty(2 * k, np.int64)
    ratio = np.empty(n_steps)
    for t in range(n_steps):
        ratio[t] = _lpt_ratio(c[t], world, accum, load, count, scratch)
    srt = np.empty((k, n_steps), np.int64)  # each column's steps by cost
    pos = np.empty((k, n_steps), np.int64)  # each step's place in its column's order
    vals = np.empty((k, n_steps))  # each column's costs in that order (fixed: swaps only move them)
    for j in range(k):
        srt[j] = np.argsort(c[:, j], kind="mergesort")
        for r in range(n_steps):
            pos[j, srt[j, r]] = r
            vals[j, r] = c[srt[j, r], j]
    a = np.empty(k)
    b = np.empty(k)
    for _ in range(LEVEL_PASSES):
        for t in range(n_steps):
            if not ratio[t] > 1.0 + tol:
                continue
            _lpt_ratio(c[t], world, accum, load, count, rank_of)
            mean = load.mean()
            slow = 0
            fast = 0
            for r in range(1, world):
                if load[r] > load[slow]:
                    slow = r
                if load[r] < load[fast]:
                    fast = r
            best_gain = tol / 5.0  # a swap must win something the rank moves will not undo
            bj = -1
            bu = -1
            br_t = 0.0
            br_u = 0.0
            for j in range(k):
                r = rank_of[j]
                if r == slow:
                    aim = c[t, j] - (load[slow] - mean)
                elif r == fast:
                    aim = c[t, j] + (mean - load[fast])
                elif n_steps > LEVEL_ALL_STEPS:
                    continue
                else:
                    aim = c[t, j]
                at = np.searchsorted(vals[j], aim)
                lo, hi = max(0, at - NEAREST), min(n_steps, at + NEAREST)
                if n_steps <= LEVEL_ALL_STEPS:  # a short epoch: every member of every column
                    lo, hi = 0, n_steps
                for x in range(lo, hi):
                    u = srt[j, x]
                    if u == t or c[u, j] == c[t, j]:
                        continue
                    a[:] = c[t]
                    a[j] = c[u, j]
                    rt = _lpt_ratio(a, world, accum, load, count, scratch)
                    if not rt < ratio[t]:
                        continue
                    b[:] = c[u]
                    b[j] = c[t, j]
                    ru = _lpt_ratio(b, world, accum, load, count, scratch)
                    gain = ratio[t] + ratio[u] - rt - ru
                    if gain > best_gain:
                        best_gain, bj, bu, br_t, br_u = gain, j, u, rt, ru
            if bj < 0:
                continue
            x = c[t, bj]
            c[t, bj] = c[bu, bj]
            c[bu, bj] = x
            y = out[t, bj]
            out[t, bj] = out[bu, bj]
            out[bu, bj] = y
            pt = pos[bj, t]
            pu = pos[bj, bu]
            srt[bj, pt] = bu
            srt[bj, pu] = t
            pos[bj, t] = pu
            pos[bj, bu] = pt
            ratio[t] = br_t
            ratio[bu] = br_u
    return out
