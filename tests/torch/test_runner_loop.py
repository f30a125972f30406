"""The plain loop (:func:`padfree.recipes.loop.train_loop` around :meth:`padfree.torch.StepRunner.step`)
trains SP=2 and CP=2 on 2 forked gloo ranks: one SGD step moves the parameters as the step's documents do,
each run alone through the model's own attention on one process; also with a truncated sample whose loss
tokens the plan cannot count (assistant-only loss), which the ranks of a group then count once."""

from __future__ import annotations

import argparse
import datetime

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from conftest import HANG_S  # noqa: E402

from padfree import PlanConfig  # noqa: E402
from padfree.errors import ConfigError  # noqa: E402
from padfree.models import build_model  # noqa: E402
from padfree.torch import (  # noqa: E402
    PackCollator,
    PlanBatchSampler,
    PlannedDataset,
    StepRunner,
    token_loss_sum,
)

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 64}  # fmt: skip
LR = 0.5


def _data(overlong: str) -> tuple[list[dict], list[int], list[int] | None]:
    """Odd lengths (rows padded for the shards); with ``truncate`` samples over the row and loss on the last
    two thirds of each sample only (``loss_tokens`` given, which the plan cannot count on a cut sample)."""
    rng = np.random.default_rng(7)
    if overlong == "error":
        items = [{"input_ids": rng.integers(1, 64, n)} for n in (37, 21, 9, 45, 13, 27, 5, 31)]
        return items, [len(d["input_ids"]) for d in items], None
    items = []
    for n in (130, 21, 109, 45, 117, 27, 5, 31):  # a row holds 48 x 2 tokens
        ids = rng.integers(1, 64, n)
        labels = ids.copy()
        labels[: n // 3] = -100
        items.append({"input_ids": ids, "labels": labels})
    return items, [len(d["input_ids"]) for d in items], [int((d["labels"][1:] != -100).sum()) for d in items]


def _alone(items: list[dict], config: PlanConfig, micro: list, loss_tokens) -> dict[str, torch.Tensor]:
    """The parameters after one SGD step of the step's rows, every document run alone under ``sdpa``."""
    model = build_model("tiny-llama", attn_implementation="sdpa", seed=2, **TINY)
    collate = PackCollator(sp=config.sp, cp=config.cp)
    rows = [collate(PlannedDataset(items).__getitems__(mb)) for mb in micro]
    tokens = sum(r.loss_tokens for r in rows)
    if loss_tokens is None:
        assert tokens == micro[0].info.step_tokens
        assert sum(int(r["input_ids"].shape[1]) - r.tokens for r in rows) > 0  # rows padded for the shards
    else:  # a cut sample with a custom loss count: the plan leaves the count to the loop
        assert micro[0].info.step_tokens is None
        assert any(
            n < len(items[i]["input_ids"]) for mb in micro for i, n in zip(mb.info.indices, mb.info.lengths)
        )
    for row in rows:
        starts, lengths = row["cu_seq_lens_q_padded"][:-1], torch.diff(row["cu_seq_lens_q"])
        for a, n in zip(starts.tolist(), lengths.tolist()):
            ids, labels = row["input_ids"][:, a : a + n], row["labels"][:, a : a + n]
            (token_loss_sum(model(input_ids=ids).logits, labels) / tokens).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return model.state_dict()


@pytest.mark.parametrize(
    ("shard", "overlong"), [({"sp": 2}, "error"), ({"cp": 2}, "error"), ({"cp": 2}, "truncate")]
)
def test_plain_loop_trains_sp_and_cp_with_the_unsharded_rows_gradients(tmp_path, shard, overlong):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from padfree.recipes.loop import train_loop
    from padfree.testing.forkranks import launch
    from padfree.torch.run.lifecycle import StopOnSignal

    items, lengths, loss = _data(overlong)
    config = PlanConfig(strategy="packed", budget=48, grad_accum=2, seed=1, overlong=overlong, **shard)
    model = build_model("tiny-llama", attn_implementation="padfree_varlen", seed=2, **TINY)
    args = argparse.Namespace(seen_log=None, epochs=1, clip=0.0, max_steps=1, checkpoint_every=0, log_every=1,
                              quiet=True)  # fmt: skip

    def one_step(rank: int, world: int) -> None:  # its objects (DDP's reducer) go before the process group
        stop = StopOnSignal()
        try:
            runner = StepRunner(config, model, rank=rank, world=world)
            assert runner.mode == "sharded" and runner.sampler_ranks == {"dp_rank": 0, "dp_size": 1}
            sampler = PlanBatchSampler(lengths, config, loss_tokens=loss, **runner.sampler_ranks)
            collate = PackCollator(**shard)
            loader = DataLoader(PlannedDataset(items), batch_sampler=sampler, collate_fn=collate)
            ddp = DistributedDataParallel(model)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            code = train_loop(
                args, rank, torch.device("cpu"), None, stop, "runner", (sampler, loader, model, opt),
                runner.step_tokens, lambda mbs, n: runner.step(ddp, mbs, n), seen_here=runner.leads,
            )  # fmt: skip
            assert code == 0 and sampler.step == 1
            torch.save(model.state_dict(), tmp_path / f"params-{rank}.pt")
        finally:
            stop.restore()

    def rank_main(rank: int, world: int, store: str) -> None:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}",
                                timeout=datetime.timedelta(seconds=HANG_S))  # fmt: skip
        try:
            one_step(rank, world)
        finally:
            dist.destroy_process_group()

    launch(rank_main, 2, tmp_path / "no-seen-log", run="runner-loop", timeout=HANG_S)
    unsharded = PlanBatchSampler(lengths, config, loss_tokens=loss, dp_rank=0, dp_size=1)
    micro = list(unsharded)[: config.grad_accum]
    want = _alone(items, config, micro, loss)
    before = model.state_dict()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"params-{rank}.pt")
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {k}")
    assert max((v - before[k]).abs().max() for k, v in want.items()) > 1e-3  # the step moved the weights


def test_the_runner_decides_the_mode_once_and_refuses_what_sp_cp_cannot_run():
    model = build_model("tiny-llama", attn_implementation="padfree_varlen", seed=2, **TINY)
    plain = StepRunner(PlanConfig(strategy="packed", budget=64), model, rank=3, world=4)
    assert (plain.mode, plain.sampler_ranks, plain.leads) == ("plain", {"dp_rank": 3, "dp_size": 4}, True)
    assert plain.reach == 64
    chunked = StepRunner(PlanConfig(strategy="chunked", budget=64, grad_accum=4), model)
    assert (chunked.mode, chunked.reach) == ("whole_documents", 256)
    refusals = [
        ({"strategy": "bucketed", "sp": 2}, 2, "--sp/--cp shard packed rows: use --strategy packed"),
        ({"strategy": "packed", "cp": 2}, 3, "world size is 3: launch a multiple of 2"),
        ({"strategy": "packed", "sp": 2}, 2, "needs torch.distributed"),  # checked last: nothing else wrong
    ]
    for fields, world, rule in refusals:
        with pytest.raises(ConfigError, match=rule) as err:
            StepRunner(PlanConfig(budget=64, **fields), model, rank=0, world=world)
        assert "\n" not in str(err.value)
    assert model.config._attn_implementation == "padfree_varlen"  # refused before it switched the attention
