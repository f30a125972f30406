"""A streamed plan (issue 43, item 3) trained by the plain loop (:func:`padfree.torch.run.loop.train_loop`)
and by PadfreeTrainer, SIGKILLed at 1 rank, resumed and killed at 2, resumed at 4: every sample of the stream
trains exactly once (a mixture: every sample of each source's drawn prefix), and the last run's steps are the
unbroken run's from its checkpoint. Sources: parquet shards read in order and a ``datasets`` streaming
``IterableDataset``, each once as one stream and once as a weighted mixture of two streams (``-mixed``);
ranks are forked (:mod:`padfree.testing.forkranks`)."""

from __future__ import annotations

import json
import signal
import time
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
STEP_S = 0.1
"""Seconds each step waits: a tiny model's steps take milliseconds, and the parent polls the seen-log, so a
kill would otherwise land several steps after the one it waits for (or after the epoch's end)."""
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "vocab_size": 64}  # fmt: skip


def samples() -> list[dict]:
    rng = np.random.default_rng(11)
    return [{"input_ids": rng.integers(1, 64, int(n)).tolist()} for n in rng.integers(4, 60, N)]


MIXED = CONFIG.with_(sources=(("chat", 0.7), ("code", 0.3)), unit="tokens")


def config_of(kind: str) -> tuple[PlanConfig, int | None]:
    """The plan config and window of a kind of stream (a mixture has no window)."""
    return (MIXED, None) if kind.endswith("-mixed") else (CONFIG, WINDOW)


def make_source(kind: str, root: Path):
    """One stream over the three shards, or (``-mixed``) ``chat`` over the first two and ``code`` over the
    third."""
    files = sorted(str(p) for p in root.glob("shard*.parquet"))
    if kind.endswith("-mixed"):
        base = kind.removesuffix("-mixed")
        return {"chat": _stream(base, files[:2], "chat"), "code": _stream(base, files[2:], "code")}
    return _stream(kind, files, "hf-stream")


def _stream(kind: str, files: list[str], name: str):
    if kind == "parquet":
        from padfree.data.sample_streams import ShardSamples

        return ShardSamples(files)
    import datasets

    from padfree.data.sample_streams import HFStreamSamples

    ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    return HFStreamSamples(ds, name=name)


def _made_before_fork(kind: str, root: Path):
    """The sources built once in the parent (``datasets`` resolves its files and modules there, not in
    every forked rank at once); each rank iterates its own copy."""
    built = make_source(kind, root)
    return lambda: built


def check_once(records: list[dict], kind: str) -> None:
    """Every sample of the first epoch once (a mixture: each source's drawn prefix, positions 0 .. n-1, once;
    the epoch ended when one source ran out), in the steps that count."""
    if not kind.endswith("-mixed"):
        report = seenlog.check_exactly_once(records, N, epochs=1)
        assert report["ok"] and report["runs"] == 3, report
        return
    from collections import Counter

    ids = Counter(r["index"] for r in seenlog.counted(records) if r["epoch"] == 0)
    assert set(ids.values()) == {1}, [i for i, c in ids.items() if c > 1][:5]
    sizes = {0: 110, 1: N - 110}
    drawn = {}
    for s in (0, 1):
        pos = sorted(i // 2 for i in ids if i % 2 == s)
        assert pos == list(range(len(pos))), (s, pos[:5], len(pos))
        drawn[s] = len(pos)
    assert any(sizes[s] - drawn[s] < 16 for s in (0, 1)) and min(drawn.values()) > 20, drawn


def write_shards(root: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    data = samples()
    for j, (a, b) in enumerate(((0, 50), (50, 110), (110, N))):
        table = pa.table({"input_ids": [d["input_ids"] for d in data[a:b]]})
        pq.write_table(table, root / f"shard{j}.parquet", row_group_size=16)


def rank_main(rank: int, world: int, store: str, kind: str, root: Path, run: str, made) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from padfree.models import build_model
    from padfree.recipes.loop import train_loop
    from padfree.torch import PackCollator, step_loss, token_loss_sum
    from padfree.torch.documents.attention import attention_implementation
    from padfree.torch.feed.streamed import StreamBatchSampler, StreamDataset
    from padfree.torch.run.checkpoint import CheckpointDir
    from padfree.torch.run.lifecycle import StopOnSignal
    from padfree.torch.run.loop import resume_from

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = build_model("tiny-llama", attn_implementation=attention_implementation("packed"), **TINY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config, window = config_of(kind)
    sampler = StreamBatchSampler(made(), config, window, rank=rank, world_size=world)
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
        time.sleep(STEP_S)
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
        ckpt.release()  # no destroy_process_group: the rank leaves at once (os._exit); its teardown hung once


@pytest.mark.parametrize("kind", ["parquet-mixed", "datasets"])
def test_a_streamed_run_killed_at_1_and_2_ranks_resumes_at_4_every_sample_once(tmp_path, kind) -> None:
    write_shards(tmp_path)
    seen = tmp_path / "seen.jsonl"

    def main(run):
        made = _made_before_fork(kind, tmp_path)
        return lambda rank, world, store: rank_main(rank, world, store, kind, tmp_path, run, made)

    # 1 rank: ~20 steps in the stream; killed after step 6, then after 4 more steps at 2 ranks
    assert forkranks.launch(main("a"), 1, seen, run="a", kill_at=6) == [-signal.SIGKILL]
    assert forkranks.launch(main("b"), 2, seen, run="b", kill_at=10) == [-signal.SIGKILL] * 2
    assert forkranks.launch(main("c"), 4, seen, run="c") == [0] * 4
    records = seenlog.read(seen)
    check_once(records, kind)
    assert {r["run"] for r in seenlog.counted(records)} == {"a", "b", "c"}
    _equal_to_unbroken(tmp_path, kind, records)


def _equal_to_unbroken(tmp_path: Path, kind: str, records: list[dict]) -> None:
    """The last run is the unbroken run from its checkpoint at 4 ranks, step for step and rank for rank (in
    the stream's first epoch)."""
    from padfree.torch.feed.streamed import StreamBatchSampler

    resumed = json.loads((tmp_path / "resumed-c.json").read_text())
    expected: dict = {}
    for rank in range(4):
        s = StreamBatchSampler(make_source(kind, tmp_path), *config_of(kind), rank=rank, world_size=4)
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


def trainer_main(rank: int, world: int, store: str, kind: str, root: Path, run: str, made) -> None:
    import os

    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState
    from transformers import TrainerCallback, TrainingArguments

    from padfree.hf import STATE_FILE, PadfreeTrainer
    from padfree.models import build_model
    from padfree.torch import PackCollator
    from padfree.torch.documents.attention import attention_implementation
    from padfree.torch.feed.streamed import Stream

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
            time.sleep(STEP_S)

    out = root / "out"
    args = TrainingArguments(str(out), gradient_accumulation_steps=CONFIG.grad_accum, max_steps=20,
                             save_steps=1, optim="sgd", learning_rate=0.1, report_to=[], use_cpu=True,
                             disable_tqdm=True, remove_unused_columns=False, logging_steps=100)  # fmt: skip
    config, window = config_of(kind)
    stream = Stream(made(), window)
    trainer = PadfreeTrainer(model=model, args=args, stream=stream, plan_config=config, collator=logged,
                             callbacks=[Seen()])  # fmt: skip
    done = sorted(out.glob("checkpoint-*/" + STATE_FILE), key=lambda p: int(p.parent.name.split("-")[1]))
    if done and rank == 0:
        state = json.loads(done[-1].read_text())
        step = int(done[-1].parent.name.split("-")[1])
        (root / f"resumed-{run}.json").write_text(json.dumps({"step": step, "sampler": state}))
    trainer.train(resume_from_checkpoint=str(done[-1].parent) if done else None)
    os.close(seen)  # no destroy_process_group: the rank leaves at once (os._exit)


def trainer_case(kind: str, tmp_path: Path) -> None:
    """The PadfreeTrainer case, run in a fresh interpreter by the test below: its ranks fork from a process
    whose only threads are its own (forked from a test worker that has run other tests, the Trainer's ranks
    could inherit a thread pool's held lock and hang)."""
    write_shards(tmp_path)
    seen = tmp_path / "seen.jsonl"

    def main(run):
        made = _made_before_fork(kind, tmp_path)
        return lambda rank, world, store: trainer_main(rank, world, store, kind, tmp_path, run, made)

    assert forkranks.launch(main("a"), 1, seen, run="a", kill_at=6) == [-signal.SIGKILL]
    assert forkranks.launch(main("b"), 2, seen, run="b", kill_at=10) == [-signal.SIGKILL] * 2
    assert forkranks.launch(main("c"), 4, seen, run="c") == [0] * 4
    records = seenlog.read(seen)
    check_once(records, kind)
    assert {r["run"] for r in seenlog.counted(records) if r["epoch"] == 0} == {"a", "b", "c"}
    _equal_to_unbroken(tmp_path, kind, records)


@pytest.mark.parametrize("kind", ["datasets-mixed", "parquet"])
def test_padfree_trainer_streamed_killed_at_1_and_2_ranks_resumes_at_4_every_sample_once(
    tmp_path, kind
) -> None:
    import os
    import subprocess
    import sys

    from conftest import HANG_S

    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    case = f"t.trainer_case({kind!r}, pathlib.Path({str(tmp_path)!r}))"
    code = f"import pathlib, test_stream_kill_resume as t; {case}"
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=2 * HANG_S
    )
    assert run.returncode == 0, run.stderr[-3000:]
