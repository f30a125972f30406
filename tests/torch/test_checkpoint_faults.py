"""A checkpoint directory that cannot be turned against its owner, and writes that fail cleanly: LOCK and the
checkpoint files are never followed through a link nor opened when they are not regular files (nothing
outside the directory changes); a failed write (read-only, full device, I/O error) is one line on every rank,
leaves no temporary file and the last good checkpoint intact, and the resume after it runs every sample
exactly once; ``keep`` never removes the run's own new checkpoints."""

from __future__ import annotations

import datetime
import errno
import os
import stat
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from padfree import PlanConfig, make_plan
from padfree.core.fingerprint import explain
from padfree.errors import StateError
from padfree.torch import PlanBatchSampler
from padfree.torch.run.checkpoint import LOCK_NAME, CheckpointDir


def _state(step: int, sampler: dict | None = None) -> dict:
    return {
        "model": {"w": torch.full((3,), float(step))},
        "optimizer": {},
        "sampler": sampler or {},
        "step": step,
    }


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# ----- the lock and the files are the directory's own -----------------------------------------------------
def test_a_lock_that_is_a_link_fifo_or_folder_is_refused_and_its_target_untouched(tmp_path: Path):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me\n")
    cases = {
        "link": lambda lock: lock.symlink_to(outside),
        "dangling link": lambda lock: lock.symlink_to(tmp_path / "nowhere"),
        "fifo": lambda lock: os.mkfifo(lock),
        "folder": lambda lock: lock.mkdir(),
    }
    for name, make in cases.items():
        d = tmp_path / name.replace(" ", "-")
        d.mkdir()
        make(d / LOCK_NAME)
        with pytest.raises(StateError) as exc:
            CheckpointDir(d).acquire("run")
        msg = str(exc.value)
        assert (
            "\n" not in msg and LOCK_NAME in msg and ("symbolic link" in msg or "not a regular file" in msg)
        )
        assert outside.read_text() == "keep me\n"
    assert not (tmp_path / "nowhere").exists()  # O_CREAT never followed the dangling link


def test_a_lock_that_is_a_hard_link_or_a_socket_is_refused_and_the_other_file_untouched(tmp_path: Path):
    """A hard link passes O_NOFOLLOW and the regular-file check, yet is the outside file itself: taking the
    lock (truncate, write the owner) would overwrite it."""
    import socket

    outside = tmp_path / "precious.txt"
    outside.write_text("keep me\n")
    d = tmp_path / "ck"
    d.mkdir()
    os.link(outside, d / LOCK_NAME)
    with pytest.raises(StateError, match="2 hard links") as exc:
        CheckpointDir(d).acquire("run")
    assert "\n" not in str(exc.value) and outside.read_text() == "keep me\n"
    s = tmp_path / "sock"
    s.mkdir()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(s / LOCK_NAME))
        with pytest.raises(StateError, match=f"{LOCK_NAME}: the lock file is not a regular file"):
            CheckpointDir(s).acquire("run")


def test_checkpoint_files_that_are_not_regular_are_skipped_and_a_planted_temporary_is_not_followed(
    tmp_path: Path, monkeypatch
):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me\n")
    d = tmp_path / "ck"
    lines: list[str] = []
    ck = CheckpointDir(d, say=lines.append)
    ck.acquire("run")
    ck.save(1, lambda: _state(1))
    os.mkfifo(d / "step-000000003.pt")  # would block torch.load forever
    (d / "step-000000002.pt").symlink_to(outside)
    path, state = ck.newest_intact()
    assert path.name == "step-000000001.pt" and state["step"] == 1
    assert sum("not a regular file" in line for line in lines) == 2
    # a link planted where the next temporary goes: the exclusive, no-follow create refuses it
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    (d / ".step-000000004.pt.4242.tmp").symlink_to(outside)
    with pytest.raises(StateError, match="cannot write the checkpoint") as exc:
        ck.save(4, lambda: _state(4))
    assert "\n" not in str(exc.value) and outside.read_text() == "keep me\n"
    ck.release()


# ----- a failed write: one line, no temporary, the last good checkpoint intact ----------------------------
class _FullAfter:
    """A file whose writes fail with ``err`` once ``limit`` bytes were written."""

    def __init__(self, f, err: int, limit: int) -> None:
        self.f, self.err, self.limit, self.n = f, err, limit, 0

    def write(self, data) -> int:
        self.n += len(data)
        if self.n > self.limit:
            raise OSError(self.err, os.strerror(self.err))
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *a) -> None:
        self.f.close()


def _fail(monkeypatch, how: str) -> None:
    real_fdopen, real_open = os.fdopen, os.open
    if how in ("ENOSPC", "EIO"):
        err = getattr(errno, how)
        monkeypatch.setattr(os, "fdopen", lambda *a, **k: _FullAfter(real_fdopen(*a, **k), err, 1000))
    elif how == "read-only":  # what a folder made read-only after the lock gives (root ignores chmod)

        def ro(path, flags, *a, **k):
            if str(path).endswith(".tmp"):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_open(path, flags, *a, **k)

        monkeypatch.setattr(os, "open", ro)
    elif how in ("fsync", "replace"):

        def eio(*a, **k):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, how, eio)
    elif how in ("dir-fsync", "dir-fsync-unsupported"):  # the rename done, then the folder's fsync fails
        real_fsync, code = os.fsync, errno.EIO if how == "dir-fsync" else errno.EINVAL

        def dir_fails(fd):
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(code, os.strerror(code))
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", dir_fails)


@pytest.mark.parametrize("how", ["ENOSPC", "EIO", "read-only", "fsync", "replace", "dir-fsync"])
def test_a_failed_write_is_one_line_leaves_no_temporary_and_the_last_good_checkpoint(
    tmp_path, monkeypatch, how
):
    d = tmp_path / "ck"
    ck = CheckpointDir(d, keep=2, say=lambda *a: None)
    ck.acquire("run")
    ck.save(1, lambda: _state(1))
    ck.save(2, lambda: _state(2))
    with monkeypatch.context() as m:
        _fail(m, how)
        with pytest.raises(StateError) as exc:
            ck.save(3, lambda: _state(3) | {"model": {"w": torch.zeros(100_000)}})
    msg = str(exc.value)
    assert (
        "\n" not in msg and "cannot write the checkpoint" in msg and "step-000000002.pt, is intact" in msg
    ), msg
    assert _names(d) == [LOCK_NAME, "step-000000001.pt", "step-000000002.pt"]  # no .tmp, nothing removed
    path, state = ck.newest_intact()
    assert path.name == "step-000000002.pt" and state["step"] == 2
    ck.release()


def test_a_folder_that_cannot_be_fsynced_is_no_failure(tmp_path, monkeypatch):
    """EINVAL from a directory's fsync (file systems that do not support it) is not an I/O error."""
    ck = CheckpointDir(tmp_path / "ck", say=lambda *a: None)
    ck.acquire("run")
    with monkeypatch.context() as m:
        _fail(m, "dir-fsync-unsupported")
        ck.save(1, lambda: _state(1))
    assert ck.newest_intact()[0].name == "step-000000001.pt"
    ck.release()


def test_the_resume_after_a_failed_write_runs_every_sample_exactly_once(tmp_path, monkeypatch):
    lengths = np.random.default_rng(1).integers(1, 300, 300)
    cfg = PlanConfig(strategy="packed", budget=512, grad_accum=2, seed=3)
    d = tmp_path / "ck"
    ck = CheckpointDir(d, say=lambda *a: None)
    ck.acquire("run")
    sampler = PlanBatchSampler(lengths, cfg, rank=0, world_size=1)
    it = iter(sampler)
    done: list[int] = []
    for step in range(1, 7):
        done += [i for _ in range(2) for i in next(it)]
        if step == 3:
            ck.save(step, lambda: _state(3, sampler.state_dict()))
            kept = list(done)
        if step == 6:
            with monkeypatch.context() as m:
                _fail(m, "ENOSPC")
                with pytest.raises(StateError, match="No space left on device"):
                    ck.save(
                        step, lambda: _state(6, sampler.state_dict()) | {"model": {"w": torch.zeros(10**5)}}
                    )
    ck.release()  # the run stops here
    again = CheckpointDir(d, say=lambda *a: None)
    again.acquire("run-2")
    state = again.resume()
    assert state["step"] == 3
    resumed = PlanBatchSampler(lengths, cfg, rank=0, world_size=1)
    resumed.load_state_dict(state["sampler"])
    rest = [i for mb in resumed for i in mb]
    want = Counter(make_plan(lengths, cfg.with_(world_size=1, grad_accum=1), 0).indices.tolist())
    assert Counter(kept + rest) == want
    again.release()


def _ranks_fail(rank: int, world: int, store: str, d: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        ck = CheckpointDir(d, rank, world, say=lambda *a: None)
        out: dict = {}
        try:
            ck.acquire("run")
            ck.save(1, lambda: _state(1))
            if rank == 0:  # only rank 0 writes, and its disk is full
                real = os.fdopen
                os.fdopen = lambda *a, **k: _FullAfter(real(*a, **k), errno.ENOSPC, 100)
            ck.save(2, lambda: _state(2))
            out["saved"] = True
        except StateError as exc:
            out["error"] = str(exc)
        results[rank] = out
        dist.barrier()  # every rank got here: none is left waiting for another
    finally:
        dist.destroy_process_group()


def test_a_failed_write_stops_every_rank_with_the_same_line(tmp_path: Path):
    results = mp.Manager().dict()
    d = tmp_path / "ck"
    mp.spawn(_ranks_fail, args=(2, str(tmp_path / "store"), str(d), results), nprocs=2, join=True)
    assert "error" in results[0] and results[0] == results[1], dict(results)
    assert "No space left on device" in results[0]["error"]
    assert _names(d) == [LOCK_NAME, "step-000000001.pt"]


# ----- keep: a fresh run in a folder of a longer run's checkpoints ----------------------------------------
def test_keep_never_removes_the_runs_own_new_checkpoints(tmp_path: Path):
    d = tmp_path / "ck"
    longer = CheckpointDir(d, keep=2, say=lambda *a: None)
    longer.acquire("long")
    for step in (80, 90, 100):
        longer.save(step, lambda step=step: _state(step))
    longer.release()
    lines: list[str] = []
    fresh = CheckpointDir(d, keep=2, say=lines.append)  # a new run, started without --resume
    fresh.acquire("fresh")
    fresh.save(10, lambda: _state(10))
    assert _names(d) == [LOCK_NAME, "step-000000010.pt"]  # the older run's higher steps would be resumed
    assert any("removed 2 checkpoint(s) of higher steps" in line for line in lines)
    fresh.save(20, lambda: _state(20))
    fresh.save(30, lambda: _state(30))
    assert _names(d) == [LOCK_NAME, "step-000000020.pt", "step-000000030.pt"]
    assert fresh.resume()["step"] == 30  # a resume continues the fresh run
    fresh.release()


# ----- resuming under another configuration says which field differs --------------------------------------
def test_a_checkpoint_of_another_config_names_the_field_not_a_rank(tmp_path: Path):
    lengths = np.arange(1, 200)
    old = PlanBatchSampler(lengths, PlanConfig(strategy="packed", budget=256), rank=0, world_size=1)
    now = PlanBatchSampler(lengths, PlanConfig(strategy="packed", budget=512), rank=0, world_size=1)
    saved = old.state_dict()
    ck = CheckpointDir(tmp_path / "ck")
    with pytest.raises(StateError) as exc:
        ck.check_fingerprints(saved["fingerprint"], now.fingerprint, explain(saved["identity"], now.identity))
    msg = str(exc.value)
    assert "another configuration (budget 256 in the checkpoint, 512 now)" in msg and "rank" not in msg, msg
    ck.check_fingerprints(saved["fingerprint"], old.fingerprint)  # the same config: accepted


def test_a_folder_name_with_a_newline_stays_one_line(tmp_path: Path):
    d = tmp_path / "a\nb"
    d.mkdir()
    os.mkfifo(d / LOCK_NAME)
    with pytest.raises(StateError) as exc:
        CheckpointDir(d).acquire("run")
    assert "\n" not in str(exc.value) and "a\\nb" in str(exc.value)


@pytest.mark.parametrize(
    "edit",
    [
        {"step": "abc"},
        {"step": -5},
        {"step": None},
        {"step": [1]},
        {"step": 1.5},
        {"step": True},
        {"step": 10**30},
        {"sampler": "x"},
        {"sampler": None},
        {"model": [1]},
    ],
)
def test_a_checkpoint_whose_step_or_parts_are_edited_is_damaged_and_skipped(tmp_path: Path, edit: dict):
    """``int(state["step"])`` and ``state["sampler"].get`` in a training loop raised tracebacks on these."""
    d = tmp_path / "ck"
    lines: list[str] = []
    ck = CheckpointDir(d, say=lines.append)
    ck.acquire("run")
    ck.save(1, lambda: _state(1))
    torch.save(_state(2) | edit, d / "step-000000002.pt")
    path, state = ck.newest_intact()
    assert path.name == "step-000000001.pt" and state["step"] == 1
    assert len(lines) == 1 and "step-000000002.pt: damaged checkpoint (ValueError: " in lines[0], lines
    assert "\n" not in lines[0]
    ck.release()
