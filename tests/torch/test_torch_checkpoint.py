"""A run owns its checkpoint directory (padfree.torch.run.checkpoint): a second run on the directory is
refused
naming the owner, a dead run's lock is taken over, a damaged newest checkpoint falls back to the previous
one, every rank resumes the checkpoint rank 0 chose or all refuse together; and SIGTERM only sets a flag
(padfree.torch.run.lifecycle). examples/train.py under these: tests/testing/test_train_lifecycle.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import gloo_group

from padfree.errors import StateError
from padfree.torch.run.checkpoint import LOCK_NAME, CheckpointDir


def _state(step: int) -> dict:
    return {
        "model": {"w": torch.full((3,), float(step))},
        "optimizer": {},
        "sampler": {"fp": 1},
        "step": step,
    }


def _said() -> tuple[list[str], object]:
    lines: list[str] = []
    return lines, lambda *a, **k: lines.append(" ".join(map(str, a)))


# ----- the directory, one process -------------------------------------------------------------------------
def test_a_second_owner_is_refused_with_one_line_naming_the_first(tmp_path: Path):
    first = CheckpointDir(tmp_path / "ck")
    first.acquire("run-a")
    owner = json.loads((tmp_path / "ck" / LOCK_NAME).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname() and owner["run"] == "run-a"
    with pytest.raises(StateError) as info:  # a second open file description: flock conflicts
        CheckpointDir(tmp_path / "ck").acquire("run-b")
    msg = str(info.value)
    assert "\n" not in msg and "in use by run run-a" in msg and f"pid {os.getpid()}" in msg, msg
    first.release()
    lines, say = _said()
    CheckpointDir(tmp_path / "ck", say=say).acquire("run-b")  # released: no takeover to report
    assert lines == []


def test_a_dead_runs_lock_is_taken_over_and_said(tmp_path: Path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    pid = int(dead.stdout)
    d = tmp_path / "ck"
    d.mkdir()
    (d / LOCK_NAME).write_text(json.dumps({"host": "h1", "pid": pid, "run": "old", "since": "t"}) + "\n")
    (d / ".step-000000004.pt.123.tmp").write_bytes(b"half a checkpoint")
    lines, say = _said()
    ck = CheckpointDir(d, say=say)
    ck.acquire("new")
    assert len(lines) == 2, lines
    assert f"took over the lock of run old (pid {pid} on host h1" in lines[0]
    assert "removed 1 temporary file" in lines[1] and not list(d.glob("*.tmp"))
    assert json.loads((d / LOCK_NAME).read_text())["run"] == "new"


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_intact_one(tmp_path: Path):
    ck = CheckpointDir(tmp_path, keep=3)
    for step in (3, 6, 9):
        ck.save(step, lambda step=step: _state(step))
    assert [p.name for p in ck.files()] == ["step-000000009.pt", "step-000000006.pt", "step-000000003.pt"]
    newest = tmp_path / "step-000000009.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    torch.save({"model": {}}, tmp_path / "step-000000006.pt")  # loads, but is not a whole checkpoint
    lines, say = _said()
    state = CheckpointDir(tmp_path, say=say).resume()
    assert state["step"] == 3 and state["path"].endswith("step-000000003.pt")
    assert len(lines) == 2 and all("damaged checkpoint" in x and "falling back" in x for x in lines), lines
    assert "step-000000009.pt" in lines[0] and "missing optimizer, sampler, step" in lines[1]
    (tmp_path / "step-000000003.pt").write_bytes(b"garbage")
    assert CheckpointDir(tmp_path, say=say).resume() is None


def test_save_keeps_the_newest_and_leaves_no_temporary_file(tmp_path: Path):
    ck = CheckpointDir(tmp_path, keep=2)
    for step in range(1, 6):
        ck.save(step, lambda step=step: _state(step))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000004.pt", "step-000000005.pt"]


# ----- every rank resumes what rank 0 chose ----------------------------------------------------------------
def _ranks(rank: int, world: int, store: str, d: str, results) -> None:
    with gloo_group(rank, world, store):
        ck = CheckpointDir(d, rank, world, say=lambda *a: None)
        out: dict = {}
        try:
            ck.acquire(f"run-{rank}")
            state = ck.resume()
            out["step"] = state["step"]
            ck.check_fingerprints("fp", "fp" if rank == 0 else "other-data")
        except StateError as exc:
            out["error"] = str(exc)
        results[rank] = out


def test_every_rank_loads_the_checkpoint_rank_0_chose_and_all_refuse_together(tmp_path: Path):
    ck = CheckpointDir(tmp_path / "ck", keep=3)
    for step in (2, 4):
        ck.save(step, lambda step=step: _state(step))
    newest = tmp_path / "ck" / "step-000000004.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    results = mp.Manager().dict()
    mp.spawn(_ranks, args=(2, str(tmp_path / "store"), str(tmp_path / "ck"), results), nprocs=2, join=True)
    assert results[0]["step"] == results[1]["step"] == 2  # both fell back with rank 0
    # rank 1 holds other data: both ranks refuse, with the same line
    assert results[0]["error"] == results[1]["error"] and "rank 1 would resume" in results[0]["error"]


def test_stop_on_signal_restores_the_previous_handler():
    from padfree.torch.run.lifecycle import StopOnSignal

    before = signal.getsignal(signal.SIGTERM)
    stop = StopOnSignal()
    assert signal.getsignal(signal.SIGTERM) != before and not stop.agreed()
    stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before
