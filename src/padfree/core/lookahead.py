"""Streams planned in a bounded window: lengths learned as they are read, a window of ``W`` samples planned
with today's strategies, half of its steps given out, the window refilled; resumable at any world size.

::

    stream (positions 0, 1, 2 ...) --read up to W--> window --plan_items (strategy, ranks)--> steps
          ^                                            |                                       |
          +------------- refill ------- the rest ------+------ the first half of the steps ---+--> out

A round plans the whole window (its samples in any order: the plan's steps mix them), gives out the first
``ceil(steps * EMIT_SHARE)`` steps (all of them once the stream is exhausted) and keeps the samples of the
others, which the next round plans again with the samples read to refill the window. Every sample read
enters the window once and leaves it in exactly one step. Memory is O(W): the window's ids and lengths and
one round's plan.

The state that continues a stream (:class:`WindowState`) is the round's start: its index and shape, the
stream position read so far, the window's ids and lengths, and the steps of the round already given out. At
the same shape the round is planned again and continues at that step; at another world size the round's
given-out steps are taken out and a new round starts at the new shape. Streams: :class:`ArrayLengths` (a
length column in memory), :class:`padfree.data.length_streams.ParquetLengths` (a length column of parquet
shards, in order, seekable), :class:`IteratorLengths` (an iterator: it cannot seek, so it is refused for
exact resume in one line).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from padfree.core import kernels
from padfree.core.budget import Budget
from padfree.core.config import PlanConfig
from padfree.core.items import Items, check_overlong
from padfree.core.plan import Plan, plan_items
from padfree.core.replay import one_per_micro
from padfree.core.sources import assign_steps
from padfree.core.strategies import REGISTRY
from padfree.errors import ConfigError, StateError

EMIT_SHARE = 0.5
"""The share of a round's steps given out before the window is refilled and planned again."""
_TAG = 0x57A  # the rounds' random streams


class LengthStream(Protocol):
    """Where a streamed plan reads lengths: ``read(start, count)`` gives the lengths at stream positions
    ``start .. start+count-1`` (fewer at the stream's end, none past it)."""

    name: str

    def read(self, start: int, count: int) -> np.ndarray: ...


@dataclass(frozen=True)
class ArrayLengths:
    """A stream over lengths known up front (or a length column read shard by shard): seekable."""

    lengths: np.ndarray
    name: str = "lengths"

    def read(self, start: int, count: int) -> np.ndarray:
        return np.asarray(self.lengths[start : start + count], dtype=np.int64)


class IteratorLengths:
    """A stream over an iterator of lengths (tokenized on the fly): it reads forward only, so a resume
    cannot seek it back to a saved position (refused in one line)."""

    def __init__(self, lengths: Iterable[int], name: str = "iterator") -> None:
        self._it = iter(lengths)
        self._pos = 0
        self.name = name

    def read(self, start: int, count: int) -> np.ndarray:
        if start != self._pos:
            raise ConfigError(
                f"source {self.name!r} cannot seek (an iterator): exact resume needs a stream that can be "
                f"read from position {start} (it is at {self._pos}); use a seekable source (a length column, "
                "shards in order) or start the stream again"
            )
        out = np.fromiter((int(x) for _, x in zip(range(count), self._it, strict=False)), dtype=np.int64)
        self._pos += out.shape[0]
        return out


@dataclass(frozen=True)
class WindowState:
    """The start of a round, and the steps of it already given out (JSON-able as :meth:`to_state`)."""

    epoch: int
    round: int
    read: int  # stream positions read before the round's refill
    world_size: int
    grad_accum: int
    ids: np.ndarray  # the window's stream positions at the round's start (before its refill)
    lengths: np.ndarray
    given: int = 0  # steps of the round given out
    steps: int = 0  # steps given out before the round

    def to_state(self) -> dict:
        return {
            "format": "padfree.window/1",
            "epoch": self.epoch,
            "round": self.round,
            "read": self.read,
            "world_size": self.world_size,
            "grad_accum": self.grad_accum,
            "ids": self.ids.tolist(),
            "lengths": self.lengths.tolist(),
            "given": self.given,
            "steps": self.steps,
        }

    @classmethod
    def from_state(cls, state: object) -> WindowState:
        if not isinstance(state, dict) or state.get("format") != "padfree.window/1":
            raise StateError("not a padfree window state (expected format 'padfree.window/1')")
        try:
            ints = {k: int(state[k]) for k in ("epoch", "round", "read", "world_size", "grad_accum", "given")}
            ids = np.asarray(state["ids"], dtype=np.int64)
            lengths = np.asarray(state["lengths"], dtype=np.int64)
            steps = int(state.get("steps", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"malformed window state ({str(exc)[:80]})") from None
        if ids.shape != lengths.shape or ids.ndim != 1 or (ids >= ints["read"]).any() or (ids < 0).any():
            raise StateError("malformed window state: ids and lengths must be one per buffered sample, read")
        return cls(ints["epoch"], ints["round"], ints["read"], ints["world_size"], ints["grad_accum"], ids,
                   lengths, ints["given"], steps)  # fmt: skip


@dataclass(frozen=True)
class Step:
    """One step of a streamed plan: its index in the epoch and its micro-batches (stream positions),
    ``world_size * grad_accum`` of them, rank after rank (see :class:`~padfree.core.plan.Plan`)."""

    index: int
    micro: list[np.ndarray]
    lengths: list[np.ndarray]
    state_after: WindowState


@dataclass(frozen=True)
class _Round:
    """A round planned: the refilled window (``ids``, ``lens``, ``read`` positions read after the refill),
    the steps it gives out (``order``: window positions micro-batch after micro-batch, rank after rank,
    cut at ``offsets``; ``lengths``: their tokens), how many, and the window positions it carries."""

    ids: np.ndarray
    lens: np.ndarray
    read: int
    exhausted: bool
    order: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    n_steps: int
    rest: np.ndarray


def _round(state: WindowState, config: PlanConfig, stream: LengthStream, window: int) -> _Round | None:
    """The round that starts at ``state``: its window refilled from ``stream`` and planned at the state's
    shape (``None``: nothing left to plan)."""
    want = max(window - state.ids.shape[0], 0)
    new = stream.read(state.read, want) if want else np.zeros(0, np.int64)
    if new.shape[0] and (new < 1).any():
        i = int(np.argmax(new < 1))
        raise ConfigError(f"source {stream.name!r}: sample {state.read + i}: length must be >= 1")
    ids = np.concatenate((state.ids, np.arange(state.read, state.read + new.shape[0], dtype=np.int64)))
    lens = np.concatenate((state.lengths, new.astype(np.int64)))
    exhausted = new.shape[0] < want  # a full window read nothing: the next round finds out
    if ids.shape[0] == 0:
        if state.read == 0:
            raise ConfigError(f"source {stream.name!r}: empty (a source needs at least one sample)")
        return None
    cfg = config.with_(world_size=state.world_size, grad_accum=state.grad_accum)
    budget = Budget.of(cfg)
    over = lens > budget.item
    if over.any():
        check_overlong(int(over.sum()), lens.shape[0], int(ids[np.argmax(over)]), int(lens.max()),
                       budget.item, cfg.overlong, stream.name)  # fmt: skip
        if cfg.overlong != "truncate":
            raise ConfigError(f"streamed plans take overlong 'error' or 'truncate' (got {cfg.overlong!r})")
        lens = np.minimum(lens, budget.item)
    items = Items(lens, np.arange(ids.shape[0], dtype=np.int64), None, ids.shape[0])
    words = [cfg.seed, state.epoch, REGISTRY[cfg.strategy].stream_id, _TAG, state.round]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))
    try:
        plan = plan_items(items, cfg, state.epoch, rng=rng, assign=False)
    except ConfigError:  # too few samples for a step: one each, the rest of the step empty
        plan = one_per_micro(items, cfg, state.epoch)
    order, offsets, lengths, n_steps, rest = _emit(plan, exhausted)
    read = state.read + new.shape[0]
    return _Round(ids, lens, read, exhausted, order, offsets, lengths, n_steps, rest)


def _emit(plan: Plan, exhausted: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray]:
    """The steps a round gives out and the window positions it carries: every step once the stream is
    exhausted, else ``ceil(steps * EMIT_SHARE)`` of them, made of the round's fullest packed rows (its
    partly filled rows' samples go back to the window and are packed again with the refill), each step's
    micro-batches then given to ranks."""
    cfg = plan.config
    k = cfg.micro_per_step
    n_micro = plan.n_steps * k
    emit = _emitted(plan, exhausted)
    sizes = np.diff(plan.offsets[: n_micro + 1])
    if cfg.packed and emit < plan.n_steps:
        row = np.repeat(np.arange(n_micro, dtype=np.int64), sizes)
        fill = np.bincount(row, weights=plan.lengths[: row.shape[0]], minlength=n_micro)
        chosen = np.sort(np.argsort(-fill, kind="stable")[: emit * k])
    else:
        chosen = np.arange(emit * k, dtype=np.int64)
    pos = np.arange(plan.indices.shape[0], dtype=np.int64)
    pos, offsets = kernels.gather_segments(pos, plan.offsets[: n_micro + 1], chosen)
    out = np.ones(plan.indices.shape[0], bool)
    out[pos] = False
    order, lengths = plan.indices[pos], plan.lengths[pos]
    if cfg.world_size > 1 and order.shape[0]:
        order, offsets, lengths = assign_steps(order, offsets, lengths, cfg)
    return order, offsets, lengths, emit, plan.indices[out]


def _emitted(plan: Plan, exhausted: bool) -> int:
    return plan.n_steps if exhausted else max(1, math.ceil(plan.n_steps * EMIT_SHARE))


def check_window(config: PlanConfig, window: int) -> None:
    """A window of ``window`` samples for a streamed plan at ``config``, or one line naming the rule."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"window must be an integer >= 1 samples (got {window!r})")
    if config.sources is not None:
        raise ConfigError(
            "a window plans one stream: weighted sources over streams are composed step by step "
            "(padfree.core.source_streams.mixed_steps, StreamBatchSampler with window=None)"
        )
    if config.spec.layout is not None:  # a strategy that lays out its own epoch needs the whole of it
        raise ConfigError(
            f"streamed plans take a packed, bucketed, sorted or random strategy (not {config.strategy})"
        )
    if window < 2 * config.micro_per_step:
        raise ConfigError(
            f"window {window} holds fewer than two steps' micro-batches ({2 * config.micro_per_step}): "
            "its steps would hold empty micro-batches; use a larger window (window_for_steps)"
        )


def window_steps(
    stream: LengthStream,
    config: PlanConfig,
    window: int,
    *,
    epoch: int = 0,
    state: WindowState | None = None,
) -> Iterator[Step]:
    """The steps of a streamed plan at ``config``'s shape, from ``state`` (default: the stream's start), each
    with the state after it. A state of another shape continues at this one (its round's given-out steps
    are taken out and a new round starts here)."""
    check_window(config, window)
    if state is None:
        state = WindowState(epoch, 0, 0, config.world_size, config.grad_accum,
                            np.zeros(0, np.int64), np.zeros(0, np.int64))  # fmt: skip
    shape = (config.world_size, config.grad_accum)
    if (state.world_size, state.grad_accum) != shape:
        state = _reshape(state, config, stream, window)
    k = config.micro_per_step
    while True:
        rnd = _round(state, config, stream, window)
        if rnd is None:
            return
        ids, offs = rnd.ids, rnd.offsets
        for s in range(state.given, rnd.n_steps):
            micro = [ids[rnd.order[offs[j] : offs[j + 1]]] for j in range(s * k, (s + 1) * k)]
            mlens = [rnd.lengths[offs[j] : offs[j + 1]] for j in range(s * k, (s + 1) * k)]
            after = WindowState(state.epoch, state.round, state.read, *shape, state.ids, state.lengths, s + 1,
                                state.steps)  # fmt: skip
            yield Step(state.steps + s, micro, mlens, after)
        if rnd.exhausted and rnd.rest.shape[0] == 0:
            return
        state = WindowState(state.epoch, state.round + 1, rnd.read, *shape, ids[rnd.rest], rnd.lens[rnd.rest],
                            0, state.steps + rnd.n_steps)  # fmt: skip


def _reshape(state: WindowState, config: PlanConfig, stream: LengthStream, window: int) -> WindowState:
    """A state of another shape, continued at ``config``'s: its round planned at its own shape, the steps it
    gave out taken out of the window, a new round from there."""
    rnd = _round(state, config, stream, window)
    if rnd is None:
        return WindowState(state.epoch, state.round + 1, state.read, config.world_size, config.grad_accum,
                           state.ids, state.lengths, 0, state.steps)  # fmt: skip
    if state.given > rnd.n_steps:
        raise StateError(f"malformed window state: {state.given} steps given out of a round of {rnd.n_steps}")
    keep = np.ones(rnd.ids.shape[0], bool)
    keep[rnd.order[: rnd.offsets[state.given * state.world_size * state.grad_accum]]] = False
    return WindowState(state.epoch, state.round + 1, rnd.read, config.world_size, config.grad_accum,
                       rnd.ids[keep], rnd.lens[keep], 0, state.steps + state.given)  # fmt: skip


def window_for_steps(steps: float, config: PlanConfig, mean_length: float) -> int:
    """A window of about ``steps`` steps' worth of samples of ``mean_length`` tokens at ``config``'s shape.

    >>> window_for_steps(4, PlanConfig(strategy="packed", budget=1024, world_size=2, grad_accum=2), 256.0)
    64
    """
    per_step = config.micro_per_step * config.budget / max(float(mean_length), 1.0)
    return max(config.micro_per_step, int(math.ceil(steps * per_step)))
