"""The plans themselves are pinned: ``padfree plan`` output for every strategy on two real length sets (and
the windowed path) hashes to the values recorded in ``tests/core/plan_hashes.json``.

Refactors must reproduce them byte for byte. Only an intended change of the plans may rewrite the file
(``python tests/core/test_plan_golden.py --write``), and its commit says so.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from padfree import STRATEGIES, PlanConfig, make_plan
from padfree.cli import main

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = ROOT / "fixtures" / "lengths"
HASHES = Path(__file__).resolve().parent / "plan_hashes.json"

# (name, lengths file, extra CLI options)
CASES = [
    ("self_instruct", "self_instruct_t0.cl100k.npy",
     ["--budget", "8192", "--world-size", "4", "--grad-accum", "2", "--epoch", "1", "--seed", "0"]),
    ("python_split", "python_stdlib_code.mistral_v1.npy",
     ["--budget", "4096", "--world-size", "2", "--grad-accum", "2", "--overlong", "split", "--seed", "5"]),
    ("gsm8k_buckets", "gsm8k.cl100k.npy",
     ["--budget", "2048", "--world-size", "8", "--grad-accum", "1", "--buckets", "6", "--mix", "16"]),
]  # fmt: skip


def _cli_hash(tmp: Path, strategy: str, file: str, opts: list[str]) -> str:
    out = tmp / f"{strategy}.jsonl"
    assert main(["plan", str(LENGTHS / file), "--strategy", strategy, *opts, "--out", str(out)]) == 0
    return hashlib.sha256(out.read_bytes()).hexdigest()


def _stream_hash(strategy: str) -> str:
    lengths = np.load(LENGTHS / "self_instruct_t0.cl100k.npy")
    cfg = PlanConfig(strategy=strategy, budget=8192, world_size=2, grad_accum=2, seed=7)
    p = make_plan(lengths, cfg, epoch=2, stream=True, window=12_000)
    h = hashlib.sha256()
    for a in (p.indices, p.offsets, p.lengths):
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()


def compute(tmp: Path) -> dict[str, str]:
    got = {}
    for name, file, opts in CASES:
        for s in STRATEGIES:
            got[f"{name}/{s}"] = _cli_hash(tmp, s, file, opts)
    for s in STRATEGIES:
        got[f"stream/{s}"] = _stream_hash(s)
    return got


@pytest.mark.slow
def test_plans_match_recorded_hashes(tmp_path: Path) -> None:
    want = json.loads(HASHES.read_text())
    got = compute(tmp_path)
    assert got == want


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        HASHES.write_text(json.dumps(compute(Path(d)), indent=1, sort_keys=True) + "\n")
    print(f"wrote {HASHES}")
