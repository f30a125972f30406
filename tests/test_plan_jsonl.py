"""`padfree plan` JSONL lines have one shape per file: `lengths` on every line whenever a sample was truncated
or split (the pieces' token counts: a consumer never needs the overlong policy), `starts` when split."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from padfree.cli import main


@pytest.mark.parametrize("overlong", ["truncate", "split", "drop", "error"])
def test_plan_lines_have_one_shape(overlong: str, tmp_path: Path, fixtures_dir: Path) -> None:
    lengths = np.load(fixtures_dir / "lengths" / "python_stdlib_code.mistral_v1.npy")[:300]
    budget = 4096 if overlong != "error" else int(lengths.max())
    out, lengths_file = tmp_path / "plan.jsonl", tmp_path / "l.npy"
    np.save(lengths_file, lengths)
    argv = ["plan", str(lengths_file), "--out", str(out), "--budget", str(budget), "--overlong", overlong]
    assert main([*argv, "--world-size", "2"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    keys = {tuple(rec) for rec in lines}
    assert len(keys) == 1, keys  # every line has the same fields
    cut = (lengths > budget).any() and overlong in ("truncate", "split")
    assert ("lengths" in lines[0]) == cut
    assert ("starts" in lines[0]) == (cut and overlong == "split")
    if cut:
        got: dict[int, int] = {}
        for rec in lines:
            for i, n in zip(rec["indices"], rec["lengths"], strict=True):
                got[i] = got.get(i, 0) + n
        want = np.minimum(lengths, budget) if overlong == "truncate" else lengths
        assert all(got[i] == want[i] for i in range(lengths.shape[0]))  # truncated lengths reported
