"""Worker for tests/test_hf_sp.py (launched by torch.distributed.run, 2 CPU ranks with gloo): one SGD step of
PadfreeTrainer with padfree's own SP=2 (Ulysses) and CP=2 (zigzag) on packed rows, also with truncated and
split samples whose loss-token count the plan cannot know; rank 0 saves the parameters and both ranks the
micro-batches they were given."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from transformers import TrainingArguments

from padfree import PlanConfig
from padfree.hf import PadfreeTrainer
from padfree.models import build_model
from padfree.torch import PackCollator

TINY_KW = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 64}  # fmt: skip
LR = 0.5
RUNS = {  # name: (SP or CP, average_tokens_across_devices, overlong policy)
    "sp-True": ({"sp": 2}, True, "error"),
    "sp-False": ({"sp": 2}, False, "error"),
    "cp-True": ({"cp": 2}, True, "error"),
    "sp-truncate": ({"sp": 2}, True, "truncate"),
    "sp-split-False": ({"sp": 2}, False, "split"),
    "cp-split": ({"cp": 2}, True, "split"),
}


def data(overlong: str = "error") -> tuple[list[dict], list[int], list[int] | None]:
    """Odd lengths, so that every row is padded for the shards; with an overlong policy also samples over
    the budget, and loss on part of each sample only (``loss_tokens`` given, which the plan cannot count
    on a truncated or split sample): (items, lengths, loss_tokens)."""
    rng = np.random.default_rng(7)
    if overlong == "error":
        items = [{"input_ids": rng.integers(1, 64, n)} for n in (37, 21, 9, 45, 13, 27, 5, 31)]
        return items, [len(d["input_ids"]) for d in items], None
    items = []
    for n in (130, 21, 109, 45, 117, 27, 5, 31):  # a row holds 48 x 2 tokens
        ids = rng.integers(1, 64, n)
        labels = ids.copy()
        labels[: n // 3] = -100  # a prompt without loss
        items.append({"input_ids": ids, "labels": labels})
    loss = [int((d["labels"][1:] != -100).sum()) for d in items]
    return items, [len(d["input_ids"]) for d in items], loss


def config(shard: dict, overlong: str = "error") -> PlanConfig:
    return PlanConfig(strategy="packed", budget=48, grad_accum=2, seed=1, overlong=overlong, **shard)


def main(out: str) -> None:
    for name, (shard, average, overlong) in RUNS.items():
        items, lengths, loss = data(overlong)
        model = build_model("tiny-llama", attn_implementation="padfree_varlen", seed=2, **TINY_KW)
        args = TrainingArguments(
            f"{out}/run-{name}", gradient_accumulation_steps=2, max_steps=1, optim="sgd", learning_rate=LR,
            lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, remove_unused_columns=False,
            report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
            average_tokens_across_devices=average,
        )  # fmt: skip
        collate, seen = PackCollator(**shard), []

        def recording(batch, collate=collate, seen=seen):
            out = collate(batch)
            seen.append([int(i) for i in out.info.indices])
            return out

        plan = {"lengths": lengths, "loss_tokens": loss, "plan_config": config(shard, overlong)}
        trainer = PadfreeTrainer(model=model, args=args, train_dataset=items, collator=recording, **plan)
        trainer.train()
        sampler = trainer.padfree_sampler
        rank = trainer.args.process_index
        with open(f"{out}/seen-{name}-{rank}.json", "w") as f:
            json.dump({"seen": seen, "dp": [sampler.rank, sampler.world_size]}, f)
        if rank == 0:
            torch.save(trainer.model.state_dict(), f"{out}/params-{name}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
