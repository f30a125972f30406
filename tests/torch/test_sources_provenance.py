"""Provenance on every token (issue 43): the sampler takes weighted sources, the collators emit each token's
source beside its document, the per-source losses equal a per-document brute force, and the plain loop and
PadfreeTrainer log them."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from padfree import PlanConfig
from padfree.core import sources as S
from padfree.errors import ConfigError
from padfree.torch import (
    PackCollator,
    PadCollator,
    PlanBatchSampler,
    PlannedDataset,
    source_loss_sums,
    token_loss_sum,
)

WEIGHTS = (("chat", 0.5), ("code", 0.3), ("math", 0.2))
SIZES = {"chat": 30, "code": 12, "math": 5}


def _data(seed: int = 0) -> tuple[dict[str, np.ndarray], list[dict]]:
    """Per-source lengths and the concatenated dataset (sources in the config's order)."""
    rng = np.random.default_rng(seed)
    lengths = {name: rng.integers(3, 40, SIZES[name]) for name, _ in WEIGHTS}
    data = [{"input_ids": rng.integers(1, 60, int(n)).tolist()} for name, _ in WEIGHTS for n in lengths[name]]
    return lengths, data


def _cfg(strategy: str = "packed", **kw: object) -> PlanConfig:
    return PlanConfig(strategy=strategy, budget=64, grad_accum=2, sources=WEIGHTS, epoch_steps=6, **kw)


@pytest.mark.parametrize("strategy", ["packed", "bucketed"])
def test_every_token_carries_its_source(strategy: str) -> None:
    lengths, data = _data()
    sampler = PlanBatchSampler(lengths, _cfg(strategy), rank=0, world_size=2)
    starts = np.cumsum([0, *SIZES.values()])
    collate = PackCollator() if strategy == "packed" else PadCollator()
    ds = PlannedDataset(data)
    n = 0
    for mb in sampler:
        batch = collate(ds.__getitems__(mb))
        assert batch.source_ids is not None and batch.source_ids.shape == batch["labels"].shape
        expect = np.searchsorted(starts, np.asarray(mb), side="right") - 1
        assert list(mb.info.sources) == expect.tolist()
        got = batch.source_ids.numpy()
        if strategy == "packed":  # one row: each document's tokens carry its source
            assert got[0].tolist() == np.repeat(expect, [len(data[i]["input_ids"]) for i in mb]).tolist()
        else:
            for r, i in enumerate(mb):
                width = len(data[i]["input_ids"])
                assert (got[r, :width] == expect[r]).all() and (got[r, width:] == -1).all()
        n += 1
    assert n == 6 * 2  # 6 steps x grad_accum 2 on this rank


def test_source_losses_equal_each_document_alone() -> None:
    torch.manual_seed(0)
    lengths, data = _data(1)
    sampler = PlanBatchSampler(lengths, _cfg(), rank=0, world_size=1)
    mb = next(iter(sampler))
    batch = PackCollator()(PlannedDataset(data).__getitems__(mb))
    vocab = 60
    logits = torch.randn(1, batch["labels"].shape[1], vocab)
    sums = source_loss_sums(logits, batch["labels"], batch.source_ids, 3)
    # brute force: each document's own loss, summed by its source
    expect = torch.zeros(2, 3, dtype=torch.float64)
    at = 0
    for i, s in zip(mb, mb.info.sources, strict=True):
        width = len(data[i]["input_ids"])
        lab = batch["labels"][:, at : at + width]
        expect[0, s] += token_loss_sum(logits[:, at : at + width], lab).double()
        expect[1, s] += float((lab[:, 1:] != -100).sum())
        at += width
    assert torch.allclose(sums, expect, atol=1e-6)
    assert float(sums[1].sum()) == batch.loss_tokens
    assert torch.isclose(sums[0].sum(), token_loss_sum(logits, batch["labels"]).double(), atol=1e-5)
    per_source = S.source_token_sums(batch.source_ids.numpy(), np.ones(batch.source_ids.shape), 3)
    assert per_source.tolist() == np.bincount(np.asarray(mb.info.sources), weights=[
        len(data[i]["input_ids"]) for i in mb], minlength=3).tolist()  # fmt: skip


def test_sampler_resumes_sources_at_another_world_size() -> None:
    lengths, _ = _data(2)
    cfg = _cfg()
    run = [PlanBatchSampler(lengths, cfg, rank=r, world_size=2) for r in range(2)]
    its = [iter(s) for s in run]
    seen = [i for _ in range(3 * 2) for it in its for i in next(it)]  # 3 steps
    state = run[0].state_dict()
    assert state["sources"]["steps"] == 3 and sum(state["sources"]["drawn"]) == len(seen)
    more = [PlanBatchSampler(lengths, cfg.with_(grad_accum=1), rank=r, world_size=4) for r in range(4)]
    for s in more:
        s.load_state_dict(state)
    sizes = np.array(list(SIZES.values()))
    edges = np.cumsum([0, *sizes])
    seen_src = np.searchsorted(edges, seen, side="right") - 1
    assert list(more[0].cursor.counters().drawn) == np.bincount(seen_src, minlength=3).tolist()
    rest = [i for s in more for mb in s for i in mb]
    assert more[0].steps_in_epoch == 6
    all_src = np.searchsorted(edges, seen + rest, side="right") - 1
    assert list(more[0].cursor.counters().drawn) == np.bincount(all_src, minlength=3).tolist()
    counts = np.bincount(seen + rest, minlength=int(sizes.sum()))
    for a, b in zip(np.cumsum([0, *sizes])[:-1], np.cumsum(sizes), strict=True):
        assert counts[a:b].max() - counts[a:b].min() <= 1  # exactly once per pass of each source


def test_sampler_refuses_bad_sources_in_one_line() -> None:
    lengths, _ = _data()
    with pytest.raises(ConfigError, match="source 'math': empty"):
        PlanBatchSampler({**lengths, "math": []}, _cfg(), rank=0, world_size=1)
    with pytest.raises(ConfigError, match="balance='static'"):
        PlanBatchSampler(lengths, _cfg(), rank=0, world_size=2, balance="dynamic")
    with pytest.raises(ConfigError, match="per source: a mapping"):
        PlanBatchSampler(np.arange(1, 10), _cfg(), rank=0, world_size=1)


def test_plain_loop_logs_the_loss_per_source(tmp_path, capsys) -> None:
    from conftest import TINY_MODEL

    from padfree.models import build_model
    from padfree.recipes.loop import train_loop
    from padfree.torch.run.lifecycle import StopOnSignal

    torch.manual_seed(0)
    lengths, data = _data(3)
    cfg = _cfg()
    sampler = PlanBatchSampler(lengths, cfg, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(
        PlannedDataset(data), batch_sampler=sampler, collate_fn=PackCollator()
    )
    model = build_model("tiny-llama", attn_implementation="sdpa", **{**TINY_MODEL, "vocab_size": 64})
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def micro_step(micro_batches, step_tokens):
        loss_sum, tokens, by = torch.zeros(()), 0, torch.zeros(2, 3, dtype=torch.float64)
        for b in micro_batches:
            inputs = dict(b)
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            s = token_loss_sum(logits, labels)
            (s / step_tokens).backward()
            loss_sum += s.detach()
            tokens += b.tokens
            by += source_loss_sums(logits, labels, b.source_ids, 3)
        return loss_sum, tokens, by

    args = argparse.Namespace(
        seen_log=None, epochs=1, clip=0.0, max_steps=None, checkpoint_every=0, log_every=3
    )
    stop = StopOnSignal()
    try:
        code = train_loop(
            args, 0, torch.device("cpu"), None, stop, "r", (sampler, loader, model, opt),
            lambda mbs: mbs[0].info.step_tokens, micro_step,
        )  # fmt: skip
    finally:
        stop.restore()
    assert code == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("loss by source")]
    assert len(lines) == 3  # the first step (said at once), then steps 3 and 6
    for name, _ in WEIGHTS:
        assert f" {name} " in lines[0]
    mean = float(lines[0].split("chat ")[1].split()[0])
    assert 3.0 < mean < 5.5  # a random 64-token model: about ln 64 = 4.16


def test_trainer_logs_the_loss_per_source(tmp_path) -> None:
    pytest.importorskip("transformers")
    from conftest import TINY_MODEL
    from transformers import TrainingArguments

    from padfree.hf import PadfreeTrainer
    from padfree.models import build_model
    from padfree.torch.documents.attention import attention_implementation

    torch.manual_seed(0)
    lengths, data = _data(4)
    cfg = _cfg()
    model = build_model(
        "tiny-llama",
        attn_implementation=attention_implementation("packed"),
        **{**TINY_MODEL, "vocab_size": 64},
    )
    args = TrainingArguments(
        str(tmp_path), gradient_accumulation_steps=2, max_steps=4, logging_steps=2, report_to=[],
        remove_unused_columns=False, use_cpu=True, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = PadfreeTrainer(model=model, args=args, train_dataset=data, lengths=lengths, plan_config=cfg)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    for h in logged:
        for name, _ in WEIGHTS:
            assert 2.0 < h[f"loss_{name}"] < 6.0
