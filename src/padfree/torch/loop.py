"""What every training loop over a padfree plan needs, whatever it trains: micro-batches grouped into
optimizer steps, one run id on every rank, and the check that a checkpoint belongs to this run before it is
loaded.

>>> from types import SimpleNamespace as NS
>>> mbs = [NS(id=i, info=NS(last=i % 2 == 1)) for i in range(4)]
>>> [[mb.id for mb in step] for step in steps_of(mbs)]
[[0, 1], [2, 3]]
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from padfree.core.fingerprint import explain
from padfree.errors import StateError, one_line

T = TypeVar("T")


def steps_of(micro_batches: Iterable[T]) -> Iterator[list[T]]:
    """A rank's micro-batches (anything with ``.info.last``: the sampler's, or the batches a collator makes of
    them) grouped into optimizer steps: the micro-batch whose ``info.last`` is set closes a step."""
    group: list[T] = []
    for batch in micro_batches:
        group.append(batch)
        if batch.info.last:  # type: ignore[attr-defined]
            yield group
            group = []


def run_id(rank: int = 0, world: int = 1) -> str:
    """One id per launch (time and a random tag), the same on every rank: rank 0 draws it and broadcasts it
    when ``world > 1`` (``torch.distributed`` initialized)."""
    run: list[str | None] = [
        f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}" if rank == 0 else None
    ]
    if world > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(run, src=0)
    assert run[0] is not None
    return run[0]


def check_resume(
    state: dict, ckpt: Any, sampler: Any, saved: dict | None = None, now: dict | None = None
) -> None:
    """Refuse, in one :class:`~padfree.errors.StateError` line naming what differs, a checkpoint ``state``
    (:meth:`padfree.torch.checkpoint.CheckpointDir.resume`'s) written under another configuration: the
    model's own options ``saved`` vs ``now`` (e.g. a drafter's recipe), then the plan's identity and
    fingerprint against ``sampler``'s (every rank the same, :meth:`CheckpointDir.check_fingerprints`)."""
    why = explain(saved, now or {}) if saved is not None else None
    if why:
        raise StateError(
            f"{one_line(state['path'])}: the checkpoint belongs to another configuration ({why}); "
            "resume with the options it was written with, or start this run in another --checkpoint-dir"
        )
    why = explain(state["sampler"].get("identity"), sampler.identity, sampler=True)
    ckpt.check_fingerprints(state["sampler"].get("fingerprint"), sampler.fingerprint, why)


__all__ = ["check_resume", "run_id", "steps_of"]
