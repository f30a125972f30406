"""Plans for sequence (SP) and context (CP) parallelism: every row a multiple of SP, every document of a
packed row a multiple of 2 x CP, the group's budget of sp x cp x budget tokens, the padding counted in every
metric and in the rank balance, and sp = cp = 1 reproducing today's plans and fingerprints."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from padfree import ConfigError, CostModel, PlanConfig, make_plan
from padfree.cli import main
from padfree.core import cost
from padfree.core.fingerprint import fingerprint_and_identity
from padfree.core.metrics import plan_metrics
from padfree.core.shard import Shard
from padfree.errors import OverlongError

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = ROOT / "fixtures" / "lengths"
HASHES = Path(__file__).resolve().parent / "plan_hashes.json"
STRATEGIES = ["sorted", "random", "bucketed", "packed"]
SHARDS = [(2, 1), (4, 1), (8, 1), (1, 2), (1, 4), (2, 2), (3, 2), (4, 4)]


def up(x, m):
    return -(-np.asarray(x, dtype=np.int64) // m) * m


def long_tail(n=6000, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(5.0, 1.0, n).astype(np.int64) + 1, 1000)
    lengths[rng.choice(n, 6, replace=False)] = rng.integers(1100, 2000, 6)  # over 1024, within 2 x 1024
    return lengths


def rows(plan):
    return [plan.lengths[plan.offsets[k] : plan.offsets[k + 1]] for k in range(plan.n_micro)]


def test_shard_degrees_are_validated_in_one_line():
    for bad in (0, -1, True, 2.0, "2", 1025):
        with pytest.raises(ConfigError, match="sp must be an integer from 1 to 1024"):
            PlanConfig(sp=bad)
        with pytest.raises(ConfigError, match="cp must be an integer"):
            PlanConfig(cp=bad)
    with pytest.raises(ConfigError, match="lower the budget"):
        PlanConfig(budget=2**20, sp=8, cp=4)
    with pytest.raises(ConfigError, match="not planned with sp or cp"):
        PlanConfig(strategy="packed", anchor_budget=10, cp=2)
    for shard in ({"sp": 2}, {"cp": 2}, {"sp": 2, "cp": 4}):  # chunks carry a document's past: not sharded
        with pytest.raises(ConfigError, match="chunked strategy is not planned with sp or cp > 1"):
            PlanConfig(strategy="chunked", budget=512, **shard)
    assert PlanConfig(budget=2**19, sp=8, cp=4).shard == Shard(8, 4)


@pytest.mark.parametrize(("sp", "cp"), SHARDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_row_shards_evenly_within_the_group_budget(strategy, sp, cp):
    """Packed: each document padded to 2 x CP, the row to SP (cp x lcm(2, sp) with CP); padded rows: the
    width to that multiple; either way at most sp x cp x budget tokens, padding included. Checked from the
    plan's lengths here, not from the planner's own shapes."""
    lengths = long_tail()
    budget = 1024
    cfg = PlanConfig(strategy=strategy, budget=budget, world_size=4, grad_accum=2, sp=sp, cp=cp, seed=3)
    plan = make_plan(lengths, cfg, 1)
    assert sorted(plan.indices.tolist()) == list(range(lengths.shape[0]))
    row = cp * np.lcm(2, sp) if cp > 1 else sp
    doc = 2 * cp if cp > 1 else 1
    want = []
    for r in rows(plan):
        if cfg.packed:
            padded = int(up(up(r, doc).sum(), row))
            assert padded % sp == 0 and padded % doc == 0
        else:
            padded = len(r) * int(up(r.max(), row)) if len(r) else 0
            assert padded // max(len(r), 1) % sp == 0
        assert padded <= sp * cp * budget
        want.append(padded)
    assert np.array_equal(plan.shapes().slots, np.array(want, dtype=np.float64))
    assert int(plan.lengths.max()) > budget  # long documents fit the group's row


def test_metrics_count_the_added_padding():
    lengths = np.array([5, 2])
    one = dict(budget=4, world_size=1, grad_accum=1)
    packed_sp = plan_metrics(make_plan(lengths, PlanConfig(strategy="packed", sp=2, **one)))
    assert packed_sp["padding_efficiency"] == pytest.approx(7 / 8)  # 5 + 2 -> a row of 8
    assert packed_sp["fill"] == pytest.approx(7 / 8)  # against the group's 2 x 4 tokens
    packed_cp = plan_metrics(make_plan(lengths, PlanConfig(strategy="packed", cp=2, **one)))
    assert packed_cp["padding_efficiency"] == pytest.approx(7 / 12)  # 8 + 4: documents to 2 x cp = 4
    sorted_sp = make_plan(lengths, PlanConfig(strategy="sorted", sp=4, **one))
    assert plan_metrics(sorted_sp)["padding_efficiency"] == pytest.approx(7 / 16)  # 2 rows x width 8
    unsharded = plan_metrics(make_plan(lengths, PlanConfig(strategy="packed", budget=8, world_size=1)))
    assert unsharded["padding_efficiency"] == 1.0
    assert packed_sp["compute_efficiency"] < unsharded["compute_efficiency"]


@pytest.mark.parametrize("strategy", ["packed", "bucketed"])
def test_ranks_are_balanced_on_the_padded_work(strategy):
    """The rank costs are those of the padded rows (recomputed here from the lengths), and the planner's
    balance holds on them."""
    lengths = long_tail(seed=5)
    cfg = PlanConfig(strategy=strategy, budget=512, world_size=8, grad_accum=2, cp=4, seed=1)
    plan = make_plan(lengths, cfg, 0)
    a, b, c = cfg.cost.a, cfg.cost.b, cfg.cost.c
    costs = []
    for r in rows(plan):
        if cfg.packed:
            spans = up(r, 8)
            spans[-1] += int(up(spans.sum(), 8) - spans.sum())
            costs.append(a * spans.sum() + b * (spans.astype(float) ** 2).sum() + c)
        else:
            w = float(up(r.max(), 8))
            costs.append(a * len(r) * w + b * len(r) * w * w + c)
    assert np.allclose(plan.costs(), costs)
    assert plan_metrics(plan)["imbalance"] < 1.05


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sp_cp_of_one_reproduce_the_golden_plans(strategy):
    """Explicit sp = cp = 1 is the plan the golden hashes pin (windowed path) and the same fingerprint."""
    lengths = np.load(LENGTHS / "self_instruct_t0.cl100k.npy")
    cfg = PlanConfig(strategy=strategy, budget=8192, world_size=2, grad_accum=2, seed=7, sp=1, cp=1)
    p = make_plan(lengths, cfg, epoch=2, stream=True, window=12_000)
    h = hashlib.sha256()
    for arr in (p.indices, p.offsets, p.lengths):
        h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    assert h.hexdigest() == json.loads(HASHES.read_text())[f"stream/{strategy}"]
    fp, identity = fingerprint_and_identity(lengths, cfg)
    assert "sp" not in identity and "cp" not in identity and "sp" not in cfg.to_dict()
    plain = PlanConfig(strategy=strategy, budget=8192, world_size=2, grad_accum=2, seed=7)
    assert fp == fingerprint_and_identity(lengths, plain)[0]
    sharded, ident = fingerprint_and_identity(lengths, cfg.with_(sp=2))
    assert sharded != fp and ident["sp"] == 2


def test_windowed_sharded_plans_hold_every_sample_once():
    lengths = long_tail(n=9000, seed=2)
    cfg = PlanConfig(strategy="packed", budget=1024, world_size=2, grad_accum=2, sp=2, cp=2, seed=4)
    plan = make_plan(lengths, cfg, 0, stream=True, window=2500)
    assert np.array_equal(np.sort(plan.indices), np.arange(9000))
    assert np.all(plan.shapes().slots % 4 == 0) and plan.shapes().slots.max() <= 4096


def test_overlong_is_measured_against_the_group_row():
    lengths = np.array([100, 3000, 200, 50])
    with pytest.raises(OverlongError, match="longer than the budget of 2048"):
        make_plan(lengths, PlanConfig(strategy="packed", budget=1024, sp=2))
    plan = make_plan(lengths, PlanConfig(strategy="packed", budget=1024, sp=4))
    assert int(plan.lengths.max()) == 3000
    split = make_plan(lengths, PlanConfig(strategy="packed", budget=512, sp=2, cp=2, overlong="split"))
    assert int(split.lengths.max()) <= 2048 and int(split.lengths.sum()) == int(lengths.sum())


def test_cost_shapes_of_a_sharded_packed_row():
    sh = cost.micro_shapes(np.array([5, 2, 3]), np.array([0, 3]), True, shard=Shard(sp=4, cp=1))
    assert sh.slots.tolist() == [12.0] and sh.real.tolist() == [10.0]
    assert sh.attn.tolist() == [25.0 + 4.0 + 25.0]  # the tail of 2 joins the last document's span
    unsharded = cost.micro_shapes(np.array([5, 2, 3]), np.array([0, 3]), True, shard=Shard())
    assert unsharded.slots.tolist() == [10.0] and unsharded.attn.tolist() == [38.0]


def _cli(args, capsys):
    code = main(args)
    return code, capsys.readouterr()


def test_cli_plan_and_analyze_take_sp_and_cp(tmp_path, capsys):
    lengths = tmp_path / "lengths.npy"
    np.save(lengths, long_tail(n=3000, seed=9))
    out = tmp_path / "plan.jsonl"
    opts = ["--budget", "1024", "--world-size", "2", "--grad-accum", "2"]
    assert main(["plan", str(lengths), "--strategy", "packed", *opts, "--sp", "4", "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    all_lengths = np.load(lengths)
    assert sorted(i for r in recs for i in r["indices"]) == list(range(3000))
    assert max(int(all_lengths[r["indices"]].sum()) for r in recs) > 1024
    capsys.readouterr()
    code, res = _cli(["analyze", str(lengths), *opts, "--strategies", "packed,sorted", "--cp", "2", "--json"],
                     capsys)  # fmt: skip
    assert code == 0
    got = json.loads(res.out)
    assert got["config"]["cp"] == 2 and got["config"]["sp"] == 1
    assert got["strategies"]["packed"]["padding_efficiency"] < 1.0
    plain = ["analyze", str(lengths), "--budget", "2048", "--strategies", "packed", "--json"]
    code, res = _cli(plain, capsys)
    assert code == 0 and "sp" not in json.loads(res.out)["config"]
    assert json.loads(res.out)["strategies"]["packed"]["padding_efficiency"] == 1.0
    assert main(["plan", str(lengths), "--sp", "0", "--out", str(out)]) == 2
    assert "argument --sp: must be an integer from 1 to 1024 (got '0')" in capsys.readouterr().err


def test_cost_model_sees_the_padding_not_only_the_tokens():
    """A slot-only cost model prices a sharded packed row at its padded length."""
    lengths = np.array([7, 7, 7, 7])
    cfg = PlanConfig(strategy="packed", budget=8, world_size=1, cp=2, cost=CostModel(1, 0, 0))
    plan = make_plan(lengths, cfg, 0)
    assert plan.costs().sum() == 4 * 8  # each 7 padded to 8
