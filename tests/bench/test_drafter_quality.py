"""benchmarks/drafter_quality.py: chain verification against a step-by-step replay, the summaries and targets
the issue's JSON holds, resuming a cut-short run, and (with the peers installed) the smoke run end to end."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.quality import ARMS, chain_acceptance
from support.peers import peer_missing

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("drafter_quality", ROOT / "benchmarks/drafter_quality.py")
    assert spec is not None and spec.loader is not None
    dq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dq)
    return dq


def _replay(drafts: np.ndarray, seq: np.ndarray, start: int) -> list[int]:
    """Speculative decoding replayed one verification at a time: the drafter proposes from the last known
    token, the target (whose greedy output is ``seq``) accepts the matching prefix and adds its own token."""
    known = start + 1  # seq[:known] is known (the prefill produced seq[start])
    out = []
    while known < len(seq):
        j = known - 1
        proposal = [int(drafts[k, j - 1]) for k in range(drafts.shape[0])]
        accepted = 0
        for tok in proposal:
            if known + accepted < len(seq) and tok == seq[known + accepted]:
                accepted += 1
            else:
                break
        produced = min(accepted + 1, len(seq) - known)
        out.append(produced)
        known += produced
    return out


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(3, 30),
    k=st.integers(1, 4),
    start=st.integers(1, 5),
    seed=st.integers(0, 10_000),
    hit=st.floats(0, 1),
)
def test_chain_acceptance_is_the_step_by_step_replay(n, k, start, seed, hit):
    rng = np.random.default_rng(seed)
    start = min(start, n - 2)
    seq = rng.integers(0, 5, n)
    truth = np.array([[seq[t + 2 + j] if t + 2 + j < n else -1 for t in range(n)] for j in range(k)])
    drafts = np.where(rng.random(truth.shape) < hit, truth, -2)  # each draft right with probability `hit`
    got = chain_acceptance(drafts, seq, start)
    assert got == _replay(drafts, seq, start)
    assert sum(got) == n - 1 - start and all(1 <= g <= k + 1 for g in got)


def test_perfect_drafts_accept_every_block_and_wrong_ones_none():
    seq = np.arange(20)
    k = 3
    perfect = np.array([[t + 2 + j for t in range(20)] for j in range(k)])
    assert chain_acceptance(perfect, seq, 2) == [4, 4, 4, 4, 1]
    assert chain_acceptance(np.full((k, 20), -1), seq, 2) == [1] * 17


def _curve(levels: list[float], tokens_per_s: float, epoch_at: float) -> list[dict]:
    marks = [
        {"why": "mark", "seconds": 10.0 * i, "tokens": int(10 * i * tokens_per_s), "epochs": 0.0,
         "acceptance_length": a}
        for i, a in enumerate(levels)
    ]  # fmt: skip
    epoch = {"why": "epoch", "seconds": epoch_at, "tokens": 1000, "epochs": 1.0, "acceptance_length": 1.2}
    return [*marks, epoch]


def test_summary_and_targets_hold_the_issue_json():
    dq = _script()
    results = []
    for seed in range(2):
        lift = 0.01 * seed
        results += [
            {"method": "dflash", "arm": "padfree_packed", "seed": seed,
             "curve": _curve([1.0, 1.3 + lift, 1.5 + lift], 100, 10)},
            {"method": "dflash", "arm": "specforge_random", "seed": seed,
             "curve": _curve([1.0, 1.1 + lift, 1.2 + lift], 50, 20)},
            {"method": "dflash", "arm": "sorted_fixed", "seed": seed,
             "curve": _curve([1.0, 1.05, 1.1], 90, 12)},
        ]  # fmt: skip
    summary = dq.summarize(results, "dflash", 2)
    assert set(summary["arms"]) == set(ARMS)
    for arm in summary["arms"].values():
        assert len(arm["seconds"]) == len(arm["acceptance_length"]) == 3
        assert len(arm["per_seed"]) == 2 and arm["at_epoch_end"]["1"]["seeds"] == 2
    assert summary["arms"]["padfree_packed"]["acceptance_length"][-1] == pytest.approx(1.505)
    t = summary["targets"]
    # random ends at 1.2 / 1.21 after 20 s; packed passes it between 0 and 10 s (linear): 1.2 at 20/3 s
    assert t["packed_time_to_random_final_over_random_time"][0] == pytest.approx((10 * 0.2 / 0.3) / 20)
    assert t["half_time_met"] and t["equal_time_met_at_final"]
    assert t["equal_time_beyond_spread_at_marks"] == [True, True]
    assert set(t["sorted_vs_shuffled_at_equal_tokens"]["1"]) >= {"sorted_mean", "random_mean", "lower"}
    assert dq.reach_time(results[0]["curve"], 9.0) is None
    assert "| padfree_packed |" in dq.table(summary, "dflash")


def test_resume_keeps_finished_jobs_and_refuses_other_options(tmp_path):
    dq = _script()
    partial = tmp_path / "q.partial.json"
    key = {"mode": "smoke", "seconds": 3.0, "evals": 2}
    done = [{"method": "dflash", "arm": a, "seed": 0, "curve": _curve([1.0, 1.1], 10, 5)} for a in ARMS]
    partial.write_text(json.dumps({"key": key, "raw": done}))
    assert dq.finished(partial, key) == done
    assert dq.finished(tmp_path / "absent.json", key) == []
    with pytest.raises(SystemExit, match="--resume needs the same"):
        dq.finished(partial, {**key, "seconds": 4.0})

    class Job:  # what run_all reads of a job before running it
        def __init__(self, arm):
            self.method, self.arm, self.seed = "dflash", arm, 0

    said = []
    out = dq.run_all([Job(a) for a in ARMS], 1, said.append, partial, key, done_before=done)
    assert out == done and said == [f"3 jobs kept from {partial}, 0 to run"]  # nothing ran again


def test_the_md_names_each_methods_decoder_and_preset():
    lines = _script().method_lines(["dflash", "dflash2", "eagle3"]).splitlines()
    assert len(lines) == 3
    assert "`DFlashDraftModel" in lines[0] and "`specforge` preset" in lines[0]
    assert "`DFlash2DraftModel" in lines[1] and "window off" in lines[1]
    assert "`speculators` preset" in lines[1]
    assert "`Eagle3DraftModel" in lines[2] and "`specforge` preset" in lines[2]


@pytest.mark.skipif(bool(peer_missing("dflash")), reason=peer_missing("dflash") or "")
def test_smoke_run_writes_the_issue_json(tmp_path):
    pytest.importorskip("tokenizers")
    dq = _script()
    assert dq.main(["--smoke", "--methods", "dflash", "--workers", "1", "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "drafter_quality_smoke.json").read_text())
    assert set(got["arms"]) == set(ARMS) and got["prompts"] >= 1
    assert got["target"]["parameters"] > 0 and got["target"]["regenerated"] > 0
    for arm in got["arms"].values():
        assert len(arm["seconds"]) == len(arm["acceptance_length"]) >= 2
        assert arm["seconds"][0] == 0 and all(a >= 1.0 for a in arm["acceptance_length"])
    assert {"padfree_packed", "specforge_random"} <= {r["arm"] for r in got["raw"]}
    md = (tmp_path / "drafter_quality_smoke.md").read_text()
    assert md.startswith("# drafter_quality_smoke") and "- dflash: decoded by z-lab's `dflash` package" in md
    assert (tmp_path / "drafter_quality_smoke.png").stat().st_size > 0
