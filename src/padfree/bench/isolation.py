"""An arm's heaviest step, run first in a child process under a memory limit, so that an arm that would run
the machine out of memory is recorded as such (with its peak) instead of taking the whole bench down.

``padfree bench`` trains its arms interleaved in one process (so that a slow spell of a shared machine hits
every arm alike). A peer whose micro-batches run well over the budget (``hf_batch_rebalance``: up to ~6x)
can then need more memory than the machine has, and the kernel's out-of-memory killer ends the process and
every arm's figures with it. :func:`preflight` runs the arm's heaviest micro-batch (by modeled work) once,
forward, backward and optimizer update, in a fresh Python process whose address space is capped with
``resource.setrlimit(RLIMIT_AS)``: an allocation past the cap fails there (``MemoryError`` or torch's
"can't allocate memory"), the child reports it with its peak resident memory, and the parent leaves the arm
out of the rounds. The cap defaults to 80% of the memory available when the bench starts
(:func:`default_limit`), so what passes the preflight fits beside the other arms' small models.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

_OOM_MARKERS = ("can't allocate memory", "out of memory", "cannot allocate memory", "std::bad_alloc")


def default_limit() -> int:
    """80% of ``MemAvailable`` (Linux), in bytes; 0 (no limit) where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(int(line.split()[1]) * 1024 * 0.8)
    except (OSError, ValueError):
        pass
    return 0


def is_oom(exc: BaseException) -> bool:
    """Whether an exception is an allocation failure (``MemoryError``, torch's allocator refusing)."""
    return isinstance(exc, MemoryError) or any(m in str(exc).lower() for m in _OOM_MARKERS)


def preflight(items: list, cfg: object, packed: bool, limit: int, timeout: float = 600.0) -> dict:
    """Run one step of ``items`` (one micro-batch) with a fresh :class:`~padfree.bench.trainer.Trainer` for
    ``cfg`` in a child process whose address space is capped at ``limit`` bytes (0: uncapped).

    Returns ``{"ok": True, "peak_rss_mb"}``, or ``{"ok": False, "out_of_memory", "error", "peak_rss_mb"}``
    (the child's own peak; for a child killed by a signal, the largest peak of any child so far)."""
    with tempfile.TemporaryDirectory(prefix="padfree-preflight-") as d:
        job = Path(d) / "job.pkl"
        job.write_bytes(pickle.dumps((items, cfg, packed, int(limit))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "padfree.bench.isolation", str(job)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "out_of_memory": False, "error": f"timed out after {timeout:.0f} s"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    tail = (proc.stderr.strip().splitlines() or [""])[-1][:200]
    killed = proc.returncode < 0
    return {
        "ok": False,
        "out_of_memory": killed or any(m in tail.lower() for m in _OOM_MARKERS),
        "error": (f"killed by signal {-proc.returncode}" if killed else f"exit {proc.returncode}: {tail}"),
        "peak_rss_mb": peak,
    }


def _child(job: Path) -> int:
    items, cfg, packed, limit = pickle.loads(job.read_bytes())
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def peak() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    try:
        from padfree.bench.trainer import Trainer

        trainer = Trainer.of(cfg, packed=packed)
        batch = trainer.collate(items)
        trainer.step(batch, batch.loss_tokens)
    except BaseException as exc:  # noqa: BLE001 - every failure is the arm's result
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        out = {"ok": False, "out_of_memory": is_oom(exc), "error": f"{type(exc).__name__}: {first}"}
        print(json.dumps(out | {"peak_rss_mb": peak()}), flush=True)
        return 3
    print(json.dumps({"ok": True, "peak_rss_mb": peak()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_child(Path(sys.argv[1])))
