"""Compiled cuts of an ordered run of items into micro-batches within a budget (a packed row's ``sum`` or a
padded one's ``count * longest``): greedy, merged when small, even, into ``n`` pieces, or dealt longest first.
:mod:`padfree.core.batching` forms micro-batches with them, :mod:`padfree.core.steps` and
:mod:`padfree.core.sources` cut a step's tail."""

from __future__ import annotations

import numpy as np

from padfree.core.kernels import njit


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
