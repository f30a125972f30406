"""How a training process ends: together with its launcher, and on SIGTERM only at a step boundary, after a
checkpoint.

- :func:`die_with_parent`: torchrun starts each worker in a session of its own, so a SIGKILL of the launcher
  alone (an OOM killer, a scheduler signalling one pid) would leave the workers training, writing checkpoints
  beside the relaunched job. With this the kernel kills a worker as soon as its launcher is gone.
- :class:`StopOnSignal`: SIGTERM (what schedulers send before preemption) only sets a flag; the training
  loop asks :meth:`StopOnSignal.agreed` at each step boundary (all ranks agree, since the signal may reach
  only some of them), saves a checkpoint and exits with :data:`EXIT_STOPPED`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

EXIT_STOPPED = 128 + signal.SIGTERM
"""Exit code after a SIGTERM stop (the shell's code for a process ended by SIGTERM): the run is not finished,
so a launcher or a retry loop must not take it for a completed one."""

_PR_SET_PDEATHSIG = 1


def launched_by_torchrun() -> bool:
    """True in a worker started by torchrun / torch.distributed.run (it sets ``TORCHELASTIC_RUN_ID``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def die_with_parent(sig: int = signal.SIGKILL, poll_seconds: float = 0.5) -> str:
    """Have this process receive ``sig`` when its parent process exits; returns how (``prctl`` or ``poll``).

    Linux: ``prctl(PR_SET_PDEATHSIG)``, delivered by the kernel the moment the parent dies (it tracks the
    parent *thread*: torchrun starts workers from its main thread). Elsewhere, a daemon thread polls
    ``os.getppid()``. If the parent died while this was being set up, the signal is raised at once.
    Call it first thing in a worker, and only in a worker: a process started from an interactive shell
    should survive the shell.
    """
    parent = os.getppid()
    how = "poll"
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0:
                how = "prctl"
        except (OSError, AttributeError):
            pass
    if how == "poll":
        threading.Thread(target=_watch, args=(parent, sig, poll_seconds), daemon=True).start()
    if os.getppid() != parent:  # the parent died before the watch was armed
        os.kill(os.getpid(), sig)
    return how


def _watch(parent: int, sig: int, poll_seconds: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_seconds)
    os.kill(os.getpid(), sig)


class StopOnSignal:
    """Turn SIGTERM (by default) into a request to stop at the next step boundary.

    >>> import os, signal
    >>> stop = StopOnSignal()
    >>> os.kill(os.getpid(), signal.SIGTERM)
    >>> stop.received, stop.agreed()
    ('SIGTERM', True)
    >>> stop.restore()
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.received: str | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum: int, _frame: object) -> None:
        self.received = signal.Signals(signum).name

    def agreed(self, device: torch.device | str = "cpu") -> bool:
        """Whether any rank received the signal (an all-reduce when distributed: call it on every rank at the
        same step boundary)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.received is not None
        flag = torch.tensor([int(self.received is not None)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        """Put the previous handlers back."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
