"""The torch-free cursor: every rank's micro-batches are the plan's (make_plan's assignment when static),
their facts are right, a resumed cursor continues exactly, and an unassigned plan refuses to say which rank
runs what."""

import json

import numpy as np
import pytest

from padfree import STRATEGIES, PlanConfig, make_plan
from padfree.core.cursor import Cursor, EpochSource
from padfree.core.replay import Segment, replay
from padfree.core.state_check import seal
from padfree.errors import ConfigError, StateError


def _drain(cursor: Cursor) -> list:
    out = []
    while (nxt := cursor.take()) is not None:
        out.append(nxt)
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_rank_takes_its_micro_batches_of_the_plan_with_their_facts(strategy):
    lengths = np.random.default_rng(1).integers(1, 400, 300)
    cfg = PlanConfig(strategy=strategy, budget=800, world_size=3, grad_accum=2, seed=5)
    plan = make_plan(lengths, cfg, 2)
    source = EpochSource.of(lengths, cfg)
    for r in range(3):
        cursor = Cursor(source, cfg, r, epoch=2)
        assert cursor.remaining() == plan.n_steps * 2 and cursor.steps_in_epoch == plan.n_steps
        taken = _drain(cursor)
        assert [n.ids for n in taken] == [plan.micro(k).tolist() for k in plan.micro_ids(r)]
        k = cfg.micro_per_step
        for j, n in enumerate(taken):
            step, micro = divmod(j, 2)
            assert (n.info.step, n.info.micro, n.info.last, n.info.rank) == (step, micro, micro == 1, r)
            lo, hi = int(plan.offsets[step * k]), int(plan.offsets[(step + 1) * k])
            assert n.info.step_tokens == int((plan.lengths[lo:hi] - 1).sum())
            assert n.features is None
        assert cursor.remaining() == 0 and cursor.peek() is None and cursor.step == plan.n_steps


def test_a_cursor_restored_mid_step_continues_exactly():
    lengths = np.random.default_rng(2).integers(1, 300, 200)
    cfg = PlanConfig(strategy="packed", budget=600, world_size=2, grad_accum=3, seed=1)
    source = EpochSource.of(lengths, cfg)
    whole = [n.ids for n in _drain(Cursor(source, cfg, 1))]
    first = Cursor(source, cfg, 1)
    head = [first.take().ids for _ in range(4)]  # one step and one micro-batch into the next
    assert first.peek() == (1, 1)
    again = Cursor(source, cfg, 1)
    again.restore(first.position)
    assert head + [n.ids for n in _drain(again)] == whole


def test_a_cursor_saves_and_loads_itself_and_a_refused_state_leaves_it_where_it_was():
    lengths = np.random.default_rng(4).integers(1, 300, 200)
    cfg = PlanConfig(strategy="packed", budget=600, world_size=2, grad_accum=3, seed=1)
    source = EpochSource.of(lengths, cfg)
    whole = [n.ids for n in _drain(Cursor(source, cfg, 1, dynamic=True))]
    first = Cursor(source, cfg, 1, dynamic=True)
    head = [first.take().ids for _ in range(4)]  # one step and one micro-batch into the next
    state = json.loads(json.dumps(first.state_dict()))
    assert state["history"][0][3] == first.budget and state["taken"]  # planned with headroom; mid-step
    again = Cursor(source, cfg, 1, dynamic=True)
    again.load_state_dict(state)
    assert head + [n.ids for n in _drain(again)] == whole and again.spent
    again.set_epoch(0)  # the same epoch: nothing left, but no longer spent
    assert not again.spent and again.peek() is None
    edited = seal({k: v for k, v in state.items() if k != "digest"} | {"taken": "0" * 32})
    stays = Cursor(source, cfg, 1, dynamic=True)
    stays.take()
    before = stays.position
    with pytest.raises(StateError, match="taken"):
        stays.load_state_dict(edited)
    assert stays.position == before
    other_budget = seal({k: v for k, v in state.items() if k != "digest"} | {"history": [[2, 3, 1, 123]]})
    with pytest.raises(StateError, match="not one this sampler plans at"):
        stays.load_state_dict(other_budget)
    assert stays.position == before


def test_an_unassigned_plan_refuses_to_name_ranks_and_the_loss_counts_are_checked():
    lengths = np.random.default_rng(3).integers(1, 300, 120)
    cfg = PlanConfig(strategy="bucketed", budget=600, seed=2)
    plan, _ = replay(EpochSource.of(lengths, cfg).items, cfg, 0, [Segment(2, 2, 0)])
    assert not plan.assigned
    with pytest.raises(ConfigError, match="not given to ranks"):
        plan.micro_ids(0)
    with pytest.raises(ConfigError, match="not given to ranks"):
        next(plan.records())
    with pytest.raises(ConfigError, match="loss_tokens"):
        EpochSource.of(lengths, cfg, loss_tokens=lengths)  # a count must be < the sample's length


def test_dynamic_balance_is_refused_with_sp_or_cp():
    """Dynamic re-cuts among ranks do not pad for the shard (bypassed, they filled rows past the group's
    sp x cp x budget row): the cursor refuses them in one line, as the sampler does."""
    cfg = PlanConfig(strategy="packed", budget=64, world_size=2, grad_accum=2, sp=2, cp=2)
    src = EpochSource.of(np.arange(1, 201) % 60 + 1, cfg)
    with pytest.raises(ConfigError, match="does not re-cut SP/CP plans yet"):
        Cursor(src, cfg, 0, dynamic=True)
    assert Cursor(src, cfg, 0).take() is not None  # static balance plans them
