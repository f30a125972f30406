"""Worker for tests/test_hf_sp.py (launched by torch.distributed.run, 2 CPU ranks with gloo): one SGD step of
PadfreeTrainer with padfree's own SP=2 (Ulysses) and CP=2 (zigzag) on packed rows; rank 0 saves the
parameters and both ranks the micro-batches they were given."""

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
RUNS = {"sp-True": ({"sp": 2}, True), "sp-False": ({"sp": 2}, False), "cp-True": ({"cp": 2}, True)}


def data():
    """Odd lengths, so that every row is padded for the shards."""
    rng = np.random.default_rng(7)
    items = [{"input_ids": rng.integers(1, 64, n)} for n in (37, 21, 9, 45, 13, 27, 5, 31)]
    return items, [len(d["input_ids"]) for d in items]


def config(shard: dict) -> PlanConfig:
    return PlanConfig(strategy="packed", budget=48, grad_accum=2, seed=1, **shard)


def main(out: str) -> None:
    items, lengths = data()
    for name, (shard, average) in RUNS.items():
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

        trainer = PadfreeTrainer(model=model, args=args, train_dataset=items, lengths=lengths,
                                 plan_config=config(shard), collator=recording)  # fmt: skip
        trainer.train()
        sampler = trainer.padfree_sampler
        rank = trainer.args.process_index
        with open(f"{out}/seen-{name}-{rank}.json", "w") as f:
            json.dump({"seen": seen, "dp": [sampler.rank, sampler.world_size]}, f)
        if rank == 0:
            torch.save(trainer.model.state_dict(), f"{out}/params-{name}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
