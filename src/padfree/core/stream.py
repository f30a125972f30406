"""Planning a huge epoch window by window, in bounded memory: one dealer, one loop, one join.

The samples are dealt to ``ceil(n / window)`` windows at random (a window id per sample, drawn from the
seed and the epoch), each window is planned on its own with :func:`padfree.core.plan.plan_items` (the same
strategy, budget, world size and grad-accum, its own random stream), and the window plans are concatenated.
Every window's micro-batch count is a multiple of ``world_size * grad_accum`` (the planner spreads its
tail), so steps never straddle windows: every rank still gets ``grad_accum`` micro-batches per step and
every sample appears exactly once. Because windows are random subsets, each window holds the dataset's
length mix, and so does every step.

::

    samples (make_plan, plan_pieces, a replay's first segment) --+
                                                                 +-- deal_windows --> window_pieces --> join
    prepared items (the rest of a resumed epoch, replay) --------+     (dealer)         (the loop)

:func:`plan_pieces <padfree.core.planner.plan_pieces>` stops before the join (one window in memory at a time);
:func:`plan_stream` is all three. Prepared items are dealt on their own random streams and the plan is
written back over their own arrays, so the rest of an epoch is re-planned without a second copy of it.

Memory: the window ids (1 byte a sample while there are < 128 windows), their grouping (int32 sample ids),
the output plan (int32 ``indices`` and ``lengths``) and one window's working arrays; nothing of size ``n``
in int64. Samples stay int32 when the lengths are int32.

A strategy with ``fixed_batches`` (``sorted``) draws its windows from the seed alone (not the epoch), so, as
in the in-memory path, its micro-batches are the same every epoch and only their order changes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from padfree.core import kernels
from padfree.core.budget import Budget
from padfree.core.config import PlanConfig
from padfree.core.items import Items, Report, check_overlong, make_items, validate_lengths
from padfree.core.kernels import njit
from padfree.core.plan import Plan, check_epoch, check_fills_step, epoch_rng, plan_items
from padfree.core.strategies import REGISTRY
from padfree.errors import ConfigError

DEFAULT_WINDOW = 4_000_000
"""Samples per window: about 0.3-0.5 GB of working memory per window (see docs/scale.md)."""

_CHUNK = 8_000_000  # samples per pass when counting over the whole array
_SAMPLES, _PREPARED = 0, 2  # random sub-streams: window ids (this tag) and window plans (tag + 1)


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


def _index_dtype(n: int) -> type:
    return np.int32 if n < 2**31 else np.int64


@dataclass(frozen=True)
class Windows:
    """One epoch dealt to windows (:func:`deal_windows`): window ``j`` holds entries ``starts[j]:starts[j+1]``
    of the window order.

    Attributes:
        order: the sample id of each entry, grouped by window (ascending inside a window when the entries are
            samples; int32 when ``n < 2**31``).
        starts: the window boundaries.
        items: items per window (after the overlong policy).
        budget: the segment's :class:`~padfree.core.budget.Budget`; samples are cut into items at its
            ``item``.
        n_samples: samples of the epoch.
        n_over: samples longer than ``budget.item``.
        lengths: the validated sample lengths (int32 when they came as int32), when samples are dealt.
        prepared: the items dealt instead (the rest of a resumed epoch), in window order, in their own
            arrays: :func:`join` writes the plan over them.
        single: one window, planned as the in-memory path plans it (the epoch's own random stream).
    """

    order: np.ndarray
    starts: np.ndarray
    items: np.ndarray
    budget: Budget
    n_samples: int
    n_over: int = 0
    lengths: np.ndarray | None = None
    prepared: Items | None = None
    single: bool = False

    @property
    def n_windows(self) -> int:
        return int(self.starts.shape[0] - 1)

    def samples(self, j: int) -> np.ndarray:
        return self.order[self.starts[j] : self.starts[j + 1]]

    def items_at(self, lo: int, hi: int, overlong: str, path: str | None = None) -> Items:
        """Entries ``lo:hi`` of the window order as plannable items (global sample ids)."""
        if self.prepared is not None:
            p = self.prepared
            if self.single:
                return p
            return Items(
                p.length[lo:hi],
                p.sample_ids()[lo:hi],
                None if p.start is None else p.start[lo:hi],
                p.n_samples,
            )
        assert self.lengths is not None
        ids = self.order[lo:hi]
        it = make_items(self.lengths[ids].astype(np.int64), self.budget.item, overlong, path)
        gids = ids.astype(np.int64)
        sample = gids if it.sample is None else gids[it.sample]
        return Items(it.length, sample, it.start, self.n_samples, it.truncated, it.split, it.dropped)


def deal_windows(
    source: ArrayLike | Items,
    config: PlanConfig,
    epoch: int,
    window: int = DEFAULT_WINDOW,
    path: str | None = None,
    budget: Budget | None = None,
    *,
    in_place: bool = False,
) -> Windows:
    """The one dealer: ``source`` (per-sample lengths, or prepared :class:`Items`) dealt to windows of about
    ``window`` entries at random; a window that would hold fewer items than one step
    (``world_size * grad_accum``) is merged into its neighbour.

    Lengths are validated and the overlong policy checked over the whole epoch (at ``budget.item``, default
    ``Budget.of(config)``). Prepared items are permuted into window order in copies of their arrays, or
    with ``in_place=True`` in their own (writeable) arrays, which the plan then overwrites.

    >>> w = deal_windows(np.arange(1, 101), PlanConfig(budget=200), epoch=0, window=30)
    >>> w.n_windows, int(w.items.sum()), sorted(w.order.tolist()) == list(range(100))
    (4, 100, True)
    """
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ConfigError(f"window must be an integer >= 1 (got {window!r})")
    budget = Budget.of(config) if budget is None else budget
    if isinstance(source, Items):
        return _deal_prepared(source, config, epoch, int(window), budget, in_place)
    lengths = validate_lengths(source, path, compact=True)
    n = int(lengths.shape[0])
    cut = budget.item
    n_windows = max(1, math.ceil(n / int(window)))
    label_epoch = 0 if REGISTRY[config.strategy].fixed_batches else epoch
    labels = _labels(epoch_rng(config.seed, label_epoch, config.strategy, _SAMPLES), n, n_windows)

    # one pass in chunks: items per window, and the overlong report
    items = np.zeros(n_windows, np.int64)
    n_over, first_over, longest = 0, -1, 0
    for a in range(0, n, _CHUNK):
        chunk = lengths[a : a + _CHUNK]
        lab = labels[a : a + _CHUNK]
        over = chunk > cut
        c_over = int(np.count_nonzero(over))
        longest = max(longest, int(chunk.max()))
        if c_over and first_over < 0:
            first_over = a + int(np.argmax(over))
        n_over += c_over
        if config.overlong == "drop":
            items += np.bincount(lab[~over], minlength=n_windows)
        elif config.overlong == "split" and c_over:
            pieces = (chunk.astype(np.int64) + (cut - 1)) // cut
            items += np.bincount(lab, weights=pieces, minlength=n_windows).astype(np.int64)
        else:
            items += np.bincount(lab, minlength=n_windows)
    check_overlong(n_over, n, first_over, longest, cut, config.overlong, path)
    check_fills_step(int(items.sum()), config)

    order, starts, items = _group(labels, items, config.micro_per_step)
    single = starts.shape[0] == 2
    return Windows(order, starts, items, budget, n, n_over, lengths=lengths, single=single)


def _deal_prepared(
    items: Items, config: PlanConfig, epoch: int, window: int, budget: Budget, in_place: bool
) -> Windows:
    """:func:`deal_windows` of prepared items: window ids on their own stream, the arrays permuted into
    window order (one window only: left as they are, planned as the in-memory path plans them)."""
    n = len(items)
    n_windows = max(1, math.ceil(n / window))
    if n_windows == 1:
        whole = np.array([0, n], np.int64)
        return Windows(
            items.sample_ids(), whole, whole[1:], budget, items.n_samples, prepared=items, single=True
        )
    labels = _labels(epoch_rng(config.seed, epoch, config.strategy, _PREPARED), n, n_windows)
    order, starts, per_window = _group(
        labels, np.bincount(labels, minlength=n_windows), config.micro_per_step
    )
    del labels
    # the items in window order, in their own arrays: every window is then one contiguous slice, and its
    # plan (a permutation of the slice) is written back over it
    arrays = [items.length, items.sample_ids()] + ([] if items.start is None else [items.start])
    seen = np.zeros(n, np.uint8)
    for i, arr in enumerate(arrays):
        if not in_place or not arr.flags.writeable:
            arrays[i] = arr = arr.copy()
        seen[:] = 0
        permute_in_place(arr, order, seen)
    del order, seen
    start = arrays[2] if items.start is not None else None
    prepared = Items(arrays[0], arrays[1], start, items.n_samples)
    return Windows(arrays[1], starts, per_window, budget, items.n_samples, prepared=prepared)


def _group(labels: np.ndarray, per_window: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Windows too small for one step merged, then the ids grouped by window: ``(order, starts, per
    window)``, window ``j`` holding ``order[starts[j]:starts[j+1]]``."""
    labels, per_window = _merge_small(labels, per_window, k)
    n = int(labels.shape[0])
    order: np.ndarray = np.empty(n, _index_dtype(n))
    starts = kernels.counting_sort_into(labels, per_window.shape[0], order)  # sample ids by window
    return order, starts, per_window


def _merge_small(labels: np.ndarray, items: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge windows too small for one step (``k`` items) into the next one (the last into the previous
    one); returns the new labels and items per window."""
    if items.min() >= k:
        return labels, items
    n_windows = items.shape[0]
    new_id = np.zeros(n_windows, np.int64)
    cur, acc = 0, 0
    for j in range(n_windows):  # loops over windows, not samples
        new_id[j] = cur
        acc += int(items[j])
        if acc >= k:
            cur, acc = cur + 1, 0
    if acc > 0:  # a short remainder joins the window before it
        new_id[new_id == cur] = cur - 1
    n_windows = int(new_id.max()) + 1
    items = np.bincount(new_id, weights=items, minlength=n_windows).astype(np.int64)
    return new_id.astype(labels.dtype)[labels], items


def _labels(rng: np.random.Generator, n: int, n_windows: int) -> np.ndarray:
    dtype = np.int8 if n_windows < 2**7 else np.int16 if n_windows < 2**15 else np.int32
    return rng.integers(0, n_windows, n, dtype=dtype)


def window_pieces(
    windows: Windows,
    config: PlanConfig,
    epoch: int,
    path: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    *,
    t0: float | None = None,
    assign: bool = True,
) -> Iterator[Plan]:
    """The one loop: the epoch dealt to ``windows`` as consecutive plans of whole steps (global sample ids),
    one window in memory at a time, each planned on its own random stream (``assign``: see
    :func:`padfree.core.plan.plan_items`); a single window is the in-memory plan. A window whose
    micro-batches cannot be made whole steps (nearly all of them single samples) is planned again together
    with the next window. ``progress(done, total)`` after each plan."""
    n_windows = windows.n_windows
    tag = _SAMPLES if windows.prepared is None else _PREPARED
    lo = 0
    for j in range(n_windows):
        hi = int(windows.starts[j + 1])
        rng = None if windows.single else epoch_rng(config.seed, epoch, config.strategy, tag + 1, j)
        items = windows.items_at(lo, hi, config.overlong, path)
        try:
            plan = plan_items(
                items, config, epoch, budget=windows.budget, t0=t0 if windows.single else None, rng=rng,
                assign=assign,
            )  # fmt: skip
        except ConfigError:
            if j == n_windows - 1:
                raise
            continue
        del items
        yield plan
        lo = hi
        if progress is not None:
            progress(j + 1, n_windows)


def join(
    windows: Windows, pieces: Iterable[Plan], config: PlanConfig, epoch: int, t0: float, assign: bool
) -> Plan:
    """The one join: the window plans written one after the other (each one's offsets shifted) into compact
    arrays (int32 lengths and starts), or for prepared items back over their own arrays."""
    total = int(windows.items.sum())
    if windows.prepared is None:
        indices: np.ndarray = np.empty(total, _index_dtype(windows.n_samples))
        lens = np.empty(total, np.int32)
        # as in the in-memory path: starts only when some sample was split
        split = config.overlong == "split" and windows.n_over > 0
        starts = np.empty(total, np.int32) if split else None
    else:
        indices, lens, starts = windows.prepared.sample_ids(), windows.prepared.length, windows.prepared.start
    offsets = [np.zeros(1, np.int64)]
    edges: np.ndarray | None = None
    counts = [0, 0, 0]  # truncated, split, dropped
    pos = 0
    for i, p in enumerate(pieces):
        m = int(p.indices.shape[0])
        indices[pos : pos + m] = p.indices
        lens[pos : pos + m] = p.lengths
        if starts is not None:
            starts[pos : pos + m] = 0 if p.starts is None else p.starts
        offsets.append(p.offsets[1:] + pos)
        if i == 0:
            edges = p.edges
        pos += m
        for c, v in enumerate((p.truncated, p.split, p.dropped)):
            counts[c] += v
    assert pos == total, (pos, total)
    report = Report(windows.n_samples, *counts)
    return Plan.of(
        config, epoch, indices, np.concatenate(offsets), lens, report, starts=starts, edges=edges, t0=t0,
        assigned=assign,
    )  # fmt: skip


def plan_stream(
    source: ArrayLike | Items,
    config: PlanConfig,
    epoch: int = 0,
    *,
    window: int = DEFAULT_WINDOW,
    path: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    t0: float | None = None,
    assign: bool = True,
    budget: Budget | None = None,
    in_place: bool = False,
) -> Plan:
    """Plan one epoch window by window and return one compact :class:`Plan`: :func:`deal_windows`,
    :func:`window_pieces`, :func:`join` (``assign=False``: steps not yet given to ranks, see
    :func:`padfree.core.plan.plan_items`; ``budget``, ``in_place``: see :func:`deal_windows`).

    ``indices`` are int32 (when there are fewer than 2**31 samples), ``lengths`` and ``starts`` int32,
    ``offsets`` int64. ``edges`` are window 0's (every window draws its own bucket phase). With a single
    window (``window >= n``) the result is exactly the in-memory plan
    (:func:`padfree.core.plan.plan_in_memory`). Prepared items (the rest of a resumed epoch,
    :mod:`padfree.core.replay`) keep their arrays' types.

    >>> cfg = PlanConfig(strategy="packed", budget=64, world_size=2, grad_accum=2, seed=3)
    >>> p = plan_stream(np.arange(1, 201) % 60 + 1, cfg, epoch=0, window=50)
    >>> p.n_micro % 4, np.array_equal(np.sort(p.indices), np.arange(200))
    (0, True)
    >>> q = plan_stream(make_items(np.arange(1, 201) % 60 + 1, 64, "error"), cfg, 0, window=50, assign=False)
    >>> q.n_micro % 4, np.array_equal(np.sort(q.indices), np.arange(200))
    (0, True)
    """
    t0 = time.perf_counter() if t0 is None else t0
    epoch = check_epoch(epoch)
    windows = deal_windows(source, config, epoch, window, path, budget, in_place=in_place)
    pieces = window_pieces(windows, config, epoch, path, progress, t0=t0, assign=assign)
    if windows.single:
        [plan] = pieces
        return plan
    return join(windows, pieces, config, epoch, t0, assign)
