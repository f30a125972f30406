"""Per-micro-batch SP/CP degree (lab.degree, a benchmark-only plan): every sample once per epoch, degree-1
rows within the per-GPU budget and holding no document over it, degree-G rows within the group's, every GPU
of a group walking the same phases (brute force over small inputs), determinism, and a modeled gain over
the fixed full degree where long documents are rare."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from lab import degree
from lab.degree import epoch_cost, fixed_costs, plan_degrees
from padfree import ConfigError, PlanConfig, make_plan
from padfree.core.items import make_items
from padfree.core.shard import round_up


def lengths_long_tail(n, seed, budget, longest):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(np.log(budget) - 2.5, 1.0, n).astype(np.int64) + 1, budget)
    n_long = max(1, n // 50)
    lengths[rng.choice(n, n_long, replace=False)] = rng.integers(budget + 1, longest + 1, n_long)
    return lengths


def check_schedule(gp, lengths):
    """Walk every GPU of every DP rank through its phases: the same phases and degrees on all GPUs of a
    group; a degree-G phase is one row for all of them, within sp x cp x budget padded; a degree-1 phase is
    G disjoint rows, GPU g the g-th, each within the budget; every item (sample piece) runs exactly once."""
    c = gp.config
    g_size, budget, shard = c.sp * c.cp, c.budget, c.shard
    cap = shard.capacity(budget)
    assert gp.n_phases % c.micro_per_step == 0 and gp.n_phases > 0
    assert set(np.unique(gp.degree).tolist()) <= {1, g_size}
    seen: Counter = Counter()
    tokens: Counter = Counter()
    phases = []
    for rank in range(c.world_size):
        walks = [list(gp.schedule(rank, g)) for g in range(g_size)]
        steps_of = [[(k, d) for k, d, _ in w] for w in walks]
        assert all(s == steps_of[0] for s in steps_of)  # aligned: every collective finds all G GPUs
        for k, d in steps_of[0]:
            phases.append(k)
            rows = [gp.gpu_row(k, g) for g in range(g_size)]
            if d == g_size:
                assert len(set(rows)) == 1
                lens = gp.lengths[gp.row_offsets[rows[0]] : gp.row_offsets[rows[0] + 1]]
                padded = round_up(np.array([shard.sizes(lens, packed=True).sum()]), shard.row_multiple)[0]
                assert padded <= cap and lens.max() > budget  # the full degree only where a GPU cannot
                run = [rows[0]]
            else:
                assert d == 1 and len(set(rows)) == g_size
                run = rows
            for j in run:
                a, b = gp.row_offsets[j], gp.row_offsets[j + 1]
                if d == 1:
                    assert gp.lengths[a:b].sum() <= budget
                seen.update(gp.indices[a:b].tolist())
                for i, n in zip(gp.indices[a:b].tolist(), gp.lengths[a:b].tolist(), strict=True):
                    tokens[i] += n
    assert sorted(phases) == list(range(gp.n_phases))
    items = make_items(lengths, cap, c.overlong)
    assert seen == Counter(items.sample_ids().tolist())
    kept = items.sample_ids() if items.dropped else np.arange(lengths.shape[0])
    expect = np.minimum(lengths, cap) if c.overlong == "truncate" else lengths
    assert all(tokens[int(i)] == expect[i] for i in kept)


@pytest.mark.parametrize("seed", range(40))
def test_brute_force_group_schedule_on_small_inputs(seed):
    rng = np.random.default_rng(seed)
    sp, cp = [(2, 1), (4, 1), (1, 2), (2, 2), (3, 1), (8, 1)][seed % 6]
    budget = int(rng.integers(16, 64))
    overlong = ["split", "truncate", "drop", "error"][seed % 4]
    longest = budget * sp * cp * (2 if overlong != "error" else 1)
    lengths = lengths_long_tail(int(rng.integers(20, 200)), seed, budget, longest)
    cfg = PlanConfig(
        strategy="packed", budget=budget, world_size=int(rng.integers(1, 4)),
        grad_accum=int(rng.integers(1, 4)), sp=sp, cp=cp, overlong=overlong, seed=seed,
    )  # fmt: skip
    gp = plan_degrees(lengths, cfg, epoch=seed % 3, comm=float(rng.random()), fill=seed % 5 != 0)
    check_schedule(gp, lengths)


def test_short_documents_run_at_degree_one_and_long_ones_at_the_full_degree():
    lengths = lengths_long_tail(3000, 7, 256, 4 * 256)
    cfg = PlanConfig(strategy="packed", budget=256, world_size=3, grad_accum=2, sp=2, cp=2, seed=4)
    gp = plan_degrees(lengths, cfg, comm=0.1)
    check_schedule(gp, lengths)
    deg = gp.row_degrees()
    per_row = np.maximum.reduceat(gp.lengths, gp.row_offsets[:-1]) if gp.lengths.size else gp.lengths
    nonempty = np.diff(gp.row_offsets) > 0
    assert np.all((per_row[nonempty] > 256) == (deg[nonempty] == 4))
    assert (gp.degree == 1).sum() > (gp.degree == 4).sum() > 0
    alone = plan_degrees(lengths, cfg, comm=0.1, fill=False)  # no short document at degree 4
    check_schedule(alone, lengths)
    wide = np.repeat(alone.row_degrees(), np.diff(alone.row_offsets)) == 4
    assert np.array_equal(wide, alone.lengths > 256)
    # rows are full: the degree-1 rows hold on average > 90% of the budget
    assert (
        gp.lengths.sum() - gp.lengths[np.repeat(deg, np.diff(gp.row_offsets)) == 4].sum()
        > 0.9 * 256 * ((deg == 1) & nonempty).sum()
    )


def test_deterministic_and_fresh_every_epoch():
    lengths = lengths_long_tail(2000, 3, 128, 512)
    cfg = PlanConfig(strategy="packed", budget=128, world_size=2, grad_accum=2, sp=4, seed=11)
    a, b = plan_degrees(lengths, cfg, 1, comm=0.2), plan_degrees(lengths, cfg, 1, comm=0.2)
    for name in ("indices", "lengths", "row_offsets", "degree", "first_row"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    c = plan_degrees(lengths, cfg, 2, comm=0.2)
    assert not np.array_equal(a.indices, c.indices)
    other_seed = plan_degrees(lengths, cfg.with_(seed=12), 1, comm=0.2)
    assert not np.array_equal(a.indices, other_seed.indices)


def test_dp_ranks_are_balanced_by_the_phase_costs():
    lengths = lengths_long_tail(4000, 5, 256, 1024)
    cfg = PlanConfig(strategy="packed", budget=256, world_size=4, grad_accum=4, sp=4, seed=2)
    gp = plan_degrees(lengths, cfg, comm=0.1)
    costs = gp.costs().reshape(gp.n_steps, 4, 4)
    per_rank = costs.sum(axis=2)
    balanced = float(np.mean(per_rank.max(axis=1) / per_rank.mean(axis=1)))
    shuffled = np.random.default_rng(0).permuted(costs.reshape(gp.n_steps, 16), axis=1)
    unbalanced = shuffled.reshape(gp.n_steps, 4, 4).sum(axis=2)
    assert balanced < float(np.mean(unbalanced.max(axis=1) / unbalanced.mean(axis=1)))
    assert balanced < 1.05


def test_modeled_gain_over_the_fixed_full_degree():
    """Long documents rare: most tokens avoid the sharding's communication, so the per-micro-batch degree
    costs less; without a communication term and without CP padding it costs about the same."""
    lengths = lengths_long_tail(6000, 9, 512, 4 * 512)
    cfg = PlanConfig(strategy="packed", budget=512, world_size=2, grad_accum=4, sp=4, seed=1)
    fixed = make_plan(lengths, cfg, 0)
    w, ga = cfg.world_size, cfg.grad_accum
    for comm in (0.1, 0.3):
        dyn = plan_degrees(lengths, cfg, 0, comm=comm)
        gain = epoch_cost(fixed_costs(fixed, comm), w, ga) / epoch_cost(dyn.costs(), w, ga)
        assert gain > 1.0 + comm / 2
    dyn0 = plan_degrees(lengths, cfg, 0)
    ratio = epoch_cost(fixed_costs(fixed), w, ga) / epoch_cost(dyn0.costs(), w, ga)
    assert 0.9 < ratio < 1.1


def test_refusals_name_the_rule():
    lengths = np.full(50, 10)
    with pytest.raises(ConfigError, match="sp or cp > 1"):
        plan_degrees(lengths, PlanConfig(strategy="packed", budget=64))
    with pytest.raises(ConfigError, match="packed rows"):
        plan_degrees(lengths, PlanConfig(strategy="bucketed", budget=64, sp=2))
    with pytest.raises(ConfigError, match="comm must be"):
        plan_degrees(lengths, PlanConfig(strategy="packed", budget=64, sp=2), comm=-1.0)
    with pytest.raises(ConfigError, match="cannot fill one step"):
        plan_degrees(lengths[:3], PlanConfig(strategy="packed", budget=64, sp=2, world_size=2, grad_accum=2))
    gp = plan_degrees(lengths, PlanConfig(strategy="packed", budget=64, sp=2))
    with pytest.raises(ConfigError, match="outside a group"):
        gp.gpu_micro(0, 2)


def test_tail_kept_whole_when_dealing_it_anew_would_overflow_a_row(monkeypatch):
    """The last partial step's rows stay as they are and empty degree-1 phases complete the step when
    dealing its documents anew cannot keep every row within the budget."""
    monkeypatch.setattr(degree._cuts, "lpt_bins", lambda lens, n, budget: np.zeros(0, np.int64))
    lengths = lengths_long_tail(700, 1, 64, 256)
    cfg = PlanConfig(strategy="packed", budget=64, world_size=3, grad_accum=3, sp=2, cp=2, seed=5)
    gp = plan_degrees(lengths, cfg)
    check_schedule(gp, lengths)
    assert (np.diff(gp.row_offsets) == 0).sum() >= 4  # at least one whole phase of idle GPUs


def test_records_hold_every_sample_once_as_json_lines():
    """The phases as JSON lines (:meth:`GroupPlan.records`): degree-G lines one row, degree-1 lines one row
    per GPU within the budget, every sample's tokens once."""
    values = lengths_long_tail(1500, 2, 256, 2048)
    cfg = PlanConfig(strategy="packed", budget=256, world_size=2, grad_accum=2, sp=4, overlong="split")
    gp = plan_degrees(values, cfg, comm=0.1)
    recs = [json.loads(json.dumps(r)) for r in gp.records()]
    assert {r["degree"] for r in recs} == {1, 4} and len(recs) % 4 == 0
    tokens: Counter = Counter()
    for r in recs:
        if r["degree"] == 4:
            rows = [(r["indices"], r["lengths"])]
        else:
            assert len(r["gpus"]) == 4 and all(sum(ls) <= 256 for ls in r["gpu_lengths"])
            rows = list(zip(r["gpus"], r["gpu_lengths"], strict=True))
        for ids, ls in rows:
            for i, n in zip(ids, ls, strict=True):
                tokens[i] += n
    assert tokens == Counter({i: int(v) for i, v in enumerate(values)})  # every sample's tokens once
    with pytest.raises(ConfigError, match="needs sp or cp > 1"):
        plan_degrees(values, cfg.with_(sp=1))
