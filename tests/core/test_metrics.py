"""Each metric on a hand-computed case (see docs/metrics.md for the definitions)."""

import numpy as np
import pytest

from padfree import CostModel, PlanConfig
from padfree.core.metrics import (
    adjacent_corr,
    cobatch_repeat,
    compute_efficiency,
    fill,
    imbalance,
    padding_efficiency,
    plan_metrics,
    step_divergence,
)
from padfree.core.plan import Plan

LENGTHS = np.array([4, 2, 3, 1, 5])


def hand_plan(groups, cost=CostModel(a=1.0, b=0.0, c=0.0), strategy="random", budget=8, world=2, accum=1):
    indices = np.concatenate([np.array(g, dtype=np.int64) for g in groups])
    offsets = np.concatenate(([0], np.cumsum([len(g) for g in groups]))).astype(np.int64)
    cfg = PlanConfig(strategy=strategy, budget=budget, world_size=world, grad_accum=accum, cost=cost)
    return Plan(config=cfg, epoch=0, indices=indices, offsets=offsets, lengths=LENGTHS[indices])


# micro-batches [4,2] [3] | [1] [5]: two steps of two ranks
GROUPS = [[0, 1], [2], [3], [4]]


def test_padding_efficiency_padded():
    # real 15 tokens; slots 2*4 + 3 + 1 + 5 = 17
    assert padding_efficiency(hand_plan(GROUPS)) == pytest.approx(15 / 17)


def test_packed_rows_compute_their_tokens_and_fill_counts_the_budget():
    # packed: 4 rows computed as their 15 tokens (no padding); fill = 15 / (4 bins x budget 8)
    plan = hand_plan(GROUPS, strategy="packed")
    assert padding_efficiency(plan) == 1.0
    assert fill(plan) == pytest.approx(15 / 32)
    assert fill(hand_plan(GROUPS)) == pytest.approx(15 / 32)  # fill is the same for padded micro-batches


def test_compute_efficiency_with_attention_and_overhead():
    plan = hand_plan(GROUPS, cost=CostModel(a=1.0, b=1.0, c=0.5))
    real = 15 + (16 + 4 + 9 + 1 + 25)
    computed = 17 + (2 * 16 + 9 + 1 + 25) + 4 * 0.5
    assert compute_efficiency(plan) == pytest.approx(real / computed)


def test_imbalance():
    # step 0: ranks 8 and 3; step 1: ranks 1 and 5
    expected = ((8 / 5.5) + (5 / 3)) / 2
    assert imbalance(hand_plan(GROUPS)) == pytest.approx(expected)


def test_step_divergence():
    # dataset token-weighted CDF at 1..4: 1/15, 3/15, 6/15, 10/15
    # step 0 (4,2,3): 0, 2/9, 5/9, 1   step 1 (1,5): 1/6 each
    w0 = 1 / 15 + abs(2 / 9 - 3 / 15) + abs(5 / 9 - 6 / 15) + abs(1 - 10 / 15)
    w1 = abs(1 / 6 - 1 / 15) + abs(1 / 6 - 3 / 15) + abs(1 / 6 - 6 / 15) + abs(1 / 6 - 10 / 15)
    assert step_divergence(hand_plan(GROUPS)) == pytest.approx((w0 + w1) / 2 / 3.0)


def test_step_divergence_zero_when_every_step_is_the_dataset():
    lengths_plan = hand_plan([[0, 1, 2, 3, 4]], world=1, budget=25)
    assert step_divergence(lengths_plan) == pytest.approx(0.0)


def test_cobatch_repeat():
    a = hand_plan([[0, 1, 2], [3], [4]], world=1)
    # pairs in a: (0,1) (0,2) (1,2)
    same = hand_plan([[2, 1, 0], [4], [3]], world=1)
    one = hand_plan([[0, 1], [2, 3], [4]], world=1)
    none = hand_plan([[0, 3], [1, 4], [2]], world=1)
    assert cobatch_repeat(a, same) == pytest.approx(1.0)
    assert cobatch_repeat(a, one) == pytest.approx(1 / 3)
    assert cobatch_repeat(a, none) == pytest.approx(0.0)


def test_adjacent_corr():
    # steps of one micro-batch each with mean lengths 1, 5, 1, 5, 1: perfectly anti-correlated
    lengths = np.array([1, 5, 1, 5, 1])
    cfg = PlanConfig(strategy="random", budget=8, world_size=1)
    idx = np.arange(5)
    plan = Plan(config=cfg, epoch=0, indices=idx, offsets=np.arange(6), lengths=lengths)
    assert adjacent_corr(plan) == pytest.approx(-1.0)
    ramp = Plan(config=cfg, epoch=0, indices=idx, offsets=np.arange(6), lengths=np.array([1, 2, 3, 4, 5]))
    assert adjacent_corr(ramp) == pytest.approx(1.0)


def test_plan_metrics_keys():
    from padfree.advice.analyze import ROWS  # every metric `padfree analyze` shows is measured

    m = plan_metrics(hand_plan(GROUPS), hand_plan(GROUPS))
    missing = [r.key for r in ROWS if r.key not in m]
    assert not missing and len(ROWS) >= 12
    assert m["steps"] == 2 and m["micro_batches"] == 4
    assert m["tokens_per_step_min"] == 6 and m["tokens_per_step_max"] == 9
