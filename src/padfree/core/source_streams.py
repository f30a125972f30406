"""Weighted sources over streams: every step composed by the deficit rule of :mod:`padfree.core.sources`
from each source's next samples in stream order, formed and balanced as any step; resumable exactly, at any
world size, from the sources' counters alone.

::

    stream "chat" (positions 0, 1, ...)  --+
    stream "code" (positions 0, 1, ...)  --+--deficit rule over the step (in the unit)--> k micro-batches
    stream "math" (positions 0, 1, ...)  --+         --ranks balanced--> the step

Each source is read in order (no shuffle: a stream is what it is; shuffle its shards upstream) into a
lookahead buffer of what the next step may draw (:class:`_Ahead`); nothing else is held, so the state that
continues the epoch is the :class:`~padfree.core.sources.Counters` (samples drawn, that is the stream
position, and units per source): O(sources). The epoch ends when a source's stream ends before a step could
be composed (its share can no longer be held; the other sources' rest is left for the next epoch's read), or
at ``epoch_steps`` / ``epoch_tokens``. A sample's id is ``position * n_sources + source``
(:func:`split_id`). In the loss unit a stream counts ``length - 1`` loss tokens per sample; "one document" is
the item budget (every sample's bound).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from padfree.core.budget import Budget
from padfree.core.config import PlanConfig
from padfree.core.lookahead import LengthStream
from padfree.core.sources import Counters, _rng, _Step, assign_steps, next_step
from padfree.errors import ConfigError, OverlongError, StateError

__all__ = ["MixedStep", "counters_from_state", "mixed_steps", "split_id"]


def split_id(ids: np.ndarray, n_sources: int) -> tuple[np.ndarray, np.ndarray]:
    """``(source, position)`` of each id of a mixture of streams.

    >>> [a.tolist() for a in split_id(np.array([0, 4, 5]), 3)]
    [[0, 1, 2], [0, 1, 1]]
    """
    ids = np.asarray(ids, dtype=np.int64)
    return ids % n_sources, ids // n_sources


@dataclass(frozen=True)
class _Mix:
    names: tuple[str, ...]
    weights: np.ndarray
    unit: str


class _Ahead:
    """One source's stream from a position on: the lengths read but not yet drawn."""

    def __init__(self, stream: LengthStream, name: str, item: int, overlong: str) -> None:
        self.stream, self.name, self.item, self.overlong = stream, name, item, overlong
        self.base, self.lens, self.end = 0, np.zeros(0, np.int64), False

    def get(self, pos: int, count: int) -> np.ndarray:
        if pos < self.base:
            raise StateError(f"source {self.name!r}: asked for position {pos} behind {self.base}")
        self.lens = self.lens[pos - self.base :] if pos - self.base < self.lens.shape[0] else self.lens[:0]
        self.base = pos
        short = count - self.lens.shape[0]
        if short > 0 and not self.end:
            at = self.base + self.lens.shape[0]
            new = np.asarray(self.stream.read(at, short), dtype=np.int64)
            self.end = new.shape[0] < short
            if at == 0 and new.shape[0] == 0:
                raise ConfigError(f"source {self.name!r}: empty (a source needs at least one sample)")
            if (new < 1).any():
                raise ConfigError(
                    f"source {self.name!r}: sample {at + int(np.argmax(new < 1))}: length must be >= 1"
                )
            if self.overlong == "error" and (new > self.item).any():
                i = int(np.argmax(new > self.item))
                raise OverlongError(
                    f"source {self.name!r}: sample {at + i} has {int(new[i])} tokens, over the budget of "
                    f"{self.item}; raise the budget or choose overlong='truncate'"
                )
            self.lens = np.concatenate((self.lens, new))
        return self.lens[:count]


class _StreamStep(_Step):
    """A step composed from streams: each source's buffer is its stream's next samples."""

    def __init__(self, aheads: list[_Ahead], mix: _Mix, config: PlanConfig, item: int, budget: int) -> None:
        self.data, self.config, self.item, self.budget = mix, config, item, budget  # type: ignore[assignment]
        self.aheads = aheads
        self.want = np.full(len(mix.names), 64, np.int64)
        self.one = float(item)

    def buffers(self, drawn: tuple[int, ...]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        k = len(self.aheads)
        raw = [a.get(int(drawn[s]), int(self.want[s])) for s, a in enumerate(self.aheads)]
        ids = [(int(drawn[s]) + np.arange(r.shape[0], dtype=np.int64)) * k + s for s, r in enumerate(raw)]
        full = np.concatenate(raw)
        lens = np.minimum(full, self.item)
        if self.data.unit == "documents":
            vals = np.ones(lens.shape[0])
        elif self.data.unit == "tokens":
            vals = lens.astype(np.float64)
        else:
            vals = np.minimum(full - 1, lens).astype(np.float64)
        off = np.concatenate(([0], np.cumsum([r.shape[0] for r in raw])))
        return ids, lens, vals, off

    def ended(self, s: int) -> bool:
        return self.aheads[s].end


@dataclass(frozen=True)
class MixedStep:
    """One step of a mixture of streams: its index in the epoch, its micro-batches (ids, see
    :func:`split_id`) rank after rank, their tokens, and the counters after it."""

    index: int
    micro: list[np.ndarray]
    lengths: list[np.ndarray]
    state_after: Counters


def mixed_steps(
    streams: Mapping[str, LengthStream],
    config: PlanConfig,
    *,
    epoch: int = 0,
    start: Counters | None = None,
) -> Iterator[MixedStep]:
    """The steps of an epoch of weighted sources over streams at ``config``'s shape, from ``start`` (the
    counters after some steps, at any shape; default: the epoch's start)."""
    if config.sources is None:
        raise ConfigError("a mixture of streams needs sources in the config (sources=((name, weight), ...))")
    names = tuple(n for n, _ in config.sources)
    for name in sorted(set(map(str, streams)) ^ set(names)):
        what = "a stream given but not in the config's sources" if name in streams else "no stream given"
        raise ConfigError(f"source {name!r}: {what}")
    total = np.array([float(w) for _, w in config.sources])
    mix = _Mix(names, total / total.sum(), config.unit)
    bud = Budget.of(config)
    aheads = [_Ahead(streams[n], n, bud.item, config.overlong) for n in names]
    step = _StreamStep(aheads, mix, config, bud.item, bud.plan)
    cur = Counters.zero(len(names)) if start is None else start
    if len(cur.drawn) != len(names):
        raise StateError(f"source counters for {len(cur.drawn)} sources, the config has {len(names)}")
    at = config if bud.plan == config.budget else config.with_(budget=bud.plan)
    k = config.micro_per_step
    while (config.epoch_steps is None or cur.steps < config.epoch_steps) and (
        config.epoch_tokens is None or cur.tokens < config.epoch_tokens
    ):
        nxt = next_step(step, cur, k * bud.plan, _rng(config, epoch, cur.steps))
        if nxt is None:
            return
        ids, lens, offsets, after = nxt
        if config.world_size > 1:
            ids, offsets, lens = assign_steps(ids, offsets, lens, at)
        micro = [ids[offsets[j] : offsets[j + 1]] for j in range(k)]
        yield MixedStep(cur.steps, micro, [lens[offsets[j] : offsets[j + 1]] for j in range(k)], after)
        cur = after


def counters_from_state(state: object, n_sources: int) -> Counters:
    """:class:`Counters` from :meth:`Counters.to_state`, or one :class:`StateError` line."""
    try:
        assert isinstance(state, dict)
        c = Counters(tuple(int(x) for x in state["drawn"]), tuple(float(x) for x in state["got"]),
                     float(state["units"]), int(state["tokens"]), int(state["steps"]))  # fmt: skip
    except (AssertionError, KeyError, TypeError, ValueError):
        raise StateError("malformed source counters (drawn, got, units, tokens, steps)") from None
    if len(c.drawn) != n_sources or len(c.got) != n_sources or min(c.drawn) < 0:
        raise StateError(f"source counters for {len(c.drawn)} sources, the config has {n_sources}")
    return c
