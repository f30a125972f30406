"""The seen-log: one JSON line per consumed sample, and the exactly-once check after kills and resumes.

Each rank appends ``{"run", "epoch", "step", "rank", "index"}`` lines (``step`` counts optimizer steps since
the start of training) with one ``write`` per step to a file opened ``O_APPEND``, so lines of concurrent
ranks never interleave. A killed run may leave steps it did after its last checkpoint; the run that resumes
from that checkpoint redoes them. So the steps that count are, for each step, those of the latest run that
did it, where a run that resumed at step ``s`` (its first logged step) also supersedes every earlier run's
steps ``>= s`` (it re-plans them, possibly at another world size and so with different step boundaries).

A run that leaves samples out on purpose (``--overlong drop``: the samples longer than the budget) says so
first, with one ``{"run", "dropped"}`` line per such sample: the check counts them as dropped, not lost, and
reports any of them that trained anyway.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path


def append(fd: int, run: str, epoch: int, step: int, rank: int, indices: list[int]) -> None:
    """Append one step's samples with a single write (the caller flushes per step by calling this once).

    The write starts with a newline, so a line cut by a kill never swallows the next run's first line."""
    if indices:
        head = json.dumps({"run": run, "epoch": epoch, "step": step, "rank": rank})[:-1]
        os.write(fd, ("\n" + "".join(f'{head}, "index": {int(i)}}}\n' for i in indices)).encode())


def append_dropped(fd: int, run: str, indices: Iterable[int]) -> None:
    """Say, with a single write, which samples this run leaves out on purpose (every epoch)."""
    lines = "".join(json.dumps({"run": run, "dropped": int(i)}) + "\n" for i in indices)
    if lines:
        os.write(fd, ("\n" + lines).encode())


def read_dropped(path: str | Path) -> set[int]:
    """The samples any run said it leaves out on purpose (see :func:`append_dropped`)."""
    out = set()
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("dropped"), int) and "run" in rec:
            out.add(rec["dropped"])
    return out


def read(path: str | Path) -> list[dict]:
    """Every complete line (a line cut by a kill is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and {"run", "epoch", "step", "rank", "index"} <= rec.keys():
            out.append(rec)
    return out


def counted(records: list[dict]) -> list[dict]:
    """The records of the steps that count (see the module docstring)."""
    order: list[str] = []
    first: dict[str, int] = {}
    for rec in records:
        run = rec["run"]
        if run not in first:
            order.append(run)
            first[run] = rec["step"]
        first[run] = min(first[run], rec["step"])
    # a run's steps count up to the first step of any later run
    limit = {}
    bound = float("inf")
    for run in reversed(order):
        limit[run] = bound
        bound = min(bound, first[run])
    return [r for r in records if r["step"] < limit[r["run"]]]


def check_exactly_once(records: list[dict], n_samples: int, epochs: int, dropped: Iterable[int] = ()) -> dict:
    """Count, per epoch, samples consumed 0 or >= 2 times in the steps that count. ``dropped``: the samples
    left out on purpose (:func:`read_dropped`): each must be consumed 0 times (``dropped_trained`` counts
    those that were) and is not missing. Returns a report with ``ok`` true when every other sample of every
    epoch was consumed exactly once."""
    kept = counted(records)
    left_out = set(dropped)
    foreign_drops = sum(1 for i in left_out if not 0 <= i < n_samples)
    report: dict[str, object] = {
        "runs": len({r["run"] for r in records}),
        "records": len(records),
        "counted": len(kept),
        "dropped": len(left_out),
    }
    per_epoch = []
    ok = foreign_drops == 0
    if foreign_drops:
        report["dropped_foreign"] = foreign_drops
    for e in range(epochs):
        c = Counter(r["index"] for r in kept if r["epoch"] == e)
        missing = sum(1 for i in range(n_samples) if c[i] == 0 and i not in left_out)
        dup = sum(1 for v in c.values() if v > 1)
        foreign = sum(1 for i in c if not 0 <= i < n_samples)
        trained = sum(1 for i in left_out if c[i] > 0)
        per_epoch.append(
            {
                "epoch": e,
                "missing": missing,
                "duplicated": dup,
                "foreign": foreign,
                "dropped_trained": trained,
            }
        )
        ok = ok and missing == dup == foreign == trained == 0
    report["epochs"] = per_epoch
    report["ok"] = ok
    return report
