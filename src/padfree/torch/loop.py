"""What every training loop over a padfree plan needs, whatever it trains: micro-batches grouped into
optimizer steps, one run id on every rank, the check that a checkpoint belongs to this run before it is
loaded, and the epochs themselves (:func:`train_loop`: steps, clipping, the seen-log, SIGTERM, checkpoints and
the log) with their options (:func:`add_run_args`): what ``examples/train.py`` and
``examples/train_drafter.py`` run around their own micro-step.

>>> from types import SimpleNamespace as NS
>>> mbs = [NS(id=i, info=NS(last=i % 2 == 1)) for i in range(4)]
>>> [[mb.id for mb in step] for step in steps_of(mbs)]
[[0, 1], [2, 3]]
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from padfree.core.fingerprint import explain
from padfree.errors import StateError, one_line
from padfree.options import COUNT, WARM, Bounded
from padfree.progress import bars_wanted, progress_bar
from padfree.testing import seenlog
from padfree.torch._balance import balance_summary
from padfree.torch._distributed import all_reduce_sum
from padfree.torch.checkpoint import CheckpointDir
from padfree.torch.lifecycle import EXIT_STOPPED, StopOnSignal

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


# ----- the epochs ----------------------------------------------------------------------------------------
def add_run_args(p: argparse.ArgumentParser) -> None:
    """Steps, clipping, checkpoints, resume, the seen-log, the log and rank balancing (``train_loop``'s)."""
    p.add_argument(
        "--max-steps", type=COUNT, default=None, help="stop after this many optimizer steps in all"
    )
    p.add_argument("--clip", type=Bounded(float, 0, 1e9), default=1.0, help="gradient norm clip (0: off)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument(
        "--checkpoint-every", type=WARM, default=0, help="steps between checkpoints (0: only at the end)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint, if any")
    p.add_argument("--seen-log", default=None, help="append one JSON line per consumed sample")
    p.add_argument("--log-every", type=COUNT, default=10)
    p.add_argument(
        "--balance", default="static", choices=["static", "dynamic"],
        help="dynamic: balance ranks from measured micro-batch times (PlanBatchSampler(balance=...))",
    )  # fmt: skip
    p.add_argument("--balance-every", type=COUNT, default=4, help="steps between timing exchanges (dynamic)")
    p.add_argument(
        "--quiet", action="store_true", help="no progress bar (there is none off a terminal or under CI)"
    )


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


def train_loop(
    args: argparse.Namespace,
    rank: int,
    device: torch.device,
    ckpt: CheckpointDir | None,
    stop: StopOnSignal,
    run: str,
    parts: tuple[Any, Any, torch.nn.Module, torch.optim.Optimizer],
    count: Callable[[list], Any],
    micro_step: Callable[[list, Any], tuple],
    *,
    step: int = 0,
    after_step: Callable[[list, str, int, int], None] | None = None,
    extra: dict | None = None,
    dropped: Iterable[int] = (),
    seen_here: bool = True,
) -> int:
    """The epochs: optimizer steps of ``micro_step(micro_batches, step_count) -> (loss_sum, tokens)`` with the
    loss normalized by ``count(micro_batches)`` (the step's loss-bearing positions on all ranks), gradient
    clipping, the seen-log, SIGTERM, checkpoints and the log; the examples run it around their ``micro_step``.
    ``parts`` are ``(sampler, loader, model, optimizer)``; ``after_step(micro_batches, run, epoch, step)``
    runs after each optimizer step (before any checkpoint of it); ``extra`` goes into every checkpoint;
    ``dropped``: the samples the plan leaves out on purpose (``--overlong drop``), said once in the seen-log
    so its check does not count them lost; ``seen_here``: whether this rank writes the seen-log (under
    SP/CP only the first rank of each group, whose rows the others share).

    With weighted sources ``micro_step`` may return a third value, its micro-batches' per-source loss sums
    and loss tokens (:func:`padfree.torch.source_loss_sums`, shape ``(2, sources)``): the log then says each
    source's mean loss since the last log line, over all ranks."""
    log = print if rank == 0 else (lambda *a, **k: None)
    sampler, loader, model, optimizer = parts
    if args.seen_log:
        Path(args.seen_log).parent.mkdir(parents=True, exist_ok=True)
    logged = args.seen_log if seen_here else None
    seen = os.open(logged, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if logged else None
    if seen is not None and rank == 0:
        seenlog.append_dropped(seen, run, dropped)
    t_last, tokens_since, done, first = time.perf_counter(), 0, False, step + 1
    t_train, tokens_run = t_last, 0
    names = [n for n, _ in sampler.config.sources or ()]
    by_source: torch.Tensor | None = None  # per-source loss sums and tokens since the last log line
    bars = rank == 0 and bars_wanted(getattr(args, "quiet", False))
    with progress_bar("training", _steps_left(args, sampler, step), enabled=bars) as advance:
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)
            for micro_batches in steps_of(loader):
                step_tokens = count(micro_batches)
                result = micro_step(micro_batches, step_tokens)
                loss_sum, tokens = result[0], result[1]
                if len(result) > 2 and result[2] is not None:
                    part = result[2].detach().double().cpu()
                    by_source = part if by_source is None else by_source + part
                tokens_since += tokens
                tokens_run += tokens
                if args.clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                advance()

                if seen is not None:
                    ids = [i for b in micro_batches for i in b.info.indices]
                    if sampler.config.chunked:  # a document once, not once per chunk
                        ids = [
                            i for b in micro_batches for i, s in zip(b.info.indices, b.info.starts) if s == 0
                        ]
                    seenlog.append(seen, run, epoch, step - 1, rank, ids)
                if after_step is not None:
                    after_step(micro_batches, run, epoch, step - 1)
                if stop.agreed(device):
                    if ckpt is not None:
                        save(ckpt, step, model, optimizer, sampler, extra)
                    log(f"stopped by {stop.received or 'a signal on another rank'} after step {step}")
                    return EXIT_STOPPED
                if ckpt is not None and args.checkpoint_every and step % args.checkpoint_every == 0:
                    save(ckpt, step, model, optimizer, sampler, extra)
                known = sampler.steps_in_epoch  # None: a stream's, known once it is read to its end
                last = (args.max_steps is not None and step >= args.max_steps) or (
                    epoch == args.epochs - 1 and known is not None and sampler.step >= known
                )
                # the run's first step (how fast it goes) and its last are said even off the --log-every grid
                if step % args.log_every == 0 or last or step == first:
                    totals = all_reduce_sum(
                        torch.stack([loss_sum.double().cpu(), torch.tensor(float(tokens_since))]), device
                    )
                    dt = time.perf_counter() - t_last
                    loss = totals[0].item() / max(step_tokens, 1)
                    log(
                        f"epoch {epoch} step {step} ({sampler.step}/{sampler.steps_in_epoch}) "
                        f"loss {loss:.4f} tokens/s {totals[1].item() / dt:,.0f}"
                    )
                    advance(0, description=f"epoch {epoch} loss {loss:.4f}")
                    if by_source is not None and names:
                        log(source_loss_line(all_reduce_sum(by_source, device).cpu(), names))
                        by_source = None
                    t_last, tokens_since = time.perf_counter(), 0
                if args.max_steps is not None and step >= args.max_steps:
                    done = True
                    break
            if done:
                break
    if ckpt is not None:
        save(ckpt, step, model, optimizer, sampler, extra)
    seconds = time.perf_counter() - t_train
    tokens_all = all_reduce_sum(torch.tensor(float(tokens_run)), device).item()  # every rank, once
    log(
        f"finished at step {step}, epoch {sampler.epoch} ({sampler.step}/{sampler.steps_in_epoch} steps): "
        f"{tokens_all:,.0f} tokens in {seconds:.1f} s, {tokens_all / max(seconds, 1e-9):,.0f} tokens/s"
    )
    summary = balance_summary(sampler.balance_stats())
    log(f"sampler after {seconds:.1f} s of training: {summary}")
    if seen is not None:
        os.close(seen)
    return 0


def _steps_left(args: argparse.Namespace, sampler: Any, step: int) -> int | None:
    """Optimizer steps this run has left (the progress bar's total): to ``--max-steps`` or to the end of the
    last epoch, whichever comes first (``None``: not known)."""
    per_epoch = getattr(sampler, "steps_in_epoch", None)
    left = None
    if isinstance(per_epoch, int):
        left = max((args.epochs - sampler.epoch) * per_epoch - sampler.step, 0)
    if args.max_steps is not None:
        left = max(args.max_steps - step, 0) if left is None else min(left, max(args.max_steps - step, 0))
    return left


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
    "add_run_args",
    "check_resume",
    "resume_from",
    "run_id",
    "save",
    "setup_distributed",
    "steps_of",
    "train_loop",
]
