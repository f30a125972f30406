"""Compiled loops that decide which rank runs which micro-batch of a step: the assignment (``balance_ranks``),
the levelling of steps so that their ranks can be balanced (``level_steps``), the evening out of assigned
steps (``even_packed_steps``, ``even_padded_steps``) and the re-cut among ranks of different speeds
(``recut_packed``, ``recut_padded``). :mod:`padfree.core.steps` and :mod:`padfree.core.balance` call them.

A padded micro-batch of ``count`` rows, the longest ``L``, costs ``count * padded_cost(a, b, L)`` plus ``c``
under the cost model ``(a, b, c)`` (:mod:`padfree.core.cost`)."""

from __future__ import annotations

import numpy as np

from padfree.core.kernels import njit


@njit(cache=True, nogil=True)
def padded_cost(a: float, b: float, longest: int) -> float:
    """One padded row's cost ``a*L + b*L*L`` for rows of ``L`` (``longest``) tokens."""
    return a * longest + b * longest * longest


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
    ``count * padded_cost(a, b, L)`` plus ``c`` (``cost = (a, b, c)``, ``L`` its longest), a rank's time is
    its cost over its speed. While the slowest rank's time can be lowered, the move that leaves the two ranks
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
        load[q // accum] += count[q] * padded_cost(a, b, longest[q])
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
            src_time = (load[slow] - padded_cost(a, b, ls)) / speeds[slow]
            for dst in range(k):
                r = dst // accum
                if r == slow:
                    continue
                ld = longest[dst] if longest[dst] > length else length
                if (count[dst] + 1) * ld > budget:
                    continue
                lo = longest[dst]
                added = (count[dst] + 1) * padded_cost(a, b, ld) - count[dst] * padded_cost(a, b, lo)
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
        load[slow] -= padded_cost(a, b, ls)
        r = best_dst // accum
        lo = longest[best_dst]
        ld = lo if lo > lens[row] else lens[row]
        load[r] += (count[best_dst] + 1) * padded_cost(a, b, ld) - count[best_dst] * padded_cost(a, b, lo)
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
    of them), a micro-batch costing ``count * padded_cost(a, b, L) + c`` (``cost = (a, b, c)``, ``L`` its
    longest).
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
            load[q // accum] += (e0 - s0) * padded_cost(a, b, longest) + c
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
            load[q // accum] += count[q] * padded_cost(a, b, ln) + c
        if not load.max() < before:
            continue
        _place_bins(bin_of, count, base, end - base, s * k, perm, new_off)
    return perm, new_off


CANDIDATES = 16
"""Items of the slowest rank that one round of :func:`even_packed_steps` tries (and 4x as many partners):
a step of more is sampled, at a rotating offset."""

ROUNDS_PER_MICRO = 4
"""Rounds (changes tried) of :func:`even_packed_steps` per micro-batch of a step, at most (plus 64)."""


@njit(cache=True, nogil=True)
def _improve(
    mine: np.ndarray,
    others: np.ndarray,
    bin_of: np.ndarray,
    weight: np.ndarray,
    size: np.ndarray,
    room: np.ndarray,
    cnt: np.ndarray,
    load: np.ndarray,
    p: int,
    accum: int,
    least: float,
) -> bool:
    """One round of :func:`even_packed_steps` on one step: of the moves of an item of ``mine`` (the slowest
    rank ``p``'s candidates) into another rank's micro-batch with room, and its swaps with a lighter item of
    ``others``, the one that leaves the two ranks it touches with the lowest slower cost is made (the items'
    ``bin_of``, the micro-batches' ``room`` and ``cnt``, the ranks' ``load`` updated) when it lowers rank
    ``p``'s cost by more than ``least``. Returns whether it was made."""
    k = room.shape[0]
    top = load[p]
    best = top
    bi = -1
    bj = -1
    bv = -1
    for i in mine:
        u = bin_of[i]
        wi = weight[i]
        si = size[i]
        for v in range(k):  # a move (that leaves its micro-batch an item)
            q = v // accum
            if q == p or room[v] < si or cnt[u] < 2:
                continue
            worst = max(top - wi, load[q] + wi)
            if worst < best:
                best, bi, bj, bv = worst, i, -1, v
        for j in others:  # a swap
            v = bin_of[j]
            q = v // accum
            d = wi - weight[j]
            if d <= 0.0:
                continue
            sj = size[j]
            if room[u] + si < sj or room[v] + sj < si:
                continue
            worst = max(top - d, load[q] + d)
            if worst < best:
                best, bi, bj, bv = worst, i, j, v
    if bi < 0 or not best < top - least:
        return False
    u = bin_of[bi]
    q = bv // accum
    d = weight[bi]
    room[u] += size[bi]
    room[bv] -= size[bi]
    bin_of[bi] = bv
    if bj < 0:
        cnt[u] -= 1
        cnt[bv] += 1
    else:
        d -= weight[bj]
        room[bv] += size[bj]
        room[u] -= size[bj]
        bin_of[bj] = u
    load[p] -= d
    load[q] += d
    return True


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
            made = _improve(
                mine[it % step_i : n_mine : step_i],
                others[it % step_j : n_others : step_j],
                bin_of,
                weight[base : base + n],
                size[base : base + n],
                room,
                cnt,
                load,
                p,
                accum,
                least,
            )
            if not made:
                misses += 1
                if misses >= max(step_i, step_j):
                    break
                continue  # the next round samples other candidates
            misses = 0
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
