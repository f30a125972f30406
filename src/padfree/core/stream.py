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

``sorted`` draws its windows from the seed alone (not the epoch), so, as in the in-memory path, its
micro-batches are the same every epoch and only their order changes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from padfree.core._kernels import njit
from padfree.core.config import PlanConfig
from padfree.core.items import Items, check_overlong, make_items, validate_lengths
from padfree.core.plan import Plan, check_epoch, check_fills_step, epoch_rng, plan_in_memory, plan_items
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
        n_over: samples longer than the budget.
    """

    lengths: np.ndarray
    order: np.ndarray
    starts: np.ndarray
    items: np.ndarray
    n_over: int = 0

    @property
    def n_windows(self) -> int:
        return int(self.starts.shape[0] - 1)

    def samples(self, j: int) -> np.ndarray:
        return self.order[self.starts[j] : self.starts[j + 1]]


def deal_windows(
    lengths: np.ndarray, config: PlanConfig, epoch: int, window: int = DEFAULT_WINDOW, path: str | None = None
) -> Windows:
    """Validate the lengths, apply the overlong checks globally and deal the samples to windows.

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
    budget = config.budget
    k = config.micro_per_step
    n_windows = max(1, math.ceil(n / int(window)))
    label_dtype = np.int8 if n_windows < 2**7 else np.int16 if n_windows < 2**15 else np.int32
    label_epoch = 0 if config.strategy == "sorted" else epoch
    labels = epoch_rng(config.seed, label_epoch, config.strategy, 0).integers(
        0, n_windows, n, dtype=label_dtype
    )

    # one pass in chunks: items per window, and the overlong report
    items = np.zeros(n_windows, np.int64)
    n_over, first_over, longest = 0, -1, 0
    for a in range(0, n, _CHUNK):
        chunk = lengths[a : a + _CHUNK]
        lab = labels[a : a + _CHUNK]
        over = chunk > budget
        c_over = int(np.count_nonzero(over))
        longest = max(longest, int(chunk.max()))
        if c_over and first_over < 0:
            first_over = a + int(np.argmax(over))
        n_over += c_over
        if config.overlong == "drop":
            items += np.bincount(lab[~over], minlength=n_windows)
        elif config.overlong == "split" and c_over:
            pieces = (chunk.astype(np.int64) + (budget - 1)) // budget
            items += np.bincount(lab, weights=pieces, minlength=n_windows).astype(np.int64)
        else:
            items += np.bincount(lab, minlength=n_windows)
    check_overlong(n_over, n, first_over, longest, budget, config.overlong, path)
    total = int(items.sum())
    check_fills_step(total, config)

    # merge windows too small for one step into the next one (the last into the previous one)
    if items.min() < k:
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
        labels = new_id.astype(label_dtype)[labels]

    order: np.ndarray = np.empty(n, _index_dtype(n))
    starts = _group_by_label(labels, n_windows, order)
    return Windows(lengths=lengths, order=order, starts=starts, items=items, n_over=n_over)


def plan_window(
    windows: Windows,
    j: int,
    config: PlanConfig,
    epoch: int,
    path: str | None = None,
    ids: np.ndarray | None = None,
) -> Plan:
    """Plan window ``j`` (or the samples ``ids``) on window ``j``'s random stream; the plan holds global
    sample ids and whole steps."""
    ids = windows.samples(j) if ids is None else ids
    it = make_items(windows.lengths[ids].astype(np.int64), config.budget, config.overlong, path)
    gids = ids.astype(np.int64)
    sample = gids if it.sample is None else gids[it.sample]
    items = Items(
        it.length,
        sample,
        it.start,
        int(windows.lengths.shape[0]),
        truncated=it.truncated,
        split=it.split,
        dropped=it.dropped,
    )
    return plan_items(items, config, epoch, rng=epoch_rng(config.seed, epoch, config.strategy, 1, j))


def iter_window_plans(
    windows: Windows, config: PlanConfig, epoch: int, path: str | None = None
) -> Iterator[tuple[int, Plan]]:
    """``(j, plan)`` for the windows in order, one window in memory at a time; ``j`` is the last window the
    plan covers. A window whose micro-batches cannot be made whole steps (nearly all of them single samples)
    is planned again together with the next window."""
    carry = None
    for j in range(windows.n_windows):
        ids = windows.samples(j) if carry is None else np.concatenate([carry, windows.samples(j)])
        try:
            plan = plan_window(windows, j, config, epoch, path, ids)
        except ConfigError:
            if j == windows.n_windows - 1:
                raise
            carry = ids
            continue
        carry = None
        yield j, plan


def plan_stream(
    lengths: np.ndarray,
    config: PlanConfig,
    epoch: int = 0,
    *,
    window: int = DEFAULT_WINDOW,
    path: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    t0: float | None = None,
) -> Plan:
    """Plan one epoch window by window and return one compact :class:`Plan`.

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
    windows = deal_windows(lengths, config, epoch, window, path)
    if windows.n_windows == 1:
        plan = plan_in_memory(windows.lengths, config, epoch, path=path, t0=t0)
        if progress is not None:
            progress(1, 1)
        return plan
    n = int(windows.lengths.shape[0])
    total = int(windows.items.sum())
    indices: np.ndarray = np.empty(total, _index_dtype(n))
    lens = np.empty(total, np.int32)
    # as in the in-memory path: starts only when some sample was split
    starts = np.empty(total, np.int32) if config.overlong == "split" and windows.n_over else None
    offsets_parts = [np.zeros(1, np.int64)]
    edges = None
    pos, micro_base = 0, 0
    truncated = split = dropped = 0
    first = True
    for j, p in iter_window_plans(windows, config, epoch, path):
        m = int(p.indices.shape[0])
        indices[pos : pos + m] = p.indices
        lens[pos : pos + m] = p.lengths
        if starts is not None:
            starts[pos : pos + m] = 0 if p.starts is None else p.starts
        offsets_parts.append(p.offsets[1:] + pos)
        if first:
            edges, first = p.edges, False
        pos += m
        micro_base += p.n_micro
        truncated += p.truncated
        split += p.split
        dropped += p.dropped
        if progress is not None:
            progress(j + 1, windows.n_windows)
    assert pos == total, (pos, total)
    return Plan(
        config=config,
        epoch=epoch,
        indices=indices,
        offsets=np.concatenate(offsets_parts),
        lengths=lens,
        starts=starts,
        edges=edges,
        n_samples=n,
        truncated=truncated,
        split=split,
        dropped=dropped,
        plan_seconds=time.perf_counter() - t0,
    )
