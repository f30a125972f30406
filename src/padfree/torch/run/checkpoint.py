"""A training run's checkpoint directory: owned by one run at a time, written atomically, and resumed from
the checkpoint rank 0 chooses (the newest intact one) on every rank.

The pieces a training loop needs (``examples/train.py`` uses all of them)::

    ckpt = CheckpointDir("ckpt", rank, world, say=print)
    ckpt.acquire(run_id)                # refuses a second run on the directory; takes over a dead run's lock
    state = ckpt.resume(device)          # None, or the newest intact checkpoint, the same one on every rank
    ckpt.check_fingerprints(state["sampler"]["fingerprint"], sampler.fingerprint)
    ...
    ckpt.save(step, lambda: {...})       # every rank calls it; rank 0 writes once all ranks are there
    ckpt.release()

Ownership: ``LOCK`` in the directory holds an exclusive ``flock`` for as long as the owning process lives
and names its host, pid and run. The kernel drops the lock when that process dies, however it dies, so a
lock that can be taken while the file still names an owner belonged to a dead run: it is taken over and
that is said in one line. Only rank 0 holds it; the other ranks learn the outcome from rank 0.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed as dist

from padfree.errors import StateError, one_line

LOCK_NAME = "LOCK"
_STEP = re.compile(r"step-(\d+)\.pt")
REQUIRED = ("model", "optimizer", "sampler", "step")


def quiet(*_a: object, **_k: object) -> None:
    """Say nothing: the ``say`` of every rank but 0, and of callers that want no progress lines."""
    return None


class CheckpointDir:
    """The checkpoint directory of one run, as seen from one rank.

    Args:
        directory: where ``step-NNNNNNNNN.pt`` files live (created if missing).
        rank, world: this process's rank and the world size (collectives are used when ``world > 1``).
        say: where one-line notices go (takeover, damaged checkpoint, cleaned temporary files); rank 0 only.
        keep: checkpoints kept after each save (the newest ``keep``).
    """

    def __init__(
        self, directory: str | Path, rank: int = 0, world: int = 1, say: Callable = print, keep: int = 2
    ) -> None:
        self.dir = Path(directory)
        self.rank, self.world, self.keep = rank, world, max(1, keep)
        self.say = say if rank == 0 else quiet
        self._fd: int | None = None

    # ----- ownership --------------------------------------------------------------------------------------
    def acquire(self, run: str) -> None:
        """Own the directory for this run, or raise :class:`StateError` (on every rank) naming the owner.

        Also removes the temporary files of interrupted writes (no writer can be left once we own it)."""
        self._on_rank0(lambda: self._acquire(run))

    def _acquire(self, run: str) -> None:
        lock = self.dir / LOCK_NAME
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            # never through a symlink (it would truncate the file it points to), never blocking on a FIFO
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StateError(
                    f"{_shown(lock)}: the lock file is a symbolic link; padfree only ever writes its own "
                    "regular file there: remove the link"
                ) from None
            if exc.errno == errno.EISDIR:
                raise StateError(
                    f"{_shown(lock)}: the lock file is a folder, not a regular file; remove it"
                ) from None
            if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):  # a socket (or a device without a driver)
                raise StateError(
                    f"{_shown(lock)}: the lock file is not a regular file (a socket or device); remove it"
                ) from None
            raise StateError(
                f"{_shown(self.dir)}: cannot use as checkpoint directory ({exc.strerror or exc})"
            ) from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise StateError(
                f"{_shown(lock)}: the lock file is not a regular file (a FIFO, socket, device or folder); "
                "remove it"
            )
        if info.st_nlink != 1:  # a hard link: truncating it would truncate a file elsewhere too
            os.close(fd)
            raise StateError(
                f"{_shown(lock)}: the lock file has {info.st_nlink} hard links (it is also a file elsewhere, "
                "which taking the lock would overwrite); remove it"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _describe(_read_owner(fd))
            os.close(fd)
            raise StateError(
                f"{_shown(self.dir)}: checkpoint directory in use by {owner}; wait for that run to end or "
                "use another --checkpoint-dir"
            ) from None
        previous = _read_owner(fd)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "run": run, "since": _now()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            raise StateError(
                f"{_shown(lock)}: cannot write the lock file ({exc.strerror or exc}); free the device or "
                "use another --checkpoint-dir"
            ) from None
        self._fd = fd
        if previous:
            self.say(
                f"{_shown(self.dir)}: took over the lock of {_describe(previous)}, which is no longer running"
            )
        stale = [p for p in self.dir.iterdir() if p.name.endswith(".tmp")]
        removed = 0
        for p in stale:
            with contextlib.suppress(OSError):  # a folder named *.tmp is not ours to remove
                p.unlink(missing_ok=True)
                removed += 1
        if removed:
            self.say(f"{_shown(self.dir)}: removed {removed} temporary file(s) of interrupted writes")

    def release(self) -> None:
        """Give the directory up (an empty ``LOCK`` means nobody owns it)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    # ----- reading ----------------------------------------------------------------------------------------
    def files(self) -> list[Path]:
        """Checkpoint files, newest (highest step) first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _STEP.fullmatch(p.name))]
        return [p for _, p in sorted(found, reverse=True)]

    def newest_intact(self, map_location: str | torch.device = "cpu") -> tuple[Path | None, dict | None]:
        """The newest checkpoint that loads and holds every required key; each damaged newer one is said
        (so is one that is not a regular file: a link, FIFO or folder is never opened)."""
        for path in self.files():
            try:
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    raise ValueError("not a regular file")
                state = torch.load(path, map_location=map_location, weights_only=True)
                missing = [k for k in REQUIRED if not isinstance(state, dict) or k not in state]
                if missing:
                    raise ValueError(f"missing {', '.join(missing)}")
                _check_fields(state)
            except Exception as exc:  # torch.load raises many types for a truncated or garbled file
                self.say(
                    f"{_shown(path)}: damaged checkpoint ({_short(exc)}); falling back to the previous one"
                )
                continue
            return path, state
        return None, None

    def resume(self, map_location: str | torch.device = "cpu") -> dict | None:
        """Rank 0 chooses the newest intact checkpoint; every rank loads that same file. ``None``: start
        fresh. Returns the state with ``"path"`` added."""
        chosen: dict = {}

        def choose() -> str | None:
            path, state = self.newest_intact(map_location)
            chosen["state"] = state
            return None if path is None else path.name

        name = self._on_rank0(choose)
        if name is None:
            return None
        path = self.dir / str(name)
        state, error = chosen.get("state"), None
        if state is None:
            try:
                state = torch.load(path, map_location=map_location, weights_only=True)
            except Exception as exc:
                why = _short(exc)
                error = f"{_shown(path)}: rank {self.rank} cannot load the checkpoint rank 0 chose ({why})"
        self._all_or_none(error)
        assert state is not None  # else every rank raised
        return {**state, "path": str(path)}

    def check_fingerprints(self, saved: str, mine: str, why: str | None = None) -> None:
        """Every rank resumes the same sampler state on the same data order, or all refuse (one line).

        When the ranks agree with each other but the checkpoint was written under another configuration,
        the line says so, with ``why`` (which field differs, e.g. from
        :func:`padfree.core.fingerprint.explain`); a rank-disagreement line only when ranks disagree."""
        pairs: list = [(saved, mine)]
        if self.world > 1:
            pairs = [None] * self.world
            dist.all_gather_object(pairs, (saved, mine))
        bad = [r for r, pair in enumerate(pairs) if tuple(pair) != tuple(pairs[0])]
        if bad:
            s, m = pairs[bad[0]]
            raise StateError(
                f"{_shown(self.dir)}: rank {bad[0]} would resume sampler state {s} on data order {m}, rank "
                f"0 state {pairs[0][0]} on {pairs[0][1]}; every rank must resume the same state on the same "
                "data"
            )
        if saved != mine:
            raise StateError(
                f"{_shown(self.dir)}: the checkpoint belongs to another configuration "
                f"({why or f'sampler state {saved}, data order and config now {mine}'}); resume with the "
                "config and data it was written with, or start this run in another --checkpoint-dir"
            )

    # ----- writing ----------------------------------------------------------------------------------------
    def save(self, step: int, state: Callable[[], dict]) -> Path:
        """Every rank calls this at the same step; rank 0 writes ``state()`` once all ranks got here.

        Atomic: a temporary file is created (exclusively, never through a link), written, fsynced and
        renamed, and the directory fsynced, so a reader (or a resume after SIGKILL) sees the old file or the
        new one, never half of one. Keeps the newest ``keep`` of this run: checkpoints of a higher step (an
        earlier, longer run in the same folder, or a damaged one skipped at resume) are removed, so that the
        next resume continues this run, and this run's own new checkpoints are never the ones removed.

        Any failure to write (a read-only folder, a full device, an I/O error) raises one
        :class:`StateError` line on every rank, with no temporary file left and the previous checkpoints
        intact: stop and resume from the last good one."""
        if self.world > 1:
            dist.barrier()
        final = self.dir / f"step-{step:09d}.pt"

        def write() -> None:
            try:
                self._write(final, state)
            except OSError as exc:
                last = None
                with contextlib.suppress(OSError):
                    last = next((p.name for p in self.files() if p != final), None)
                kept = f"the last good one, {last}, is intact" if last else "there is no earlier checkpoint"
                raise StateError(
                    f"{_shown(final)}: cannot write the checkpoint ({exc.strerror or _short(exc)}); {kept}: "
                    "the run stops; free the device or fix the folder, then resume"
                ) from None
            with contextlib.suppress(
                OSError
            ):  # the new checkpoint is written: a failed clean-up is no failure
                self._trim(step)

        self._on_rank0(write)
        return final

    def _write(self, final: Path, state: Callable[[], dict]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{final.name}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                out = _Writes(f)
                try:
                    torch.save(state(), out)  # type: ignore[arg-type]  # a file-like: write and flush
                except RuntimeError:  # torch's writer turns the OSError of a failed write into this
                    if out.error is not None:
                        raise out.error from None
                    raise
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        try:
            fsync_dir(self.dir)
        except OSError:  # the rename may not survive a crash: the new checkpoint is not one to resume from
            with contextlib.suppress(OSError):
                final.unlink()
            raise

    def _trim(self, step: int) -> None:
        """Keep the newest ``keep`` checkpoints up to ``step``; remove those of a higher step."""
        files = self.files()
        ahead = [p for p in files if _step_of(p) > step]
        mine = [p for p in files if _step_of(p) <= step]
        for old in ahead + mine[self.keep :]:
            with contextlib.suppress(OSError):  # a folder of that name is not ours; a retry can remove it
                old.unlink(missing_ok=True)
        if ahead:
            self.say(
                f"{_shown(self.dir)}: removed {len(ahead)} checkpoint(s) of higher steps than this run's "
                f"{step} (an earlier run's, or damaged), so that a resume continues this run"
            )

    # ----- rank 0 decides, every rank learns --------------------------------------------------------------
    def _on_rank0(self, fn: Callable[[], object]) -> object:
        out: list = [None, None]
        if self.rank == 0:
            try:
                out = [fn(), None]
            except StateError as exc:
                out = [None, str(exc)]
        if self.world > 1:
            dist.broadcast_object_list(out, src=0)
        if out[1] is not None:
            raise StateError(out[1])
        return out[0]

    def _all_or_none(self, error: str | None) -> None:
        """Raise the first rank's error on every rank (so no rank waits forever for one that gave up)."""
        errors = [error]
        if self.world > 1:
            errors = [None] * self.world
            dist.all_gather_object(errors, error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise StateError(first)


class _Writes:
    """A file's ``write`` that remembers the OSError it raised (torch.save reports it as a RuntimeError that
    does not say why)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def _check_fields(state: dict) -> None:
    """The fields a resume reads before anything else: ``step`` an integer from 0 to 2^63 - 1 (not a bool,
    not a float), ``model``, ``optimizer`` and ``sampler`` objects; else ``ValueError`` (a damaged file)."""
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise ValueError(f"step must be an integer from 0 to 2^63 - 1 (got {step!r:.40})")
    bad = [k for k in ("model", "optimizer", "sampler") if not isinstance(state[k], dict)]
    if bad:
        raise ValueError(f"{', '.join(bad)} must be an object (got {type(state[bad[0]]).__name__})")


def _step_of(path: Path) -> int:
    m = _STEP.fullmatch(path.name)
    return int(m.group(1)) if m else -1


def _shown(path: Path | str) -> str:
    """A path as one line: control characters (a newline in a folder name) escaped."""
    return one_line(str(path))


def _read_owner(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        if not data:
            return None  # nobody owns it (new, or released by a run that ended)
        owner = json.loads(data)
    except (OSError, ValueError):
        return {"unreadable": True}
    return owner if isinstance(owner, dict) else {"unreadable": True}


def _describe(owner: dict | None) -> str:
    if not owner or owner.get("unreadable"):
        return "another run (its LOCK file does not say which)"
    return (
        f"run {owner.get('run', '?')} (pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, "
        f"since {owner.get('since', '?')})"
    )


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


_NO_DIR_FSYNC = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF, errno.EACCES, errno.EPERM)
"""What a file system that cannot open or fsync a directory answers (not an I/O failure)."""


def fsync_dir(d: Path) -> None:
    """Make a rename in ``d`` durable; an I/O error (EIO, ENOSPC...) is raised, a file system that cannot
    fsync a directory is not an error."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError as exc:
        if exc.errno in _NO_DIR_FSYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__
