"""What every training loop over a padfree plan needs, whatever it trains: micro-batches grouped into
optimizer steps, one run id on every rank, the check that a checkpoint belongs to this run before it is
loaded, the resume and save themselves, and the lines a run ends its log with. The examples' epochs
(argparse options, the seen-log, SIGTERM) are :func:`padfree.recipes.loop.train_loop`, built on these; a step
itself is :meth:`padfree.torch.StepRunner.step`.

>>> from types import SimpleNamespace as NS
>>> mbs = [NS(id=i, info=NS(last=i % 2 == 1)) for i in range(4)]
>>> [[mb.id for mb in step] for step in steps_of(mbs)]
[[0, 1], [2, 3]]
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from padfree.core.fingerprint import explain
from padfree.errors import StateError, one_line
from padfree.torch.feed.balance import balance_summary
from padfree.torch.run.checkpoint import CheckpointDir

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
        dist.broadcast_object_list(run, src=0)
    assert run[0] is not None
    return run[0]


def check_resume(
    state: dict, ckpt: Any, sampler: Any, saved: dict | None = None, now: dict | None = None
) -> None:
    """Refuse, in one :class:`~padfree.errors.StateError` line naming what differs, a checkpoint ``state``
    (:meth:`padfree.torch.run.checkpoint.CheckpointDir.resume`'s) written under another configuration: the
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


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join the process group when launched by torchrun (nccl on GPU, gloo on CPU); else one process."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def resume_from(
    state: dict,
    ckpt: CheckpointDir,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: Any,
    saved: dict | None = None,
    now: dict | None = None,
) -> int:
    """Load a checkpoint into the model, optimizer and sampler; returns its step. A checkpoint written under
    another configuration is one line naming what differs: the plan's fields, and ``saved`` vs ``now`` (a
    model's own options, e.g. the drafter's) where given."""
    check_resume(state, ckpt, sampler, saved, now)
    try:  # every rank loads the same file: all fail alike, rank 0 says it
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        raise StateError(
            f"{one_line(state['path'])}: the checkpoint's model or optimizer does not fit this run "
            f"({type(exc).__name__}: {one_line(str(exc))[:200]}); resume with the model options it was "
            "written with, or start this run in another --checkpoint-dir"
        ) from None
    sampler.load_state_dict(state["sampler"])
    return int(state["step"])


def balance_line(sampler: Any, seconds: float) -> str:
    """The sampler's balance after ``seconds`` of training, for the log (:meth:`PlanBatchSampler.
    balance_stats`, in one line)."""
    return f"sampler after {seconds:.1f} s of training: {balance_summary(sampler.balance_stats())}"


def source_loss_line(sums: torch.Tensor, names: list[str]) -> str:
    """Each source's mean loss from its ``(2, sources)`` loss sums and tokens (:func:`padfree.torch.
    source_loss_sums`), for the log: ``loss by source: chat 1.2345 (1,024 tokens), ...``.

    >>> source_loss_line(torch.tensor([[2.0, 0.0], [4.0, 0.0]]), ["chat", "code"])
    'loss by source: chat 0.5000 (4 tokens), code - (0 tokens)'
    """
    parts = []
    for j, name in enumerate(names):
        loss, n = float(sums[0, j]), int(sums[1, j])
        parts.append(f"{name} {loss / n:.4f} ({n:,} tokens)" if n else f"{name} - (0 tokens)")
    return "loss by source: " + ", ".join(parts)


def save(
    ckpt: CheckpointDir,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: Any,
    extra: dict | None = None,
) -> None:
    """Rank 0 saves once every rank has logged the step (the seen-log never lags a checkpoint)."""
    ckpt.save(
        step,
        lambda: {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "sampler": sampler.state_dict(),
            "step": step,
            **(extra or {}),
        },
    )


__all__ = [
    "balance_line",
    "check_resume",
    "resume_from",
    "run_id",
    "save",
    "setup_distributed",
    "source_loss_line",
    "steps_of",
]
