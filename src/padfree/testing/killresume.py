"""Kill-and-resume harness: run a training script (``examples/train.py``; under torchrun for more than one
rank), SIGKILL its whole process tree once its seen-log shows a chosen step, and resume it, possibly at
another world size. Used by the CI test and by ``benchmarks/soak_kill_resume.py``.
Linux only (reads /proc)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def command(script: str | Path, nproc: int, args: list[str], torchrun: bool | None = None) -> list[str]:
    """The launch command: ``torchrun --standalone`` (default: for more than one rank), else ``python``."""
    if not (nproc > 1 if torchrun is None else torchrun):
        return [sys.executable, str(script), *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, so killing the
    launcher's process group is not enough)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and all its descendants (no process gets to clean up or write anything)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


@dataclass
class Outcome:
    nproc: int
    killed: bool
    returncode: int
    last_step: int  # highest step this launch logged (-1: none)
    seconds: float


def run(
    script: str | Path,
    nproc: int,
    args: list[str],
    seen_log: str | Path,
    kill_at_step: int | None = None,
    timeout: float = 600.0,
    output: str | Path | None = None,
    env: dict | None = None,
    kill_delay: float = 0.0,
    torchrun: bool | None = None,
) -> Outcome:
    """Launch, then SIGKILL the tree ``kill_delay`` seconds after this launch has logged a step
    ``>= kill_at_step`` (``None``: let it finish). Raises ``RuntimeError`` if it fails on its own or times
    out."""
    seen_log = Path(seen_log)
    offset = seen_log.stat().st_size if seen_log.exists() else 0
    last, buf = -1, b""
    out = open(output or os.devnull, "ab")  # noqa: SIM115
    t0 = time.perf_counter()
    cmd = command(script, nproc, args, torchrun)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        while True:
            if seen_log.exists():
                with open(seen_log, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    with contextlib.suppress(ValueError, KeyError):
                        last = max(last, int(json.loads(line)["step"]))
            if kill_at_step is not None and last >= kill_at_step:
                time.sleep(kill_delay)
                kill_tree(proc)
                return Outcome(nproc, True, proc.returncode, last, time.perf_counter() - t0)
            code = proc.poll()
            if code is not None:
                if code != 0:
                    raise RuntimeError(f"{' '.join(cmd)} exited with {code}")
                return Outcome(nproc, False, code, last, time.perf_counter() - t0)
            if time.perf_counter() - t0 > timeout:
                kill_tree(proc)
                raise RuntimeError(f"launch timed out after {timeout:.0f} s")
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        out.close()
