"""Worker for tests/test_hf.py (launched by torch.distributed.run, 2 CPU ranks with gloo): one SGD step of
PadfreeTrainer under DDP, with ``average_tokens_across_devices`` on and off; rank 0 saves the parameters.
Then 3 epochs with dynamic balancing: each rank writes the samples it consumed and its balance stats."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from transformers import TrainingArguments

from padfree import PlanConfig
from padfree.hf import PadfreeTrainer
from padfree.models import build_model
from padfree.torch.documents.attention import attention_implementation

TINY_KW = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 2, "vocab_size": 64}  # fmt: skip


def ddp_data():
    """One step of 4 packed rows (2 ranks x 2) with very different token counts: three documents fill
    three rows alone and the short ones share the fourth (119, 99, 89 and 17 loss tokens)."""
    rng = np.random.default_rng(5)
    data = [{"input_ids": rng.integers(1, 64, n)} for n in (120, 100, 90, 8, 5, 7)]
    return data, [len(d["input_ids"]) for d in data]


CONFIG = PlanConfig(strategy="packed", budget=127, grad_accum=2, seed=1)
LR = 0.5


def main(out: str) -> None:
    data, lengths = ddp_data()
    for average in (True, False):
        model = build_model("tiny-llama", attn_implementation=attention_implementation("packed"), **TINY_KW)
        args = TrainingArguments(
            f"{out}/run-{average}", gradient_accumulation_steps=2, max_steps=1, optim="sgd", learning_rate=LR,
            lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, remove_unused_columns=False,
            report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
            average_tokens_across_devices=average,
        )  # fmt: skip
        plan = {"lengths": lengths, "plan_config": CONFIG}
        trainer = PadfreeTrainer(model=model, args=args, train_dataset=data, **plan)
        assert trainer.padfree_sampler.world_size == 2
        trainer.train()
        if trainer.args.process_index == 0:
            torch.save(trainer.model.state_dict(), f"{out}/params-{average}.pt")
    dynamic(out, data, lengths)


class Logged(list):
    """A dataset that remembers which samples were read."""

    seen: list

    def __getitem__(self, i):
        self.seen.append(int(i))
        return super().__getitem__(i)


def dynamic(out: str, data: list, lengths: list) -> None:
    model = build_model("tiny-llama", attn_implementation=attention_implementation("packed"), **TINY_KW)
    args = TrainingArguments(
        f"{out}/dynamic", gradient_accumulation_steps=1, num_train_epochs=3, remove_unused_columns=False,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    ds = Logged(data * 4)
    ds.seen = []
    config = CONFIG.with_(grad_accum=1)
    trainer = PadfreeTrainer(
        model=model, args=args, train_dataset=ds, lengths=lengths * 4, plan_config=config, balance="dynamic",
        balance_every=2,
    )  # fmt: skip
    trainer.train()
    rank = trainer.args.process_index
    stats = trainer.padfree_sampler.balance_stats()
    with open(f"{out}/dynamic-{rank}.json", "w") as f:
        json.dump({"seen": ds.seen, "stats": stats}, f)


if __name__ == "__main__":
    main(sys.argv[1])
