"""Train a tiny Llama on real variable-length data with a padfree plan: plain PyTorch, DDP, kill-safe.

One process:      python examples/train.py --strategy packed --budget 2048 --overlong truncate --max-steps 50
Long documents:   python examples/train.py --strategy chunked --budget 1024 --grad-accum 8 (up to 8K tokens,
                  each trained whole in chunks of 1024 that attend to their earlier chunks)
Several ranks:    torchrun --nproc_per_node 2 examples/train.py --strategy bucketed --grad-accum 2
SP / CP:          torchrun --nproc_per_node 2 examples/train.py --strategy packed --sp 2 (or --cp 2): every
                  packed row is sharded over 2 ranks (Ulysses sequence / zigzag context parallelism)
Kill and resume:  add --checkpoint-dir ckpt --checkpoint-every 10, then rerun with --resume (any world size)

What it does, top to bottom:
- tokenizes ``--data`` (default: the vendored ``fixtures/samples/*.jsonl.gz``; files, globs, folders, any
  format ``padfree lengths`` reads, ``--format``/``--field-map``/``--chat-template`` likewise) with
  ``--tokenizer`` (SentencePiece .model, tokenizer.json or a transformers folder) by padfree's one rule
  (:mod:`padfree.data.tokenization`): a chat sample is ``[BOS] + role + "\\n" + content + "\\n" + [EOS]``
  per message, a document ``text + [EOS]``: exactly what ``padfree lengths`` counts. With ``--lengths FILE``
  (made by ``padfree lengths``) the plan uses the file, and a sample whose token count differs from it stops
  the run with one line naming it. Samples longer than ``--budget`` follow ``--overlong`` as in ``padfree
  plan``: ``error`` (the default) stops with one line; ``truncate``, ``split`` or ``drop`` are said in one
  line at the start (how many samples, how many tokens not trained).
- loss (``--loss-on``): ``assistant`` (default) puts loss on the tokens of assistant messages (their BOS
  and EOS included); documents always have loss on every token. ``all`` puts loss on every token.
- plans micro-batches with :class:`padfree.torch.PlanBatchSampler` (``--strategy``, ``--budget``: tokens per
  micro-batch), ``--grad-accum`` micro-batches per rank per optimizer step; gradients are all-reduced only
  on the last one (``no_sync`` before), and every micro-batch's loss is ``sum of token losses / tokens of
  the whole step on all ranks``, so the step's gradient is exactly the full-batch token mean.
- builds a transformers Llama from a config with random weights (``padfree.models.load_model``, no
  download); ``--model DIR`` with saved weights (``save_pretrained``) and no ``--model-set``/``--vocab-size``
  loads them with ``from_pretrained``. Packed rows use padfree's varlen attention when available, else
  sdpa; a model that cannot train packed stops with one line naming why (:func:`padfree.models.
  packing_refusal`, the same sentence as ``padfree check-packing --model DIR``).
- ``--sp N`` / ``--cp N`` (packed only, under ``torchrun`` with a multiple of N processes): N consecutive
  ranks share each micro-batch and each runs its shard of the packed row
  (:class:`padfree.torch.StepRunner`, the same code as ``PadfreeTrainer``); the step's
  gradient equals the unsharded run's. Models with convolutions or recurrences (hybrids) are refused.
- every ``--checkpoint-every`` steps rank 0 writes model, optimizer and sampler state atomically (temp
  file + ``os.replace``); ``--resume`` continues from the latest one at any world size: the sampler
  re-plans the rest of the epoch over the new ranks, every sample still exactly once per epoch.
- the run owns ``--checkpoint-dir`` (:class:`padfree.torch.run.checkpoint.CheckpointDir`): a second run on it
  is refused with one line naming the owner, a dead run's lock is taken over; rank 0 chooses the checkpoint
  (the newest intact one) and every rank loads it; SIGTERM saves a checkpoint at the next step boundary and
  exits with code 143; under torchrun the workers die with their launcher
  (:mod:`padfree.torch.run.lifecycle`).
- ``--seen-log FILE``: every rank appends one JSON line per consumed sample, flushed once per step:
  ``{"run", "epoch", "step", "rank", "index"}`` (``step`` = optimizer steps since the start of training);
  under ``--overlong drop`` each run first says which samples it leaves out, one ``{"run", "dropped"}``
  line each (:mod:`padfree.testing.seenlog` counts them as dropped, not lost).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from padfree.core.items import dropped_samples, planned_tokens
from padfree.errors import ConfigError, PadfreeError
from padfree.models import load_model, require_packable
from padfree.options import (
    add_data_and_model_args,
    add_number,
    example_parser,
    model_overrides,
    plan_config,
    run_example,
    training_data,
)
from padfree.recipes.loop import add_run_args, train_loop
from padfree.recipes.reach import overlong_note
from padfree.torch import PackCollator, PadCollator, PlanBatchSampler, PlannedDataset, StepRunner
from padfree.torch.run.checkpoint import CheckpointDir
from padfree.torch.run.lifecycle import StopOnSignal, die_with_parent, launched_by_torchrun
from padfree.torch.run.loop import resume_from, run_id, setup_distributed

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
"""Real chat, math, code and document samples and a 32K SentencePiece tokenizer, vendored in the repo."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = example_parser(__doc__)
    add_data_and_model_args(p, FIXTURES, chunked=True)
    add_number(p, "--sp", 1, "packed rows sharded over this many ranks by Ulysses sequence parallelism")
    add_number(p, "--cp", 1, "packed rows sharded over this many ranks by zigzag context parallelism")
    add_run_args(p)
    return p.parse_args(argv)


# ----- training -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if launched_by_torchrun():
        die_with_parent()  # torchrun's workers run in sessions of their own: stop with the launcher
    stop = StopOnSignal()  # SIGTERM: checkpoint at the next step boundary, then exit
    rank, world, device = setup_distributed()
    ckpt = CheckpointDir(args.checkpoint_dir, rank, world, say=print) if args.checkpoint_dir else None
    try:
        return train(args, rank, world, device, ckpt, stop)
    except PadfreeError:  # raised on every rank alike (rank 0 decides): rank 0 says it (run_example)
        if rank == 0:
            raise
        return 2
    finally:
        stop.restore()  # main() may run in-process (tests): leave no SIGTERM handler behind
        if ckpt is not None:
            ckpt.release()
        if world > 1:
            dist.destroy_process_group()


def train(args, rank, world, device, ckpt: CheckpointDir | None, stop: StopOnSignal) -> int:
    log = print if rank == 0 else (lambda *a, **k: None)
    run = run_id(rank, world)
    if ckpt is not None:
        ckpt.acquire(run)  # before any step: a second run on the directory is refused here

    samples, lengths, loss_tokens = training_data(args)
    config = plan_config(args)
    overrides = model_overrides(args)
    if args.vocab_size:
        for s in samples:
            s["input_ids"] = s["input_ids"] % args.vocab_size
    where = f"--strategy {args.strategy} on {args.model}"
    model = load_model(args.model, StepRunner.attention(config), args.seed, where=where, **overrides).to(
        device
    )
    vocab, top = int(model.config.vocab_size), max((int(s["input_ids"].max()) for s in samples), default=0)
    if top >= vocab:
        raise ConfigError(
            f"--model {args.model}: its vocabulary holds {vocab} tokens, the tokenized data has id {top}; "
            "use the model's own tokenizer (--tokenizer) or fold the ids with --vocab-size"
        )
    if config.packed:
        require_packable(model, where)
    # how a micro-batch runs: plain, chunked or sharded over --sp/--cp ranks (which it groups)
    runner = StepRunner(config, model, rank=rank, world=world, device=device, keep_chunks=args.keep_chunks)
    sampler = PlanBatchSampler(
        lengths,
        config,
        loss_tokens=loss_tokens,
        balance=args.balance,
        balance_every=args.balance_every,
        **runner.sampler_ranks,
    )
    if config.packed:
        collator = PackCollator(chunked=config.chunked, sp=config.sp, cp=config.cp)
    else:
        collator = PadCollator(pad_to_multiple_of=8)
    loader = DataLoader(
        PlannedDataset(samples), batch_sampler=sampler, collate_fn=collator, pin_memory=device.type == "cuda"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    step = 0
    state = ckpt.resume(device) if ckpt is not None and args.resume else None
    if state is not None:
        step = resume_from(state, ckpt, model, optimizer, sampler)
        log(f"resumed from {state['path']} at step {step}, epoch {sampler.epoch}, world size {world}")
        del state
    ddp = DistributedDataParallel(model) if world > 1 else model

    n_params = sum(p.numel() for p in model.parameters())
    line = overlong_note(config, lengths)  # the longest sample trained whole: the runner's reach
    if line:
        log(line)
    log(
        f"run {run}: {len(samples)} samples, {planned_tokens(lengths, runner.reach, args.overlong)} tokens, "
        f"{n_params / 1e6:.1f}M params, "
        f"{args.strategy} budget {args.budget}, world {world} x grad_accum {args.grad_accum}, "
        f"attention {model.config._attn_implementation}"
        + (f", {runner.size} ranks per row ({'sp' if config.sp > 1 else 'cp'})" if runner.size > 1 else "")
    )

    def micro_step(micro_batches, step_tokens):  # timed: each row's compute, not DDP's all-reduce wait
        return runner.step(ddp, micro_batches, step_tokens, timed=sampler.timed)

    parts = (sampler, loader, model, optimizer)
    dropped = dropped_samples(lengths, runner.reach, args.overlong)
    return train_loop(
        args, rank, device, ckpt, stop, run, parts, runner.step_tokens, micro_step, step=step,
        dropped=dropped, seen_here=runner.leads,
    )  # fmt: skip


if __name__ == "__main__":
    run_example(main)
