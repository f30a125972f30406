"""What both trainer adapters share: a planned batch of indices that carries its epoch through a DataLoader,
each rank's micro-batches of an epoch resumable at another world size (:class:`ElasticEpochs`), per-document
anchors laid out in a row, the drafter cost model a plan balances ranks with, the recipe a trainer's method
trains, this rank's place, and the forward hooks an ``install`` puts on their model."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from padfree.core.anchors import AnchorPolicy, choose_anchors
from padfree.core.balance import Balance
from padfree.core.config import PlanConfig
from padfree.core.cursor import Cursor, EpochSource
from padfree.core.fingerprint import explain
from padfree.core.position import Position
from padfree.core.replay import Segment
from padfree.drafter import methods, recipes
from padfree.drafter.recipes import Recipe
from padfree.errors import ConfigError, StateError


@dataclass(frozen=True)
class BatchInfo:
    """Where a planned micro-batch comes from: its epoch, its step (this rank's micro-batch number in the
    epoch), its sample ids (``indices``) and the token counts the plan was made from (``lengths``, one per
    sample; ``None``: not known), which :class:`padfree.torch.PlannedDataset` hands to the collate function
    beside the items."""

    epoch: int
    step: int
    indices: np.ndarray
    lengths: np.ndarray | None = None


class PlannedBatch(list):
    """A micro-batch's sample ids (a list, as a batch sampler yields) that also carries its :class:`BatchInfo`
    through DataLoader workers (pickled with it)."""

    def __init__(self, ids: Sequence[int] | np.ndarray, info: BatchInfo) -> None:
        super().__init__(int(i) for i in ids)
        self.info = info

    def __reduce__(self):
        return (PlannedBatch, (list(self), self.info))


def doc_anchors(
    mask: np.ndarray,
    starts: Sequence[int] | np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    sample_ids: Sequence[int] | np.ndarray,
    *,
    policy: AnchorPolicy,
    seed: int,
    epoch: int,
) -> np.ndarray:
    """The anchors of every document of a flat row (positions in the row), each chosen from the document's own
    loss mask and (seed, epoch, sample id): what the document gets alone."""
    out = [
        choose_anchors(mask[s : s + n], policy, seed=seed, epoch=epoch, sample_id=int(sid)) + s
        for s, n, sid in zip(starts, lengths, sample_ids, strict=True)
    ]
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)


def check_rank(rank: int, world_size: int) -> None:
    for name, v, low in (("world size", world_size, 1), ("rank", rank, 0)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < low:
            raise ConfigError(f"{name} must be an integer >= {low} (got {v!r})")
    if rank >= world_size:
        raise ConfigError(f"rank {rank} outside world size {world_size}")


def this_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: the given ones, else torch.distributed's (:mod:`padfree.torch`), else ``(0,
    1)``; checked."""
    from padfree.torch.execution.distributed import rank_and_world

    rank, world_size = rank_and_world(rank, world_size)
    check_rank(rank, world_size)
    return rank, world_size


def recipe_for(trainer: str, method: str, recipe: Recipe | None = None) -> Recipe:
    """``recipe``, or ``trainer``'s preset for ``method`` (:func:`padfree.drafter.recipes.get`), checked to
    train ``method``: one line otherwise."""
    methods.get(method)  # a registered method, else one line
    r = recipe or recipes.get(trainer, method)
    if r.method != method:
        raise ConfigError(f"recipe {r.name} is for {r.method}, not {method}")
    return r


class Installed:
    """The hooks an adapter's ``install`` put on a model; :meth:`remove` takes them off (once) and then undoes
    whatever else the install changed (``undo``)."""

    def __init__(self, handles: list, undo: Callable[[], None] | None = None) -> None:
        self._handles, self._undo = handles, undo

    def remove(self) -> None:
        if not self._handles:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._undo is not None:
            self._undo()


def forward_hooks(model: Any, before: Callable, local: threading.local, name: str) -> list:
    """``before(module, args, kwargs)`` as ``model``'s forward pre-hook (it sees and may replace the keywords)
    and a forward hook that always runs after the forward, even a failed one, and clears ``local.<name>``
    (what ``before`` set for this forward). Their handles, for :class:`Installed`."""

    def after(*_args: Any) -> None:
        setattr(local, name, None)

    return [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, always_call=True),
    ]


RECORD = "padfree-resume.json"
"""The file :class:`ElasticEpochs` keeps in its ``record_dir``: each epoch's shapes (where each run began)."""
_RECORD_FORMAT = "padfree.adapter-resume/1"


class ElasticEpochs:
    """This rank's micro-batches of each epoch, through :class:`padfree.core.cursor.Cursor` (what
    :class:`padfree.torch.PlanBatchSampler` hands out), resumable at another world size or grad_accum.

    Their trainers save only how many micro-batches each rank had run in the epoch (speculators'
    ``local_step``, SpecForge's ``epoch_batch``), which means other samples at another world size. So rank 0
    records in ``record_dir`` (:data:`RECORD`) where in each epoch each run began and at which shape; a resume
    at ``skip`` micro-batches rebuilds the epoch's history from it (segments of ``(world_size, grad_accum,
    steps)``) and continues exactly as ``PlanBatchSampler.load_state_dict`` does: at the same shape the same
    plan from ``skip`` on, at another the rest of the epoch re-planned over the new ranks. Without
    ``record_dir``, or without a record of the epoch, a resume mid-epoch is refused in one line (it cannot be
    made exact).

    ``who``: the adapter's class, named in messages; ``hint``: how to give ``record_dir``.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        config: PlanConfig,
        rank: int,
        *,
        anchors: np.ndarray | None = None,
        record_dir: str | os.PathLike | None = None,
        who: str,
        hint: str,
    ) -> None:
        check_rank(rank, config.world_size)
        self.config, self.rank, self.who, self.hint = config, int(rank), who, hint
        self.cursor = Cursor(EpochSource.of(lengths, config, anchors=anchors), config, self.rank)
        self.fingerprint, self.identity = self.cursor.fingerprint, self.cursor.identity
        self.record_dir = None if record_dir is None else Path(record_dir)
        self.resumed_from: list[Segment] | None = None  # the history of the last resume (tests, logs)

    @property
    def path(self) -> Path | None:
        return None if self.record_dir is None else self.record_dir / RECORD

    # ----- the record --------------------------------------------------------------------------------------
    def _read(self) -> dict[str, Any]:
        path = self.path
        if path is None or not path.is_file():
            return {}
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise StateError(
                f"{path}: unreadable resume record ({err}); move it away to start afresh"
            ) from None
        if (
            not isinstance(raw, dict)
            or raw.get("format") != _RECORD_FORMAT
            or not isinstance(raw.get("epochs"), dict)
        ):
            raise StateError(f"{path}: not a padfree resume record (format {_RECORD_FORMAT})")
        return raw

    def _entries(self, raw: dict[str, Any], epoch: int) -> list[tuple[int, int, int]]:
        entries = raw.get("epochs", {}).get(str(epoch))
        try:
            out = [(int(a), int(w), int(g)) for a, w, g in entries or []]
        except (TypeError, ValueError):
            raise StateError(f"{self.path}: damaged resume record of epoch {epoch}") from None
        return out

    def commit(self, epoch: int, skip: int) -> None:
        """Record (rank 0) that this run iterates ``epoch`` from ``skip`` micro-batches at its shape: the
        epoch's earlier entries that began before ``skip`` stay (they ran the part this run skips)."""
        path = self.path
        if path is None or self.rank != 0:
            return
        raw = self._read() if skip > 0 else {}
        if raw.get("fingerprint") != self.fingerprint:
            raw = {}
        kept = [e for e in self._entries(raw, epoch) if e[0] < skip] if skip > 0 else []
        kept.append((int(skip), self.config.world_size, self.config.grad_accum))
        epochs = {k: v for k, v in raw.get("epochs", {}).items() if k != str(epoch)}
        epochs[str(epoch)] = [list(e) for e in kept]
        out = {"format": _RECORD_FORMAT, "fingerprint": self.fingerprint, "identity": self.identity}
        out["epochs"] = epochs
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{RECORD}.{os.getpid()}")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, path)

    def history(self, epoch: int, skip: int) -> list[Segment]:
        """The epoch's segments up to ``skip`` micro-batches of this rank (its last one this run's, at steps
        0 or continuing the same shape), from the record; refused in one line when it cannot be exact."""
        w, g = self.config.world_size, self.config.grad_accum
        if skip == 0:
            return [Segment(w, g, 0)]
        where = f"{self.who}: resuming epoch {epoch} after {skip} micro-batches per rank"
        if self.path is None:
            raise StateError(
                f"{where}, but it cannot tell at which world size they ran (their checkpoint does not say): "
                f"{self.hint}, so that a resume continues exactly at any world size"
            )
        raw = self._read()
        if raw and raw.get("fingerprint") != self.fingerprint:
            why = explain(raw.get("identity"), self.identity, "in the record", sampler=True) or "another plan"
            raise StateError(f"{where}: the record {self.path} belongs to another plan ({why})")
        entries = [e for e in self._entries(raw, epoch) if e[0] < skip]
        if not entries or entries[0][0] != 0:
            raise StateError(
                f"{where}: {self.path} has no record of how epoch {epoch} began (was the checkpoint written "
                f"by a run without this record?); the resume cannot be made exact"
            )
        history: list[Segment] = []
        ends = [e[0] for e in entries[1:]] + [skip]
        for (start, world, accum), end in zip(entries, ends, strict=True):
            if (end - start) % accum:
                raise StateError(
                    f"{where}: {end - start} micro-batches at grad_accum {accum} are not whole steps"
                )
            seg = Segment(world, accum, (end - start) // accum)
            if history and (history[-1].world_size, history[-1].grad_accum) == (world, accum):
                seg = Segment(world, accum, history[-1].steps + seg.steps)
                history.pop()
            history.append(seg)
        if (history[-1].world_size, history[-1].grad_accum) != (w, g):
            history.append(Segment(w, g, 0))
        return history

    def batches(self, epoch: int, skip: int = 0) -> list[tuple[list[int], int]]:
        """This rank's micro-batches of ``epoch`` after ``skip`` of its own (see :meth:`history`): ``(sample
        ids, micro-batch number in the epoch)`` each."""
        history = self.history(int(epoch), int(skip))
        cur = self.cursor
        cur.restore(Position(int(epoch), history, 0, Balance.of(self.config.cost)))
        try:
            n = cur.remaining()
        except StateError as err:
            raise StateError(
                f"{self.who}: resuming epoch {epoch} after {skip} micro-batches: {err}"
            ) from None
        if n < 0:
            raise StateError(
                f"{self.who}: resuming epoch {epoch} after {skip} micro-batches per rank, more than the "
                "epoch has at the shapes recorded"
            )
        out = []
        for j in range(n):
            nxt = cur.take()
            assert nxt is not None
            out.append((nxt.ids, int(skip) + j))
        self.resumed_from = history if skip else None
        return out
