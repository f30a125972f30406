"""padfree.hf: transformers.Trainer / trl.SFTTrainer fed by a plan give exactly the plain loop's step.

- the example (examples/hf_trainer.py) trains on the vendored fixtures with ``bucketed`` and ``packed`` and
  writes the sampler state into its checkpoints; a run stopped at a checkpoint and resumed ends with the same
  weights as a run that never stopped;
- one SGD step through the Trainer (and through TRL's SFTTrainer) moves the parameters exactly as the plain
  PyTorch loop with padfree.torch's loss helpers, on two accumulation micro-batches of very different token
  counts; the Trainer's logged step loss is total token loss / total step tokens, not the mean of the
  micro-batch means.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from conftest import HANG_S, TINY_MODEL  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from padfree import PlanConfig  # noqa: E402
from padfree.errors import ConfigError  # noqa: E402
from padfree.hf import STATE_FILE, PadfreeTrainer, padfree_sft_trainer  # noqa: E402
from padfree.models import build_model  # noqa: E402
from padfree.torch import (  # noqa: E402
    PackCollator,
    PadCollator,
    PlanBatchSampler,
    PlannedDataset,
    step_loss,
    token_loss_sum,
)
from padfree.torch.documents.attention import attention_implementation  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
TINY = [f"{k}={v}" for k, v in TINY_MODEL.items() if k != "vocab_size"]
TINY_KW = {**TINY_MODEL, "vocab_size": 64}


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", ROOT / "examples" / "hf_trainer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run_example(out: Path, strategy: str, *extra: str):
    argv = ["--data", str(FIXTURES / "samples/gsm8k.jsonl.gz"), "--strategy", strategy, "--budget", "256",
            "--overlong", "truncate",
            "--grad-accum", "2", "--limit-samples", "48", "--vocab-size", "256", "--output-dir", str(out),
            *[a for kv in TINY for a in ("--model-set", kv)], *extra]  # fmt: skip
    return _example().main(argv)


@pytest.mark.parametrize("strategy", ["bucketed", "packed"])
def test_example_trains_saves_and_resumes_exactly(tmp_path, strategy):
    full = _run_example(tmp_path / "full", strategy, "--max-steps", "3", "--save-steps", "2")
    assert full.state.global_step == 3
    losses = [h["loss"] for h in full.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(np.isfinite(losses))
    if strategy == "packed":  # the packed keys reached the model: no attention mask, per-document positions
        assert full.model.config._attn_implementation == attention_implementation("packed")
    state = json.loads((tmp_path / "full" / "checkpoint-2" / STATE_FILE).read_text())
    assert state["history"][-1][2] == 2 and state["partial"] == 0  # 2 steps consumed, none half-way

    # stop after checkpoint-2, resume: the same third step as the run that never stopped
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-2", resumed_dir / "checkpoint-2")
    resumed = _run_example(resumed_dir, strategy, "--max-steps", "3", "--save-steps", "2", "--resume")
    assert resumed.state.global_step == 3
    a = load_file(tmp_path / "full" / "checkpoint-3" / "model.safetensors")
    b = load_file(resumed_dir / "checkpoint-3" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    s_full = json.loads((tmp_path / "full" / "checkpoint-3" / STATE_FILE).read_text())
    assert json.loads((resumed_dir / "checkpoint-3" / STATE_FILE).read_text()) == s_full
    # the logged epoch is the plan's progress, and a resumed run logs what the unbroken run logged
    probe = PlanBatchSampler(full.padfree_sampler._lengths, full.padfree_sampler.config, world_size=1, rank=0)
    per_epoch = probe.steps_in_epoch
    logged = {h["step"]: h["epoch"] for h in full.state.log_history if "loss" in h}
    assert logged == pytest.approx({s: s / per_epoch for s in (1, 2, 3)})
    assert [h["epoch"] for h in resumed.state.log_history if "loss" in h][-1] == pytest.approx(3 / per_epoch)


def test_resume_refuses_checkpoint_without_sampler_state(tmp_path):
    _run_example(tmp_path, "packed", "--max-steps", "1")
    (tmp_path / "checkpoint-1" / STATE_FILE).unlink()
    from padfree.errors import StateError

    with pytest.raises(StateError, match="no padfree sampler state"):
        _run_example(tmp_path, "packed", "--max-steps", "2", "--resume")


# ----- one optimizer step: Trainer == plain loop ------------------------------------------------------------
def _uneven_data():
    """Two accumulation micro-batches of very different token counts (a sample of 120 tokens, two of 8)."""
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(1, 64, n)} for n in (120, 8, 8)]
    lengths = [len(d["input_ids"]) for d in data]
    return data, lengths


def _plain_step(data, lengths, config, lr):
    """The plain PyTorch loop (examples/train.py) for the first optimizer step; returns params, loss sum."""
    attn = attention_implementation(config.strategy)
    model = build_model("tiny-llama", attn_implementation=attn, **TINY_KW)
    model.float()
    sampler = PlanBatchSampler(lengths, config, world_size=1, rank=0)
    collator = PackCollator() if config.strategy == "packed" else PadCollator(pad_to_multiple_of=8)
    ds = PlannedDataset(data)
    micro = [collator(ds.__getitems__(mb)) for mb in list(sampler)[: config.grad_accum]]
    assert all(b.info.step == 0 for b in micro) and micro[-1].info.last
    total, per_micro = 0.0, []
    for b in micro:
        inputs = dict(b)
        labels = inputs.pop("labels")
        s = token_loss_sum(model(**inputs).logits, labels)
        step_loss(s, b.info.step_tokens, 1).backward()
        total += s.item()
        per_micro.append((s.item(), b.loss_tokens))
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, total, per_micro, micro


def _trainer_step(tmp_path, data, lengths, config, lr, kind):
    attn = attention_implementation(config.strategy)
    model = build_model("tiny-llama", attn_implementation=attn, **TINY_KW)
    model.float()
    common = {
        "output_dir": str(tmp_path / kind),
        "gradient_accumulation_steps": config.grad_accum,
        "max_steps": 1,
        "optim": "sgd",
        "learning_rate": lr,
        "lr_scheduler_type": "constant",
        "weight_decay": 0.0,
        "max_grad_norm": 0.0,
        "remove_unused_columns": False,
        "report_to": [],
        "logging_steps": 1,
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
    }
    plan = {"lengths": lengths, "plan_config": config}
    if kind == "sft":
        from datasets import Dataset
        from transformers import LlamaTokenizer
        from trl import SFTConfig

        tok = LlamaTokenizer(vocab_file=str(FIXTURES / "tokenizers/llama_sp32k.model"))
        tok.pad_token = tok.unk_token
        rows = [{"input_ids": d["input_ids"].tolist(), "labels": d["input_ids"].tolist()} for d in data]
        args = SFTConfig(**common, dataset_kwargs={"skip_prepare_dataset": True}, max_length=None, bf16=False)
        trainer = padfree_sft_trainer()(
            model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok, **plan
        )
    else:
        trainer = PadfreeTrainer(model=model, args=TrainingArguments(**common), train_dataset=data, **plan)
    trainer.train()
    loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, loss


@pytest.mark.parametrize(
    ("strategy", "kind"),
    [("bucketed", "hf"), ("packed", "hf"), ("packed", "sft")],
    ids=["bucketed", "packed", "sft"],
)
def test_one_step_equals_plain_loop_with_uneven_micro_batches(tmp_path, strategy, kind):
    data, lengths = _uneven_data()
    config = PlanConfig(strategy=strategy, budget=127, grad_accum=2, seed=0)
    lr = 0.5
    expected, total, per_micro, micro = _plain_step(data, lengths, config, lr)
    # the plan made two micro-batches of very different sizes (119 + 7 + 7 loss tokens in all)
    small, big = sorted(b.loss_tokens for b in micro)
    assert big >= 5 * small
    step_tokens = micro[0].info.step_tokens
    assert step_tokens == 133

    got, logged = _trainer_step(tmp_path, data, lengths, config, lr, kind)
    for k, v in expected.items():  # float32 throughout: equal to rounding
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5)
    # the step loss is total token loss / total step tokens, not the mean of per-micro-batch means
    token_mean = total / step_tokens
    mean_of_means = float(np.mean([s / n for s, n in per_micro]))
    assert abs(token_mean - mean_of_means) > 0.01  # the two normalizations are distinguishable here
    assert logged == pytest.approx(token_mean, rel=2e-4)  # logs are rounded to 4 significant digits


def test_grad_accum_must_match_the_plan(tmp_path):
    data, lengths = _uneven_data()
    model = build_model("tiny-llama", **TINY_KW)
    args = TrainingArguments(str(tmp_path), gradient_accumulation_steps=1, report_to=[], use_cpu=True)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=1"):
        PadfreeTrainer(
            model=model,
            args=args,
            train_dataset=data,
            lengths=lengths,
            plan_config=PlanConfig(strategy="packed", budget=128, grad_accum=2),
        )


def test_len_and_epochs_follow_the_plan(tmp_path):
    """Epoch-based runs: exactly the plan's micro-batches of every epoch (epochs may differ in step count)."""
    rng = np.random.default_rng(1)
    data = [{"input_ids": rng.integers(1, 64, n)} for n in rng.integers(2, 60, 40)]
    lengths = [len(d["input_ids"]) for d in data]
    config = PlanConfig(strategy="bucketed", budget=96, grad_accum=2, seed=3)
    model = build_model("tiny-llama", **TINY_KW)
    args = TrainingArguments(
        str(tmp_path), gradient_accumulation_steps=2, num_train_epochs=3, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
    )  # fmt: skip
    trainer = PadfreeTrainer(model=model, args=args, train_dataset=data, lengths=lengths, plan_config=config)
    per_epoch = []
    for e in range(3):
        s = PlanBatchSampler(lengths, config, world_size=1, rank=0)
        s.set_epoch(e)
        per_epoch.append(s.steps_in_epoch)
    loader = trainer.get_train_dataloader()
    n = len(loader)
    assert n == 2 * sum(per_epoch)
    seen = [(batch.info.epoch, batch.info.step) for batch in loader]
    assert len(seen) == n and len(loader) == 0  # len() is what is left
    for e in range(3):
        assert sum(1 for ep, _ in seen if ep == e) == 2 * per_epoch[e]
    trainer.padfree_sampler.set_epoch(0)
    out = trainer.train()
    assert out.global_step == sum(per_epoch)
    assert trainer.state.epoch == pytest.approx(3.0)  # plan epochs, not the Trainer's single long one


def test_every_sampler_option_reaches_the_sampler(tmp_path):
    """The Trainer takes each keyword option of PlanBatchSampler but rank, world size and epoch, and the
    sampler it builds plans with them (here: window by window, dynamic, with its own headroom)."""
    import inspect

    from padfree.hf import SAMPLER_OPTIONS

    kw_only = [
        n for n, p in inspect.signature(PlanBatchSampler).parameters.items() if p.kind is p.KEYWORD_ONLY
    ]
    assert set(SAMPLER_OPTIONS) == set(kw_only) - {"loss_tokens", "rank", "world_size", "epoch"}
    data, lengths = _uneven_data()
    config = PlanConfig(strategy="packed", budget=160, grad_accum=2, seed=3)
    args = TrainingArguments(str(tmp_path), gradient_accumulation_steps=2, report_to=[], use_cpu=True)
    options = {"balance": "dynamic", "balance_every": 3, "balance_headroom": 0.75, "window": 5}
    trainer = PadfreeTrainer(model=build_model("tiny-llama", **TINY_KW), args=args, train_dataset=data,
                             lengths=lengths, plan_config=config, **options)  # fmt: skip
    sampler = trainer.padfree_sampler
    assert (sampler.balance, sampler.balance_every, sampler.cursor.source.window) == ("dynamic", 3, 5)
    assert sampler.balance_stats()["plan_budget"] == 120  # 0.75 x 160
    want = PlanBatchSampler(lengths, config, rank=0, world_size=1, **options)
    assert [list(m) for m in sampler] == [list(m) for m in want]


def test_ddp_two_ranks_equals_plain_loop_over_the_whole_step(tmp_path):
    """2 CPU ranks (gloo): the DDP step of the Trainer equals one process running all 4 micro-batches of
    the step with the plain loop's normalization, with ``average_tokens_across_devices`` on and off."""
    import os
    import subprocess

    sys.path.insert(0, str(ROOT / "tests"))
    import hf_ddp_worker as w

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "hf_ddp_worker.py"), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]

    data, lengths = w.ddp_data()
    model = build_model("tiny-llama", attn_implementation=attention_implementation("packed"), **w.TINY_KW)
    ds, collator = PlannedDataset(data), PackCollator()
    micro = []
    for rank in (0, 1):
        sampler = PlanBatchSampler(lengths, w.CONFIG, world_size=2, rank=rank)
        micro += [collator(ds.__getitems__(mb)) for mb in list(sampler)[: w.CONFIG.grad_accum]]
    assert {b.info.step for b in micro} == {0}
    counts = [b.loss_tokens for b in micro]
    assert sum(counts) == micro[0].info.step_tokens and max(counts) >= 3 * min(counts)
    for b in micro:
        inputs = dict(b)
        labels = inputs.pop("labels")
        step_loss(token_loss_sum(model(**inputs).logits, labels), b.info.step_tokens, 1).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= w.LR * p.grad
    expected = model.state_dict()
    for average in (True, False):
        got = torch.load(tmp_path / f"params-{average}.pt")
        for k, v in expected.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5)

    # dynamic balancing: the Trainer timed every micro-batch, both ranks refit the same balance, and each
    # of the 3 epochs consumed every sample once
    runs = [json.loads((tmp_path / f"dynamic-{r}.json").read_text()) for r in (0, 1)]
    stats = [r["stats"] for r in runs]
    assert stats[0]["fitted"] and stats[0]["exchanges"] >= 3 and stats[0]["records"] > 0
    assert stats[0]["speeds"] == stats[1]["speeds"] and stats[0]["cost"] == stats[1]["cost"]
    seen = sorted(runs[0]["seen"] + runs[1]["seen"])
    assert seen == sorted(list(range(4 * len(w.ddp_data()[0]))) * 3)


def test_checkpoint_state_is_what_was_consumed_despite_prefetch(tmp_path):
    """With DataLoader workers the sampler runs ahead of training; each checkpoint still records the state
    right after its own last step."""
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(1, 64, n)} for n in rng.integers(2, 60, 40)]
    config = PlanConfig(strategy="packed", budget=96, grad_accum=2, seed=0)
    args = TrainingArguments(
        str(tmp_path), gradient_accumulation_steps=2, max_steps=3, remove_unused_columns=False, report_to=[],
        use_cpu=True, dataloader_num_workers=2, save_steps=1, disable_tqdm=True,
    )  # fmt: skip
    lengths = [len(d["input_ids"]) for d in data]
    trainer = PadfreeTrainer(
        model=build_model("tiny-llama", **TINY_KW), args=args, train_dataset=data, lengths=lengths,
        plan_config=config,
    )  # fmt: skip
    trainer.train()
    assert trainer.padfree_sampler.state_dict()["history"][-1][2] > 3  # the workers prefetched past step 3
    for step in (1, 2, 3):
        state = json.loads((tmp_path / f"checkpoint-{step}" / STATE_FILE).read_text())
        assert state["history"] == [[1, 2, step]] and state["partial"] == 0


@pytest.mark.slow
def test_accelerate_launch_gives_the_sampler_its_rank_and_world_size(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` on CPU runs two processes (gloo): each sampler
    gets its own rank and world size 2, the ranks train disjoint samples of the same steps, and the
    checkpoint records world size 2. (Without ``--multi_gpu`` accelerate starts a single process on a machine
    without GPUs; docs/hf.md says so.)"""
    import os
    import shutil as sh
    import subprocess

    exe = sh.which("accelerate", path=str(Path(sys.executable).parent)) or sh.which("accelerate")
    if exe is None:
        pytest.fail("the accelerate CLI is not installed (the hf extra installs it)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [exe, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", "--main_process_port", "0",
           str(ROOT / "tests" / "hf_accelerate_worker.py"), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"], r["process_index"]) for r in ranks] == [(0, 2, 0), (1, 2, 1)]
    assert ranks[0]["seen"] and not set(ranks[0]["seen"]) & set(ranks[1]["seen"])
    state = json.loads((tmp_path / "checkpoint-2" / STATE_FILE).read_text())
    assert state["history"][-1][:2] == [2, 2] and state["history"][-1][2] == 2
