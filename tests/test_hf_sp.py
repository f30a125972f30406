"""PadfreeTrainer with padfree's own sequence / context parallelism (2 CPU ranks, gloo) equals the plain loop
over the unsharded rows; the ParallelismConfig settings it cannot run are refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate.parallelism_config import ParallelismConfig  # noqa: E402
from conftest import HANG_S
from transformers import TrainingArguments  # noqa: E402

from padfree import PlanConfig  # noqa: E402
from padfree.errors import ConfigError  # noqa: E402
from padfree.hf import PadfreeTrainer  # noqa: E402
from padfree.models import build_model  # noqa: E402
from padfree.torch import PackCollator, PlanBatchSampler, PlannedDataset, token_loss_sum  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_padfree_sp_and_cp_steps_equal_the_unsharded_rows(tmp_path):
    """Also with truncated and split samples whose loss tokens the plan cannot count: the count of
    every process then holds the rows of an SP/CP group once per rank, and must count them once."""
    sys.path.insert(0, str(ROOT / "tests"))
    import hf_sp_worker as w

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "hf_sp_worker.py"), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, (shard, _average, overlong) in w.RUNS.items():
        items, lengths, loss = w.data(overlong)
        config = w.config(shard, overlong)
        seen = [json.loads((tmp_path / f"seen-{name}-{r}.json").read_text()) for r in (0, 1)]
        assert seen[0] == seen[1] and seen[0]["dp"] == [0, 1]  # both ranks of the group: the same rows
        sampler = PlanBatchSampler(lengths, config, loss_tokens=loss, dp_rank=0, dp_size=1)
        micro = list(sampler)[: config.grad_accum]
        assert seen[0]["seen"][: config.grad_accum] == [list(map(int, mb)) for mb in micro]
        model = build_model("tiny-llama", attn_implementation="padfree_varlen", seed=2, **w.TINY_KW)
        collate = PackCollator(**shard)
        batches = [collate(PlannedDataset(items).__getitems__(mb)) for mb in micro]
        tokens = sum(b.loss_tokens for b in batches)  # the unsharded rows' own count
        if overlong == "error":
            assert tokens == micro[0].info.step_tokens
        else:  # the step holds a cut sample and the plan leaves the count to the Trainer
            assert micro[0].info.step_tokens is None
            pieces = [(i, n) for mb in micro for i, n in zip(mb.info.indices, mb.info.lengths)]
            assert any(n < lengths[i] for i, n in pieces)
        padded = 0
        for batch in batches:
            padded += batch["input_ids"].shape[1] - batch.tokens
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            (token_loss_sum(model(**inputs).logits, batch["labels"]) / tokens).backward()
        assert padded > 0 or overlong != "error"  # the rows were padded for the shards
        with torch.no_grad():
            for p in model.parameters():
                p -= w.LR * p.grad
        got = torch.load(tmp_path / f"params-{name}.pt")
        before = build_model("tiny-llama", seed=2, **w.TINY_KW).state_dict()
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
        assert max((v - before[k]).abs().max() for k, v in got.items()) > 1e-3  # the step moved the weights


def _trainer(tmp_path, plan: PlanConfig, **targs):
    data = [{"input_ids": list(range(1, n))} for n in (20, 30, 12, 25)]
    args = TrainingArguments(str(tmp_path), gradient_accumulation_steps=plan.grad_accum, report_to=[],
                             use_cpu=True, remove_unused_columns=False, **targs)  # fmt: skip
    sizes = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "vocab_size": 64}
    model = build_model("tiny-llama", attn_implementation="padfree_varlen", **sizes)
    lengths = [len(d["input_ids"]) for d in data]
    return PadfreeTrainer(model=model, args=args, train_dataset=data, lengths=lengths, plan_config=plan)


@pytest.mark.parametrize(
    ("pc", "strategy", "rule"),
    [
        ({"cp_size": 2}, "packed", "accelerate's CP hook forces one causal mask over the packed row"),
        ({"cp_size": 2}, "bucketed", "with padded rows is a GPU check"),
        ({"sp_size": 2}, "packed", r"runs DeepSpeed ALST .* use padfree's Ulysses SP"),
    ],
)
def test_parallelism_configs_it_cannot_run_are_refused_in_one_line(tmp_path, pc, strategy, rule):
    plan = PlanConfig(strategy=strategy, budget=64, grad_accum=1)
    with pytest.raises(ConfigError, match=rule) as err:
        _trainer(tmp_path, plan, parallelism_config=ParallelismConfig(**pc))
    assert "\n" not in str(err.value)


def test_padfree_sp_needs_its_processes_and_packed_rows(tmp_path):
    with pytest.raises(ConfigError, match="world size is 1: launch a multiple of 2"):
        _trainer(tmp_path, PlanConfig(strategy="packed", budget=64, grad_accum=1, sp=2))
