"""PlanBatchSampler with a drafter's anchors: every micro-batch within both budgets, exact and elastic
resume keep every sample exactly once, and the state refuses other anchors."""

import json
from collections import Counter

import numpy as np
import pytest

from padfree import CostModel, PlanConfig, StateError
from padfree.testing.threadranks import Board, run_ranks
from padfree.torch import PlanBatchSampler

COST = CostModel(a=1.0, b=1e-4, c=20.0, d=8.0, e=0.01)


def data(n=300, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 700, n)
    anchors = np.minimum(lengths - 1, rng.integers(0, 40, n))
    return lengths, anchors


def samplers(lengths, anchors, cfg, world, **kw):
    board = Board(world)
    return [
        PlanBatchSampler(
            lengths, cfg, rank=r, world_size=world, anchors=anchors, balance_exchange=board.exchange(r), **kw
        )
        for r in range(world)
    ]


def run(group, limit=None):
    """Every rank in a thread takes ``limit`` micro-batches (None: to the end) and reports a time that
    grows with its tokens and anchors (rank 1 is slower)."""

    def seconds(r, i, mb):
        t = 1e-4 * sum(mb.info.lengths) + 1e-3 * sum(mb.info.anchors or ()) + 1e-3
        return t * (1.5 if r == 1 else 1.0)

    return [mb for mbs in run_ranks(group, seconds, limit) for mb in mbs]


def check_budgets(mbs, lengths, anchors, cfg):
    for mb in mbs:
        if not mb:
            continue
        lens, anc = lengths[list(mb)], anchors[list(mb)]
        assert list(mb.info.anchors) == anc.tolist()
        if cfg.packed:
            assert lens.sum() <= cfg.budget and anc.sum() <= cfg.anchor_budget
        else:
            assert len(lens) * lens.max() <= cfg.budget and len(anc) * anc.max() <= cfg.anchor_budget


@pytest.mark.parametrize("strategy", ["packed", "bucketed"])
@pytest.mark.parametrize("balance", ["static", "dynamic"])
def test_resume_exact_and_elastic_with_anchors(strategy, balance):
    lengths, anchors = data()
    everything = Counter(range(lengths.shape[0]))
    cfg = PlanConfig(strategy=strategy, budget=1024, grad_accum=2, anchor_budget=64, cost=COST, seed=4)
    kw = {"balance": balance, "balance_every": 1}
    first = samplers(lengths, anchors, cfg, 2, **kw)
    taken = run(first, limit=7)  # three steps and one micro-batch of the fourth, past two exchanges
    state = json.loads(json.dumps(first[0].state_dict()))
    assert json.loads(json.dumps(first[1].state_dict())) == state

    def resume_covers_the_rest(before: list, saved: dict, world: int) -> None:
        resumed = samplers(lengths, anchors, cfg, world, **kw)
        for s in resumed:
            s.load_state_dict(saved)
        after = run(resumed)
        check_budgets(before + after, lengths, anchors, cfg)
        assert Counter(i for mb in before + after for i in mb) == everything

    resume_covers_the_rest(taken, state, 2)  # exact: same shape, continues mid-step
    fresh = samplers(lengths, anchors, cfg, 2, **kw)
    done = run(fresh, limit=6)
    boundary = json.loads(json.dumps(fresh[0].state_dict()))
    resume_covers_the_rest(done, boundary, 3)  # elastic: at a step boundary, to three ranks


def test_state_refuses_other_anchors():
    lengths, anchors = data()
    cfg = PlanConfig(strategy="packed", budget=1024, anchor_budget=64)
    state = PlanBatchSampler(lengths, cfg, rank=0, world_size=1, anchors=anchors).state_dict()
    other = anchors.copy()
    other[0] = (other[0] + 1) % 5
    with pytest.raises(StateError, match="the anchor counts differ"):
        PlanBatchSampler(lengths, cfg, rank=0, world_size=1, anchors=other).load_state_dict(state)


def test_drafter_weights_survive_the_state():
    lengths, anchors = data()
    cfg = PlanConfig(strategy="packed", budget=1024, anchor_budget=64, cost=COST)
    s = PlanBatchSampler(lengths, cfg, rank=0, world_size=2, anchors=anchors)
    state = s.state_dict()
    assert state["balance"]["drafter"] == [COST.d, COST.e]
    t = PlanBatchSampler(lengths, cfg.with_(cost=CostModel()), rank=0, world_size=2, anchors=anchors)
    t.load_state_dict(json.loads(json.dumps(state)))
    assert t.state_dict()["balance"] == state["balance"]


def test_the_sampler_shows_the_plan_it_hands_out_planned_once(monkeypatch):
    """``sampler.plan`` is the plan of the epoch the sampler yields (a report of its heaviest micro-batch
    reads it): the steps of planning the epoch at this shape (before their micro-batches are given to ranks
    and evened, which moves items between a step's micro-batches, never between steps), kept, and not
    planned again when the epoch runs."""
    from padfree.core import cursor as cursor_mod
    from padfree.core.planner import make_plan

    def steps(p):
        k = p.config.micro_per_step
        return sorted(
            tuple(sorted(p.indices[p.offsets[s * k] : p.offsets[(s + 1) * k]].tolist()))
            for s in range(p.n_steps)
        )

    lengths, anchors = data(120)
    cfg = PlanConfig(strategy="packed", budget=1024, grad_accum=2, anchor_budget=64, cost=COST)
    sampler = PlanBatchSampler(lengths, cfg, rank=0, world_size=2, anchors=anchors, epoch=1)
    plan = sampler.plan
    assert steps(plan) == steps(make_plan(lengths, cfg.with_(world_size=2), 1, anchors=anchors))
    calls = []
    real = cursor_mod.replay
    monkeypatch.setattr(cursor_mod, "replay", lambda *a, **k: calls.append(1) or real(*a, **k))
    taken = [sorted(mb) for mb in sampler if len(mb)]
    assert sampler.plan is plan and calls == []  # the epoch ran on the plan already made
    step_of = {i: n for n, step in enumerate(steps(plan)) for i in step}
    assert taken and all(len({step_of[i] for i in mb}) == 1 for mb in taken)
