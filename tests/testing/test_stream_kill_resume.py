"""A streamed plan (issue 43, item 3) trained by the plain loop (:func:`padfree.torch.loop.train_loop`),
SIGKILLed at 1 rank, resumed and killed at 2, resumed at 4: every sample of the stream trains exactly once,
and the last run's steps are the unbroken run's from its checkpoint. Sources: parquet shards read in order
and a ``datasets`` streaming ``IterableDataset``; ranks are forked (:mod:`padfree.testing.forkranks`)."""

from __future__ import annotations

import json
import signal
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch

from padfree import PlanConfig
from padfree.testing import forkranks, seenlog

N = 160
CONFIG = PlanConfig(strategy="packed", budget=128, grad_accum=2, seed=7)
WINDOW = 48
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "vocab_size": 64}  # fmt: skip


def samples() -> list[dict]:
    rng = np.random.default_rng(11)
    return [{"input_ids": rng.integers(1, 64, int(n)).tolist()} for n in rng.integers(4, 60, N)]


def make_source(kind: str, root: Path):
    if kind == "parquet":
        from padfree.data.sample_streams import ShardSamples

        return ShardSamples(sorted(str(p) for p in root.glob("shard*.parquet")))
    import datasets

    from padfree.data.sample_streams import HFStreamSamples

    ds = datasets.load_dataset("parquet", data_files=sorted(str(p) for p in root.glob("shard*.parquet")),
                               split="train", streaming=True)  # fmt: skip
    return HFStreamSamples(ds, name="hf-stream")


def write_shards(root: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    data = samples()
    for j, (a, b) in enumerate(((0, 50), (50, 110), (110, N))):
        table = pa.table({"input_ids": [d["input_ids"] for d in data[a:b]]})
        pq.write_table(table, root / f"shard{j}.parquet", row_group_size=16)


def rank_main(rank: int, world: int, store: str, kind: str, root: Path, run: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from padfree.models import build_model
    from padfree.torch import PackCollator, step_loss, token_loss_sum
    from padfree.torch.attention import attention_implementation
    from padfree.torch.checkpoint import CheckpointDir
    from padfree.torch.lifecycle import StopOnSignal
    from padfree.torch.loop import resume_from, train_loop
    from padfree.torch.streamed import StreamBatchSampler, StreamDataset

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = build_model("tiny-llama", attn_implementation=attention_implementation("packed"), **TINY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = StreamBatchSampler(make_source(kind, root), CONFIG, WINDOW, rank=rank, world_size=world)
    loader = DataLoader(StreamDataset(), batch_sampler=sampler, collate_fn=PackCollator())
    ckpt = CheckpointDir(root / "ckpt", rank, world, say=lambda *a: None)
    ckpt.acquire(run)
    stop = StopOnSignal()
    state = ckpt.resume(device)
    step = 0
    if state is not None:
        step = resume_from(state, ckpt, model, optimizer, sampler)
        if rank == 0:
            (root / f"resumed-{run}.json").write_text(json.dumps({"step": step, "sampler": state["sampler"]}))
    ddp = DistributedDataParallel(model) if world > 1 else model

    def micro_step(micro_batches, step_tokens):
        loss_sum = torch.zeros(())
        for batch in micro_batches:
            labels = batch.pop("labels")
            token_losses = token_loss_sum(ddp(**batch).logits, labels)
            step_loss(token_losses, step_tokens, world).backward()
            loss_sum += token_losses.detach()
        return loss_sum, sum(b.tokens for b in micro_batches)

    seen = str(root / "seen.jsonl")
    args = Namespace(epochs=1, max_steps=None, clip=1.0, seen_log=seen, checkpoint_every=1, log_every=100,
                     quiet=True)  # fmt: skip
    parts = (sampler, loader, model, optimizer)
    try:
        count = lambda mbs: mbs[0].info.step_tokens  # noqa: E731 - the plan's loss tokens of the step
        train_loop(args, rank, device, ckpt, stop, run, parts, count, micro_step, step=step)
    finally:
        stop.restore()
        ckpt.release()
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["parquet", "datasets"])
def test_a_streamed_run_killed_at_1_and_2_ranks_resumes_at_4_every_sample_once(tmp_path, kind) -> None:
    write_shards(tmp_path)
    seen = tmp_path / "seen.jsonl"

    def main(run):
        return lambda rank, world, store: rank_main(rank, world, store, kind, tmp_path, run)

    # 1 rank: ~20 steps in the stream; killed after step 6, then after 4 more steps at 2 ranks
    assert forkranks.launch(main("a"), 1, seen, run="a", kill_at=6) == [-signal.SIGKILL]
    assert forkranks.launch(main("b"), 2, seen, run="b", kill_at=10) == [-signal.SIGKILL] * 2
    assert forkranks.launch(main("c"), 4, seen, run="c") == [0] * 4
    records = seenlog.read(seen)
    report = seenlog.check_exactly_once(records, N, epochs=1)
    assert report["ok"] and report["runs"] == 3, report
    kept = seenlog.counted(records)
    assert {r["run"] for r in kept} == {"a", "b", "c"}
    _equal_to_unbroken(tmp_path, kind, records)


def _equal_to_unbroken(tmp_path: Path, kind: str, records: list[dict]) -> None:
    """The last run is the unbroken run from its checkpoint at 4 ranks, step for step and rank for rank (in
    the stream's first epoch)."""
    from padfree.torch.streamed import StreamBatchSampler

    resumed = json.loads((tmp_path / "resumed-c.json").read_text())
    expected: dict = {}
    for rank in range(4):
        s = StreamBatchSampler(make_source(kind, tmp_path), CONFIG, WINDOW, rank=rank, world_size=4)
        s.load_state_dict(resumed["sampler"])
        for mb in s:
            assert mb.info.epoch == 0
            expected.setdefault((mb.info.step, rank), []).extend(mb)
    got: dict = {}
    for r in records:
        if r["run"] == "c" and r["epoch"] == 0:
            got.setdefault((r["step"], r["rank"]), []).append(r["index"])
    assert min(k[0] for k in got) == resumed["step"]
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in expected.items()}


def trainer_main(rank: int, world: int, store: str, kind: str, root: Path, run: str) -> None:
    import os

    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState
    from transformers import TrainerCallback, TrainingArguments

    from padfree.hf import STATE_FILE, PadfreeTrainer
    from padfree.models import build_model
    from padfree.torch import PackCollator
    from padfree.torch.attention import attention_implementation
    from padfree.torch.streamed import Stream

    torch.set_num_threads(1)
    ranks = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
    os.environ.update({k: str(v) for k, v in ranks.items()}, MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    AcceleratorState._reset_state(True)  # forked from a process that may have trained before
    PartialState._reset_state()
    torch.manual_seed(0)
    model = build_model("tiny-llama", attn_implementation=attention_implementation("packed"), **TINY)
    collate, mine = PackCollator(), {}

    def logged(items):
        mine.setdefault(items.info.step, []).extend(items.info.indices)
        return collate(items)

    seen = os.open(root / "seen.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    class Seen(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            info = trainer._padfree_info
            seenlog.append(seen, run, info.epoch, state.global_step - 1, rank, mine.pop(info.step))

    out = root / "out"
    args = TrainingArguments(str(out), gradient_accumulation_steps=CONFIG.grad_accum, max_steps=40,
                             save_steps=1, optim="sgd", learning_rate=0.1, report_to=[], use_cpu=True,
                             disable_tqdm=True, remove_unused_columns=False, logging_steps=100)  # fmt: skip
    stream = Stream(make_source(kind, root), WINDOW)
    trainer = PadfreeTrainer(model=model, args=args, stream=stream, plan_config=CONFIG, collator=logged,
                             callbacks=[Seen()])  # fmt: skip
    done = sorted(out.glob("checkpoint-*/" + STATE_FILE), key=lambda p: int(p.parent.name.split("-")[1]))
    if done and rank == 0:
        state = json.loads(done[-1].read_text())
        step = int(done[-1].parent.name.split("-")[1])
        (root / f"resumed-{run}.json").write_text(json.dumps({"step": step, "sampler": state}))
    trainer.train(resume_from_checkpoint=str(done[-1].parent) if done else None)
    os.close(seen)
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["datasets", "parquet"])
def test_padfree_trainer_streamed_killed_at_1_and_2_ranks_resumes_at_4_every_sample_once(
    tmp_path, kind
) -> None:
    write_shards(tmp_path)
    seen = tmp_path / "seen.jsonl"

    def main(run):
        return lambda rank, world, store: trainer_main(rank, world, store, kind, tmp_path, run)

    assert forkranks.launch(main("a"), 1, seen, run="a", kill_at=6) == [-signal.SIGKILL]
    assert forkranks.launch(main("b"), 2, seen, run="b", kill_at=10) == [-signal.SIGKILL] * 2
    assert forkranks.launch(main("c"), 4, seen, run="c") == [0] * 4
    records = seenlog.read(seen)
    report = seenlog.check_exactly_once(records, N, epochs=1)
    assert report["ok"] and report["runs"] == 3, report
    assert {r["run"] for r in seenlog.counted(records) if r["epoch"] == 0} == {"a", "b", "c"}
    _equal_to_unbroken(tmp_path, kind, records)
