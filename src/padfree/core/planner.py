"""``make_plan``: the one place that decides whether an epoch is planned in memory or window by window.

::

    lengths --make_plan--+-- n <= STREAM_THRESHOLD --> plan.plan_in_memory --> plan_items --> Plan
                         +-- larger (or stream=True) --> stream.plan_stream --> plan_items per window --> Plan

:func:`plan_pieces` makes the same epoch piece by piece; window by window it is the stream planner's dealer
and loop without its join (:mod:`padfree.core.stream`), which a replay's windowed segments use too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypedDict

import numpy as np
from numpy.typing import ArrayLike

from padfree.core import stream as _stream
from padfree.core.capacity import bounded
from padfree.core.config import PlanConfig
from padfree.core.plan import Plan, check_epoch, plan_in_memory
from padfree.errors import ConfigError

if TYPE_CHECKING:  # annotations only: typing.Unpack is Python 3.11+, and numpy is the core's one dependency
    from typing_extensions import Unpack

STREAM_THRESHOLD = 20_000_000
"""``make_plan`` plans above this many samples window by window (see :mod:`padfree.core.stream`)."""


def planning_window(lengths: ArrayLike, stream: bool | None = None, window: int | None = None) -> int | None:
    """The one decision between the two paths: ``None`` to plan in memory, else the window size.

    ``stream=True`` plans window by window, ``False`` in memory; ``None`` decides by size (above
    :data:`STREAM_THRESHOLD` samples). ``window`` (default :data:`padfree.core.stream.DEFAULT_WINDOW`) only
    sizes the windows.

    >>> planning_window(np.ones(10)), planning_window(np.ones(10), True), planning_window([1, 2], True, 5)
    (None, 4000000, 5)
    """
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1
    ):
        raise ConfigError(f"window must be an integer >= 1 (got {window!r})")
    try:
        n = len(lengths)  # type: ignore[arg-type]
    except TypeError:  # a scalar: validate_lengths reports it
        n = 0
    if stream or (stream is None and n > STREAM_THRESHOLD):
        return _stream.DEFAULT_WINDOW if window is None else int(window)
    return None


class Planning(TypedDict, total=False):
    """How an epoch is planned, the keywords :func:`make_plan` and :func:`plan_pieces` share (all optional).

    ``path``: the file the lengths came from, named in errors. ``stream``: ``True`` plans window by window,
    ``False`` in memory, ``None`` (default) by size (:func:`planning_window`). ``window``: about this many
    samples a window (default :data:`padfree.core.stream.DEFAULT_WINDOW`). ``progress(done, total)``:
    called after each window of a window-by-window plan."""

    path: str | None
    stream: bool | None
    window: int | None
    progress: Callable[[int, int], None] | None


def _preamble(
    lengths: ArrayLike,
    config: PlanConfig,
    epoch: int,
    how: Planning,
    anchors: ArrayLike | None = None,
    t0: float | None = None,
) -> Plan | tuple[int, int]:
    """What :func:`make_plan` and :func:`plan_pieces` decide first: the whole epoch's plan when it is made in
    one piece (weighted sources, composed step by step; or in memory), else the checked epoch and the window
    to plan in. Refuses a window for what is planned in memory only: a strategy's own layout, a drafter
    plan; and, as Python would for a named keyword, a keyword that is not :class:`Planning`'s."""
    unknown = sorted(set(how) - Planning.__optional_keys__)
    if unknown:
        raise TypeError(f"planning got an unexpected keyword argument {unknown[0]!r}")
    epoch = check_epoch(epoch)
    if config.sources is not None:  # weighted sources: lengths per source, composed step by step
        from padfree.core import sources

        data = sources.source_data(lengths, config)  # type: ignore[arg-type]
        return sources.plan_sources(data, config, epoch)[0]
    window = planning_window(lengths, how.get("stream"), how.get("window"))
    if window is None:
        return plan_in_memory(lengths, config, epoch, path=how.get("path"), t0=t0, anchors=anchors)
    if config.spec.layout is not None:
        raise ConfigError(
            f"{config.strategy} plans are planned in memory, up to {STREAM_THRESHOLD:,} samples "
            "(not window by window)"
        )
    if anchors is not None or bounded(config):
        raise ConfigError(
            f"drafter plans (anchors, anchor_budget, attn_budget) are planned in memory, up to "
            f"{STREAM_THRESHOLD:,} samples (not window by window)"
        )
    return epoch, window


def make_plan(
    lengths: ArrayLike,
    config: PlanConfig,
    epoch: int = 0,
    *,
    anchors: ArrayLike | None = None,
    **how: Unpack[Planning],
) -> Plan:
    """Plan one epoch: a pure function of (lengths, config, epoch) (and of ``anchors``, a drafter plan's
    draft blocks per sample, which its micro-batches hold within ``config.anchor_budget``; in memory only).

    Above :data:`STREAM_THRESHOLD` samples (or with ``stream=True``) the epoch is planned in windows of
    about ``window`` samples to bound memory (:func:`padfree.core.stream.plan_stream`); ``stream=False``
    forces the in-memory path. The keywords ``path``, ``stream``, ``window`` and ``progress``:
    :class:`Planning`.

    >>> import numpy as np
    >>> cfg = PlanConfig(strategy="bucketed", budget=64, world_size=2, grad_accum=2, seed=1)
    >>> plan = make_plan(np.arange(1, 41), cfg, epoch=0)
    >>> plan.n_micro % 4, sorted(plan.indices.tolist()) == list(range(40))
    (0, True)
    """
    t0 = time.perf_counter()
    routed = _preamble(lengths, config, epoch, how, anchors, t0)
    if isinstance(routed, Plan):
        return routed
    epoch, every = routed
    path, progress = how.get("path"), how.get("progress")
    return _stream.plan_stream(lengths, config, epoch, window=every, path=path, progress=progress, t0=t0)


def plan_pieces(
    lengths: ArrayLike, config: PlanConfig, epoch: int = 0, **how: Unpack[Planning]
) -> Iterator[Plan]:
    """The epoch :func:`make_plan` makes, as consecutive pieces of whole steps, one in memory at a time
    (keywords: :class:`Planning`).

    In memory (and for weighted sources) the one piece is :func:`make_plan`'s plan; on the window path each
    piece is one window's plan (:func:`padfree.core.stream.window_pieces`), and their concatenation is
    :func:`make_plan`'s plan (sample ids are global; the pieces' offsets start at 0). Measuring a plan piece
    by piece (:class:`padfree.core.metrics.EpochMeter`) keeps memory at one window's, not the epoch's.

    >>> cfg = PlanConfig(strategy="packed", budget=64, world_size=2, grad_accum=2, seed=3)
    >>> lengths = np.arange(1, 201) % 60 + 1
    >>> pieces = list(plan_pieces(lengths, cfg, 0, stream=True, window=50))
    >>> whole = make_plan(lengths, cfg, 0, stream=True, window=50)
    >>> len(pieces), np.array_equal(np.concatenate([p.indices for p in pieces]), whole.indices)
    (4, True)
    """
    routed = _preamble(lengths, config, epoch, how)
    if isinstance(routed, Plan):
        yield routed
        return
    epoch, every = routed
    windows = _stream.deal_windows(lengths, config, epoch, every, how.get("path"))
    yield from _stream.window_pieces(windows, config, epoch, how.get("path"), how.get("progress"))
