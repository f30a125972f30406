import json

import numpy as np
import pytest

from padfree.advice.simulate import motivating_ratios, simulate, simulate_batches
from padfree.baselines import naive_bucketed
from padfree.cli import main
from padfree.core.buckets import bucket_of, growth_edges
from padfree.core.config import CostModel, PlanConfig


def test_padded_by_hand():
    # micro 0: two rows of 10 -> slots 20, attention 200; micro 1: two rows of 20 -> slots 40, attention 800
    cost = CostModel(a=1.0, b=0.01, c=5.0)
    out = simulate_batches(np.array([10, 10, 20, 20]), np.array([0, 2, 4]), False, 2, 1, cost, 0.5)
    # ranks: 20 + 2 + 5 = 27 and 40 + 8 + 5 = 53; the step waits for 53
    assert out["step_cost_total"] == pytest.approx(53.0)
    assert out["tokens_per_unit"] == pytest.approx(60 / 53)
    assert out["epoch_seconds"] == pytest.approx(26.5)
    assert out["tokens_per_second"] == pytest.approx(60 / 26.5)
    assert out["imbalance"] == pytest.approx(53 / 40)


def test_packed_and_accumulation_by_hand():
    # one rank, two accumulation micro-batches per step, two steps: packed rows (their tokens, no padding to
    # the budget of 8) with per-document attention
    lens = np.array([3, 5, 8, 2, 2, 4, 6])
    offsets = np.array([0, 2, 3, 6, 7])
    cost = CostModel(a=1.0, b=0.1, c=1.0)
    out = simulate_batches(lens, offsets, True, 1, 2, cost)
    step1 = (8 + 0.1 * (9 + 25) + 1) + (8 + 0.1 * 64 + 1)
    step2 = (8 + 0.1 * (4 + 4 + 16) + 1) + (6 + 0.1 * 36 + 1)
    assert out["steps"] == 2
    assert out["step_cost_total"] == pytest.approx(step1 + step2)
    assert out["tokens_per_unit"] == pytest.approx(30 / (step1 + step2))
    assert "tokens_per_second" not in out
    with pytest.raises(ValueError, match="whole steps"):
        simulate_batches(lens, offsets[:-1], True, 1, 2, cost)


def test_equal_lengths_every_strategy_same_throughput():
    # 64 samples of 100 tokens, budget 400: 16 micro-batches of 4 rows, 4 steps of 2 ranks x 2 micro-batches;
    # each step costs 2 * 400 slots on every rank -> 4 * 800 = 3200 units for 6400 tokens
    lengths = np.full(64, 100)
    res = simulate(lengths, PlanConfig(budget=400, world_size=2, grad_accum=2, cost=CostModel(1.0, 0.0, 0.0)))
    for name, r in res["strategies"].items():
        assert r["step_cost_total"] == pytest.approx(3200.0), name
        assert r["tokens_per_unit"] == pytest.approx(2.0), name
        assert r["ratio_to_sorted"] == pytest.approx(1.0), name


def test_seed_mix_random_over_sorted_follows_padding_when_only_slots_cost(seed_mix):
    cfg = PlanConfig(budget=16384, world_size=8, grad_accum=4, cost=CostModel(1.0, 0.0, 0.0))
    res = simulate(seed_mix, cfg, strategies=("sorted", "random"), naive=False)["strategies"]
    pad_ratio = res["random"]["padding_efficiency"] / res["sorted"]["padding_efficiency"]
    assert abs(res["random"]["ratio_to_sorted"] - pad_ratio) < 0.05
    # and it is the motivating case's measured ratio within a few points
    assert abs(res["random"]["ratio_to_sorted"] - motivating_ratios()["random"]) < 0.05


def test_naive_bucketed_is_a_partition_inside_buckets():
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 3000, 20_000)
    order, offsets = naive_bucketed(lengths, 4096, np.random.default_rng(1), step_size=8)
    assert np.array_equal(np.sort(order), np.arange(lengths.size))
    assert (offsets.shape[0] - 1) % 8 == 0
    b = bucket_of(lengths, growth_edges(lengths, 1.25))[order]
    for k in range(offsets.shape[0] - 1):
        lo, hi = offsets[k], offsets[k + 1]
        assert (hi - lo) * lengths[order[lo:hi]].max() <= 4096
        assert b[lo] == b[hi - 1]  # never mixes buckets
    # micro-batch order is shuffled: bucket ids of consecutive micro-batches are not sorted
    first = b[offsets[:-1]]
    assert np.any(np.diff(first) < 0)


def test_cli_simulate_json_with_cost_file(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(x) for x in np.random.default_rng(0).integers(1, 500, 2000)) + "\n")
    cost = tmp_path / "cost.json"
    CostModel(a=1.0, b=0.001, c=10.0).save(cost, seconds_per_unit=1e-6)
    args = ["simulate", str(lengths), "--gpus", "4", "--grad-accum", "2", "--budget", "2048"]
    assert main([*args, "--cost", str(cost), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["config"]["gpus"] == 4 and res["config"]["seconds_per_unit"] == 1e-6
    rows = res["strategies"]
    assert set(rows) == {"sorted", "random", "bucketed", "packed", "naive_bucketed"}
    for r in rows.values():
        assert r["tokens_per_second"] == pytest.approx(r["tokens_per_unit"] / 1e-6)
    assert rows["random"]["ratio_to_sorted"] < rows["bucketed"]["ratio_to_sorted"]
    assert main([*args, "--strategies", "sorted,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert capsys.readouterr().err == ""  # no held-out error recorded: no warning


def test_simulate_warns_once_when_the_cost_file_fits_badly(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(x) for x in np.random.default_rng(0).integers(1, 500, 500)) + "\n")
    args = ["simulate", str(lengths), "--gpus", "2", "--grad-accum", "1", "--budget", "1024", "--json"]
    for err, warned in ((0.53, True), (0.1, False)):
        cost = tmp_path / f"cost-{err}.json"
        CostModel(a=1.0, b=0.001, c=10.0).save(cost, seconds_per_unit=1e-6, held_out={"rel_rms": err})
        assert main([*args, "--cost", str(cost)]) == 0
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == int(warned)
        if warned:
            assert lines[0].startswith("warning: ") and "0.53 (> 0.25)" in lines[0]


def test_cli_simulate_table_on_seed_mix_shows_measured(capsys):
    assert main(["simulate", "--gpus", "8", "--strategies", "sorted,random"]) == 0
    out = capsys.readouterr().out
    assert "naive_bucketed" in out and "0.37" in out and "0.78" in out and "relative only" in out


def test_speeds_multiply_each_ranks_cost_by_hand():
    # micro 0 on rank 0 (slots 20), micro 1 on rank 1 (slots 40); rank 1 takes 1.5x as long: 20 vs 60
    out = simulate_batches(np.array([10, 10, 20, 20]), np.array([0, 2, 4]), False, 2, 1,
                           CostModel(1.0, 0.0, 0.0), speeds=np.array([1.0, 1.5]))  # fmt: skip
    assert out["step_cost_total"] == pytest.approx(60.0) and out["imbalance"] == pytest.approx(60 / 40)


@pytest.mark.parametrize("strategy", ["bucketed", "packed"])
def test_dynamic_prediction_keeps_every_token_and_beats_static_with_a_slow_rank(strategy):
    rng = np.random.default_rng(1)
    lengths = np.minimum(rng.lognormal(5.5, 1.0, 6000).astype(np.int64) + 1, 2048)
    cfg = PlanConfig(
        strategy=strategy, budget=2048, world_size=4, grad_accum=2, cost=CostModel(1.0, 1e-4, 0.0)
    )
    equal = simulate(lengths, cfg, (strategy,), naive=False)["strategies"][strategy]
    ones = simulate(lengths, cfg, (strategy,), naive=False, speeds=np.ones(4))["strategies"][strategy]
    slow = simulate(lengths, cfg, (strategy,), naive=False, speeds=np.array([1, 1, 1, 1.5]))
    row = slow["strategies"][strategy]
    assert ones["step_cost_total"] == equal["step_cost_total"]  # factors of 1: the plan as it is
    assert row["dynamic"]["tokens"] == row["tokens"] == float(lengths.sum())
    assert row["imbalance"] > 1.25 and row["dynamic"]["imbalance"] < row["imbalance"]
    assert row["dynamic_over_static"] > 1.05
    assert slow["config"]["speeds"] == [1.0, 1.0, 1.0, 1.5]
    # a true cost the plan does not know (attention 10x heavier): dynamic balances it, static cannot
    heavy = simulate(lengths, cfg, (strategy,), naive=False, true_cost=CostModel(1.0, 1e-3, 0.0))
    h = heavy["strategies"][strategy]
    assert h["dynamic"]["imbalance"] <= h["imbalance"] and heavy["config"]["true_cost"]["b"] == 1e-3


def test_cli_simulate_speeds(capsys):
    base = ["simulate", "--strategies", "packed", "--no-naive", "--budget", "8192", "--grad-accum", "1"]
    assert main([*base, "--speeds", "1,1,1.5", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["config"]["gpus"] == 3 and res["strategies"]["packed"]["dynamic_over_static"] > 1.1
    for bad in (["--speeds", "1,x"], ["--speeds", "1,0"], ["--speeds", "1,1", "--gpus", "4"]):
        assert main([*base, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("padfree: error:") and "speeds" in err and "\n" not in err


def test_drafter_blocks_by_hand():
    # one packed row (documents 4 and 6 tokens, 2 and 3 anchors), one padded micro-batch (rows 4 and 6,
    # anchors 2 and 3: blocks 2 x 3 = 6, reach 6 x 6 / 2 = 18)
    cost = CostModel(a=1.0, b=0.0, c=0.0, d=10.0, e=1.0)
    lens, anchors, offsets = np.array([4, 6]), np.array([2, 3]), np.array([0, 2])
    packed = simulate_batches(lens, offsets, True, 1, 1, cost, anchors=anchors)
    assert packed["step_cost_total"] == pytest.approx(10 + 10 * 5 + (2 * 4 + 3 * 6) / 2)
    padded = simulate_batches(lens, offsets, False, 1, 1, cost, anchors=anchors)
    assert padded["step_cost_total"] == pytest.approx(12 + 10 * 6 + 18)
    assert padded["draft_block_efficiency"] == pytest.approx(5 / 6) and packed["draft_block_efficiency"] == 1


def test_simulate_cli_drafter_setup_and_cache_size(tmp_path, capsys):
    from padfree.advice.drafter import offline_cache_bytes

    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 900, 3000)
    np.save(tmp_path / "l.npy", lengths)
    np.save(tmp_path / "l.assistant.npy", lengths // 2)
    args = ["simulate", str(tmp_path / "l.npy"), "--budget", "4096", "--world-size", "4",
            "--grad-accum", "1", "--drafter", "dflash", "--anchor-budget", "1024", "--json"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    d = out["drafter"]
    assert d["cache_bytes"] == offline_cache_bytes(int(lengths.sum()), 6, 4096, 2)
    # SpecForge's rule: every position whose token and next carry loss, at most 512 a sample
    assert d["loss_counts"].endswith("l.assistant.npy") and d["recipe"] == "specforge"
    assert d["draft_blocks"] == int(np.minimum(lengths // 2 - 1, 512).sum())
    assert d["anchors_per_sample"] == pytest.approx(np.minimum(lengths // 2 - 1, 512).mean())
    assert out["config"]["anchor_budget"] == 1024 and out["config"]["cost"]["d"] > 0
    packed = out["strategies"]["packed"]
    assert packed["draft_block_efficiency"] == 1.0 and packed["imbalance"] < 1.05
    assert out["strategies"]["random"]["draft_block_efficiency"] < 1.0
    assert main(args[:-1] + ["--drafter", "eagle3", "--json"]) == 0
    e3 = json.loads(capsys.readouterr().out)
    assert e3["drafter"]["cache_layers"] == 4 and "draft_blocks" not in e3["strategies"]["packed"]


@pytest.mark.parametrize(
    ("counts", "rule"),
    [
        (lambda n: n + 1, "from 0 to the sample's length"),
        (lambda n: -n, "from 0 to the sample's length"),
        (lambda n: n / 2.5, "from 0 to the sample's length"),
        (lambda n: np.where(n > 0, np.nan, 0.0), "from 0 to the sample's length"),
        (lambda n: n[:-1], "loss counts for"),
    ],
)
def test_simulate_drafter_refuses_loss_counts_that_do_not_fit_the_lengths(tmp_path, capsys, counts, rule):
    """Issue 28 item 4: --assistant counts above a sample's length, negative, fractional or NaN (or of another
    sample count) are one line naming the file and the sample, exit 2 (not 20,065 or 0 draft blocks)."""
    lengths = np.array([40, 90, 300, 12])
    np.save(tmp_path / "l.npy", lengths)
    np.save(tmp_path / "bad.npy", counts(lengths))
    args = [
        "simulate",
        str(tmp_path / "l.npy"),
        "--drafter",
        "dflash",
        "--assistant",
        str(tmp_path / "bad.npy"),
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.npy" in err[0] and rule in err[0], err


def test_simulate_drafter_refuses_more_cache_layers_than_the_target_has(tmp_path, capsys):
    np.save(tmp_path / "l.npy", np.random.default_rng(0).integers(20, 900, 400))
    args = ["simulate", str(tmp_path / "l.npy"), "--drafter", "eagle3", "--target-layers", "8", "--json"]
    assert main([*args, "--cache-layers", "9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cache-layers 9" in err[0] and "8 layers" in err[0], err
    assert main([*args, "--cache-layers", "8"]) == 0


def test_simulate_eagle3_says_nothing_of_dflash_blocks(tmp_path, capsys):
    np.save(tmp_path / "l.npy", np.random.default_rng(0).integers(20, 900, 400))
    assert main(["simulate", str(tmp_path / "l.npy"), "--drafter", "eagle3"]) == 0
    out = capsys.readouterr().out
    assert "drafter eagle3:" in out and "blocks" not in out.split("drafter eagle3:")[1]
    assert main(["simulate", str(tmp_path / "l.npy"), "--drafter", "dflash"]) == 0
    assert "DFlash blocks per epoch" in capsys.readouterr().out
