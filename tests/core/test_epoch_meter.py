"""Measuring an epoch window by window (EpochMeter over plan_pieces, CoBatchMap across epochs) gives every
metric of the whole plan: the same numbers as plan_metrics and cobatch_repeat on the concatenated plans, for
every strategy, overlong policy and window size, and with hypothesis-drawn lengths and configs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from padfree import CostModel, PlanConfig
from padfree.advice.analyze import measure
from padfree.core.metrics import CoBatchMap, EpochMeter, cobatch_repeat, item_counts, plan_metrics
from padfree.core.planner import make_plan, plan_pieces

STRATEGIES = ("sorted", "random", "bucketed", "packed")
EXACT = ("steps", "micro_batches", "truncated", "split", "dropped", "buckets")


def _whole(lengths, cfg, window):
    p0 = make_plan(lengths, cfg, 0, stream=True, window=window)
    p1 = make_plan(lengths, cfg, 1, stream=True, window=window)
    return plan_metrics(p1) | {"cobatch_repeat": cobatch_repeat(p0, p1)}


def _windowed(lengths, cfg, window):
    previous = CoBatchMap.for_lengths(lengths, cfg)
    for piece in plan_pieces(lengths, cfg, 0, stream=True, window=window):
        previous.record(piece)
    meter = EpochMeter(cfg, item_counts(lengths, cfg), previous)
    return meter.measure(plan_pieces(lengths, cfg, 1, stream=True, window=window))


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k == "plan_seconds":
            continue
        if k in EXACT:
            assert a[k] == b[k], k
        else:
            assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-12), k


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("overlong", ["truncate", "split", "drop"])
def test_window_by_window_equals_the_whole_plan(strategy, overlong):
    rng = np.random.default_rng(7)
    lengths = np.minimum(rng.lognormal(5.0, 1.1, 6000).astype(np.int64) + 1, 5000).astype(np.int32)
    cfg = PlanConfig(strategy=strategy, budget=2048, world_size=2, grad_accum=2, seed=3, overlong=overlong,
                     cost=CostModel(a=1.0, b=0.002, c=40.0))  # fmt: skip
    pieces = list(plan_pieces(lengths, cfg, 1, stream=True, window=1500))
    assert len(pieces) >= 3  # really in windows
    _same(_windowed(lengths, cfg, 1500), _whole(lengths, cfg, 1500))


def test_in_memory_measure_equals_the_plan_metrics_of_make_plan():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 3000, 4000)
    for strategy in STRATEGIES:
        cfg = PlanConfig(strategy=strategy, budget=4096, world_size=4, grad_accum=2, seed=9)
        p0, p1 = make_plan(lengths, cfg, 0), make_plan(lengths, cfg, 1)
        _same(measure(lengths, cfg), plan_metrics(p1) | {"cobatch_repeat": cobatch_repeat(p0, p1)})


@given(
    n=st.integers(60, 700),
    strategy=st.sampled_from(STRATEGIES),
    world=st.integers(1, 3),
    accum=st.integers(1, 3),
    window=st.integers(40, 400),
    overlong=st.sampled_from(["truncate", "split", "drop"]),
    seed=st.integers(0, 2**32),
)
def test_window_by_window_equals_the_whole_plan_for_any_config(
    n, strategy, world, accum, window, overlong, seed
):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 700, n)
    cfg = PlanConfig(strategy=strategy, budget=512, world_size=world, grad_accum=accum, seed=seed % 1000,
                     overlong=overlong)  # fmt: skip
    try:
        whole = _whole(lengths, cfg, window)
    except ValueError:  # too few items for a step: both paths refuse alike
        with pytest.raises(ValueError):
            _windowed(lengths, cfg, window)
        return
    _same(_windowed(lengths, cfg, window), whole)


def test_item_counts_are_the_plans_entry_lengths():
    lengths = np.array([5, 3000, 700, 1024, 2049, 1, 4096])
    for overlong in ("truncate", "split", "drop"):
        cfg = PlanConfig(strategy="packed", budget=1024, overlong=overlong)
        plan = make_plan(lengths, cfg, 0)
        expect = np.bincount(plan.lengths, minlength=cfg.budget + 1)
        np.testing.assert_array_equal(item_counts(lengths, cfg), expect)


def test_cobatch_map_refuses_plans_of_other_samples():
    cfg = PlanConfig(strategy="random", budget=64, world_size=1)
    a = make_plan(np.arange(1, 41), cfg, 0)
    b = make_plan(np.arange(1, 42), cfg, 1)
    with pytest.raises(ValueError, match="do not hold the same samples"):
        cobatch_repeat(a, b)


def _brute_cobatch(a, b) -> float:
    """Pairs listed one by one: those sharing a micro-batch in ``a`` that share one in ``b`` too."""

    def pairs(plan):
        keys = list(
            zip(
                plan.indices.tolist(), (plan.starts if plan.starts is not None else 0 * plan.indices).tolist()
            )
        )
        out = set()
        for m in range(plan.n_micro):
            group = sorted(keys[plan.offsets[m] : plan.offsets[m + 1]])
            out |= {(x, y) for i, x in enumerate(group) for y in group[i + 1 :]}
        return out

    first = pairs(a)
    return len(first & pairs(b)) / len(first) if first else 0.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plan_metrics_equal_each_metric_function_and_brute_force_pairs(strategy):
    from padfree.core import metrics

    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 900, 500)
    cfg = PlanConfig(strategy=strategy, budget=512, world_size=2, grad_accum=2, seed=2, overlong="split",
                     cost=CostModel(a=1.0, b=0.01, c=5.0))  # fmt: skip
    p0, p1 = make_plan(lengths, cfg, 0), make_plan(lengths, cfg, 1)
    m = plan_metrics(p1, p0)
    for name in ("padding_efficiency", "fill", "compute_efficiency", "imbalance", "modeled_throughput",
                 "step_divergence", "adjacent_corr"):  # fmt: skip
        assert m[name] == pytest.approx(getattr(metrics, name)(p1), rel=1e-12), name
    tok = metrics.step_tokens(p1)
    assert (m["tokens_per_step_min"], m["tokens_per_step_max"]) == (tok.min(), tok.max())
    assert m["cobatch_repeat"] == pytest.approx(_brute_cobatch(p1, p0), rel=1e-12)
    assert measure(lengths, cfg)["cobatch_repeat"] == pytest.approx(_brute_cobatch(p0, p1), rel=1e-12)
