"""Planning a huge epoch window by window, in bounded memory.

The samples are dealt to ``ceil(n / window)`` windows at random (a window id per sample, drawn from the
seed and the epoch), each window is planned on its own with :func:`padfree.core.plan.plan_items` (the same
strategy, budget, world size and grad-accum, its own random stream), and the window plans are concatenated.
Every window's micro-batch count is a multiple of ``world_size * grad_accum`` (the planner spreads its
tail), so steps never straddle windows: every rank still gets ``grad_accum`` micro-batches per step and
every sample appears exactly once. Because windows are random subsets, each window holds the dataset's
length mix, and so does every step.

Memory: the window ids (1 byte a sample while there are < 128 windows), their grouping (int32 sample ids),
the output plan (int32 ``indices`` and ``lengths``) and one window's working arrays; nothing of size ``n``
in int64. Samples stay int32 when the lengths are int32.

A strategy with ``fixed_batches`` (``sorted``) draws its windows from the seed alone (not the epoch), so, as
in the in-memory path, its micro-batches are the same every epoch and only their order changes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from padfree.core import _kernels
from padfree.core._kernels import njit
from padfree.core.budget import Budget
from padfree.core.config import PlanConfig
from padfree.core.items import Items, Report, check_overlong, make_items, validate_lengths
from padfree.core.plan import Plan, check_epoch, check_fills_step, epoch_rng, plan_items
from padfree.core.strategies import REGISTRY
from padfree.errors import ConfigError

DEFAULT_WINDOW = 4_000_000
"""Samples per window: about 0.3-0.5 GB of working memory per window (see docs/scale.md)."""

_CHUNK = 8_000_000  # samples per pass when counting over the whole array


@njit(cache=True, nogil=True)
def _group_by_label(labels: np.ndarray, n_labels: int, out: np.ndarray) -> np.ndarray:
    """Stable counting sort of sample ids by window label into ``out``; returns the window starts."""
    starts = np.zeros(n_labels + 1, np.int64)
    for i in range(labels.shape[0]):
        starts[labels[i] + 1] += 1
    for k in range(n_labels):
        starts[k + 1] += starts[k]
    fill = starts[:-1].copy()
    for i in range(labels.shape[0]):
        k = labels[i]
        out[fill[k]] = i
        fill[k] += 1
    return starts


def _index_dtype(n: int) -> type:
    return np.int32 if n < 2**31 else np.int64


@dataclass(frozen=True)
class Windows:
    """How one epoch's samples are dealt to windows.

    Attributes:
        lengths: the validated lengths (int32 when they came as int32).
        order: sample ids grouped by window, ascending inside a window (int32 when ``n < 2**31``).
        starts: window ``j`` holds ``order[starts[j]:starts[j+1]]``.
        items: planned items per window (after the overlong policy).
        n_over: samples longer than ``budget.item``.
        budget: the segment's :class:`~padfree.core.budget.Budget`; the overlong policy cuts at its ``item``.
    """

    lengths: np.ndarray
    order: np.ndarray
    starts: np.ndarray
    items: np.ndarray
    n_over: int = 0
    budget: Budget | None = None

    @property
    def n_windows(self) -> int:
        return int(self.starts.shape[0] - 1)

    def samples(self, j: int) -> np.ndarray:
        return self.order[self.starts[j] : self.starts[j + 1]]


def deal_windows(
    lengths: ArrayLike,
    config: PlanConfig,
    epoch: int,
    window: int = DEFAULT_WINDOW,
    path: str | None = None,
    budget: Budget | None = None,
) -> Windows:
    """Validate the lengths, apply the overlong checks globally and deal the samples to windows.

    The overlong policy cuts at ``budget.item`` (default ``Budget.of(config)``); a plan that leaves headroom
    packs to a smaller ``budget.plan`` than its items may reach.

    A window that would hold fewer items than one step (``world_size * grad_accum``) is merged into its
    neighbour.

    >>> w = deal_windows(np.arange(1, 101), PlanConfig(budget=200), epoch=0, window=30)
    >>> w.n_windows, int(w.items.sum()), sorted(w.order.tolist()) == list(range(100))
    (4, 100, True)
    """
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ConfigError(f"window must be an integer >= 1 (got {window!r})")
    lengths = validate_lengths(lengths, path, compact=True)
    n = int(lengths.shape[0])
    budget = Budget.of(config) if budget is None else budget
    cut = budget.item
    k = config.micro_per_step
    n_windows = max(1, math.ceil(n / int(window)))
    label_epoch = 0 if REGISTRY[config.strategy].fixed_batches else epoch
    labels = _labels(epoch_rng(config.seed, label_epoch, config.strategy, 0), n, n_windows)

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
    total = int(items.sum())
    check_fills_step(total, config)

    order, starts, items = _group(labels, items, k)
    return Windows(lengths=lengths, order=order, starts=starts, items=items, n_over=n_over, budget=budget)


def _group(labels: np.ndarray, per_window: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Windows too small for one step merged, then the ids grouped by window: ``(order, starts, per
    window)``, window ``j`` holding ``order[starts[j]:starts[j+1]]``."""
    labels, per_window = _merge_small(labels, per_window, k)
    n = int(labels.shape[0])
    order: np.ndarray = np.empty(n, _index_dtype(n))
    starts = _group_by_label(labels, per_window.shape[0], order)
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


def _window_plans(
    starts: np.ndarray,
    items_of: Callable[[int, int], Items],
    config: PlanConfig,
    epoch: int,
    tag: int,
    assign: bool,
    budget: Budget | None = None,
) -> Iterator[tuple[int, int, int, Plan]]:
    """The one windowed planner: ``(j, lo, hi, plan)`` for the windows in order, window ``j`` (entries
    ``lo:hi`` of the window order) planned on its own stream ``(tag, j)``; one window in memory at a time. A
    window whose micro-batches cannot be made whole steps (nearly all of them single samples) is planned again
    together with the next window (``lo`` stays)."""
    n_windows = int(starts.shape[0] - 1)
    lo = 0
    for j in range(n_windows):
        hi = int(starts[j + 1])
        rng = epoch_rng(config.seed, epoch, config.strategy, tag, j)
        try:
            plan = plan_items(items_of(lo, hi), config, epoch, budget=budget, rng=rng, assign=assign)
        except ConfigError:
            if j == n_windows - 1:
                raise
            continue
        yield j, lo, hi, plan
        lo = hi


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
    """The epoch dealt to ``windows`` as consecutive plans of whole steps (global sample ids), one window in
    memory at a time; a single window is the in-memory plan. ``progress(done, total)`` after each window
    (``assign``: see :func:`padfree.core.plan.plan_items`)."""
    budget = Budget.of(config) if windows.budget is None else windows.budget
    if windows.n_windows == 1:
        whole = make_items(windows.lengths.astype(np.int64), budget.item, config.overlong, path)
        yield plan_items(whole, config, epoch, budget=budget, t0=t0, assign=assign)
        if progress is not None:
            progress(1, 1)
        return
    n = int(windows.lengths.shape[0])

    def items_of(lo: int, hi: int) -> Items:
        ids = windows.order[lo:hi]
        it = make_items(windows.lengths[ids].astype(np.int64), budget.item, config.overlong, path)
        gids = ids.astype(np.int64)
        sample = gids if it.sample is None else gids[it.sample]
        return Items(it.length, sample, it.start, n, it.truncated, it.split, it.dropped)

    for j, _, _, plan in _window_plans(windows.starts, items_of, config, epoch, 1, assign, budget):
        yield plan
        if progress is not None:
            progress(j + 1, windows.n_windows)


def plan_stream(
    lengths: ArrayLike,
    config: PlanConfig,
    epoch: int = 0,
    *,
    window: int = DEFAULT_WINDOW,
    path: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    t0: float | None = None,
    assign: bool = True,
    budget: Budget | None = None,
) -> Plan:
    """Plan one epoch window by window and return one compact :class:`Plan` (``assign=False``: steps not
    yet given to ranks, see :func:`padfree.core.plan.plan_items`; ``budget``: the segment's, see
    :func:`deal_windows`).

    ``indices`` are int32 (when there are fewer than 2**31 samples), ``lengths`` and ``starts`` int32,
    ``offsets`` int64. ``edges`` are window 0's (every window draws its own bucket phase). With a single
    window (``window >= n``) the result is exactly the in-memory plan
    (:func:`padfree.core.plan.plan_in_memory`).

    >>> cfg = PlanConfig(strategy="packed", budget=64, world_size=2, grad_accum=2, seed=3)
    >>> p = plan_stream(np.arange(1, 201) % 60 + 1, cfg, epoch=0, window=50)
    >>> p.n_micro % 4, np.array_equal(np.sort(p.indices), np.arange(200))
    (0, True)
    """
    t0 = time.perf_counter() if t0 is None else t0
    epoch = check_epoch(epoch)
    windows = deal_windows(lengths, config, epoch, window, path, budget)
    pieces = window_pieces(windows, config, epoch, path, progress, t0=t0, assign=assign)
    if windows.n_windows == 1:
        [plan] = pieces
        return plan
    n = int(windows.lengths.shape[0])
    # as in the in-memory path: starts only when some sample was split
    out = _Concat(int(windows.items.sum()), n, config.overlong == "split" and windows.n_over > 0, assign)
    for p in pieces:
        out.add(p)
    return out.plan(config, epoch, n, t0)


class _Concat:
    """Window plans written one after the other into compact arrays (int32 lengths and starts)."""

    def __init__(self, total: int, n_samples: int, with_starts: bool, assigned: bool) -> None:
        self.total = total
        self.assigned = assigned
        self.indices: np.ndarray = np.empty(total, _index_dtype(n_samples))
        self.lens = np.empty(total, np.int32)
        self.starts = np.empty(total, np.int32) if with_starts else None
        self.offsets = [np.zeros(1, np.int64)]
        self.edges: np.ndarray | None = None
        self.pos = 0
        self.counts = [0, 0, 0]  # truncated, split, dropped
        self.first = True

    def add(self, p: Plan) -> None:
        a, m = self.pos, int(p.indices.shape[0])
        self.indices[a : a + m] = p.indices
        self.lens[a : a + m] = p.lengths
        if self.starts is not None:
            self.starts[a : a + m] = 0 if p.starts is None else p.starts
        self.offsets.append(p.offsets[1:] + a)
        if self.first:
            self.edges, self.first = p.edges, False
        self.pos += m
        for i, v in enumerate((p.truncated, p.split, p.dropped)):
            self.counts[i] += v

    def plan(self, config: PlanConfig, epoch: int, n_samples: int, t0: float) -> Plan:
        assert self.pos == self.total, (self.pos, self.total)
        report = Report(n_samples, *self.counts)
        offsets = np.concatenate(self.offsets)
        return Plan.of(
            config, epoch, self.indices, offsets, self.lens, report, starts=self.starts, edges=self.edges,
            t0=t0, assigned=self.assigned,
        )  # fmt: skip


def plan_items_windowed(
    items: Items, config: PlanConfig, epoch: int, window: int = DEFAULT_WINDOW, *, in_place: bool = False
) -> Plan:
    """Plan already prepared items window by window, steps not given to ranks (``assign=False``): the rest
    of a huge epoch resumed at another shape (:mod:`padfree.core.replay`), in bounded memory.

    The items are dealt to windows at random (from ``config.seed`` and the epoch), each window planned on
    its own stream, the plans concatenated; a window too small for whole steps is planned with the next.
    ``in_place=True`` reuses the items' own arrays for the plan (they are overwritten): the rest of an epoch
    is re-planned without a second copy of it.

    >>> from padfree.core.items import make_items
    >>> cfg = PlanConfig(strategy="packed", budget=64, world_size=2, grad_accum=2, seed=3)
    >>> p = plan_items_windowed(make_items(np.arange(1, 201) % 60 + 1, 64, "error"), cfg, 0, window=50)
    >>> p.n_micro % 4, np.array_equal(np.sort(p.indices), np.arange(200))
    (0, True)
    """
    t0 = time.perf_counter()
    n = len(items)
    n_windows = max(1, math.ceil(n / int(window)))
    if n_windows == 1:
        return plan_items(items, config, epoch, assign=False)
    labels = _labels(epoch_rng(config.seed, epoch, config.strategy, 2), n, n_windows)
    order, starts, _ = _group(labels, np.bincount(labels, minlength=n_windows), config.micro_per_step)
    del labels
    # the items in window order, in their own arrays: every window is then one contiguous slice, and its
    # plan (a permutation of the slice) is written back over it
    arrays = [items.length, items.sample_ids()] + ([] if items.start is None else [items.start])
    seen = np.zeros(n, np.uint8)
    for i, arr in enumerate(arrays):
        if not in_place or not arr.flags.writeable:
            arrays[i] = arr = arr.copy()
        seen[:] = 0
        _kernels.permute_in_place(arr, order, seen)
    del order, seen
    length, sample = arrays[0], arrays[1]
    start = arrays[2] if items.start is not None else None

    def items_of(lo: int, hi: int) -> Items:
        return Items(length[lo:hi], sample[lo:hi], None if start is None else start[lo:hi], items.n_samples)

    offsets = [np.zeros(1, np.int64)]
    for _, lo, hi, p in _window_plans(starts, items_of, config, epoch, 3, assign=False):
        sample[lo:hi], length[lo:hi] = p.indices, p.lengths
        if start is not None:
            start[lo:hi] = p.starts
        offsets.append(p.offsets[1:] + lo)
    report = Report(items.n_samples)
    return Plan.of(
        config, epoch, sample, np.concatenate(offsets), length, report, starts=start, t0=t0, assigned=False
    )
