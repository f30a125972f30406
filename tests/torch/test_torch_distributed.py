"""Real gloo process groups (2 and 4 ranks): every rank runs the same number of micro-batches per step, ranks
are disjoint and cover the dataset in every epoch and strategy, the plan's step token counts match the
collated labels on all ranks, and gradient accumulation over variable-size micro-batches on 2 ranks gives the
full-batch gradient."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import gloo_group

from padfree import PlanConfig

STRATEGIES = ["sorted", "random", "bucketed", "packed"]


def _sampler_checks(rank, world):
    from padfree.torch import PackCollator, PadCollator, PlanBatchSampler, PlannedDataset

    rng = np.random.default_rng(0)  # same data on every rank
    lengths = np.minimum(rng.lognormal(4.2, 1.0, 500).astype(np.int64) + 1, 700)
    data = [{"input_ids": rng.integers(1, 500, n)} for n in lengths]
    for strategy in STRATEGIES:
        cfg = PlanConfig(strategy=strategy, budget=1400, grad_accum=2, seed=4)
        sampler = PlanBatchSampler(lengths, cfg)  # rank and world size from torch.distributed
        assert (sampler.rank, sampler.world_size) == (rank, world)
        collate = PackCollator() if strategy == "packed" else PadCollator()
        loader = torch.utils.data.DataLoader(PlannedDataset(data), batch_sampler=sampler, collate_fn=collate)
        for epoch in range(3):
            sampler.set_epoch(epoch)
            mine, labelled, per_step = [], {}, []
            for batch in loader:
                info = batch.info
                # one collective per micro-batch, as DDP's backward would: unequal counts would hang here
                t = torch.tensor([float(batch.loss_tokens)])
                dist.all_reduce(t)
                labelled[info.step] = labelled.get(info.step, 0.0) + t.item()
                per_step.append((info.step, info.micro, info.last, info.step_tokens))
                mine.extend(info.indices)
            everyone = [None] * world
            dist.all_gather_object(everyone, (mine, per_step))
            counts = [len(p) for _, p in everyone]
            assert len(set(counts)) == 1 and counts[0] % 2 == 0, (strategy, epoch, counts)
            ids = [i for m, _ in everyone for i in m]
            assert sorted(ids) == list(range(len(lengths))), (strategy, epoch)
            assert [p[:3] for p in per_step] == [
                (s, j, j == 1) for s in range(counts[0] // 2) for j in (0, 1)
            ]
            for step, _, _, tokens in per_step:
                assert tokens == labelled[step], (strategy, epoch, step)


def _tiny_model():
    from padfree.models import build_model

    cfg = {
        "vocab_size": 61,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    return build_model("tiny-llama", attn_implementation="sdpa", seed=1, **cfg).double()


def _gradient_checks(rank, world):
    from padfree.torch import (
        PackCollator,
        PadCollator,
        PlanBatchSampler,
        PlannedDataset,
        step_loss,
        sync_unless,
        token_loss_sum,
    )

    rng = np.random.default_rng(3)
    lengths = rng.integers(2, 60, 60)
    data = []
    for n in lengths:
        ids = rng.integers(1, 61, n)
        data.append({"input_ids": ids, "loss_mask": (rng.random(n) < 0.7).astype(np.int8)})
    loss_tokens = [int(d["loss_mask"][1:].sum()) for d in data]
    for strategy in ("bucketed", "packed"):
        model = _tiny_model()
        reference = _tiny_model()  # same seed, same weights, no DDP
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        cfg = PlanConfig(strategy=strategy, budget=150, grad_accum=3, seed=2)
        sampler = PlanBatchSampler(lengths, cfg, loss_tokens=loss_tokens)
        collate = PackCollator() if strategy == "packed" else PadCollator(pad_to_multiple_of=4)
        loader = torch.utils.data.DataLoader(PlannedDataset(data), batch_sampler=sampler, collate_fn=collate)
        step = []
        checked = 0
        for batch in loader:
            step.append(batch)
            if not batch.info.last:
                continue
            sizes = {tuple(b["input_ids"].shape) for b in step}
            for b in step:
                inputs = {k: v for k, v in b.items() if k != "labels"}
                with sync_unless(ddp, b.info.last):
                    s = token_loss_sum(ddp(**inputs).logits, b["labels"])
                    step_loss(s, b.info.step_tokens, world).backward()
            # the full batch of this step: every rank's samples, one padded batch, plain token mean
            everyone = [None] * world
            dist.all_gather_object(everyone, [i for b in step for i in b.info.indices])
            full = PadCollator()([data[i] for ids in everyone for i in ids])
            reference.zero_grad()
            ref_sum = token_loss_sum(
                reference(input_ids=full["input_ids"], attention_mask=full["attention_mask"]).logits,
                full["labels"],
            )
            (ref_sum / full.loss_tokens).backward()
            assert full.loss_tokens == step[0].info.step_tokens
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-12, msg=f"{strategy} {name}")
            assert len(sizes) > 1 or strategy == "packed"  # micro-batches of different shapes
            model.zero_grad()
            step = []
            checked += 1
        assert checked == sampler.steps_in_epoch >= 2


def _worker(rank, world, store_file, gradients):
    with gloo_group(rank, world, store_file):
        _sampler_checks(rank, world)
        if gradients:
            _gradient_checks(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_agree_partition_and_accumulate_the_full_batch_gradient(world, tmp_path):
    """Sampler checks on both; the gradient equivalence on 2 ranks (one spawn: imports paid once)."""
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), world == 2), nprocs=world, join=True)
