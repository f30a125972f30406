"""The chunked strategy: every token once, a long document's chunks in order on one rank in one step, the
same plan for the same inputs, and resume / elastic resume that keep both."""

from __future__ import annotations

import json

import numpy as np
import pytest

from padfree import PlanConfig, make_plan, plan_metrics
from padfree.core.cursor import Cursor, EpochSource
from padfree.core.items import make_items
from padfree.core.planner import plan_pieces
from padfree.core.position import step_loss_tokens
from padfree.core.replay import Segment, replay
from padfree.errors import ConfigError, OverlongError

BUDGET = 256


def long_tail(n: int = 600, seed: int = 0, top: int = 8 * BUDGET) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(4.2, 1.3, n).astype(np.int64) + 1, top)


def check_chunks(indices, starts, lengths, offsets, g: int, lens: np.ndarray, reach: int) -> None:
    """Exactly once, within the budget, and each long document's chunks consecutive in one lane, in order."""
    tokens = np.bincount(indices, weights=lengths, minlength=lens.shape[0])
    np.testing.assert_array_equal(tokens, np.minimum(lens, reach))
    counts = np.diff(offsets)
    per_mb = np.add.reduceat(np.append(lengths, 0), offsets[:-1]) * (counts > 0)
    assert per_mb.max() <= BUDGET
    mb = np.repeat(np.arange(counts.shape[0]), counts)
    chunked = np.unique(indices[starts > 0])
    assert chunked.size > 0
    for s in chunked:
        at = np.flatnonzero(indices == s)
        np.testing.assert_array_equal(np.diff(mb[at]), 1)  # consecutive micro-batches
        assert np.unique(mb[at] // g).size == 1  # one lane: one rank of one step
        assert (counts[mb[at]] == 1).all()  # a chunk alone in its micro-batch
        np.testing.assert_array_equal(starts[at], np.arange(at.size) * BUDGET)
        assert (lengths[at][:-1] == BUDGET).all()


@pytest.mark.parametrize(("world", "accum"), [(1, 8), (2, 4), (3, 8)])
def test_every_token_once_and_long_documents_chunked_in_order_in_one_lane(world: int, accum: int) -> None:
    lens = long_tail()
    cfg = PlanConfig("chunked", BUDGET, world, accum, overlong="truncate", seed=7)
    plan = make_plan(lens, cfg, 1)
    assert plan.n_micro % (world * accum) == 0 and plan.starts is not None
    check_chunks(plan.indices, plan.starts, plan.lengths, plan.offsets, accum, lens, BUDGET * accum)
    again = make_plan(lens, cfg, 1)
    assert np.array_equal(plan.indices, again.indices) and np.array_equal(plan.offsets, again.offsets)
    other = make_plan(lens, cfg, 2)
    assert not np.array_equal(plan.indices, other.indices)
    m = plan_metrics(plan)
    assert m["truncated"] == int((lens > BUDGET * accum).sum())
    assert m["chunked"] == int((lens > BUDGET).sum()) > 0
    assert m["imbalance"] < 1.05 and m["padding_efficiency"] == 1.0


def test_the_cost_of_a_chunk_counts_the_keys_of_its_earlier_chunks() -> None:
    lens = np.array([4 * BUDGET, 10, 20])
    plan = make_plan(lens, PlanConfig("chunked", BUDGET, 1, 4))
    sh = plan.shapes()
    chunk = (plan.starts > 0) | (plan.lengths == BUDGET)
    want = float((plan.lengths[chunk] ** 2 + 2 * plan.lengths[chunk] * plan.starts[chunk]).sum())
    assert float(sh.attn.sum()) == pytest.approx(want + 10**2 + 20**2)
    assert float(sh.attn.sum()) == pytest.approx((4 * BUDGET) ** 2 + 500)  # the whole document's square


def test_loss_tokens_count_a_chunked_document_once() -> None:
    lens = np.array([3 * BUDGET + 5, 40, 30, 7])
    plan = make_plan(lens, PlanConfig("chunked", BUDGET, 1, 4))
    assert step_loss_tokens(plan, lens, None).sum() == int((lens - 1).sum())
    loss = np.array([100, 9, 8, 0])
    assert step_loss_tokens(plan, lens, loss).sum() == 117


def test_documents_past_the_reach_follow_the_overlong_policy() -> None:
    lens = np.array([10, 5 * BUDGET, 30, 60, 2 * BUDGET])
    with pytest.raises(OverlongError, match=r"longer than the chunked reach of 1024 tokens \(grad_accum 4 x"):
        make_plan(lens, PlanConfig("chunked", BUDGET, 1, 4))
    kept = make_plan(lens, PlanConfig("chunked", BUDGET, 1, 4, overlong="drop"))
    assert 1 not in kept.indices and kept.dropped == 1
    with pytest.raises(ConfigError, match="not split"):
        PlanConfig("chunked", BUDGET, 1, 4, overlong="split")
    with pytest.raises(ConfigError, match="window by window"):
        make_plan(lens, PlanConfig("chunked", BUDGET, 1, 4, overlong="drop"), stream=True)
    with pytest.raises(ConfigError, match="window by window"):  # the same preamble: the same refusal
        next(plan_pieces(lens, PlanConfig("chunked", BUDGET, 1, 4, overlong="drop"), stream=True))


def _drain(cursor: Cursor) -> list:
    out = []
    while (nxt := cursor.take()) is not None:
        out.append(nxt)
    return out


def _flat(taken: list) -> tuple[np.ndarray, ...]:
    ids = np.array([i for n in taken for i in n.ids], np.int64)
    starts = np.array([s for n in taken for s in n.info.starts], np.int64)
    lengths = np.array([x for n in taken for x in n.info.lengths], np.int64)
    return ids, starts, lengths


def test_cursors_hand_each_rank_its_lanes_and_resume_at_another_world_size() -> None:
    lens = long_tail(400, seed=3, top=4 * BUDGET)
    cfg = PlanConfig("chunked", BUDGET, 2, 4, seed=2)
    source = EpochSource.of(lens, cfg)
    plan = make_plan(lens, cfg, 0)
    for r in range(2):
        taken = _drain(Cursor(source, cfg, r))
        assert [n.ids for n in taken] == [plan.micro(k).tolist() for k in plan.micro_ids(r)]
        assert all(n.info.step_tokens is not None for n in taken)
    # three steps at 2 ranks, then the rest at 3 ranks: every token once, chunks still whole lanes
    first = [Cursor(source, cfg, r) for r in range(2)]
    done = [n for c in first for n in (c.take() for _ in range(3 * 4))]
    state = json.loads(json.dumps(first[0].state_dict()))
    cfg3 = cfg.with_(world_size=3)
    rest = []
    for r in range(3):
        c = Cursor(EpochSource.of(lens, cfg3), cfg3, r)
        c.load_state_dict(state)
        rest.append(_drain(c))
    ids, starts, lengths = _flat(done + [n for part in rest for n in part])
    tokens = np.bincount(ids, weights=lengths, minlength=lens.shape[0])
    np.testing.assert_array_equal(tokens, lens)
    later, _ = replay(source.items, cfg, 0, [Segment(2, 4, 3), Segment(3, 4, 0)])
    seen = np.zeros(lens.shape[0], np.int64)
    np.add.at(seen, plan.indices[: plan.offsets[3 * 8]], plan.lengths[: plan.offsets[3 * 8]])
    rest_lens = lens - seen
    assert later.starts is not None
    check_chunks(
        later.indices, later.starts, later.lengths, later.offsets, 4,
        np.where(rest_lens > 0, lens, 0), 4 * BUDGET,
    )  # fmt: skip
    # fewer micro-batches per step than a resumed document's chunks: one line that says what to do
    with pytest.raises(ConfigError, match="raise grad_accum"):
        replay(source.items, cfg, 0, [Segment(2, 4, 3), Segment(2, 2, 0)])


def test_make_items_cuts_at_the_reach() -> None:
    from padfree.core.budget import Budget

    cfg = PlanConfig("chunked", BUDGET, 1, 4, overlong="truncate")
    assert Budget.of(cfg).item == 4 * BUDGET
    items = make_items(np.array([5 * BUDGET, 3]), Budget.of(cfg).item, cfg.overlong)
    assert items.length.tolist() == [4 * BUDGET, 3]


@pytest.mark.parametrize("world", [1, 2])
def test_a_state_saved_between_chunks_resumes_at_the_steps_start(world: int) -> None:
    """A chunked step runs whole (run_step, the Trainer): a state saved inside it, here between two chunks
    of one document, resumes at the step's first micro-batch, so the document trains from its first chunk
    and every token of the epoch is trained once (issue 41)."""
    lens = long_tail(200, seed=5, top=4 * BUDGET)
    cfg = PlanConfig("chunked", BUDGET, world, 4, seed=1)
    source = EpochSource.of(lens, cfg)
    plan = make_plan(lens, cfg, 0)
    g = 4
    # the first step whose rank 0 lane holds a chunk that continues its document, and that chunk's slot
    k = next(k for k in range(plan.n_micro) if plan.starts[plan.offsets[k]] > 0 and k % (world * g) < g)
    step, j = divmod(k, world * g)
    first = [Cursor(source, cfg, r) for r in range(world)]
    done = [[c.take() for _ in range(step * g)] for c in first]  # whole steps, trained
    for c in first:
        for _ in range(j):
            c.take()  # handed out, not yet trained: the step had not run
    state = json.loads(json.dumps(first[0].state_dict()))
    assert state["partial"] == j > 0
    rest = []
    for r in range(world):
        c = Cursor(EpochSource.of(lens, cfg), cfg, r)
        c.load_state_dict(state)
        assert c.partial == 0 and c.remaining() == (plan.n_steps - step) * g
        nxt = _drain(c)
        assert len(nxt) % g == 0
        rest.append(nxt)
    ids, starts, lengths = _flat([n for part in done for n in part] + [n for part in rest for n in part])
    tokens = np.bincount(ids, weights=lengths, minlength=lens.shape[0])
    np.testing.assert_array_equal(tokens, lens)  # every token once: none lost, none twice
    resumed = rest[0][: j + 1]
    doc = resumed[j].info.indices[0]
    assert [n.info.starts[0] for n in resumed if n.info.indices == (doc,)][0] == 0  # from its first chunk


def test_the_strategy_owns_its_layout_and_its_reach() -> None:
    """The registry answers for ``chunked``: a layout of its own (no form), chunks of grad_accum whose reach
    is the one budget property, and a step given to ranks as laid out (no run-time re-cut)."""
    from padfree.core.balance import Balance, dynamic_budget, step_layout
    from padfree.core.budget import Budget

    cfg = PlanConfig("chunked", BUDGET, 2, 4, seed=3)
    assert cfg.spec.form is None and cfg.spec.layout is not None and cfg.spec.context
    assert Budget.of(cfg).reach == 4 * BUDGET and Budget.of(cfg.with_(strategy="packed")).reach == BUDGET
    assert dynamic_budget(cfg, np.array([10, 20]), 0.85) is None
    plan = make_plan(np.array([3 * BUDGET, 10, 200, 30, BUDGET + 1, 5, 7, 9, 11, 13]), cfg)
    k = cfg.micro_per_step
    step = plan.offsets[: k + 1] - plan.offsets[0]
    order, offsets = step_layout(plan.lengths[: step[-1]], step, cfg, Balance((1.0, 0.0, 0.0), (1.5, 0.5)))
    assert order.tolist() == list(range(int(step[-1]))) and offsets.tolist() == step.tolist()
    from padfree.core.strategies import Strategy

    with pytest.raises(ValueError, match="one of them"):  # a form, or a layout of its own: never both
        Strategy("neither", 99, packed=True)
