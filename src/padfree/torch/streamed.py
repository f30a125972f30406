"""A batch sampler over a stream: samples read in order into a bounded window whose lengths are learned as
read, planned by :func:`padfree.core.lookahead.window_steps`, this rank's micro-batches yielded with their
items; resumable exactly at any world size from O(window) state.

Every rank reads the whole stream (each needs every length to plan the same steps) and keeps the window's
items until their step is out; a micro-batch carries its items to the collator (through ``DataLoader``
workers too)::

    sampler = StreamBatchSampler(HFStreamSamples(load_dataset(..., streaming=True)["train"]), config, 4096)
    loader = DataLoader(StreamDataset(), batch_sampler=sampler, collate_fn=PackCollator())

``PadfreeTrainer(..., stream=Stream(source, window))`` and :func:`padfree.torch.loop.train_loop` take it as
they take a :class:`~padfree.torch.PlanBatchSampler`. Epoch ``e`` reads the stream again from its start.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from padfree.core.config import PlanConfig
from padfree.core.cursor import MicroBatch, MicroInfo
from padfree.core.fingerprint import explain, fingerprint_and_identity
from padfree.core.lookahead import WindowState, check_window, window_steps
from padfree.data.sample_streams import SampleSource
from padfree.errors import ConfigError, StateError
from padfree.torch import _dataset
from padfree.torch._dataset import Fetched
from padfree.torch._distributed import data_parallel

__all__ = ["Stream", "StreamBatch", "StreamBatchSampler", "StreamDataset"]

FORMAT = "padfree.stream/1"


@dataclass(frozen=True)
class Stream:
    """What a trainer streams: a source (:mod:`padfree.data.sample_streams`), a window of samples, and how
    many tokens a sample has (default: ``len(item["input_ids"])``)."""

    source: SampleSource
    window: int
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

    def __init__(self, source: SampleSource, length_of: Callable[[Any], int]) -> None:
        self.source, self.length_of, self.name = source, length_of, source.name
        self.items: dict[int, Any] = {}

    def read(self, start: int, count: int) -> np.ndarray:
        got = self.source.read(start, count)
        for j, item in enumerate(got):
            self.items[start + j] = item
        return np.array([self.length_of(x) for x in got], dtype=np.int64)

    def refetch(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Read a resumed window's samples again (in order, positions ascending), checking their lengths."""
        self.items.clear()
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
        source: the samples (:mod:`padfree.data.sample_streams`).
        config: the plan config (one stream: no ``sources``; not chunked); its world size is the real one.
        window: samples the planner holds (:func:`padfree.core.lookahead.window_for_steps`).
        length_of: tokens of a sample (default ``len(item["input_ids"])``).
        rank, world_size: default to ``torch.distributed`` when initialized, else 0 and the config's.
        epoch: the first epoch.
    """

    def __init__(
        self,
        source: SampleSource,
        config: PlanConfig,
        window: int,
        *,
        length_of: Callable[[Any], int] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int = 0,
    ) -> None:
        rank, world_size = data_parallel(rank, world_size, default_world=config.world_size)
        self.config = config.with_(world_size=world_size)
        check_window(self.config, window)
        self.rank, self.world_size, self.grad_accum, self.window = rank, world_size, config.grad_accum, window
        self.balance = "static"
        self._win = _Window(source, length_of or item_length)
        self._epoch, self._state, self._micro, self._spent = int(epoch), None, 0, False
        self._resumed = False
        _, ident = fingerprint_and_identity(np.zeros(0, np.int64), self.config)
        ident = {k: v for k, v in ident.items() if k not in ("samples", "lengths")}
        self.identity = {**ident, "window": window, "stream": source.name}
        self.fingerprint = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        _dataset.note_sampler()

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step(self) -> int:
        """Steps of the current epoch given out (whole steps)."""
        s = self._state
        return 0 if s is None else s.steps + s.given

    @property
    def steps_in_epoch(self) -> None:
        """Not known before the stream is read to its end."""
        return None

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from the stream's start; the current epoch (e.g. just restored) keeps its place."""
        if int(epoch) != self._epoch:
            self._epoch, self._state, self._micro, self._spent = int(epoch), None, 0, False
            self._win.items.clear()
            self._win.source.restart(int(epoch))

    def __iter__(self) -> Iterator[StreamBatch]:
        if self._spent:
            raise StateError(
                f"StreamBatchSampler: epoch {self._epoch} was already iterated to its end; call "
                f"sampler.set_epoch({self._epoch + 1}) before the next pass"
            )
        if self._state is None and not self._resumed:
            self._win.items.clear()
            self._win.source.restart(self._epoch)
        self._resumed = False
        g, items = self.grad_accum, self._win.items
        for st in window_steps(self._win, self.config, self.window, epoch=self._epoch, state=self._state):
            pieces = [(int(i), int(n)) for mb, ln in zip(st.micro, st.lengths, strict=True)
                      for i, n in zip(mb.tolist(), ln.tolist(), strict=True)]  # fmt: skip
            step_tokens = sum(loss_tokens(items[i], n) for i, n in pieces)
            mine = list(range(self.rank * g, (self.rank + 1) * g))
            taken = {j: [items[int(i)] for i in st.micro[j]] for j in mine}
            for i, _ in pieces:
                items.pop(i, None)
            for m in range(self._micro, g):
                j = mine[m]
                ids = st.micro[j].tolist()
                info = MicroInfo(self._epoch, st.index, m, m == g - 1, self.rank, self.world_size, g,
                                 step_tokens, None, tuple(st.lengths[j].tolist()), tuple(ids))  # fmt: skip
                self._micro = 0 if m == g - 1 else m + 1
                if m == g - 1:
                    self._state = st.state_after
                yield StreamBatch(ids, info, taken[j])
        self._spent = True

    def state_dict(self) -> dict:
        """The window's state at the current step (O(window)), the micro-batches of that step given out, and
        what the source needs to read the window's samples again (JSON-able)."""
        s = self._state
        oldest = 0 if s is None else int(min([s.read, *s.ids.tolist()]))
        return {
            "format": FORMAT,
            "epoch": self._epoch,
            "window": None if s is None else s.to_state(),
            "micro": self._micro,
            "spent": self._spent,
            "source": self._win.source.resume_state(oldest),
            "fingerprint": self.fingerprint,
            "identity": self.identity,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at the next micro-batch of ``state`` (another world size: at a step boundary), reading
        the window's samples again from the source (one that cannot seek is refused in one line)."""
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise StateError(f"not a streamed sampler state (expected format {FORMAT!r})")
        why = explain(state.get("identity"), self.identity, sampler=True)
        if why or state.get("fingerprint") != self.fingerprint:
            raise StateError(
                f"the streamed sampler state belongs to another configuration ({why or 'fingerprint'})"
            )
        win = None if state.get("window") is None else WindowState.from_state(state["window"])
        micro = int(state.get("micro", 0))
        if (
            micro
            and win is not None
            and (win.world_size, win.grad_accum) != (self.world_size, self.grad_accum)
        ):
            raise StateError("a streamed state saved inside a step resumes at the same world size only")
        self._epoch, self._state, self._micro = int(state["epoch"]), win, micro
        self._spent, self._resumed = bool(state.get("spent", False)), True
        self._win.source.load_resume_state(state["source"])
        if win is not None:
            self._win.refetch(win.ids, win.lengths)
        else:
            self._win.items.clear()
            self._win.source.restart(self._epoch)

    def balance_stats(self) -> dict:
        """Static balance by the configured cost model (``PlanBatchSampler.balance_stats``'s keys)."""
        return {"mode": "static", "fitted": False, "speeds": (1.0,) * self.world_size,
                "plan_budget": self.config.budget, "sampler_seconds": 0.0,
                "sampler_first_step_seconds": 0.0, "exchanges": 0}  # fmt: skip

    def timed(self, model: Any = None, info: Any = None):
        """No timing: a streamed plan is balanced statically."""
        import contextlib

        return contextlib.nullcontext()
