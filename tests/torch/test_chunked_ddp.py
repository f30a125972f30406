"""Chunked plans under DDP (2 gloo ranks): each step all-reduces once, the same buckets on both ranks, the
gradient equals the step's documents trained whole (float64), every token of the epoch is trained once, and
the run ends within a deadline (a rank stuck in a collective fails the test instead of hanging it)."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import gloo_group

from padfree import PlanConfig

BUDGET = 24


def _tiny_model():
    from padfree.models import build_model

    cfg = {"vocab_size": 61, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512}  # fmt: skip
    return build_model("tiny-llama", attn_implementation="sdpa", seed=1, **cfg).double()


def _checks(rank: int, world: int, explicit_sync: bool) -> None:
    from padfree.torch import PackCollator, PlanBatchSampler, PlannedDataset, sync_unless, token_loss_sum
    from padfree.torch.execution.chunked import run_step

    rng = np.random.default_rng(3)  # the same data on every rank
    lengths = np.concatenate([rng.integers(2, 20, 40), rng.integers(BUDGET + 1, 4 * BUDGET, 6)])
    data = [{"input_ids": rng.integers(1, 61, n)} for n in lengths]
    model, reference = _tiny_model(), _tiny_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    calls: list[int] = []

    def counting(state, bucket):  # DDP's default all-reduce, counted
        calls.append(1)
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / world)

    ddp.register_comm_hook(None, counting)
    sampler = PlanBatchSampler(lengths, PlanConfig(strategy="chunked", budget=BUDGET, grad_accum=4, seed=2))
    loader = torch.utils.data.DataLoader(
        PlannedDataset(data), batch_sampler=sampler, collate_fn=PackCollator(chunked=True)
    )
    step, per_step, chunked = [], [], 0
    pieces: list[tuple[int, int, int]] = []  # (sample, start, tokens) this rank trained
    for batch in loader:
        step.append(batch)
        if not batch.info.last:
            continue
        before = len(calls)
        tokens = batch.info.step_tokens
        if explicit_sync:
            run_step(ddp, step, world / tokens, sync=lambda final: sync_unless(ddp, final))
        else:  # no sync given: a DDP model still reduces once per step (it reduced once per row, and hung)
            run_step(ddp, step, world / tokens)
        per_step.append(len(calls) - before)
        chunked += sum(1 for b in step if b.info.starts and b.info.starts[0] > 0)
        pieces += [p for b in step for p in zip(b.info.indices, b.info.starts, b.info.lengths, strict=True)]
        everyone = [None] * world
        mine = {}
        for b in step:
            for i, s, n in zip(b.info.indices, b.info.starts, b.info.lengths, strict=True):
                mine[i] = max(mine.get(i, 0), s + n)
        dist.all_gather_object(everyone, mine)
        reference.zero_grad()
        for docs in everyone:
            for i, n in docs.items():
                ids = torch.as_tensor(data[i]["input_ids"][:n])[None]
                labels = ids.clone()
                labels[0, 0] = -100
                (token_loss_sum(reference(input_ids=ids).logits, labels) / tokens).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-12, msg=name)
        model.zero_grad()
        step = []
    everyone_chunked = [None] * world
    dist.all_gather_object(everyone_chunked, (chunked, per_step))
    assert sum(c for c, _ in everyone_chunked) >= 6  # long documents ran chunked
    patterns = {tuple(p) for _, p in everyone_chunked}
    assert len(patterns) == 1 and len(set(per_step)) == 1 and per_step[0] >= 1  # one reduction per step
    trained: list = [None] * world
    dist.all_gather_object(trained, pieces)
    covered = np.zeros(int(lengths.sum()), np.int64)  # every token of every sample, across both ranks
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for i, s, n in (p for part in trained for p in part):
        covered[first[i] + s : first[i] + s + n] += 1
    assert (covered == 1).all(), (
        f"{int((covered == 0).sum())} tokens never trained, {int((covered > 1).sum())} twice"
    )


def _worker(rank: int, world: int, store_file: str) -> None:
    with gloo_group(rank, world, store_file):
        _checks(rank, world, explicit_sync=True)
        _checks(rank, world, explicit_sync=False)


DEADLINE = 240.0  # seconds for the whole run (about 60 s on two loaded cores)


def test_ddp_reduces_once_per_step_and_equals_whole_documents(tmp_path) -> None:
    ctx = mp.start_processes(_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=False)
    end = time.monotonic() + DEADLINE
    try:
        while not ctx.join(timeout=max(end - time.monotonic(), 0.1)):
            assert time.monotonic() < end, f"chunked DDP on 2 gloo ranks still running after {DEADLINE:.0f} s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
