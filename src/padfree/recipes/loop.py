"""The examples' training loop: its command-line options (:func:`add_run_args`) and its epochs
(:func:`train_loop`: steps, clipping, the seen-log, SIGTERM, checkpoints and the log), run by
``examples/train.py`` and ``examples/train_drafter.py`` around their own micro-step, built on the loop pieces
of :mod:`padfree.torch.run.loop` and, for a language model, :class:`padfree.torch.StepRunner`."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from padfree.options import COUNT, WARM, Bounded
from padfree.progress import bars_wanted, progress_bar
from padfree.testing import seenlog
from padfree.torch import StepResult, all_reduce_sum
from padfree.torch.run.checkpoint import CheckpointDir
from padfree.torch.run.lifecycle import EXIT_STOPPED, StopOnSignal
from padfree.torch.run.loop import balance_line, save, source_loss_line, steps_of


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


def train_loop(
    args: argparse.Namespace,
    rank: int,
    device: torch.device,
    ckpt: CheckpointDir | None,
    stop: StopOnSignal,
    run: str,
    parts: tuple[Any, Any, torch.nn.Module, torch.optim.Optimizer],
    count: Callable[[list], Any],
    micro_step: Callable[[list, Any], tuple | StepResult],
    *,
    step: int = 0,
    after_step: Callable[[list, str, int, int], None] | None = None,
    extra: dict | None = None,
    dropped: Iterable[int] = (),
    seen_here: bool = True,
) -> int:
    """The epochs: optimizer steps of ``micro_step(micro_batches, step_count) -> (loss_sum, tokens)`` (or a
    :class:`~padfree.torch.StepResult`: ``examples/train.py`` hands over
    :meth:`padfree.torch.StepRunner.step`, plain, chunked or SP/CP) with the loss normalized by
    ``count(micro_batches)`` (the step's loss-bearing positions on all ranks), gradient clipping, the
    seen-log, SIGTERM, checkpoints and the log; the examples run it around their ``micro_step``.
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
    seen = _open_seen(args.seen_log, run, rank, dropped) if seen_here else None
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
                if isinstance(result, StepResult):
                    result = (result.loss_sum, result.tokens)
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
                    seenlog.append(seen, run, epoch, step - 1, rank, _seen_ids(micro_batches, sampler))
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
                    dt = time.perf_counter() - t_last
                    loss, speed = _loss_and_speed(loss_sum, step_tokens, tokens_since, dt, device)
                    log(
                        f"epoch {epoch} step {step} ({sampler.step}/{sampler.steps_in_epoch}) "
                        f"loss {loss:.4f} tokens/s {speed:,.0f}"
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
    _finished(log, sampler, step, tokens_run, time.perf_counter() - t_train, device)
    if seen is not None:
        os.close(seen)
    return 0


def _finished(
    log: Callable[[str], Any], sampler: Any, step: int, tokens: int, seconds: float, device: torch.device
) -> None:
    """The run's last lines: where it stopped, every rank's tokens (once) and their speed, the balance."""
    tokens_all = all_reduce_sum(torch.tensor(float(tokens)), device).item()
    log(
        f"finished at step {step}, epoch {sampler.epoch} ({sampler.step}/{sampler.steps_in_epoch} steps): "
        f"{tokens_all:,.0f} tokens in {seconds:.1f} s, {tokens_all / max(seconds, 1e-9):,.0f} tokens/s"
    )
    log(balance_line(sampler, seconds))


def _seen_ids(micro_batches: list, sampler: Any) -> list[int]:
    """The samples a step consumed, for the seen-log: under a chunked plan a document once, not once per
    chunk."""
    if sampler.config.chunked:
        return [i for b in micro_batches for i, s in zip(b.info.indices, b.info.starts) if s == 0]
    return [i for b in micro_batches for i in b.info.indices]


def _loss_and_speed(
    loss_sum: torch.Tensor, step_tokens: Any, tokens: int, seconds: float, device: torch.device
) -> tuple[float, float]:
    """The step's token-mean loss over every rank, and every rank's ``tokens`` per second."""
    totals = all_reduce_sum(torch.stack([loss_sum.double().cpu(), torch.tensor(float(tokens))]), device)
    return totals[0].item() / max(step_tokens, 1), totals[1].item() / seconds


def _open_seen(path: str | None, run: str, rank: int, dropped: Iterable[int]) -> int | None:
    """The seen-log's file descriptor (``None``: no ``--seen-log``), rank 0 having said which samples the plan
    leaves out on purpose."""
    if not path:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    seen = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    if rank == 0:
        seenlog.append_dropped(seen, run, dropped)
    return seen


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


__all__ = ["add_run_args", "train_loop"]
