"""``padfree plan`` and ``padfree analyze`` take the chunked strategy: starts on every line, one lane a
document, and its row in the comparison."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from padfree.cli import main


@pytest.fixture
def long_tail(tmp_path: Path) -> Path:
    rng = np.random.default_rng(5)
    lengths = np.minimum(rng.lognormal(5.0, 1.2, 500).astype(np.int64) + 1, 3000)
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths.tolist())) + "\n")
    return path


def test_plan_writes_chunks_with_their_starts(long_tail: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["plan", str(long_tail), "--strategy=chunked", "--budget=512", "--world-size=2", "--grad-accum=4"]
    assert main([*args, "--overlong=truncate", "--out=-"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all("starts" in r and sum(r["lengths"]) <= 512 for r in recs)
    later = [
        (r["step"], r["rank"], r["micro"], r["indices"][0], r["starts"][0]) for r in recs if r["starts"][0]
    ]
    assert later
    for step, rank, micro, sample, start in later:  # the chunk before: same step and rank, one micro earlier
        prev = [r for r in recs if r["step"] == step and r["rank"] == rank and r["micro"] == micro - 1]
        assert prev and prev[0]["indices"] == [sample] and prev[0]["starts"] == [start - 512]
    assert main([*args, "--out=-"]) == 2  # a 3000-token document is over 4 x 512 tokens
    err = capsys.readouterr().err  # the reach named as such; chunked cannot split, so split is not offered
    assert "longer than the chunked reach of 2048 tokens (grad_accum 4 x budget 512)" in err, err
    assert "--grad-accum" in err and "truncate or drop" in err and "split or drop" not in err


def test_analyze_compares_chunked_with_packed(long_tail: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["analyze", str(long_tail), "--budget=512", "--world-size=2", "--grad-accum=8", "--json"]
    assert main([*args, "--strategies=packed,chunked", "--overlong=truncate"]) == 0
    out = json.loads(capsys.readouterr().out)["strategies"]
    assert out["packed"]["truncated"] > 0 and out["chunked"]["truncated"] == 0
    assert out["chunked"]["padding_efficiency"] == 1.0 and out["chunked"]["imbalance"] < 1.05
    assert out["chunked"]["chunked"] == out["packed"]["truncated"] > 0  # the same documents, kept whole
    assert main([*args[:-1], "--strategies=packed,chunked", "--overlong=truncate"]) == 0
    text = capsys.readouterr().out
    assert "documents chunked (whole context)" in text
    verdict = [line for line in text.splitlines() if line.startswith("long documents: ")]
    assert len(verdict) == 1 and "truncation drops" in verdict[0] and "trains them whole" in verdict[0]
    assert main([*args, "--strategies=packed,chunked", "--overlong=truncate"]) == 0
    long_docs = json.loads(capsys.readouterr().out)["long_documents"]
    assert long_docs["chunked"]["truncated"] == 0 and long_docs["text"] in verdict[0]
    assert main([*args, "--strategies=packed,bucketed", "--overlong=truncate"]) == 0
    assert "long_documents" not in json.loads(capsys.readouterr().out)  # said only when both were planned
    assert main([*args, "--strategies=chunked,nope"]) == 2
    assert "choose from sorted, random, bucketed, packed, chunked" in capsys.readouterr().err


def test_chunked_with_sp_or_cp_is_refused_in_one_line(long_tail: Path, capsys: pytest.CaptureFixture) -> None:
    for cmd in (
        ["plan", str(long_tail), "--strategy=chunked", "--budget=512", "--sp=2", "--out=-"],
        ["analyze", str(long_tail), "--strategies=packed,chunked", "--budget=512", "--cp=2"],
    ):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert "chunked strategy is not planned with sp or cp > 1" in err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_report_says_what_truncation_and_splitting_cost_and_what_chunked_does() -> None:
    from padfree import PlanConfig
    from padfree.advice.analyze import measure
    from padfree.advice.report.chunked import chunked_numbers

    rng = np.random.default_rng(2)
    lengths = np.minimum(rng.lognormal(5.0, 1.0, 800).astype(np.int64) + 1, 2000)
    base = PlanConfig("packed", 512, 2, 4, overlong="truncate")
    packed = measure(lengths, base)
    out = chunked_numbers(lengths, base, packed)
    assert out is not None
    over = lengths[lengths > 512]
    assert out["over_budget"] == over.size and out["truncation_tokens_lost"] == int((over - 512).sum())
    assert out["split_pieces_without_beginning"] == int(((over + 511) // 512 - 1).sum())
    assert out["chunked"]["truncated"] == 0 and out["still_over_reach"] == 0
    assert 0 < out["recomputed_share"] < 1 and 0 < out["throughput_vs_packed"] <= 1.05
    verdict = "beats truncation" if out["throughput_vs_packed"] >= 0.9 else "of packed's throughput"
    assert "trains them whole" in out["text"] and verdict in out["text"]
    one = chunked_numbers(lengths, base.with_(grad_accum=1), packed)
    assert one is not None and "raise grad-accum" in one["text"]
    assert chunked_numbers(np.minimum(lengths, 512), base, packed) is None  # nothing over the budget


def test_analyze_compares_chunked_without_overlong(long_tail: Path, capsys: pytest.CaptureFixture) -> None:
    # without --overlong, comparing chunked truncates what the others cannot hold (docs/chunked.md)
    args = ["analyze", str(long_tail), "--budget=512", "--world-size=2", "--grad-accum=8", "--json"]
    assert main([*args, "--strategies=packed,chunked"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["strategies"]["packed"]["truncated"] > 0 and out["strategies"]["chunked"]["truncated"] == 0
    assert out["long_documents"]["over_budget"] == out["strategies"]["packed"]["truncated"]
    assert main([*args, "--strategies=packed"]) == 2  # without chunked: the overlong default is still error
    assert "longer than the budget of 512 tokens" in capsys.readouterr().err
