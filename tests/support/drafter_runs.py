"""The two command-line runs every drafter method's tests make: ``padfree simulate --drafter`` on seeded
lengths, and ``examples/train_drafter.py`` for one step against a target folder, exporting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from support.peers import import_peer


def simulate_drafter(tmp_path: Path, capsys: Any, method: str) -> dict:
    """The JSON of ``padfree simulate --drafter METHOD`` on 400 seeded lengths (20 to 900 tokens) at budget
    4096 on 4 ranks, one micro-batch a step; asserts it exits 0."""
    from padfree.cli import main

    np.save(tmp_path / "l.npy", np.random.default_rng(0).integers(20, 900, 400))
    args = ["simulate", str(tmp_path / "l.npy"), "--budget", "4096", "--world-size", "4",
            "--grad-accum", "1", "--drafter", method, "--json"]  # fmt: skip
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def train_drafter(
    example: Any, folder: Path, tmp_path: Path, capsys: Any, method: str, *extra: str, budget: int = 256
) -> tuple[str, dict, Path]:
    """Train ``method`` one step with ``examples/train_drafter.py`` (``example``: the module) against the
    target ``folder`` on 4 samples, checkpointing and exporting under ``tmp_path``; ``extra``: more options.
    Asserts it exits 0, says it finished at step 1 and checkpoints ``method``. Returns (what it printed, the
    checkpointed drafter's state, the export folder)."""
    from padfree.drafter.export import read_checkpoint

    import_peer("speculators")
    out, ckpt = tmp_path / "served", tmp_path / "ckpt"
    args = ["--method", method, "--target", str(folder), "--limit-samples", "4", "--budget", str(budget),
            "--max-steps", "1", *extra, "--checkpoint-dir", str(ckpt), "--export-dir", str(out)]  # fmt: skip
    assert example.main(args) == 0
    said = capsys.readouterr().out
    assert "finished at step 1" in said, said[-2000:]
    state, meta = read_checkpoint(ckpt)
    assert meta["method"] == method
    return said, state, out
