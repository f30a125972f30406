"""Worker for tests/test_hf.py, launched by ``accelerate launch --multi_gpu --num_processes 2`` (on CPU:
two processes, gloo): two optimizer steps of PadfreeTrainer; every rank writes the rank and world size its
sampler got and the sample ids it trained, and the checkpoints record the sampler state."""

from __future__ import annotations

import json
import sys

import numpy as np
from transformers import TrainingArguments

from padfree.hf import PadfreeTrainer
from padfree.models import build_model
from padfree.torch.documents.attention import attention_implementation

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import hf_ddp_worker as w  # noqa: E402


def main(out: str) -> None:
    rng = np.random.default_rng(2)
    data = [{"input_ids": rng.integers(1, 64, n)} for n in rng.integers(4, 120, 48)]
    lengths = [len(d["input_ids"]) for d in data]  # several steps an epoch: the two steps are in epoch 0
    model = build_model("tiny-llama", attn_implementation=attention_implementation("packed"), **w.TINY_KW)
    args = TrainingArguments(
        out, gradient_accumulation_steps=2, max_steps=2, save_steps=2, remove_unused_columns=False,
        report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    plan = {"lengths": lengths, "plan_config": w.CONFIG}
    trainer = PadfreeTrainer(model=model, args=args, train_dataset=data, **plan)
    seen: list[int] = []
    loader = trainer.get_train_dataloader
    trainer.get_train_dataloader = lambda: _logging(loader(), seen)  # type: ignore[method-assign]
    trainer.train()
    s = trainer.padfree_sampler
    with open(f"{out}/rank-{args.process_index}.json", "w") as f:
        json.dump({"rank": s.rank, "world_size": s.world_size, "process_index": args.process_index,
                   "seen": seen}, f)  # fmt: skip


def _logging(loader, seen: list[int]):
    class Logged:
        def __len__(self) -> int:
            return len(loader)

        def __iter__(self):
            for batch in loader:
                seen.extend(batch.info.indices)
                yield batch

        def __getattr__(self, name: str):
            return getattr(loader, name)

    return Logged()


if __name__ == "__main__":
    main(sys.argv[1])
