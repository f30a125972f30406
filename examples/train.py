"""Train a tiny Llama on real variable-length data with a padfree plan: plain PyTorch, DDP, kill-safe.

One process:      python examples/train.py --strategy packed --budget 2048 --max-steps 50
Several ranks:    torchrun --nproc_per_node 2 examples/train.py --strategy bucketed --grad-accum 2
Kill and resume:  add --checkpoint-dir ckpt --checkpoint-every 10, then rerun with --resume (any world size)

What it does, top to bottom:
- tokenizes ``--data`` (default: the vendored ``fixtures/samples/*.jsonl.gz``) with the SentencePiece
  ``--tokenizer`` (:func:`padfree.data.samples.load_samples`). A chat
  sample is ``<s>`` + ``role + "\\n" + content + "\\n"`` per message + ``</s>``; a document is
  ``<s> text </s>``. Samples are cut to ``--budget`` tokens.
- loss (``--loss-on``): ``assistant`` (default) puts loss on the tokens of assistant messages, and on
  ``</s>`` when the last message is the assistant's; documents always have loss on every token. ``all``
  puts loss on every token.
- plans micro-batches with :class:`padfree.torch.PlanBatchSampler` (``--strategy``, ``--budget``: tokens per
  micro-batch), ``--grad-accum`` micro-batches per rank per optimizer step; gradients are all-reduced only
  on the last one (``no_sync`` before), and every micro-batch's loss is ``sum of token losses / tokens of
  the whole step on all ranks``, so the step's gradient is exactly the full-batch token mean.
- builds a transformers Llama from a config with random weights (``padfree.testing.models.build_model``, no
  download); packed rows use padfree's varlen attention when available, else sdpa.
- every ``--checkpoint-every`` steps rank 0 writes model, optimizer and sampler state atomically (temp
  file + ``os.replace``); ``--resume`` continues from the latest one at any world size: the sampler
  re-plans the rest of the epoch over the new ranks, every sample still exactly once per epoch.
- ``--seen-log FILE``: every rank appends one JSON line per consumed sample, flushed once per step:
  ``{"run", "epoch", "step", "rank", "index"}`` (``step`` = optimizer steps since the start of training).
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from common import add_data_and_model_args, model_overrides  # examples/common.py
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from padfree import PlanConfig
from padfree.data.samples import load_samples, loss_tokens_of
from padfree.testing import seenlog
from padfree.testing.models import build_model
from padfree.torch import (
    PackCollator,
    PadCollator,
    PlanBatchSampler,
    PlannedDataset,
    global_loss_tokens,
    step_loss,
    sync_unless,
    token_loss_sum,
)
from padfree.torch._distributed import all_reduce_sum
from padfree.torch.attention import attention_implementation


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_and_model_args(p)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps in all")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: off)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument(
        "--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: only at the end)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint, if any")
    p.add_argument("--seen-log", default=None, help="append one JSON line per consumed sample")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--balance", default="static", choices=["static", "dynamic"],
        help="dynamic: balance ranks from measured micro-batch times (PlanBatchSampler(balance=...))",
    )  # fmt: skip
    p.add_argument("--balance-every", type=int, default=4, help="steps between timing exchanges (dynamic)")
    return p.parse_args(argv)


# ----- distributed and checkpoints ------------------------------------------------------------------------
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


def shared_run_id(rank: int, world: int) -> str:
    """One id per launch, the same on every rank."""
    run = [f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}" if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(run, src=0)
    return run[0]


def latest_checkpoint(directory: str | None) -> Path | None:
    files = sorted(Path(directory).glob("step-*.pt")) if directory else []
    return files[-1] if files else None


def save_checkpoint(directory: str, step: int, state: dict, keep: int = 2) -> None:
    """Write atomically: a reader (or a resume after SIGKILL) sees the old file or the new one, never half."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"step-{step:09d}.pt"
    tmp = d / f".{final.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    for old in sorted(d.glob("step-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)


def steps_of(loader):
    """Group a rank's micro-batches into optimizer steps (``info.last`` closes a step)."""
    group = []
    for batch in loader:
        group.append(batch)
        if batch.info.last:
            yield group
            group = []


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


# ----- training -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    log = print if rank == 0 else (lambda *a, **k: None)
    run = shared_run_id(rank, world)

    samples = load_samples(args.data, args.tokenizer, args.limit_samples, args.loss_on, args.budget)
    lengths = np.array([len(s["input_ids"]) for s in samples])
    loss_tokens = loss_tokens_of(samples)
    config = PlanConfig(
        strategy=args.strategy,
        budget=args.budget,
        grad_accum=args.grad_accum,
        seed=args.seed,
        overlong="truncate",
    )
    sampler = PlanBatchSampler(
        lengths, config, loss_tokens=loss_tokens, balance=args.balance, balance_every=args.balance_every
    )
    collator = PackCollator() if args.strategy == "packed" else PadCollator(pad_to_multiple_of=8)
    loader = DataLoader(
        PlannedDataset(samples), batch_sampler=sampler, collate_fn=collator, pin_memory=device.type == "cuda"
    )

    overrides = model_overrides(args)
    if args.vocab_size:
        for s in samples:
            s["input_ids"] = s["input_ids"] % args.vocab_size
    attn = attention_implementation(args.strategy)
    model = build_model(args.model, attn_implementation=attn, seed=args.seed, **overrides).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    step = 0
    ckpt = latest_checkpoint(args.checkpoint_dir) if args.resume else None
    if ckpt is not None:
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        step = int(state["step"])
        log(f"resumed from {ckpt} at step {step}, epoch {sampler.epoch}, world size {world}")
    ddp = DistributedDataParallel(model) if world > 1 else model

    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"run {run}: {len(samples)} samples, {int(lengths.sum())} tokens, {n_params / 1e6:.1f}M params, "
        f"{args.strategy} budget {args.budget}, world {world} x grad_accum {args.grad_accum}, "
        f"attention {attn}"
    )

    if args.seen_log:
        Path(args.seen_log).parent.mkdir(parents=True, exist_ok=True)
    seen = os.open(args.seen_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if args.seen_log else None
    t_last, tokens_since, done = time.perf_counter(), 0, False
    for epoch in range(sampler.epoch, args.epochs):
        sampler.set_epoch(epoch)
        for micro_batches in steps_of(loader):
            info = micro_batches[0].info
            # tokens carrying loss in the whole step (all ranks, all micro-batches): known from the plan
            step_tokens = info.step_tokens
            if step_tokens is None:
                step_tokens = global_loss_tokens(micro_batches, device)
            loss_sum = torch.zeros((), device=device)
            for batch in micro_batches:
                inputs = to_device(batch, device)
                labels = inputs.pop("labels")
                # timed: this micro-batch's compute, up to its last gradient (not DDP's all-reduce wait)
                with sync_unless(ddp, batch.info.last), sampler.timed(ddp):
                    logits = ddp(**inputs).logits
                    token_losses = token_loss_sum(logits, labels)
                    step_loss(token_losses, step_tokens, world).backward()
                loss_sum += token_losses.detach()
                tokens_since += batch.tokens
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if seen is not None:
                ids = [i for b in micro_batches for i in b.info.indices]
                seenlog.append(seen, run, epoch, step - 1, rank, ids)
            if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
                checkpoint(args, step, model, optimizer, sampler, rank, world)
            if step % args.log_every == 0:
                totals = all_reduce_sum(
                    torch.stack([loss_sum.double().cpu(), torch.tensor(float(tokens_since))]), device
                )
                dt = time.perf_counter() - t_last
                log(
                    f"epoch {epoch} step {step} ({sampler.step}/{sampler.steps_in_epoch}) "
                    f"loss {totals[0].item() / max(step_tokens, 1):.4f} tokens/s {totals[1].item() / dt:,.0f}"
                )
                t_last, tokens_since = time.perf_counter(), 0
            if args.max_steps is not None and step >= args.max_steps:
                done = True
                break
        if done:
            break
    if args.checkpoint_dir:
        checkpoint(args, step, model, optimizer, sampler, rank, world)
    log(f"finished at step {step}, epoch {sampler.epoch} ({sampler.step}/{sampler.steps_in_epoch} steps)")
    if args.balance == "dynamic":
        log(f"balance: {sampler.balance_stats()}")
    if seen is not None:
        os.close(seen)
    if world > 1:
        dist.destroy_process_group()
    return 0


def checkpoint(args, step, model, optimizer, sampler, rank, world) -> None:
    """Rank 0 saves once every rank has logged the step (the seen-log never lags a checkpoint)."""
    if world > 1:
        dist.barrier()
    if rank == 0:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "sampler": sampler.state_dict(),
            "step": step,
        }
        save_checkpoint(args.checkpoint_dir, step, state)


if __name__ == "__main__":
    raise SystemExit(main())
