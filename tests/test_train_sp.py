"""``examples/train.py --sp 2`` / ``--cp 2`` on 2 CPU ranks (gloo) take the step the unsharded rows take, also
when the step holds a truncated sample whose loss tokens the plan cannot count (assistant-only loss)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from padfree.options import plan_config, training_data
from padfree.torch import PackCollator, PlanBatchSampler, PlannedDataset, token_loss_sum

ROOT = Path(__file__).resolve().parents[1]
SIZES = [f"--model-set={kv}" for kv in ("hidden_size=32", "intermediate_size=64", "num_hidden_layers=2",
                                         "num_attention_heads=4", "num_key_value_heads=2")]  # fmt: skip
ARGS = ["--strategy", "packed", "--budget", "48", "--grad-accum", "2", "--overlong", "truncate",
        "--max-steps", "1", "--clip", "0", "--lr", "0.01", "--vocab-size", "128", "--limit-samples", "12",
        "--seed", "1", *SIZES]  # fmt: skip


def _example():
    spec = importlib.util.spec_from_file_location("train_example", ROOT / "examples" / "train.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _unsharded_step(shard: str) -> tuple[dict, float]:
    """The first step of the same plan on the whole rows, one process: each parameter's gradient of the
    step's token mean, and that mean."""
    train = _example()
    args = train.parse_args([*ARGS, shard, "2"])
    samples, lengths, loss_tokens = training_data(args)
    for s in samples:
        s["input_ids"] = s["input_ids"] % args.vocab_size
    config = plan_config(args)
    sampler = PlanBatchSampler(lengths, config, loss_tokens=loss_tokens, dp_rank=0, dp_size=1)
    micro = next(iter(_steps(sampler)))
    assert micro[0].info.step_tokens is None  # a truncated sample: the plan leaves the count to the loop
    assert any(n < lengths[i] for mb in micro for i, n in zip(mb.info.indices, mb.info.lengths))
    collate = PackCollator(sp=config.sp, cp=config.cp)
    batches = [collate(PlannedDataset(samples).__getitems__(mb)) for mb in micro]
    tokens = sum(b.loss_tokens for b in batches)
    from padfree.models import load_model

    model = load_model(args.model, "padfree_varlen", args.seed, **train.model_overrides(args))
    total = 0.0
    for b in batches:
        inputs = {k: v for k, v in b.items() if k != "labels"}
        loss = token_loss_sum(model(**inputs).logits, b["labels"]) / tokens
        loss.backward()
        total += loss.item()
    return {k: p.grad for k, p in model.named_parameters()}, total


def _steps(sampler):
    from padfree.torch.run.loop import steps_of

    return steps_of(sampler)


@pytest.mark.parametrize("shard", ["--sp", "--cp"])
def test_train_example_sharded_step_equals_the_unsharded_rows(tmp_path, shard):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "train.py"), *ARGS, shard, "2", "--checkpoint-dir", str(ckpt)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"2 ranks per row ({shard[2:]})" in proc.stdout
    grads, loss = _unsharded_step(shard)
    assert f"loss {loss:.4f}" in proc.stdout, proc.stdout  # the step's token mean, not a share of it
    # AdamW's first moment after one step is (1 - beta1) x the step's gradient: the sharded run's gradient
    state = torch.load(next(ckpt.glob("step-*.pt")), weights_only=False)["optimizer"]["state"]
    for i, (name, grad) in enumerate(grads.items()):
        torch.testing.assert_close(state[i]["exp_avg"] / 0.1, grad, rtol=1e-4, atol=1e-6, msg=name)


def test_sp_needs_packed_rows_and_its_processes(capsys):
    train = _example()
    with pytest.raises(Exception, match="--sp/--cp shard packed rows: use --strategy packed"):
        train.main([*ARGS[2:], "--strategy", "bucketed", "--sp", "2"])
    with pytest.raises(Exception, match="world size is 1: launch a multiple of 2"):
        train.main([*ARGS, "--sp", "2"])
