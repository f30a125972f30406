"""A batch sampler over a stream: samples read in order into a bounded window whose lengths are learned as
read, planned by :func:`padfree.core.lookahead.window_steps`, this rank's micro-batches yielded with their
items; resumable exactly at any world size from O(window) state.

Every rank reads the whole stream (each needs every length to plan the same steps) and keeps the window's
items until their step is out; a micro-batch carries its items to the collator (through ``DataLoader``
workers too)::

    sampler = StreamBatchSampler(HFStreamSamples(load_dataset(..., streaming=True)["train"]), config, 4096)
    loader = DataLoader(StreamDataset(), batch_sampler=sampler, collate_fn=PackCollator())

``PadfreeTrainer(..., stream=Stream(source, window))`` and :func:`padfree.torch.run.loop.train_loop` take it
as they take a :class:`~padfree.torch.PlanBatchSampler`. Epoch ``e`` reads the stream again from its start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from padfree.core.config import PlanConfig
from padfree.core.cursor import MicroBatch, MicroInfo
from padfree.core.fingerprint import explain, fingerprint_and_identity
from padfree.core.lookahead import WindowState, check_window, window_steps
from padfree.core.source_streams import counters_from_state, mixed_steps
from padfree.core.sources import Counters
from padfree.data.sample_streams import SampleSource
from padfree.errors import ConfigError, StateError
from padfree.torch.execution.distributed import data_parallel
from padfree.torch.feed import dataset as _dataset
from padfree.torch.feed.dataset import Fetched

__all__ = ["Stream", "StreamBatch", "StreamBatchSampler", "StreamDataset"]

FORMAT = "padfree.stream/1"


@dataclass(frozen=True)
class Stream:
    """What a trainer streams: a source (:mod:`padfree.data.sample_streams`; with weighted sources a mapping
    name -> source), a window of samples (``None`` for a mixture), and how many tokens a sample has (default:
    ``len(item["input_ids"])``)."""

    source: SampleSource | Mapping[str, SampleSource]
    window: int | None = None
    length_of: Callable[[Any], int] | None = None


class StreamBatch(MicroBatch):
    """A micro-batch of stream positions with its items (kept when sent to ``DataLoader`` workers)."""

    def __init__(self, ids: list[int], info: MicroInfo, items: list) -> None:
        super().__init__(ids, info)
        self.items = items

    def __reduce__(self):
        return (StreamBatch, (list(self), self.info, self.items))


class StreamDataset:
    """The dataset of a :class:`StreamBatchSampler`'s loader: a micro-batch brings its own items."""

    def __getitem__(self, index: int):
        raise ConfigError("a streamed plan's samples come with their micro-batch: use StreamBatchSampler")

    def __getitems__(self, batch: StreamBatch) -> Fetched:
        return Fetched(list(batch.items), batch.info)


def item_length(item: Any) -> int:
    """Tokens of a sample: its ``input_ids``."""
    ids = item["input_ids"] if isinstance(item, dict) else item
    return len(ids)


def loss_tokens(item: Any, piece: int) -> int:
    """Loss-bearing tokens of a sample's first ``piece`` tokens after its first (what the collators count):
    ``labels != -100``, else ``loss_mask``, else every token."""
    if isinstance(item, dict) and item.get("labels") is not None:
        return int((np.asarray(item["labels"]).reshape(-1)[1:piece] != -100).sum())
    if isinstance(item, dict) and item.get("loss_mask") is not None:
        return int(np.asarray(item["loss_mask"]).reshape(-1)[1:piece].astype(bool).sum())
    return max(piece - 1, 0)


class _Window:
    """The stream as the planner reads it (``read`` -> lengths), holding each read sample's item until its
    step is out."""

    def __init__(
        self, source: SampleSource, length_of: Callable[[Any], int], items: dict, of: int = 0, n: int = 1
    ) -> None:
        self.source, self.length_of, self.name = source, length_of, source.name
        self.items, self.of, self.n = items, of, n  # items by id: position * n + of (a mixture's n sources)

    def read(self, start: int, count: int) -> np.ndarray:
        got = self.source.read(start, count)
        for j, item in enumerate(got):
            self.items[(start + j) * self.n + self.of] = item
        return np.array([self.length_of(x) for x in got], dtype=np.int64)

    def refetch(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Read a resumed window's samples again (in order, positions ascending), checking their lengths."""
        order = np.argsort(ids, kind="stable")
        for i, want in zip(ids[order].tolist(), lengths[order].tolist(), strict=True):
            got = self.source.read(i, 1)
            n = self.length_of(got[0]) if got else -1
            if n != want:
                raise StateError(
                    f"source {self.name!r}: sample {i} has {n} tokens, the saved state says {want}: the "
                    "stream changed since the checkpoint (resume over the same data)"
                )
            self.items[i] = got[0]


class StreamBatchSampler:
    """Yields this rank's micro-batches of a streamed plan (see the module), ``grad_accum`` per step.

    Args:
        source: the samples (:mod:`padfree.data.sample_streams`); with weighted sources
            (``config.sources``) a mapping of each source's name to its stream, every step then composed by
            the deficit rule (:mod:`padfree.core.source_streams`; ids ``position * n_sources + source``,
            ``MicroInfo.sources`` says each sample's source).
        config: the plan config (not chunked); its world size is the real one.
        window: samples the planner holds (:func:`padfree.core.lookahead.window_for_steps`); ``None`` with
            weighted sources (a mixture is composed step by step from each stream's next samples).
        length_of: tokens of a sample (default ``len(item["input_ids"])``).
        rank, world_size: default to ``torch.distributed`` when initialized, else 0 and the config's.
        epoch: the first epoch.
    """

    def __init__(
        self,
        source: SampleSource | Mapping[str, SampleSource],
        config: PlanConfig,
        window: int | None,
        *,
        length_of: Callable[[Any], int] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int = 0,
    ) -> None:
        rank, world_size = data_parallel(rank, world_size, default_world=config.world_size)
        self.config = config.with_(world_size=world_size)
        self.names = tuple(n for n, _ in config.sources or ())
        self._items: dict[int, Any] = {}
        length_of = length_of or item_length
        if self.names:
            if window is not None:
                raise ConfigError("a mixture of streams is composed step by step: give window=None")
            if not isinstance(source, Mapping) or set(map(str, source)) != set(self.names):
                raise ConfigError(
                    f"weighted sources stream from a mapping of each source's name ({', '.join(self.names)}) "
                    "to its samples"
                )
            n = len(self.names)
            self._wins = [_Window(source[m], length_of, self._items, s, n) for s, m in enumerate(self.names)]
        else:
            if isinstance(source, Mapping):
                raise ConfigError("several streams are weighted sources: give config.sources their weights")
            assert window is not None
            check_window(self.config, window)
            self._wins = [_Window(source, length_of, self._items)]
        self.rank, self.world_size, self.grad_accum, self.window = rank, world_size, config.grad_accum, window
        self.balance = "static"
        self._epoch, self._micro, self._spent, self._resumed = int(epoch), 0, False, False
        self._state: WindowState | Counters | None = None
        _, ident = fingerprint_and_identity(np.zeros(0, np.int64), self.config)
        ident = {k: v for k, v in ident.items() if k not in ("samples", "lengths")}
        mix = (
            {"sources": [[m, float(w)] for m, w in config.sources or ()], "unit": config.unit}
            if self.names
            else {}
        )
        streams = [w.name for w in self._wins]
        self.identity = {**ident, **mix, "window": window, "stream": streams if self.names else streams[0]}
        self.fingerprint = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        _dataset.note_sampler()

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step(self) -> int:
        """Steps of the current epoch given out (whole steps)."""
        s = self._state
        return 0 if s is None else s.steps + s.given if isinstance(s, WindowState) else s.steps

    @property
    def steps_in_epoch(self) -> None:
        """Not known before the stream is read to its end."""
        return None

    def _restart(self) -> None:
        self._items.clear()
        for w in self._wins:
            w.source.restart(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from the stream's start; the current epoch (e.g. just restored) keeps its place."""
        if int(epoch) != self._epoch:
            self._epoch, self._state, self._micro, self._spent = int(epoch), None, 0, False
            self._restart()

    def _steps(self) -> Iterator:
        if self.names:
            streams = dict(zip(self.names, self._wins, strict=True))
            start = self._state if isinstance(self._state, Counters) else None
            return mixed_steps(streams, self.config, epoch=self._epoch, start=start)
        state = self._state if isinstance(self._state, WindowState) else None
        assert self.window is not None
        return window_steps(self._wins[0], self.config, self.window, epoch=self._epoch, state=state)

    def __iter__(self) -> Iterator[StreamBatch]:
        if self._spent:
            raise StateError(
                f"StreamBatchSampler: epoch {self._epoch} was already iterated to its end; call "
                f"sampler.set_epoch({self._epoch + 1}) before the next pass"
            )
        if self._state is None and not self._resumed:
            self._restart()
        self._resumed = False
        g, items, n = self.grad_accum, self._items, max(len(self.names), 1)
        for st in self._steps():
            pieces = [(int(i), int(m)) for mb, ln in zip(st.micro, st.lengths, strict=True)
                      for i, m in zip(mb.tolist(), ln.tolist(), strict=True)]  # fmt: skip
            step_tokens = sum(loss_tokens(items[i], m) for i, m in pieces)
            mine = list(range(self.rank * g, (self.rank + 1) * g))
            taken = {j: [items[int(i)] for i in st.micro[j]] for j in mine}
            for i, _ in pieces:
                items.pop(i, None)
            for m in range(self._micro, g):
                ids = st.micro[mine[m]].tolist()
                sources = tuple(i % n for i in ids) if self.names else None
                lens = tuple(st.lengths[mine[m]].tolist())
                last = m == g - 1
                info = MicroInfo(self._epoch, st.index, m, last, self.rank, self.world_size, g, step_tokens,
                                 None, lens, tuple(ids), None, sources)  # fmt: skip
                self._micro = 0 if last else m + 1
                if last:
                    self._state = st.state_after
                    self._source_states()  # each source forgets the snapshots no resume can need
                yield StreamBatch(ids, info, taken[mine[m]])
        self._spent = True

    def state_dict(self) -> dict:
        """The plan's state at the current step (a window: O(window); a mixture: the sources' counters),
        the micro-batches of that step given out, and what each source needs to read on (JSON-able)."""
        s = self._state
        if isinstance(s, Counters):
            where: dict[str, dict | None] = {"counters": s.to_state()}
        else:
            where = {"window": None if s is None else s.to_state()}
        return {
            "format": FORMAT,
            "epoch": self._epoch,
            **where,
            "micro": self._micro,
            "shape": [self.world_size, self.grad_accum],
            "spent": self._spent,
            "source": self._source_states(),
            "fingerprint": self.fingerprint,
            "identity": self.identity,
        }

    def _source_states(self) -> dict:
        """What each source needs to read on from the current state (its oldest position still needed)."""
        s = self._state
        if isinstance(s, Counters):
            return {
                m: w.source.resume_state(s.drawn[j]) for j, (m, w) in enumerate(zip(self.names, self._wins))
            }
        oldest = 0 if s is None else int(min([s.read, *s.ids.tolist()]))
        return {w.name: w.source.resume_state(oldest) for w in self._wins}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the next micro-batch of ``state`` (another world size: at a step boundary), reading
        on from each source (one that cannot seek is refused in one line)."""
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise StateError(f"not a streamed sampler state (expected format {FORMAT!r})")
        why = explain(state.get("identity"), self.identity, sampler=True)
        if why or state.get("fingerprint") != self.fingerprint:
            raise StateError(
                f"the streamed sampler state belongs to another configuration ({why or 'fingerprint'})"
            )
        at: WindowState | Counters | None = None
        if self.names and state.get("counters") is not None:
            at = counters_from_state(state["counters"], len(self.names))
        elif not self.names and state.get("window") is not None:
            at = WindowState.from_state(state["window"])
        micro = int(state.get("micro", 0))
        if micro and state.get("shape") != [self.world_size, self.grad_accum]:
            raise StateError("a streamed state saved inside a step resumes at the same world size only")
        saved = state.get("source")
        if not isinstance(saved, dict):
            raise StateError("malformed streamed sampler state: no source states")
        self._epoch, self._state, self._micro = int(state["epoch"]), at, micro
        self._spent, self._resumed = bool(state.get("spent", False)), True
        self._items.clear()
        for j, w in enumerate(self._wins):
            w.source.load_resume_state(saved.get(self.names[j] if self.names else w.name, {}))
        if isinstance(at, WindowState):
            self._wins[0].refetch(at.ids, at.lengths)
        elif at is None:
            self._restart()

    def balance_stats(self) -> dict:
        """Static balance by the configured cost model (``PlanBatchSampler.balance_stats``'s keys)."""
        return {"mode": "static", "fitted": False, "speeds": (1.0,) * self.world_size,
                "plan_budget": self.config.budget, "sampler_seconds": 0.0,
                "sampler_first_step_seconds": 0.0, "exchanges": 0}  # fmt: skip

    def timed(self, model: Any = None, info: Any = None):
        """No timing: a streamed plan is balanced statically."""
        return contextlib.nullcontext()
