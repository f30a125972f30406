"""Train a tiny Llama through ``transformers.Trainer`` (or TRL's ``SFTTrainer``) fed by a padfree plan.

    python examples/hf_trainer.py --strategy packed --overlong truncate --max-steps 20 --output-dir runs/hf
    python examples/hf_trainer.py --strategy chunked --budget 512 --grad-accum 8 --max-steps 20 --output-dir r
    python examples/hf_trainer.py --strategy bucketed --overlong truncate --grad-accum 2 --max-steps 20 \
        --output-dir runs/hf
    python examples/hf_trainer.py ... --resume                   # continue from the latest checkpoint
    torchrun --nproc_per_node 2 examples/hf_trainer.py ...        # DDP: each rank gets its share of the plan
    torchrun --nproc_per_node 2 examples/hf_trainer.py --strategy packed --sp 2 ...   # or --cp 2: SP / CP
    python examples/hf_trainer.py ... --trainer sft              # the same through trl.SFTTrainer

Data and loss as in ``examples/train.py`` (:func:`padfree.data.samples.load_samples`: any ``--tokenizer``
kind, ``--loss-on assistant|all``, samples longer than ``--budget`` by ``--overlong`` (error by default;
what truncate/split/drop did is said in one line), ``--lengths FILE`` from ``padfree lengths``, checked
sample by sample). The model is built from a config with random weights (:func:`padfree.models.load_model`;
a folder's saved weights when it has them); packed rows use padfree's varlen attention when available;
``--sp N`` / ``--cp N`` shard every packed row over N ranks (``torchrun``, a multiple of N processes).
Nothing is downloaded; CPU works (``--use-cpu`` is implied without a GPU).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from transformers import TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from padfree.hf import PadfreeTrainer, padfree_sft_trainer
from padfree.models import load_model
from padfree.options import (
    add_data_and_model_args,
    add_number,
    model_overrides,
    plan_config,
    run_example,
    training_data,
)
from padfree.progress import bars_wanted
from padfree.recipes.reach import overlong_note
from padfree.torch import StepRunner

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
"""Real chat, math, code and document samples and a 32K SentencePiece tokenizer, vendored in the repo."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_data_and_model_args(p, FIXTURES, chunked=True)
    add_number(p, "--sp", 1, "packed rows sharded over this many ranks by Ulysses sequence parallelism")
    add_number(p, "--cp", 1, "packed rows sharded over this many ranks by zigzag context parallelism")
    p.add_argument("--max-steps", type=int, default=-1, help="optimizer steps in all (default: --epochs)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: only the last)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint, if any")
    p.add_argument("--trainer", default="hf", choices=["hf", "sft"], help="transformers.Trainer or trl")
    p.add_argument("--logging-steps", type=int, default=1)
    p.add_argument(
        "--quiet", action="store_true", help="no progress bar (there is none off a terminal or under CI)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None):
    """Run the training; returns the Trainer (its ``state.log_history`` holds the losses)."""
    args = parse_args(argv)
    samples, lengths, loss_tokens = training_data(args)
    overrides = model_overrides(args)
    if args.vocab_size:
        for s in samples:
            s["input_ids"] = s["input_ids"] % args.vocab_size
    config = plan_config(args)
    line = overlong_note(config, lengths)  # samples over the reach: the longest the run trains whole
    if line:
        print(line)
    where = f"--strategy {args.strategy} on {args.model}"
    model = load_model(args.model, StepRunner.attention(config), args.seed, where=where, **overrides)
    common = {
        "output_dir": args.output_dir,
        "gradient_accumulation_steps": args.grad_accum,
        "num_train_epochs": args.epochs,
        "max_steps": args.max_steps,
        "learning_rate": args.lr,
        "remove_unused_columns": False,  # the collator's keys (position_ids, cu_seq_lens_*) reach the model
        "report_to": [],
        "logging_steps": args.logging_steps,
        "save_strategy": "steps",  # also saves at the last step
        "save_steps": args.save_steps or 10**9,
        "seed": args.seed,
        "use_cpu": not _cuda(),
        "disable_tqdm": not bars_wanted(args.quiet),  # the Trainer's bar, on a terminal only
    }
    # keep_chunks: a chunked plan's long document keeps that many chunks' activations instead of recomputing
    plan = {
        "lengths": lengths,
        "plan_config": config,
        "loss_tokens": loss_tokens,
        "keep_chunks": args.keep_chunks,
    }
    if args.trainer == "sft":
        from datasets import Dataset
        from trl import SFTConfig

        rows = [
            {"input_ids": s["input_ids"].tolist(), "labels": _labels(s).tolist()} for s in samples
        ]  # SFTTrainer wants a datasets.Dataset with input_ids/labels
        targs = SFTConfig(
            **common, dataset_kwargs={"skip_prepare_dataset": True}, max_length=None, bf16=_cuda()
        )
        trainer = padfree_sft_trainer()(
            model=model,
            args=targs,
            train_dataset=Dataset.from_list(rows),
            processing_class=_processing_class(args.tokenizer),
            **plan,
        )
    else:
        trainer = PadfreeTrainer(model=model, args=TrainingArguments(**common), train_dataset=samples, **plan)
    resume = get_last_checkpoint(args.output_dir) if args.resume and os.path.isdir(args.output_dir) else None
    metrics = trainer.train(resume_from_checkpoint=resume).metrics
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.args.process_index == 0:
        speed = f", {metrics['train_tokens_per_second']:,.0f} tokens/s" if metrics else ""
        print(
            f"{args.strategy}: {trainer.state.global_step} steps{speed}, attention "
            f"{model.config._attn_implementation}, first/last loss {losses[0]:.4f}/{losses[-1]:.4f}"
            if losses
            else f"{args.strategy}: {trainer.state.global_step} steps{speed}"
        )
    return trainer


def _labels(sample: dict) -> np.ndarray:
    return np.where(np.asarray(sample["loss_mask"]).astype(bool), sample["input_ids"], -100)


def _processing_class(tokenizer: str):
    """A transformers tokenizer for TRL (which insists on one; the data is already tokenized), loaded from
    the local file or folder."""
    from transformers import AutoTokenizer, LlamaTokenizer, PreTrainedTokenizerFast

    from padfree.data.tokenization import tokenizer_kind

    kind = tokenizer_kind(tokenizer)
    if kind == "sentencepiece":
        tok = LlamaTokenizer(vocab_file=tokenizer)
    elif kind == "tokenizers":
        tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer)
    else:
        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token
    return tok


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    run_example(main)
