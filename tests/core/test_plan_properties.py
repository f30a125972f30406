"""Property tests of the planning core: whatever the lengths and config, a plan covers every sample exactly
once, never exceeds the budget, gives every rank the same number of micro-batches per step, and is a pure
function of its inputs."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from padfree import STRATEGIES, ConfigError, PlanConfig, make_plan

lengths_st = st.lists(st.integers(min_value=1, max_value=300), min_size=8, max_size=400).map(np.array)


def config_st(strategy=st.sampled_from(STRATEGIES)):
    return st.builds(
        PlanConfig,
        strategy=strategy,
        budget=st.integers(min_value=300, max_value=2000),
        world_size=st.integers(min_value=1, max_value=4),
        grad_accum=st.integers(min_value=1, max_value=3),
        growth=st.floats(min_value=1.05, max_value=3.0),
        buckets=st.one_of(st.none(), st.integers(min_value=1, max_value=12)),
        mix=st.integers(min_value=1, max_value=64),
        seed=st.integers(min_value=0, max_value=2**32),
    )


def check_invariants(lengths: np.ndarray, plan) -> None:
    cfg = plan.config
    # exactly once
    assert np.array_equal(np.sort(plan.indices), np.arange(lengths.shape[0]))
    assert np.array_equal(plan.lengths, lengths[plan.indices])
    counts = np.diff(plan.offsets)
    assert (counts >= 1).all(), "no empty micro-batch"
    # budget
    starts = plan.offsets[:-1]
    if cfg.packed:
        assert (np.add.reduceat(plan.lengths, starts) <= cfg.budget).all()
    else:
        assert (counts * np.maximum.reduceat(plan.lengths, starts) <= cfg.budget).all()
    # equal micro-batches per rank per step
    assert plan.n_micro % cfg.micro_per_step == 0
    ranks = [plan.micro_ids(r) for r in range(cfg.world_size)]
    assert all(r.shape[0] == plan.n_steps * cfg.grad_accum for r in ranks)
    assert np.array_equal(np.sort(np.concatenate(ranks)), np.arange(plan.n_micro))


def test_every_plan_is_valid(refusals):
    @given(lengths=lengths_st, cfg=config_st(), epoch=st.integers(min_value=0, max_value=5))
    def check(lengths, cfg, epoch):
        refusals.seen()
        try:
            plan = make_plan(lengths, cfg, epoch)
        except ConfigError as exc:
            # the only legitimate refusal: too few samples to give every rank its micro-batches
            assert "cannot fill one step" in str(exc) or "same number of micro-batches" in str(exc)
            refusals.refuse()
        check_invariants(lengths, plan)

    check()
    refusals.check(most=0.45)  # fewer samples than world_size x grad_accum (<= 12) are too few


def test_plan_is_a_pure_function(refusals):
    @given(lengths=lengths_st, cfg=config_st(), epoch=st.integers(min_value=0, max_value=3))
    def check(lengths, cfg, epoch):
        refusals.seen()
        try:
            a = make_plan(lengths, cfg, epoch)
        except ConfigError:
            refusals.refuse()
        b = make_plan(lengths.copy(), PlanConfig(**{**cfg.__dict__}), epoch)
        assert np.array_equal(a.indices, b.indices)
        assert np.array_equal(a.offsets, b.offsets)

    check()
    refusals.check(most=0.45)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_epochs_differ_except_sorted_composition(strategy, seed_mix):
    lengths = seed_mix[:20000]
    cfg = PlanConfig(strategy=strategy, budget=8192, world_size=2, grad_accum=2)
    a, b = make_plan(lengths, cfg, 0), make_plan(lengths, cfg, 1)
    check_invariants(lengths, a)
    check_invariants(lengths, b)
    assert not np.array_equal(a.indices, b.indices), "the order changes every epoch"
    if strategy == "sorted":
        comp_a = sorted(tuple(sorted(m.tolist())) for m in a.micro_batches())
        comp_b = sorted(tuple(sorted(m.tolist())) for m in b.micro_batches())
        assert comp_a == comp_b, "sorted keeps its micro-batch composition"


def test_refuses_dataset_smaller_than_one_step():
    with pytest.raises(ConfigError, match="cannot fill one step"):
        make_plan(np.array([5, 6, 7]), PlanConfig(strategy="random", world_size=2, grad_accum=2), 0)


def test_tail_is_spread_not_dropped_or_duplicated():
    # 10 samples of 100 tokens, budget 200 -> 5 micro-batches; steps of 4 need 8
    lengths = np.full(10, 100)
    plan = make_plan(lengths, PlanConfig(strategy="sorted", budget=200, world_size=2, grad_accum=2), 0)
    assert plan.n_micro == 8
    check_invariants(lengths, plan)


def test_spread_tail_refuses_when_impossible():
    # 5 samples that each fill a micro-batch alone cannot make 8 micro-batches
    with pytest.raises(ConfigError, match="same number of micro-batches"):
        make_plan(np.full(5, 150), PlanConfig(strategy="random", budget=200, world_size=4, grad_accum=1), 0)


@pytest.mark.parametrize("policy", ["truncate", "split", "drop"])
def test_overlong_policies(policy):
    lengths = np.array([50, 500, 70, 1200, 30, 20, 10, 40])
    plan = make_plan(lengths, PlanConfig(strategy="packed", budget=256, overlong=policy), 0)
    if policy == "truncate":
        assert plan.truncated == 2 and plan.lengths.max() == 256
        assert np.array_equal(np.sort(plan.indices), np.arange(8))
    elif policy == "drop":
        assert plan.dropped == 2 and set(plan.indices.tolist()) == {0, 2, 4, 5, 6, 7}
    else:
        assert plan.split == 2
        # the pieces of each sample cover it exactly once
        for s in (1, 3):
            sel = plan.indices == s
            pieces = sorted(zip(plan.starts[sel].tolist(), plan.lengths[sel].tolist()))
            assert pieces[0][0] == 0
            assert sum(p[1] for p in pieces) == lengths[s]
            assert all(a[0] + a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


def test_overlong_error_names_count_and_longest():
    from padfree import OverlongError

    with pytest.raises(OverlongError, match=r"2 sample\(s\) longer than the budget of 256.*longest: 1200"):
        make_plan(np.array([50, 500, 70, 1200]), PlanConfig(budget=256), 0)
