"""Train a DFlash or EAGLE-3 drafter on a frozen tiny target, online, with a padfree plan: DDP, kill-safe.

One process:      python examples/train_drafter.py --method dflash --strategy packed --max-steps 20
Several ranks:    torchrun --nproc_per_node 2 examples/train_drafter.py --method eagle3 --grad-accum 2
Kill and resume:  add --checkpoint-dir ckpt --checkpoint-every 5, then rerun with --resume (any world size)

What it does (the data, plan, checkpoint, resume, seen-log and SIGTERM machinery is ``train.py``'s own:
``train_loop``, ``add_run_args``, ``save``):
- tokenizes ``--data`` as ``train.py`` does (loss on assistant turns by default); token ids are folded
  modulo ``--vocab-size`` (default 2048: a tiny LM head, so the example trains in minutes on a CPU).
- DFlash: counts each sample's anchors (:func:`padfree.core.anchors.anchor_counts`: the policy's quota from
  the loss mask alone) and gives them to :class:`padfree.torch.PlanBatchSampler` (``anchors=``), which keeps
  every micro-batch within ``--anchor-budget`` draft blocks (if set) and balances ranks by the drafter cost
  model (:meth:`padfree.core.config.CostModel.for_drafter`). Anchors themselves are chosen per document
  from ``(seed, epoch, sample id)`` by the collator, the same whatever the packing, rank or resume.
- every micro-batch: the frozen target runs forward under ``no_grad`` on the micro-batch's rows (packed rows
  with per-document attention), its chosen layers' hidden states feed the drafter (DDP), whose loss is
  ``KL(target || drafter)`` summed over supervised draft positions. The step's loss is normalized over all
  supervised draft positions of the step on all ranks (counted from the collated fields, all-reduced once
  per step, before any forward), so the gradient is exactly the mean over the step's draft positions.
- ``--anchor-log FILE`` (DFlash): every rank appends one JSON line per trained sample and step,
  ``{"run", "epoch", "step", "rank", "index", "anchors"}``, for the kill/resume check that every sample
  trains with the same anchors (``tests/examples/test_train_drafter.py``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
from common import (
    add_data_and_model_args,
    dropped_samples,
    load_training_data,
    plan_config,
    run_example,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from train import add_run_args, setup_distributed, shared_run_id, train_loop

from padfree.core.anchors import AnchorPolicy, anchor_counts
from padfree.core.config import CostModel
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.dflash import DFlashConfig, DFlashDrafter
from padfree.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from padfree.drafter.target import (
    TINY_TARGET,
    build_target,
    dflash_layers,
    eagle3_layers,
    lm_head,
    run_target,
)
from padfree.errors import PadfreeError
from padfree.torch import PlanBatchSampler, PlannedDataset, all_reduce_sum, step_loss, sync_unless
from padfree.torch.checkpoint import CheckpointDir
from padfree.torch.lifecycle import StopOnSignal, die_with_parent, launched_by_torchrun


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_and_model_args(p)
    add_run_args(p)
    p.add_argument("--method", default="dflash", choices=["dflash", "eagle3"])
    p.add_argument("--block-size", type=int, default=16, help="DFlash block size")
    p.add_argument("--max-anchors", type=int, default=512, help="DFlash anchors per document at most")
    p.add_argument("--anchor-budget", type=int, default=None, help="DFlash blocks per micro-batch at most")
    p.add_argument("--ttt", type=int, default=7, help="EAGLE-3 test-time-training steps")
    p.add_argument("--draft-layers", type=int, default=1, help="DFlash draft layers")
    p.add_argument("--anchor-log", default=None, help="append each trained sample's anchors (DFlash)")
    p.set_defaults(vocab_size=2048, budget=1024, overlong="truncate")  # tiny defaults that run as they are
    return p.parse_args(argv)


class DraftLoss(torch.nn.Module):
    """The drafter's loss as a module's forward, so that DDP sees the forward it synchronizes."""

    def __init__(self, drafter: torch.nn.Module) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, target_out, head, batch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drafter.loss(target_out, head, batch)


def supervised_positions(batch) -> int:
    """Supervised draft positions of a collated micro-batch (0 for an empty one)."""
    if isinstance(batch, Empty):
        return 0
    f = batch.dflash if batch.dflash is not None else batch.eagle3
    return int(f.supervised.sum())


class Empty:
    """An empty micro-batch (an epoch's tail after an elastic resume): no rows, still a step's member."""

    def __init__(self, info) -> None:
        self.info = info


class Collate:
    """The drafter collator; an empty micro-batch becomes :class:`Empty` (with its ``info``)."""

    def __init__(self, inner: DrafterCollator) -> None:
        self.inner = inner

    def __call__(self, items):
        return self.inner(items) if len(items) else Empty(items.info)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if launched_by_torchrun():
        die_with_parent()
    stop = StopOnSignal()
    rank, world, device = setup_distributed()
    ckpt = CheckpointDir(args.checkpoint_dir, rank, world, say=print) if args.checkpoint_dir else None
    try:
        return train(args, rank, world, device, ckpt, stop)
    except PadfreeError:
        if rank == 0:
            raise
        return 2
    finally:
        stop.restore()
        if ckpt is not None:
            ckpt.release()
        if world > 1:
            torch.distributed.destroy_process_group()


def train(args, rank, world, device, ckpt, stop) -> int:
    log = print if rank == 0 else (lambda *a, **k: None)
    run = shared_run_id(rank, world)
    if ckpt is not None:
        ckpt.acquire(run)
    samples, lengths, loss_tokens = load_training_data(args)
    for s in samples:
        s["input_ids"] = s["input_ids"] % args.vocab_size
    policy = AnchorPolicy(block_size=args.block_size, max_anchors=args.max_anchors)
    hidden, layers = TINY_TARGET["hidden_size"], TINY_TARGET["num_hidden_layers"]
    shape = {"hidden": hidden, "layers": layers, "vocab": args.vocab_size}
    if args.method == "dflash":
        mask = np.concatenate([np.asarray(s["loss_mask"], bool) for s in samples])
        anchors = anchor_counts(mask, np.concatenate(([0], np.cumsum(lengths))), policy)
        cost = CostModel.for_drafter("dflash", **shape, block_size=args.block_size)
    else:
        anchors = None
        cost = CostModel.for_drafter("eagle3", **shape, ttt=args.ttt)
    config = plan_config(args).with_(cost=cost, anchor_budget=args.anchor_budget)
    sampler = PlanBatchSampler(
        lengths,
        config,
        loss_tokens=loss_tokens,
        anchors=anchors,
        balance=args.balance,
        balance_every=args.balance_every,
    )
    layout = "packed" if config.packed else "padded"
    inner = DrafterCollator(args.method, policy, seed=args.seed, layout=layout, ttt=args.ttt, mask_token_id=1)
    loader = DataLoader(PlannedDataset(samples), batch_sampler=sampler, collate_fn=Collate(inner))

    target = build_target(seed=args.seed, vocab_size=args.vocab_size).to(device)
    head = lm_head(target)
    torch.manual_seed(args.seed + 1)
    heads, kv_heads = TINY_TARGET["num_attention_heads"], TINY_TARGET["num_key_value_heads"]
    common = {
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "intermediate_size": 2 * hidden,
    }
    if args.method == "dflash":
        chosen = dflash_layers(layers, max(2, args.draft_layers))
        dcfg = DFlashConfig(**common, num_layers=args.draft_layers, block_size=args.block_size,
                            n_target_layers=len(chosen))  # fmt: skip
        drafter = DFlashDrafter(dcfg, target.get_input_embeddings().weight, head.weight)
    else:
        chosen = eagle3_layers(layers)
        drafter = Eagle3Drafter(
            Eagle3Config(**common, ttt=args.ttt), target.get_input_embeddings().weight, head.weight
        )
    drafter = drafter.to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    step = 0
    state = ckpt.resume(device) if ckpt is not None and args.resume else None
    if state is not None:
        ckpt.check_fingerprints(state["sampler"].get("fingerprint"), sampler.fingerprint)
        drafter.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        step = int(state["step"])
        log(f"resumed from {state['path']} at step {step}, epoch {sampler.epoch}, world size {world}")
        del state
    step_loss_module = DraftLoss(drafter)
    ddp = DistributedDataParallel(step_loss_module) if world > 1 else step_loss_module
    log(
        f"run {run}: {args.method}, {len(samples)} samples, {int(lengths.sum())} tokens, "
        f"{sum(p.numel() for p in params) / 1e6:.2f}M drafter params, {args.strategy} budget {args.budget}, "
        f"world {world} x grad_accum {args.grad_accum}"
    )

    def count(micro_batches) -> int:
        """Supervised draft positions of the whole step on all ranks (every rank calls it once per step)."""
        local = sum(supervised_positions(mb) for mb in micro_batches)
        return int(all_reduce_sum(local, device).item())

    def micro_step(micro_batches, positions):
        loss_sum = torch.zeros((), device=device)
        for mb in micro_batches:
            with sync_unless(ddp, mb.info.last), sampler.timed(ddp):
                if isinstance(mb, Empty):  # no rows: a zero loss that still joins the gradient all-reduce
                    (sum(p.sum() for p in params) * 0.0).backward()
                    continue
                with torch.no_grad():
                    out = run_target(target, mb.contract, chosen)
                num, _ = ddp(out, head, mb)
                total = num.sum()
                step_loss(total, positions, world).backward()
            loss_sum += total.detach()
        return loss_sum, sum(supervised_positions(mb) for mb in micro_batches)

    anchor_fd = None
    if args.anchor_log and args.method == "dflash":
        Path(args.anchor_log).parent.mkdir(parents=True, exist_ok=True)
        anchor_fd = os.open(args.anchor_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log_anchors(micro_batches, run_id, epoch, at_step) -> None:
        if anchor_fd is None:
            return
        lines = []
        for mb in micro_batches:
            if isinstance(mb, Empty):
                continue
            for sid, a in zip(mb.info.indices, mb.dflash.anchors_by_doc, strict=True):
                rec = {
                    "run": run_id,
                    "epoch": epoch,
                    "step": at_step,
                    "rank": rank,
                    "index": sid,
                    "anchors": a,
                }
                lines.append(json.dumps(rec))
        if lines:
            os.write(anchor_fd, ("\n" + "\n".join(lines) + "\n").encode())

    try:
        parts = (sampler, loader, drafter, optimizer)
        dropped = dropped_samples(lengths, args.budget, args.overlong)
        return train_loop(
            args, rank, device, ckpt, stop, run, parts, count, micro_step,
            step=step, after_step=log_anchors, dropped=dropped,
        )  # fmt: skip
    finally:
        if anchor_fd is not None:
            os.close(anchor_fd)


if __name__ == "__main__":
    run_example(main)
