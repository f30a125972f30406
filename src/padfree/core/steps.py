"""Where micro-batches become optimizer steps and are given to ranks.

A step is ``world_size * grad_accum`` consecutive micro-batches of the plan; inside a step, rank ``r`` owns
slots ``r*grad_accum .. (r+1)*grad_accum - 1``. This module (1) orders micro-batches so that every step
mixes strata in proportion to their token mass, (2) makes the micro-batch count a multiple of the step
size without duplicating or dropping samples, (3) assigns micro-batches to ranks by modeled cost, and (4)
evens out a step's ranks by moving items between its micro-batches (:func:`even_ranks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from padfree.core import _cuts, _ranks, cost, kernels
from padfree.errors import ConfigError

if TYPE_CHECKING:  # the strategies' own layouts (padfree.core.chunked) use this module: no config at run time
    from padfree.core.config import PlanConfig

EVEN_TOLERANCE = 0.002
"""A bucketed step whose slowest rank costs at most this much above the mean is left as assigned."""


def stratified_order(strata: np.ndarray, tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """An order of micro-batches in which each stratum is spread evenly by token mass.

    Inside stratum ``s`` the micro-batches are shuffled, then micro-batch ``j`` gets the position
    ``(T_before_j + u_j * t_j) / T_s`` (its share of the stratum's cumulative tokens, jittered) and all
    micro-batches are sorted by position. Any window of the epoch then holds each stratum in proportion to
    its token mass, so every optimizer step sees the dataset's length mix.
    """
    m = strata.shape[0]
    shuffled = rng.permutation(m)
    # group by stratum, keeping the shuffled order inside each stratum
    grouped = shuffled[kernels.counting_argsort(strata[shuffled], int(strata.max()) + 1)]
    t = tokens[grouped].astype(np.float64)
    s = strata[grouped]
    csum = np.cumsum(t)
    first = np.searchsorted(s, s, side="left")  # index of the stratum's first micro-batch
    start_tokens = csum[first] - t[first]
    total = np.bincount(s, weights=t)[s]
    before = csum - t - start_tokens
    pos = (before + rng.random(m) * t) / total
    return grouped[np.argsort(pos, kind="stable")]


def quantile_steps(
    order: np.ndarray,
    offsets: np.ndarray,
    length: np.ndarray,
    step_size: int,
    budget: int,
    rng: np.random.Generator,
    ranks: tuple[int, int, tuple] | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Compose whole padded steps that each sample the dataset's length distribution at ``step_size``
    quantiles (the bucketed strategy's steps).

    The ``m`` micro-batches are sorted by mean length (ties at random). When ``m`` is not a multiple of
    ``step_size``, a tail of ``r = m % step_size`` micro-batches plus one step's worth (or just ``r`` when
    there is no whole step) is taken at evenly spaced ranks of that order; their samples, in that order (each
    micro-batch keeps its fresh partners), are cut anew into pieces of even cost (every piece within the
    budget) that are dealt in turn to the last one or two steps, so those steps span the whole length range
    too. The rest, ``n`` steps' worth, is cut into
    ``step_size`` consecutive chunks of ``n`` micro-batches, and each chunk deals its micro-batches to the
    ``n`` steps in a fresh random order: step ``t`` holds one micro-batch from every ``1 / step_size`` of
    the length order (stratified sampling), and the steps differ only in which member of each chunk they
    drew. With ``ranks = (world_size, grad_accum, (a, b, c))`` (the configured cost model) the steps whose
    ranks could not be balanced then swap members of the same chunk with other steps
    (:func:`level_steps`): each step still holds one micro-batch of every chunk. Returns the new ``(order,
    offsets)``, whole steps in order; ``None`` when the tail cannot be cut into its pieces (the caller then
    composes steps another way).

    >>> order, offsets = quantile_steps(np.arange(12), np.arange(0, 13, 2), np.arange(1, 13), 4, 24,
    ...                                 np.random.default_rng(0))
    >>> np.diff(offsets).tolist()  # 6 micro-batches -> 2 steps of 4 (all of them the tail)
    [3, 2, 1, 1, 2, 1, 1, 1]
    >>> sorted(order.tolist()) == list(range(12))
    True
    """
    m = offsets.shape[0] - 1
    counts = np.diff(offsets)
    tokens = np.add.reduceat(length[order].astype(np.float64), offsets[:-1])
    shuffled = rng.permutation(m)
    by_length = shuffled[np.argsort((tokens / counts)[shuffled], kind="stable")]
    n_full, r = divmod(m, step_size)
    body_steps = n_full if r == 0 else max(n_full - 1, 0)
    n_tail = m - body_steps * step_size
    in_tail = np.zeros(m, np.bool_)
    if n_tail:
        in_tail[((np.arange(n_tail) + rng.random()) * (m / n_tail)).astype(np.int64)] = True
    body = by_length[~in_tail]
    parts_order, parts_offsets = [], []
    if body_steps:
        chunk = np.arange(body.shape[0]) // body_steps
        deal = np.argsort(rng.random((step_size, body_steps)), axis=1)  # each chunk's order of steps
        step = deal[chunk, np.arange(body.shape[0]) % body_steps]
        dealt = body[np.lexsort((chunk, step))]  # step by step, chunk by chunk
        if ranks is not None and ranks[0] > 1 and body_steps > 1:
            dealt = level_steps(order, offsets, length, dealt.reshape(body_steps, step_size), *ranks).ravel()
        o, f = kernels.gather_segments(order, offsets, dealt)
        parts_order.append(o)
        parts_offsets.append(f)
    if n_tail:
        tail_steps = -(-n_tail // step_size)
        n_pieces = tail_steps * step_size
        items, _ = kernels.gather_segments(order, offsets, by_length[in_tail])  # the micro-batches' own
        ends = split_largest(_cuts.cut_into(length[items], n_pieces, budget, False), n_pieces)
        if ends.shape[0] - 1 != n_pieces:
            return None
        deal_tail = np.argsort(np.arange(n_pieces) % tail_steps, kind="stable")  # piece j -> step j % steps
        o, f = kernels.gather_segments(items, ends, deal_tail)
        parts_order.append(o)
        parts_offsets.append(f)
    if len(parts_order) == 1:
        return parts_order[0], parts_offsets[0]
    (o1, o2), (f1, f2) = parts_order, parts_offsets
    return np.concatenate((o1, o2)), np.concatenate((f1, f2[1:] + f1[-1]))


LEVEL_TOLERANCE = 0.01
"""A step whose ranks, dealt by cost, end at most this much above their mean is not levelled
(:func:`level_steps`): what is left, :func:`even_ranks` moves rows for."""


LEVEL_MAX_ACCUM = 2
"""Steps are levelled (:func:`level_steps`) at up to this many micro-batches a rank: with more, the
assignment and :func:`even_ranks` already level them (1.003 on the seed_mix at 8 x 4), and levelling would
cost planning time for nothing."""


def levels_steps(config: PlanConfig, drafting: bool) -> bool:
    """Whether a bucketed plan's steps are levelled for its ranks (:func:`level_steps`): where its ranks are
    evened (:func:`evens_ranks`), at up to :data:`LEVEL_MAX_ACCUM` micro-batches a rank."""
    return evens_ranks(config, drafting) and not config.packed and config.grad_accum <= LEVEL_MAX_ACCUM


def level_steps(
    order: np.ndarray,
    offsets: np.ndarray,
    length: np.ndarray,
    dealt: np.ndarray,
    world_size: int,
    grad_accum: int,
    coefficients: tuple,
) -> np.ndarray:
    """``dealt`` (micro-batch ids, one row per step, one column per length chunk) with members of a column
    swapped between steps so that more steps can be balanced over their ranks (``_ranks.level_steps``,
    padded micro-batch costs under ``coefficients``). A step of quantile chunks mixes lengths, but which
    member of a chunk it draws decides how its costs pair up: a lone long sample, or a chunk's least-filled
    micro-batch, can leave no even split of the step over its ranks.

    >>> level_steps(np.arange(4), np.arange(5), np.array([4, 2, 3, 1]), np.array([[0, 3], [1, 2]]), 2, 1,
    ...             (1.0, 0.0, 0.0)).tolist()  # costs 4, 1 | 2, 3 (ratios 1.6, 1.2) -> 2, 1 | 4, 3
    [[1, 3], [0, 2]]
    """
    coefs = cost.Coefficients(*(float(v) for v in coefficients[:3]))
    costs = cost.micro_costs(cost.micro_shapes(length[order], offsets, False), coefs)[dealt]
    return _ranks.level_steps(costs, dealt, world_size, grad_accum, LEVEL_TOLERANCE)


def spread_tail(offsets: np.ndarray, step_size: int) -> np.ndarray:
    """Split micro-batches (the last ones first, each in two halves) until their count is a multiple of
    ``step_size``, so every rank gets the same number of micro-batches in every step. No sample is
    duplicated or dropped; a half never exceeds the budget its whole obeyed.

    >>> spread_tail(np.array([0, 2, 4, 5]), 4).tolist()
    [0, 2, 3, 4, 5]
    """
    m = offsets.shape[0] - 1
    need = (-m) % step_size
    while need > 0:
        counts = np.diff(offsets)
        splittable = np.flatnonzero(counts >= 2)
        if splittable.size == 0:
            raise ConfigError(
                f"cannot give every rank the same number of micro-batches: {int(offsets[-1])} samples make "
                f"{m} micro-batches and {need} more are needed for steps of {step_size}; "
                "lower world_size * grad_accum"
            )
        chosen = splittable[-min(need, splittable.size) :]
        mids = offsets[chosen] + counts[chosen] // 2
        offsets = np.insert(offsets, chosen + 1, mids)
        need -= chosen.size
        m = offsets.shape[0] - 1
    return offsets


def complete_last_step(
    order: np.ndarray, offsets: np.ndarray, length: np.ndarray, step_size: int, budget: int, packed: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Make the micro-batch count a multiple of ``step_size`` by cutting the trailing partial step anew: the
    samples of its ``r`` micro-batches (``r = n_micro % step_size``) become ``step_size`` micro-batches of
    even cost: packed rows dealt longest first to the least loaded row (``_cuts.lpt_bins``), padded ones
    sorted by length and cut where the largest piece is smallest (``_cuts.cut_into``). The last step then
    costs about ``r / step_size`` of a full one, spread evenly over its ranks, instead of holding a few
    halves beside whole micro-batches. No sample is duplicated or dropped; every piece obeys the budget.

    When those samples are too few (or too long) for ``step_size`` pieces, the region grows by one whole
    step at a time; if even the whole epoch cannot be cut so, :func:`spread_tail` splits micro-batches
    (and says when that is impossible).

    >>> order, offsets = complete_last_step(np.arange(5), np.array([0, 3, 5]), np.ones(5, np.int64), 4,
    ...                                     budget=4, packed=False)
    >>> np.diff(offsets).tolist()
    [1, 1, 2, 1]
    """
    m = offsets.shape[0] - 1
    r = m % step_size
    if r == 0:
        return order, offsets
    first = m - r
    while True:
        a = int(offsets[first])
        tail = order[a:]
        n_pieces = m - first + step_size - r
        bins = _cuts.lpt_bins(length[tail], n_pieces, budget) if packed else np.empty(0, np.int64)
        if bins.shape[0] and np.bincount(bins, minlength=n_pieces).min() > 0:
            tail = tail[kernels.counting_argsort(bins, n_pieces)]
            piece_ends = np.concatenate(([0], np.cumsum(np.bincount(bins, minlength=n_pieces))))
        else:
            tail = tail[np.argsort(length[tail], kind="stable")]
            piece_ends = split_largest(_cuts.cut_into(length[tail], n_pieces, budget, packed), n_pieces)
        if piece_ends.shape[0] - 1 == n_pieces:
            order = np.concatenate((order[:a], tail))
            return order, np.concatenate((offsets[: first + 1], a + piece_ends[1:]))
        if first == 0:
            return order, spread_tail(offsets, step_size)
        first = max(0, first - step_size)


def split_largest(offsets: np.ndarray, n_pieces: int) -> np.ndarray:
    """Halve the piece with the most items until there are ``n_pieces`` (a half obeys its whole's budget), as
    long as a piece has two items to halve."""
    while 1 < offsets.shape[0] <= n_pieces:
        counts = np.diff(offsets)
        j = int(np.argmax(counts))
        if counts[j] < 2:
            break
        offsets = np.insert(offsets, j + 1, offsets[j] + counts[j] // 2)
    return offsets


def assign_ranks(
    costs: np.ndarray,
    world_size: int,
    grad_accum: int,
    max_rounds: int = 64,
    speeds: np.ndarray | None = None,
) -> np.ndarray:
    """Permutation of micro-batches that balances each step's ranks (see ``_ranks.balance_ranks``), of
    equal speed or of the given relative ``speeds``."""
    if world_size == 1:
        return np.arange(costs.shape[0], dtype=np.int64)
    uniform = speeds is None
    speeds = np.ones(world_size) if speeds is None else np.asarray(speeds, dtype=np.float64)
    c = costs.astype(np.float64)
    return _ranks.balance_ranks(c, int(world_size), int(grad_accum), int(max_rounds), speeds, uniform)


def evens_ranks(config: PlanConfig, drafting: bool) -> bool:
    """Whether :func:`even_ranks` applies: plans of several ranks, packed (not under SP/CP, whose padded rows
    cost more than their items) or bucketed (not a drafter plan, whose padded micro-batches are bounded by
    more than tokens)."""
    if config.world_size <= 1:
        return False
    if config.packed:
        return not config.shard.pads
    return config.strategy == "bucketed" and not drafting


def even_ranks(
    lens: np.ndarray,
    offsets: np.ndarray,
    config: PlanConfig,
    coefficients: tuple,
    budget: int,
    sizes: np.ndarray | None = None,
    anchors: np.ndarray | None = None,
    drafter: tuple[float, float] = (0.0, 0.0),
    costs: np.ndarray | None = None,
    order: np.ndarray | None = None,
) -> tuple[np.ndarray | None, np.ndarray]:
    """Even out the ranks of assigned steps of equal-speed ranks: where a step's slowest rank costs more than
    :data:`EVEN_TOLERANCE` above the mean, items move between the micro-batches of its ranks, and no item
    leaves its step, so the step mixing is untouched. Returns ``(perm, offsets)``: the items' new order
    (indices into ``lens``; packed, ``None`` when no step needed evening) and the new micro-batch boundaries.

    Bucketed: whole rows move from the slowest rank's micro-batches to similar-length ones of other ranks
    (``count * longest <= budget``), kept when the slowest rank's cost drops (``_ranks.even_padded_steps``);
    steps are composed by length quantile, and a step whose longest quantile is a lone long sample leaves
    its rank short. Packed: an item of the slowest rank moves to, or is swapped with a lighter one of,
    another rank's row while both rows stay within ``budget`` in ``sizes``
    (:func:`padfree.core.capacity.sizes`, default ``lens``), an item weighing its own slots, attention and,
    with ``anchors``, ``drafter`` terms (``_ranks.even_packed_steps``); packed rows are filled by size,
    not by cost, so a row of long (or anchor-rich) documents costs more than one of short ones; only the
    steps above the tolerance (by the micro-batches' ``costs``, when the caller has them) are worked on;
    ``sizes`` and ``anchors`` may be the epoch's, per item, that ``order`` puts in the order of ``lens``.

    >>> from padfree.core.config import PlanConfig
    >>> cfg = PlanConfig(strategy="bucketed", budget=8, world_size=2, grad_accum=1)
    >>> perm, offs = even_ranks(np.array([2, 2, 2, 2, 2]), np.array([0, 4, 5]), cfg, (1.0, 0.0, 0.0), 8)
    >>> perm.tolist(), offs.tolist()
    ([1, 2, 3, 0, 4], [0, 3, 5])
    >>> cfg = cfg.with_(strategy="packed")
    >>> perm, offs = even_ranks(np.array([4, 2, 1, 1]), np.array([0, 3, 4]), cfg, (1.0, 0.0, 0.0), 8)
    >>> perm.tolist(), offs.tolist()
    ([1, 2, 3, 0], [0, 3, 4])
    """
    coefs = np.asarray(coefficients[:3], dtype=np.float64)
    w, g = config.world_size, config.grad_accum
    lens = lens.astype(np.int64, copy=False)
    offsets = offsets.astype(np.int64, copy=False)
    if config.packed:
        return _even_packed(lens, offsets, w, g, coefs, int(budget), sizes, anchors, drafter, costs, order)
    return _ranks.even_padded_steps(lens, offsets, w, g, int(budget), coefs, EVEN_TOLERANCE)


def _even_packed(
    lens: np.ndarray,
    offsets: np.ndarray,
    w: int,
    g: int,
    coefs: np.ndarray,
    budget: int,
    sizes: np.ndarray | None,
    anchors: np.ndarray | None,
    drafter: tuple[float, float],
    costs: np.ndarray | None,
    order: np.ndarray | None,
) -> tuple[np.ndarray | None, np.ndarray]:
    """:func:`even_ranks` of packed steps: the steps above :data:`EVEN_TOLERANCE` gathered and evened by
    ``_ranks.even_packed_steps`` (an epoch of balanced steps costs one pass over its micro-batches)."""
    k = w * g
    model = cost.Coefficients(float(coefs[0]), float(coefs[1]), float(coefs[2]))
    if costs is None:
        held = None if anchors is None or order is None else anchors[order]
        costs = cost.micro_costs(cost.micro_shapes(lens, offsets, True, held), model, drafter)
    per_rank = costs.reshape(-1, w, g).sum(axis=2)
    bad = np.flatnonzero(per_rank.max(axis=1) > (1.0 + EVEN_TOLERANCE) * per_rank.mean(axis=1))
    if bad.size == 0:
        return None, offsets
    starts, ends = offsets[bad * k], offsets[(bad + 1) * k]
    counts = ends - starts
    base = np.concatenate(([0], np.cumsum(counts)[:-1]))  # each bad step's start among the gathered items
    idx = np.repeat(starts - base, counts) + np.arange(int(counts.sum()))
    bounds = offsets[bad[:, None] * k + np.arange(k)[None, :]] - (starts - base)[:, None]
    local = np.append(bounds.ravel(), counts.sum())
    sub_lens = lens[idx]
    src = idx if order is None else order[idx]  # the gathered items among sizes and anchors
    weight = cost.micro_costs(
        cost.item_shapes(sub_lens, None if anchors is None else anchors[src]), model._replace(c=0.0), drafter
    )  # each item a row of its own
    size = sub_lens if sizes is None else sizes[src].astype(np.int64, copy=False)
    sub_perm, sub_off = _ranks.even_packed_steps(size, weight, local, w, g, budget, model.c, EVEN_TOLERANCE)
    perm = np.arange(lens.shape[0], dtype=np.int64)
    perm[idx] = idx[sub_perm]
    new_offsets = offsets.copy()
    new_offsets[bad[:, None] * k + np.arange(k)[None, :]] = (
        sub_off[:-1].reshape(-1, k) + (starts - base)[:, None]
    )
    return perm, new_offsets
