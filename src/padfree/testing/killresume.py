"""Kill-and-resume harness: run a training script (``examples/train.py``; under torchrun for more than one
rank), SIGKILL its whole process tree (or only the launcher, as an OOM killer or a scheduler signalling one
pid would) once its seen-log shows a chosen step, and resume it, possibly at another world size. It can also
start a second job on the same checkpoint directory meanwhile (it must be refused), or send SIGTERM (the run
must checkpoint and stop). Used by the CI tests and by ``benchmarks/soak_kill_resume.py``.
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


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def kill_launcher(proc: subprocess.Popen, wait: float = 3.0) -> int:
    """SIGKILL only the launcher ``proc``; its workers must then stop on their own, at once (they watch for
    their parent's death). Returns how many of them were still alive after ``wait`` seconds (far more than a
    parent-death signal needs, far less than a run takes to finish); those are killed."""
    workers = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.perf_counter() + wait
    while any(alive(p) for p in workers) and time.perf_counter() < deadline:
        time.sleep(0.02)
    left = [p for p in workers if alive(p)]
    for p in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return len(left)


@dataclass
class Outcome:
    nproc: int
    killed: bool
    returncode: int
    last_step: int  # highest step this launch logged (-1: none)
    seconds: float
    orphans: int = 0  # kill="launcher": workers still running 3 s after their launcher was killed
    intruder: dict | None = None  # the second job's {"returncode", "line"} when one was started
    stopped: bool = False  # stopped by SIGTERM (term_at_step) and exited on its own


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
    kill: str = "tree",
    intruder_at_step: int | None = None,
    term_at_step: int | None = None,
) -> Outcome:
    """Launch, then SIGKILL the tree (``kill="tree"``) or only the launcher (``kill="launcher"``)
    ``kill_delay`` seconds after this launch has logged a step ``>= kill_at_step`` (``None``: let it finish).

    ``intruder_at_step``: once that step is logged, run the same command again (a second job on the same
    checkpoint directory) to its end, this launch paused meanwhile, and record its exit code and line.
    ``term_at_step``: send SIGTERM to the launcher once that step is logged and let the run stop on its own.
    Raises ``RuntimeError`` if the launch fails on its own (other than after SIGTERM) or times out."""
    seen_log = Path(seen_log)
    offset = seen_log.stat().st_size if seen_log.exists() else 0
    last, buf = -1, b""
    out = open(output or os.devnull, "ab")  # noqa: SIM115
    intruder, termed = None, False
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
            if intruder_at_step is not None and intruder is None and last >= intruder_at_step:
                intruder = _intrude(proc, cmd, env, timeout)
            if term_at_step is not None and not termed and last >= term_at_step:
                proc.send_signal(signal.SIGTERM)
                termed = True
            if kill_at_step is not None and last >= kill_at_step:
                time.sleep(kill_delay)
                orphans = 0
                if kill == "launcher":
                    orphans = kill_launcher(proc)
                else:
                    kill_tree(proc)
                return Outcome(
                    nproc, True, proc.returncode, last, time.perf_counter() - t0, orphans, intruder
                )
            code = proc.poll()
            if code is not None:
                if code != 0 and not termed:
                    raise RuntimeError(f"{' '.join(cmd)} exited with {code}")
                t = time.perf_counter() - t0
                return Outcome(nproc, False, code, last, t, intruder=intruder, stopped=termed)
            if time.perf_counter() - t0 > timeout:
                kill_tree(proc)
                raise RuntimeError(f"launch timed out after {timeout:.0f} s")
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        out.close()


def _intrude(owner: subprocess.Popen, cmd: list[str], env: dict | None, timeout: float) -> dict:
    """Run ``cmd`` (a second job on the same directory) to its end while the running job ``owner`` is
    paused (SIGSTOP, then SIGCONT), so the owner is alive and holds its directory the whole time (it could
    otherwise finish first and hand the directory over). Returns the second job's exit code and the line
    that names the owner (or its last line)."""
    paused = [owner.pid, *descendants(owner.pid)]
    for pid in paused:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        res = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=timeout,
            check=False,
        )
    finally:
        for pid in paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if "in use by" in ln]
    return {
        "returncode": res.returncode,
        "line": lines[0] if lines else (res.stderr.strip().splitlines() or [""])[-1],
    }
