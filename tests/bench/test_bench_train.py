"""`padfree bench`: real training of every strategy (padfree's and the peers') in interleaved rounds, and
`--converge`: held-out loss curves at equal tokens. Tiny models, tiny budgets: a schema and bookkeeping
check, not a measurement."""

import json

import numpy as np
import pytest

from padfree.bench.samples import fit_lengths
from padfree.bench.sampling import PACKED, STRATEGIES, epoch_seconds, micro_ids, strategy_batching, stratified
from padfree.cli import main

TINY = ["--vocab-size", "128", "--model-set", "hidden_size=32", "--model-set", "intermediate_size=64",
        "--model-set", "num_hidden_layers=1", "--model-set", "num_attention_heads=2",
        "--model-set", "num_key_value_heads=2", "--threads", "1"]  # fmt: skip


def _run_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def speed(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    rng = np.random.default_rng(5)
    lengths = np.concatenate([rng.integers(2, 40, 150), [90, 70]])  # two overlong: truncated to 64
    np.save(d / "lengths.npy", lengths)
    argv = ["bench", str(d / "lengths.npy"), "--budget", "64", "--steps", "2", "--warmup", "1",
            "--overlong", "truncate", "--json", "--out", str(d / "out"), "--no-isolate", *TINY]  # fmt: skip
    return d, lengths, argv


def test_bench_trains_every_strategy_with_the_plans_padding(speed, capsys):
    d, raw, argv = speed
    res = _run_json(capsys, argv)
    assert set(res) >= {"machine", "config", "order", "strategies"}
    assert list(res["strategies"]) == list(STRATEGIES)
    lengths = fit_lengths(raw, 64)
    assert res["config"]["samples"] == lengths.shape[0] and res["config"]["tokens"] == int(lengths.sum())
    ran = [n for n, r in res["strategies"].items() if "error" not in r]
    assert {"sorted", "random", "bucketed", "packed"} <= set(ran)
    for name, r in res["strategies"].items():
        if "error" in r:  # a peer that cannot run here says why
            assert name not in ("sorted", "random", "bucketed", "packed") and r["error"]
            continue
        assert r["real_tok_per_s"] > 0 and r["slots_per_s"] >= r["measured_real_tok_per_s"]
        assert r["steps"] == 2 and len(r["measured_micro_batches"]) == 2
        # the measured micro-batches, re-planned here: their tokens and padding are what was trained
        b = strategy_batching(name, lengths, 64, 0)
        assert b.n_micro == r["micro_batches_in_epoch"]
        groups = [lengths[micro_ids(b, k)] for k in r["measured_micro_batches"]]
        real = sum(int(g.sum()) for g in groups)
        slots = sum(int(g.sum()) if b.packed else g.shape[0] * int(g.max()) for g in groups)
        assert r["real_tokens"] == real and r["slots"] == slots
        assert r["loss_tokens"] == sum(int((g - 1).sum()) for g in groups)
        assert r["padding_efficiency"] == pytest.approx(real / slots)
        # the headline is the epoch's loss tokens over its estimated seconds
        epoch_loss = int((lengths - 1).sum())
        assert r["epoch_loss_tokens"] == epoch_loss
        assert r["real_tok_per_s"] == pytest.approx(epoch_loss / r["epoch_seconds_estimate"])
        assert r["packed"] == (name in PACKED)
        if name in PACKED:
            assert r["padding_efficiency"] == 1.0 and "padfree's" in r.get("note", "padfree's")
        else:
            assert r["padding_efficiency"] < 1.0 or all(np.all(g == g.max()) for g in groups)
    runs = res["strategies"]
    assert runs["sorted"]["vs_sorted"] == 1.0
    assert runs["random"]["padding_efficiency"] < runs["packed"]["padding_efficiency"]
    for stem in ("json", "md", "png"):
        assert (d / "out" / f"train_speed.{stem}").stat().st_size > 0


def test_stratified_picks_stand_for_equal_strata_and_the_estimate_is_exact_when_time_follows_work():
    rng = np.random.default_rng(0)
    work = rng.uniform(1, 10, 103)
    per_token = rng.uniform(0.5, 3, 103)
    picks, stratum = stratified(per_token, 8)
    assert picks.shape == (8,) and np.all(np.diff(picks) > 0)
    sizes = np.bincount(stratum, minlength=8)
    assert sizes.sum() == 103 and sizes.max() - sizes.min() <= 1
    assert np.all(stratum[picks] == np.arange(8))  # each pick stands in its own stratum
    # strata are contiguous ranges of work per token
    lo = np.array([per_token[stratum == j].min() for j in range(8)])
    hi = np.array([per_token[stratum == j].max() for j in range(8)])
    assert np.all(hi[np.argsort(lo)][:-1] <= np.sort(lo)[1:])
    # seconds proportional to work: the estimate is the exact epoch time
    assert epoch_seconds(0.25 * work[picks], picks, stratum, work) == pytest.approx(0.25 * work.sum())
    # fewer micro-batches than picks: all of them, each its own stratum
    p2, s2 = stratified(per_token[:5], 8)
    assert p2.tolist() == s2.tolist() == list(range(5))


def test_bench_rounds_are_interleaved(speed, capsys):
    _, _, argv = speed
    res = _run_json(capsys, [*argv[: -len(TINY)], "--strategies", "packed,sorted,random,bucketed", *TINY])
    names = ["packed", "sorted", "random", "bucketed"]
    assert list(res["strategies"]) == names
    order = res["order"]
    # warm-up round, then two measured rounds: A B C D A B C D A B C D
    assert [o[1] for o in order] == names * 3
    assert [o[0] for o in order] == [0] * 4 + [1] * 4 + [2] * 4
    assert [o[2] for o in order] == ["warmup"] * 4 + ["measured"] * 8


def test_bench_converge_curves_at_equal_tokens(tmp_path, fixtures_dir, capsys):
    argv = ["bench", "--converge", "--data", str(fixtures_dir / "samples/*.jsonl.gz"),
            "--tokenizer", str(fixtures_dir / "tokenizers/llama_sp32k.model"), "--per-file", "12",
            "--budget", "160", "--grad-accum", "2", "--train-tokens", "1200", "--eval-every", "400",
            "--eval-samples", "8", "--lr", "0.01", "--json", "--out", str(tmp_path), *TINY]  # fmt: skip
    res = _run_json(capsys, argv)
    runs = res["strategies"]
    assert list(runs) == ["sorted", "random", "bucketed", "packed"]
    comp = res["comparison"]
    assert comp["marks"] == [400.0, 800.0, 1200.0]
    budgets = res["config"]["budgets"]
    assert budgets["packed"] == 160 and min(budgets.values()) == 160 and budgets["random"] > 160
    assert all(r["budget"] == budgets[n] for n, r in runs.items())
    step_max = 2 * max(budgets.values())
    for name, r in runs.items():
        assert r["curve"][0]["tokens"] == 0 and 1200 <= r["tokens"] < 1200 + step_max
        assert r["curve"][-1]["tokens"] == r["tokens"]
        assert r["steps"][-1]["tokens"] == r["tokens"]
        assert len(comp["loss_at_marks"][name]) == 3 and np.all(np.isfinite(comp["loss_at_marks"][name]))
        # every eval mark was crossed by an evaluation no more than one step later
        for mark in comp["marks"]:
            assert any(mark <= c["tokens"] < mark + step_max for c in r["curve"])
        # the same initial weights and held-out set for every strategy
        assert r["initial_loss"] == runs["sorted"]["initial_loss"]
        assert r["final_loss"] < r["initial_loss"]
    assert comp["final_rel_diff_vs_random"]["random"] == 0.0
    fewest = min(r["curve"][-1]["step"] for r in runs.values())
    assert comp["step_marks"][-1] == fewest and comp["final_steps"]["sorted"] == len(runs["sorted"]["steps"])
    assert comp["equal_steps_rel_diff_vs_random"]["random"] == 0.0
    assert (tmp_path / "converge.png").stat().st_size > 0


def test_matched_budgets_give_equal_step_counts():
    from padfree.bench.converge import ConvergeConfig, epoch_steps, matched_budgets

    rng = np.random.default_rng(3)
    lengths = np.minimum(rng.lognormal(5.0, 1.2, 3000).astype(np.int64) + 1, 1024)
    cfg = ConvergeConfig(budget=1024, grad_accum=4)
    budgets = matched_budgets(lengths, cfg)
    target = epoch_steps(lengths, "packed", 1024, cfg)
    assert budgets["packed"] == 1024
    for name, b in budgets.items():
        steps = epoch_steps(lengths, name, b, cfg)
        assert steps <= target, name
        # the smallest such budget: one token less takes more steps (or it is the floor)
        assert b == 1024 or epoch_steps(lengths, name, b - 1, cfg) > target, name
    assert budgets["random"] > budgets["bucketed"] >= budgets["sorted"] > 1024
    unmatched = matched_budgets(lengths, ConvergeConfig(budget=1024, grad_accum=4, equal_steps=False))
    assert set(unmatched.values()) == {1024}


def test_bench_bad_options_are_one_line_errors(tmp_path, fixtures_dir, capsys):
    np.save(tmp_path / "l.npy", np.array([5, 9, 3]))
    data = ["--data", str(fixtures_dir / "samples/*.jsonl.gz")]
    cases = [
        ["bench", str(tmp_path / "l.npy"), "--strategies", "sorted,nope"],
        ["bench", "--converge", *data, "--budget", "64", "--max-len", "100"],
        ["bench", *data],  # --data without --tokenizer
        ["bench", "--converge", "--strategies", "hf_flattening", *data],
    ]
    for argv in cases:
        assert main([*argv, *TINY]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("padfree: error:") and "\n" not in err, err
