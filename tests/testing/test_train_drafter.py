"""examples/train_drafter.py: a short run of each method trains and logs its samples; killed with SIGKILL
under torchrun at 2 ranks and resumed, every sample trains exactly once per epoch, always with the anchors its
document gets alone from (seed, epoch, sample id)."""

import json
import random
from pathlib import Path

import numpy as np
import pytest

from padfree.testing import killresume, seenlog

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_drafter.py"


def base_args(fixtures_dir, tmp_path, n, method, strategy="packed"):
    return [
        "--method", method, "--data", str(fixtures_dir / "samples/*.jsonl.gz"),
        "--tokenizer", str(fixtures_dir / "tokenizers/llama_sp32k.model"),
        "--strategy", strategy, "--budget", "256", "--limit-samples", str(n), "--vocab-size", "256",
        "--block-size", "4", "--ttt", "2", "--log-every", "1000", "--seen-log", str(tmp_path / "seen.jsonl"),
        "--overlong", "truncate",
    ]  # fmt: skip


@pytest.mark.parametrize(("method", "strategy"), [("dflash", "bucketed"), ("eagle3", "packed")])
def test_a_short_run_trains_and_logs_its_samples(tmp_path, fixtures_dir, method, strategy):
    n = 24
    args = base_args(fixtures_dir, tmp_path, n, method, strategy) + ["--max-steps", "3", "--grad-accum", "2"]
    out = tmp_path / "run.out"
    res = killresume.run(SCRIPT, 1, args, tmp_path / "seen.jsonl", output=out, timeout=300)
    text = out.read_text()
    assert res.returncode == 0 and "finished at step 3" in text, text[-2000:]
    records = seenlog.read(tmp_path / "seen.jsonl")
    assert {r["step"] for r in records} == {0, 1, 2}
    assert len({r["index"] for r in records}) == len(records) > 0  # no sample twice in one epoch


def test_sigkill_and_resume_at_two_ranks_trains_each_sample_once_with_its_anchors(tmp_path, fixtures_dir):
    from padfree.core.anchors import choose_anchors
    from padfree.data.samples import load_samples
    from padfree.drafter import recipes

    n = 48
    seen, anchor_log = tmp_path / "seen.jsonl", tmp_path / "anchors.jsonl"
    args = base_args(fixtures_dir, tmp_path, n, "dflash") + [
        "--epochs", "2", "--seed", "3", "--grad-accum", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--checkpoint-every", "2", "--resume", "--anchor-log", str(anchor_log),
    ]  # fmt: skip
    out = tmp_path / "train.out"
    first = killresume.run(SCRIPT, 2, args, seen, kill_at_step=random.Random(18).randint(3, 6), output=out)
    second = killresume.run(SCRIPT, 2, args, seen, output=out)
    assert first.killed and not second.killed, out.read_text()[-3000:]

    records = seenlog.read(seen)
    report = seenlog.check_exactly_once(records, n, epochs=2)
    assert report["ok"] and report["runs"] == 2 and report["counted"] == 2 * n, report
    runs = list(dict.fromkeys(r["run"] for r in records))
    assert min(r["step"] for r in records if r["run"] == runs[1]) > 0  # resumed from a checkpoint

    samples = load_samples(
        [str(fixtures_dir / "samples/*.jsonl.gz")], str(fixtures_dir / "tokenizers/llama_sp32k.model"), n,
        "assistant", 256,
    )  # fmt: skip
    policy = recipes.override(recipes.get("specforge", "dflash"), block_size=4).anchor_policy()  # as trained
    logged = [json.loads(line) for line in anchor_log.read_text().splitlines() if line.strip()]
    assert {r["run"] for r in logged} == set(runs)
    trained = {(r["epoch"], r["index"]) for r in logged}
    assert trained == {(e, i) for e in range(2) for i in range(n)}
    for r in logged:  # the killed run's redone steps and the resumed run: one anchor set per (epoch, sample)
        mask = np.asarray(samples[r["index"]]["loss_mask"])
        alone = choose_anchors(mask, policy, seed=3, epoch=r["epoch"], sample_id=r["index"])
        assert list(r["anchors"]) == alone.tolist(), r
