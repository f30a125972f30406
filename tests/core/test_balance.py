"""Dynamic balancing's pure parts against brute force: the exact non-negative fit, the refit of coefficients
and speeds, the speed-aware assignment of a step, the packed re-cut, and that none of them can change which
items a step holds."""

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

from padfree import PlanConfig, make_plan
from padfree.core import _ranks, stream
from padfree.core.balance import Balance, dynamic_budget, step_layout
from padfree.core.budget import Budget
from padfree.core.config import DEFAULT_COST
from padfree.core.cost import Coefficients, micro_costs, micro_shapes
from padfree.core.refit import fit, nnls3, rank_stats, relative_error
from padfree.errors import ConfigError


def test_nnls3_is_the_exact_constrained_minimum():
    rng = np.random.default_rng(0)
    grid = np.linspace(0, 3, 31)
    for _ in range(25):
        m = rng.normal(size=(5, 3))
        gram = m.T @ m + 0.05 * np.eye(3)
        rhs = rng.normal(size=3)
        theta = np.array(nnls3(gram.tolist(), rhs.tolist()))
        assert (theta >= 0).all()
        obj = theta @ gram @ theta - 2 * rhs @ theta
        # brute force on a grid never does better (up to the grid's resolution around the optimum)
        pts = np.array(list(itertools.product(grid, repeat=3)))
        brute = np.einsum("ni,ij,nj->n", pts, gram, pts) - 2 * pts @ rhs
        assert obj <= brute.min() + 1e-9
        # KKT: the gradient vanishes on the support and is >= 0 off it
        grad = 2 * (gram @ theta - rhs)
        assert np.all(np.abs(grad[theta > 0]) < 1e-8) and np.all(grad[theta == 0] > -1e-8)


@pytest.mark.parametrize("seed", range(6))
def test_fit_recovers_coefficients_and_speeds_from_exact_times(seed):
    rng = np.random.default_rng(seed)
    world = int(rng.integers(2, 6))
    true = (float(rng.uniform(1e-5, 1e-4)), float(rng.choice([0.0, rng.uniform(1e-9, 1e-8)])), 0.003)
    speeds = rng.uniform(0.5, 1.5, world)
    speeds /= speeds.mean()
    rows = []
    for r in range(world):
        for _ in range(12):
            slots = rng.uniform(500, 4096)
            attn = slots * rng.uniform(50, 4096)
            rows.append((r, slots, attn, (true[0] * slots + true[1] * attn + true[2]) / speeds[r]))
    rec = np.array(rows)
    scale = (4096.0, 4096.0**2)
    cost, got = fit(rank_stats(rec, world, scale), (1e-5, 0.0, 0.0), None, scale)
    assert np.allclose(got, speeds, rtol=2e-3)
    assert np.allclose(cost[:2], true[:2], rtol=0.02, atol=1e-11)
    assert abs(cost[2] - true[2]) < 0.01 * rec[:, 3].mean()  # c is a small share of a micro-batch's time
    assert relative_error(rec, cost, got) < 0.01


def test_fit_is_the_same_whatever_the_summation_order():
    """Every rank refits from the same records, possibly gathered in another memory order."""
    rng = np.random.default_rng(3)
    rec = np.column_stack([rng.integers(0, 3, 90), rng.uniform(1, 4000, 90), rng.uniform(1, 1e7, 90),
                           rng.uniform(0.01, 0.2, 90)])  # fmt: skip
    scale = (4096.0, 4096.0**2)
    a = fit(rank_stats(rec, 3, scale), (1e-5, 1e-9, 0.0), (1.1, 0.9, 1.0), scale)
    b = fit(rank_stats(rec[rng.permutation(90)], 3, scale), (1e-5, 1e-9, 0.0), (1.1, 0.9, 1.0), scale)
    assert a == b
    assert math.isclose(sum(a[1]) / 3, 1.0, rel_tol=1e-5)


def _brute_best(costs, speeds, world, accum):
    best = math.inf
    for labels in itertools.product(range(world), repeat=len(costs)):
        if any(labels.count(r) != accum for r in range(world)):
            continue
        load = np.bincount(labels, weights=costs, minlength=world)
        best = min(best, float((load / speeds).max()))
    return best


def test_speed_aware_assignment_is_near_the_brute_force_optimum():
    rng = np.random.default_rng(1)
    ratios = []
    for _ in range(60):
        world, accum = int(rng.integers(2, 4)), int(rng.integers(1, 3))
        k = world * accum
        costs = rng.uniform(1, 10, k) ** rng.uniform(1, 2)
        speeds = rng.uniform(0.5, 1.5, world)
        perm = _ranks.balance_ranks(costs, world, accum, 64, speeds, False)
        assert sorted(perm.tolist()) == list(range(k))
        got = float((costs[perm].reshape(world, accum).sum(axis=1) / speeds).max())
        ratios.append(got / _brute_best(costs, speeds, world, accum))
    ratios = np.array(ratios)
    assert ratios.min() >= 1 - 1e-12 and ratios.max() <= 4 / 3 and np.mean(ratios < 1 + 1e-9) >= 0.6


def test_equal_speeds_give_the_plans_assignment():
    rng = np.random.default_rng(2)
    costs = rng.uniform(1, 10, 5 * 12)
    a = _ranks.balance_ranks(costs, 4, 3, 64, np.ones(4), True)
    b = _ranks.balance_ranks(costs, 4, 3, 64, np.ones(4), False)
    assert (costs[a].reshape(-1, 4, 3).sum(2).max(1) <= costs[b].reshape(-1, 4, 3).sum(2).max(1) * 1.02).all()


@pytest.mark.parametrize("seed", range(5))
def test_packed_recut_keeps_every_item_within_the_budget_and_follows_speeds(seed):
    rng = np.random.default_rng(seed)
    world, accum, budget = 2, 4, 4096
    cfg = PlanConfig(strategy="packed", budget=int(budget * 0.85), world_size=world, grad_accum=accum)
    seg = Budget.of(cfg.with_(budget=budget), cfg.budget)  # planned at 85%, re-cut up to the budget
    lens = rng.integers(20, 1500, 60)
    # bins as the plan would fill them (to 85% of the budget)
    cur, offsets = 0, [0]
    for i, n in enumerate(lens):
        if cur + n > cfg.budget:
            offsets.append(i)
            cur = 0
        cur += n
    offsets.append(len(lens))
    lens, offsets = lens[: offsets[accum * world]], np.array(offsets[: accum * world + 1])
    assert offsets.shape[0] == accum * world + 1  # 60 items of 20-1500 tokens fill the step's 8 bins
    balance = Balance((1e-4, 1e-8, 1e-3), speeds=(1.2, 0.8), fitted=True, recut=True)
    order, offs = step_layout(lens, offsets, cfg, balance, budget=seg)
    assert sorted(order.tolist()) == list(range(len(lens)))  # the step's items, each once
    per_bin = np.add.reduceat(np.append(lens[order], 0), offs[:-1])[: world * accum] * (np.diff(offs) > 0)
    assert per_bin.max() <= budget
    weights = 1e-4 * lens[order] + 1e-8 * lens[order] ** 2.0
    rank_load = np.add.reduceat(np.append(weights, 0), offs[:-1:accum])[:world]
    static = step_layout(lens, offsets, cfg, Balance((1e-4, 1e-8, 1e-3)), budget=seg)
    static_load = np.add.reduceat(np.append(weights[np.argsort(order)][static[0]], 0), static[1][:-1:accum])
    assert (rank_load / (1.2, 0.8)).max() < (static_load[:world] / (1.2, 0.8)).max()


def test_micro_costs_of_empty_micro_batches_are_the_constant():
    out = micro_costs(
        micro_shapes(np.array([3, 4]), np.array([0, 0, 2, 2]), True), Coefficients(1.0, 0.0, 5.0)
    )
    assert out.tolist() == [5.0, 12.0, 5.0]


def test_headroom_is_validated_and_for_every_strategy():
    assert dynamic_budget(PlanConfig(strategy="packed", budget=100), headroom=1.0) is None
    assert dynamic_budget(PlanConfig(strategy="bucketed", budget=100), headroom=0.85) == 85
    with pytest.raises(ConfigError, match="headroom"):
        dynamic_budget(PlanConfig(strategy="packed", budget=100), headroom=0.2)


def test_permute_in_place_is_a_gather():
    rng = np.random.default_rng(9)
    for n in (0, 1, 7, 500):
        values = rng.integers(0, 1000, n).astype(np.int32)
        order = rng.permutation(n)
        expected = values[order]
        stream.permute_in_place(values, order, np.zeros(n, np.uint8))
        assert np.array_equal(values, expected)


def _padded_step(rng, world, accum, budget, headroom=0.85):
    """A padded step as a dynamic plan cuts it: ``world * accum`` micro-batches picked at random from sorted
    runs of lognormal lengths (``count * longest <= headroom * budget``), in random order."""
    from padfree.core.batching import cut

    cap = int(budget * headroom)
    lens = np.sort(np.minimum(rng.lognormal(rng.uniform(3, 6.5), 1.0, 3000).astype(np.int64) + 2, cap))
    offs = cut(lens, cap)
    mb = rng.choice(offs.shape[0] - 1, world * accum, replace=False)
    parts = [lens[offs[q] : offs[q + 1]] for q in mb]
    return np.concatenate(parts), np.concatenate([[0], np.cumsum([len(p) for p in parts])])


def _rank_times(lens, order, offs, model, speeds, accum):
    costs = micro_costs(micro_shapes(lens[order], offs, False), Coefficients(*model))
    return costs.reshape(-1, accum).sum(axis=1) / speeds


@pytest.mark.parametrize("strategy", ["bucketed", "sorted", "random"])
@pytest.mark.parametrize("seed", range(8))
def test_padded_recut_keeps_every_item_once_within_the_budget_and_never_slower(strategy, seed):
    rng = np.random.default_rng(seed)
    world, accum, budget = int(rng.integers(2, 5)), int(rng.integers(1, 5)), 4096
    lens, offsets = _padded_step(rng, world, accum, budget)
    cfg = PlanConfig(strategy=strategy, budget=int(budget * 0.85), world_size=world, grad_accum=accum)
    seg = Budget.of(cfg.with_(budget=budget), cfg.budget)  # planned at 85%, re-cut up to the budget
    speeds = rng.uniform(0.5, 1.5, world)
    model = (float(rng.uniform(1e-5, 1e-4)), float(rng.choice([0.0, rng.uniform(1e-9, 1e-7)])), 1e-3)
    balance = Balance(model, speeds=tuple(speeds), fitted=True, recut=True)
    order, offs = step_layout(lens, offsets, cfg, balance, budget=seg)
    assert sorted(order.tolist()) == list(range(len(lens)))  # the step's items, each once
    assert offs.shape[0] == world * accum + 1 and offs[0] == 0 and offs[-1] == len(lens)
    counts = np.diff(offs)
    assert (counts > 0).all()  # a micro-batch keeps a row of its own
    longest = np.maximum.reduceat(lens[order], offs[:-1])
    assert (counts * longest).max() <= budget  # the real budget, never above
    plain = step_layout(lens, offsets, cfg, replace(balance, recut=False), budget=seg)
    got, assigned = (_rank_times(lens, *x, model, speeds, accum).max() for x in ((order, offs), plain))
    assert got <= assigned
    again = step_layout(lens.copy(), offsets.copy(), cfg, balance, budget=seg)
    assert all(np.array_equal(x, y) for x, y in zip(again, (order, offs), strict=True))  # a pure function


def test_padded_recut_follows_the_speeds():
    """The steps of a dynamic bucketed plan, one rank 1.5x slower: the re-cut's modeled imbalance is well
    below the assignment's."""
    from padfree.core.items import make_items
    from padfree.core.replay import Segment, replay

    lengths = np.minimum(np.random.default_rng(0).lognormal(5.5, 1.2, 3000).astype(np.int64) + 2, 4096)
    cfg = PlanConfig(strategy="bucketed", budget=4096, world_size=2, grad_accum=4, overlong="truncate")
    plan, _ = replay(make_items(lengths, 4096, "truncate"), cfg, 0, [Segment(2, 4, 0, 3481)])
    seg = Budget.of(cfg, 3481)
    speeds, model = np.array([1.2, 0.8]), (1e-4, 2e-8, 2e-3)
    balance = Balance(model, speeds=tuple(speeds), fitted=True, recut=True)
    ratios = {True: [], False: []}
    for s in range(plan.n_steps - 1):
        offs = plan.offsets[s * 8 : (s + 1) * 8 + 1]
        lens = plan.lengths[offs[0] : offs[-1]]
        for recut in (True, False):
            layout = step_layout(lens, offs - offs[0], plan.config, replace(balance, recut=recut), seg)
            t = _rank_times(lens, *layout, model, speeds, 4)
            ratios[recut].append(t.max() / t.mean())
    # measured (deterministic): 1.022 re-cut, 1.044 assigned (1.031 / 1.062 before steps were composed by
    # length quantile: steps of evenly spread lengths are easier to balance either way)
    assert np.mean(ratios[True]) < 1.04 and np.mean(ratios[True]) < np.mean(ratios[False]) - 0.015


def test_padded_recut_against_brute_force_row_moves():
    """Tiny steps: the kernel's rank times are exact (recomputed here) and never below the best of all
    layouts that move rows between micro-batches within the budget (brute force), never above assignment."""
    rng = np.random.default_rng(5)
    hits = []  # the re-cut's slowest time over the best of all layouts
    for _ in range(40):
        world, accum, budget = 2, 2, 100
        lens = rng.integers(5, 50, 6)
        offsets = np.array([0, 1, 3, 4, 6])
        speeds = rng.uniform(0.6, 1.4, world)
        model = (1.0, float(rng.uniform(0, 0.02)), 0.5)
        bin_of = _ranks.recut_padded(lens, offsets, speeds, accum, budget, np.array(model))
        assert sorted(set(bin_of.tolist())) == list(range(world * accum))
        best = math.inf
        for labels in itertools.product(range(world * accum), repeat=len(lens)):
            lab = np.array(labels)
            if np.bincount(lab, minlength=4).min() == 0:
                continue
            order = np.argsort(lab, kind="stable")
            offs = np.concatenate([[0], np.cumsum(np.bincount(lab, minlength=4))])
            if (np.diff(offs) * np.maximum.reduceat(lens[order], offs[:-1])).max() > budget:
                continue
            best = min(best, _rank_times(lens, order, offs, model, speeds, accum).max())
        order = np.argsort(bin_of, kind="stable")
        offs = np.concatenate([[0], np.cumsum(np.bincount(bin_of, minlength=4))])
        got = _rank_times(lens, order, offs, model, speeds, accum).max()
        assigned = _rank_times(lens, np.arange(6), offsets, model, speeds, accum).max()
        assert best - 1e-9 <= got <= assigned + 1e-9
        hits.append(got / best)
    assert np.median(hits) < 1.3  # measured 1.19: tiny steps leave row moves little room


CHAT_SETS = ("hh_rlhf_harmless_test", "gsm8k", "gpteacher_codegen", "gpteacher_roleplay_toolformer",
             "humaneval", "self_instruct_t0")  # fmt: skip


def test_bucketed_ranks_are_even_on_the_held_out_chat_sets_at_4x2(fixtures_dir):
    """Issue 28: with steps composed by length quantile, a step's share of a lone long sample or of an
    uneven cut left one rank short: at 4 ranks x 2, budget 8192, over every chat set (both tokenizers, whole
    samples and loss-bearing lengths), seeds 0-4, epochs 0-1, the worst epoch was 1.060 (humaneval) and
    the mean 1.0136. Evening each step's ranks (steps.even_ranks) gives 1.033 at worst (self_instruct_t0,
    whose longest quantile holds lone samples of 4-7K tokens: composition-limited) and 1.0073 on average."""
    from padfree.core.metrics import imbalance

    got = {}
    for name in CHAT_SETS:
        for kind in ("cl100k", "mistral_v1", "cl100k.assistant", "mistral_v1.assistant"):
            lengths = np.load(fixtures_dir / "lengths" / f"{name}.{kind}.npy").astype(np.int64)
            for seed in range(5):
                cfg = PlanConfig(strategy="bucketed", budget=8192, world_size=4, grad_accum=2, seed=seed,
                                 cost=DEFAULT_COST)  # fmt: skip
                for epoch in (0, 1):
                    got[(name, kind, seed, epoch)] = imbalance(make_plan(lengths, cfg, epoch))
    worst = max(got, key=got.__getitem__)
    assert got[worst] < 1.04, (worst, got[worst])
    assert np.mean(list(got.values())) < 1.01


@pytest.mark.parametrize("name", ["hh_rlhf_harmless_test.cl100k", "humaneval.mistral_v1", "gsm8k.cl100k"])
def test_evening_the_ranks_keeps_every_step_and_its_padding(fixtures_dir, monkeypatch, name):
    """Rows move only between the micro-batches of their step, and only where the slowest rank gets faster:
    each step holds the same samples as before (the step mixing is untouched), padding barely moves."""
    from padfree.core import steps
    from padfree.core.metrics import plan_metrics

    lengths = np.load(fixtures_dir / "lengths" / f"{name}.npy").astype(np.int64)
    cfg = PlanConfig(strategy="bucketed", budget=8192, world_size=4, grad_accum=2, seed=3, cost=DEFAULT_COST)
    even = make_plan(lengths, cfg, 1)
    monkeypatch.setattr(steps, "EVEN_TOLERANCE", float("inf"))
    assigned = make_plan(lengths, cfg, 1)
    k = cfg.micro_per_step
    for s in range(even.n_steps):
        a, b = int(even.offsets[s * k]), int(even.offsets[(s + 1) * k])
        assert a == int(assigned.offsets[s * k]) and b == int(assigned.offsets[(s + 1) * k])
        assert np.array_equal(np.sort(even.indices[a:b]), np.sort(assigned.indices[a:b]))
    rc_even, rc_assigned = even.rank_costs(), assigned.rank_costs()
    assert (rc_even.max(axis=1) <= rc_assigned.max(axis=1)).all()  # no step's slowest rank got slower
    m_even, m_assigned = plan_metrics(even), plan_metrics(assigned)
    assert m_even["step_divergence"] == m_assigned["step_divergence"]
    assert m_even["imbalance"] < m_assigned["imbalance"]
    assert m_even["padding_efficiency"] > m_assigned["padding_efficiency"] - 0.01
