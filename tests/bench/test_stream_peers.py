"""benchmarks/stream_peers.py (issue 43, item 4): its padfree part, its measures and its result schema on a
small synthetic input, whether or not the peers (grain, torchtitan) are installed."""

from __future__ import annotations

import json

import numpy as np
import stream_peers as sp


def _lengths_folder(tmp_path):
    tmp_path.mkdir()
    rng = np.random.default_rng(5)
    files = {"seed_mix": 4000, "self_instruct_t0": 900, "python_stdlib_code": 200, "gsm8k": 300}
    for name, n in files.items():
        np.save(tmp_path / f"{name}.cl100k.npy", rng.integers(1, 6000, n).astype(np.int32))
    return tmp_path


def test_the_buffer_takes_every_buffered_sample_that_fits_in_order() -> None:
    order, counts = sp._buffer_packs(np.array([6, 5, 3, 2, 8], np.int64), 4, 8)
    assert order.tolist() == [0, 3, 1, 2, 4] and counts.tolist() == [2, 2, 1]


def test_measure_deals_a_peers_micro_batches_round_robin_and_counts_share_error() -> None:
    lens = np.full(sp.K, 100, np.int64)
    lens[0] = lens[8] = 400  # round-robin: micro 0 and 8 both go to rank 0
    src = np.zeros(sp.K, np.int64)
    src[:8] = 1  # 8 of 32 documents from source 1 against a weight of 0.5
    b = sp.Batches(lens, src, np.arange(sp.K + 1, dtype=np.int64), True, False)
    m = sp.measure(b, (0.5, 0.5))
    from padfree.core import cost
    from padfree.core.config import DEFAULT_COST

    costs = cost.micro_costs(cost.micro_shapes(lens, b.offsets, True), DEFAULT_COST)
    rank0 = costs[[0, 8, 16, 24]].sum()
    other = costs[[1, 9, 17, 25]].sum()
    mean = (rank0 + 7 * other) / 8
    assert m["steps"] == 1 and m["padding_efficiency"] == 1.0
    assert m["imbalance_mean"] == round(float(rank0 / mean), 4) > 1.0
    assert m["share_error_documents_max"] == 8.0  # |8 - 0.5 * 32|
    assert m["fill"] == round(float(lens.sum() / (sp.K * sp.BUDGET)), 4)


def test_the_padfree_rows_and_the_result_schema(tmp_path) -> None:
    folder = _lengths_folder(tmp_path / "lengths")
    out = tmp_path / "out"
    result = sp.main(["--lengths", str(folder), "--samples", "3000", "--planners", "padfree,grain_first_fit",
                      "--windows", "1,2", "--out", str(out), "--name", "t"])  # fmt: skip
    assert set(result) == {"command", "versions", "streams", "notes", "rows"}
    assert [s["name"] for s in result["streams"]] == ["seed_mix", "three_sets"]
    assert json.loads((out / "t.json").read_text()) == result
    ours = [r for r in result["rows"] if r["planner"] == "padfree"]
    assert [(r["stream"], r["window_steps"]) for r in ours] == [
        ("seed_mix", 1), ("seed_mix", 2), ("three_sets", 1), ("three_sets", 2)
    ]  # fmt: skip
    for r in ours:
        assert r["status"] == "ok" and r["padding_efficiency"] == 1.0
        assert 1.0 <= r["imbalance_mean"] <= r["imbalance_p99"] and r["imbalance_mean"] < 1.1
        assert r["samples"] == 3000  # the stream's every sample, in whole steps (its last ones part-empty)
        assert r["peak_mib"] >= 0 and r["steps"] >= 1 and 0 < r["fill"] <= 1
    mixed = [r for r in ours if r["stream"] == "three_sets"]
    assert all("share_error_tokens_max" in r and "share_error_documents_mean" in r for r in mixed)
    pool = [r for r in result["rows"] if r["planner"] == "padfree_sources_documents"]
    assert len(pool) == 1 and pool[0]["share_error_documents_max"] < 1.0  # padfree's per-step bound
    grain = [r for r in result["rows"] if r["planner"] == "grain_first_fit"]
    assert len(grain) == 4 and all(r["status"] == "ok" or "not installed" in r["status"] for r in grain)
    md = (out / "t.md").read_text()
    assert "| seed_mix | padfree | 1 |" in md and "| three_sets | padfree_sources_tokens | pool |" in md
