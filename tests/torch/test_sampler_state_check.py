"""A sampler state loads only if it is the state the sampler wrote: every field is checked against the config
it is loaded under (one line naming the field), the content against its digest; and any state the sampler
writes, after any recorded times (absurd ones included), loads back and runs every sample exactly once."""

import copy
import json
import math
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from padfree import PlanConfig, StateError, make_plan
from padfree.core import refit
from padfree.core.balance import Balance
from padfree.core.state_check import seal
from padfree.errors import ConfigError, StateWarning
from padfree.testing.threadranks import Board, run_ranks
from padfree.torch import PlanBatchSampler

LENGTHS = np.random.default_rng(3).integers(1, 400, 500)
CFG = PlanConfig(strategy="packed", budget=512, grad_accum=2, seed=4)


def group(world, cfg=CFG, **kw):
    board = Board(world)
    return [
        PlanBatchSampler(
            LENGTHS,
            cfg,
            rank=r,
            world_size=world,
            balance="dynamic",
            balance_every=1,
            balance_exchange=board.exchange(r),
            **kw,
        )
        for r in range(world)
    ]


def run(samplers, times, limit=None):
    """Every rank in a thread takes ``limit`` micro-batches (None: all), recording ``times(r, i, info)``."""
    return run_ranks(samplers, lambda r, i, mb: times(r, i, mb.info), limit)


def consumed(*runs):
    return Counter(i for per_rank in runs for mbs in per_rank for mb in mbs for i in mb.info.indices)


def every_sample_once(*runs):
    want = Counter(make_plan(LENGTHS, CFG.with_(world_size=1, grad_accum=1), 0).indices.tolist())
    got = consumed(*runs)
    return sum((want - got).values()), sum((got - want).values())


def saved_mid_epoch(world=2, micro=5):
    """A dynamic group's state after ``micro`` micro-batches on each rank (mid-step when ``micro`` is odd)."""
    first = group(world)
    head = run(first, lambda r, i, info: 0.01 * (1 + r) * (1 + sum(info.lengths) / 512), limit=micro)
    return first, head, first[0].state_dict()


def load(state, world=2):
    s = group(world)[0]
    s.load_state_dict(state)
    return s


def resealed(state, edit):
    """``state`` edited by ``edit`` and sealed again: what a forger who knows the digest writes."""
    out = copy.deepcopy(state)
    edit(out)
    return seal({k: v for k, v in out.items() if k != "digest"})


# ----- every field is checked, naming the field ------------------------------------------------------------
EDITS = {
    "huge budget": (lambda s: s["history"][-1].__setitem__(3, 10**6), "history[0] budget"),
    "float budget": (lambda s: s["history"][-1].__setitem__(3, 300.7), "history[0] budget"),
    "bool budget": (lambda s: s["history"][-1].__setitem__(3, True), "history[0] budget"),
    "plausible budget": (lambda s: s["history"][-1].__setitem__(3, 300), "history[0] budget 300"),
    "steps 1e9": (lambda s: s["history"][-1].__setitem__(2, 10**9), "history[0] says 1000000000 steps"),
    "float steps": (lambda s: s["history"][-1].__setitem__(2, 2.0), "history[0] steps"),
    "negative steps": (lambda s: s["history"][-1].__setitem__(2, -1), "history[0] steps"),
    "partial": (lambda s: s.__setitem__("partial", 2), "partial 2 >= grad_accum 2"),
    "bool partial": (lambda s: s.__setitem__("partial", True), "partial must be an integer"),
    "float epoch": (lambda s: s.__setitem__("epoch", 0.0), "epoch must be an integer"),
    "no history": (lambda s: s.__setitem__("history", []), "history must be a list of 1 to"),
    "world 0": (lambda s: s["history"][-1].__setitem__(0, 0), "history[0] world size"),
    "huge cost": (lambda s: s["balance"].__setitem__("cost", [1e300] * 3), "balance.cost"),
    "bool cost": (lambda s: s["balance"].__setitem__("cost", [True, False, False]), "balance.cost"),
    "zero cost": (lambda s: s["balance"].__setitem__("cost", [0.0, 0.0, 0.0]), "balance.cost"),
    "huge speeds": (lambda s: s["balance"].__setitem__("speeds", [1e300, 1.0]), "balance.speeds"),
    "tiny speeds": (lambda s: s["balance"].__setitem__("speeds", [1e-300, 1.0]), "balance.speeds"),
    "bool speeds": (lambda s: s["balance"].__setitem__("speeds", [True, True]), "balance.speeds"),
    "speeds not mean 1": (lambda s: s["balance"].__setitem__("speeds", [2.0, 2.0]), "balance.speeds"),
    "fitted 1": (lambda s: s["balance"].__setitem__("fitted", 1), "balance.fitted"),
    "mode": (lambda s: s.__setitem__("mode", "fast"), "mode must be"),
}


@pytest.fixture(scope="module")
def mid_state():
    return saved_mid_epoch()[2]


@pytest.mark.parametrize("case", sorted(EDITS))
def test_an_impossible_field_is_refused_in_one_line_naming_it_even_when_resealed(case, mid_state):
    edit, words = EDITS[case]
    for state in (resealed(mid_state, edit), _edited(mid_state, edit)):
        s = group(2)[0]
        before = s.state_dict()
        with pytest.raises(StateError) as exc:
            s.load_state_dict(state)
        msg = str(exc.value)
        assert words in msg and "\n" not in msg, msg
        assert s.state_dict() == before  # a refused state changes nothing


def _edited(state, edit):
    out = copy.deepcopy(state)
    edit(out)
    return out


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s["balance"].__setitem__("cost", [1e-300, 0.0, 0.0]),  # plausible values, but not what
        lambda s: s["balance"].__setitem__("cost", [v * 3 for v in s["balance"]["cost"]]),  # the step ran on
        lambda s: s["balance"].__setitem__("speeds", [1.5, 0.5]),
        lambda s: s.__setitem__("epoch", s["epoch"] + 1),
        lambda s: s["history"][-1].__setitem__(2, s["history"][-1][2] + 1),
        lambda s: s.pop("identity"),
    ],
)
def test_a_plausible_edit_is_refused_by_the_digest(edit, mid_state):
    with pytest.raises(StateError, match="digest .* does not match its content") as exc:
        load(_edited(mid_state, edit))
    assert "\n" not in str(exc.value)


def test_a_mid_step_balance_edit_is_refused_even_when_resealed():
    """A balance within every bound, changed in the middle of a step, would give the step's remaining
    micro-batches to ranks differently (the red team's 1-13 lost samples). The digest alone is no defence
    (anyone can re-seal it): the state records which micro-batches of the step were handed out (``taken``)
    and a load checks that its balance gives those same ones."""
    world = 3
    first = [PlanBatchSampler(LENGTHS, CFG, rank=r, world_size=world) for r in range(world)]
    its = [iter(s) for s in first]
    head = [[next(it) for _ in range(7)] for it in its]  # 3 steps and 1 micro-batch of the 4th
    state = first[0].state_dict()
    assert state["partial"] == 1 and isinstance(state["taken"], str)
    for cost, speeds in (([1.0, 0.0, 0.0], [2.5, 0.25, 0.25]), ([0.0, 1.0, 0.0], [0.25, 0.25, 2.5])):

        def edit(s, c=cost, v=speeds):
            s["balance"].update(cost=c, speeds=v, recut=True)

        for forged in (_edited(state, edit), resealed(state, edit)):
            s = PlanBatchSampler(LENGTHS, CFG, rank=0, world_size=world)
            before = s.state_dict()
            with pytest.raises(StateError, match="digest|taken") as exc:
                s.load_state_dict(forged)
            assert "\n" not in str(exc.value) and s.state_dict() == before
        with pytest.raises(StateError, match="taken .* does not match the micro-batches"):
            PlanBatchSampler(LENGTHS, CFG, rank=0, world_size=world).load_state_dict(resealed(state, edit))
    for drop in ("taken",):
        with pytest.raises(StateError, match="taken 'None'"):
            PlanBatchSampler(LENGTHS, CFG, rank=0, world_size=world).load_state_dict(
                resealed(state, lambda s, k=drop: s.pop(k))
            )
    genuine = [PlanBatchSampler(LENGTHS, CFG, rank=r, world_size=world) for r in range(world)]
    for s in genuine:
        s.load_state_dict(state)
    assert every_sample_once(head, [list(s) for s in genuine]) == (0, 0)


def test_a_history_segment_that_ran_no_step_can_only_be_the_last(mid_state):
    for edit in (lambda s: s["history"].insert(0, [2, 2, 0]), lambda s: s["history"].insert(0, [3, 1, 0])):
        with pytest.raises(StateError, match=r"history\[0\] steps must be at least 1") as exc:
            load(resealed(mid_state, edit))
        assert "\n" not in str(exc.value)


def test_a_state_of_another_world_size_budget_is_refused_unless_its_headroom_is_given():
    three = group(3)
    head = run(three, lambda r, i, info: 0.01, limit=4)
    state = three[0].state_dict()
    assert state["history"][-1][3] == int(512 * (1 - 0.3 / 3))  # planned at 3 ranks' default headroom
    two = group(2)
    for s in two:
        s.load_state_dict(state)  # another world size: its budget is the default one at 3 ranks
    assert every_sample_once(head, run(two, lambda r, i, info: 0.01)) == (0, 0)
    custom = group(3, balance_headroom=0.7)
    run(custom, lambda r, i, info: 0.01, limit=2)
    with pytest.raises(StateError, match=r"history\[0\] budget 358 .* balance_headroom") as exc:
        group(2)[0].load_state_dict(custom[0].state_dict())
    assert "\n" not in str(exc.value)
    group(2, balance_headroom=0.7)[0].load_state_dict(
        custom[0].state_dict()
    )  # the headroom it was saved with


# ----- round trip: whatever was recorded, the written state loads and runs every sample once --------------
TIMES = st.one_of(
    st.floats(1e-3, 1.0),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 1e160, 1e-300, 5e-324, 1e300]),
    st.floats(allow_nan=True, allow_infinity=True),
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    world=st.integers(2, 3),
    cut=st.integers(0, 30),
    times=st.lists(TIMES, min_size=1, max_size=40),
    slow=st.floats(0.2, 1.0),
    world2=st.integers(1, 3),
)
def test_any_written_state_loads_back_and_continues_exactly_once(world, cut, times, slow, world2):
    first = group(world)

    def recorded(r, i, info):
        t = times[i % len(times)]
        return t if not math.isfinite(t) or t < 1e-3 or t > 1 else t / (slow if r == 0 else 1.0)

    head = run(first, recorded, limit=cut)
    state = json.loads(json.dumps(first[0].state_dict()))  # through JSON, as a checkpoint may store it
    assert all(s.state_dict() == first[0].state_dict() for s in first)  # every rank wrote the same state
    stats = first[0].balance_stats()
    assert all(math.isfinite(v) for v in stats["cost"]) and sum(stats["cost"]) > 0
    Balance.from_state(state["balance"], world)  # within every stated bound
    if state["partial"]:
        world2 = world  # mid-step: only the same shape can continue it
    second = group(world2)
    for s in second:
        s.load_state_dict(state)
    assert every_sample_once(head, run(second, recorded)) == (0, 0)


def test_absurd_times_are_dropped_counted_and_the_plan_stays_balanced():
    """An adversarial time series: a slow rank 0 (2x), salted with NaN, inf, <= 0, 1e160, 1e-300 and far
    outliers on both ranks. The refit still learns the slow rank, stays finite, and the state reloads."""
    rng = np.random.default_rng(0)
    salt = [float("nan"), float("inf"), -1.0, 0.0, 1e160, 1e-300, 1e5, 1e-9]

    def recorded(r, i, info):
        if i % 3 == 1:
            return salt[rng.integers(len(salt))]
        return (0.002 + 4e-5 * sum(info.lengths)) * (2.0 if r == 0 else 1.0)

    samplers = group(2)
    out = run(samplers, recorded, limit=60)
    stats = samplers[0].balance_stats()
    assert stats["dropped_times"] >= 15 and all(math.isfinite(v) for v in stats["cost"])
    assert stats["speeds"][0] < 0.8 < 1.2 < stats["speeds"][1]  # the slow rank is learned through the salt
    late = [mb for mb in out[0] if mb.info.step >= 20], [mb for mb in out[1] if mb.info.step >= 20]
    tokens = [sum(sum(mb.info.lengths) for mb in per) for per in late]
    assert tokens[0] < 0.85 * tokens[1]  # the slow rank is given less
    state = samplers[0].state_dict()
    again = group(2)
    for s in again:
        s.load_state_dict(state)
    assert every_sample_once(out, run(again, recorded)) == (0, 0)


# ----- the refit itself at every bound ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "prior", [(1e30, 1e30, 1e30), (1e-300, 0.0, 0.0), (0.0, 0.0, 5e-324), (1.0, 0.0, 0.0)]
)
@pytest.mark.parametrize("speeds", [None, (1 / 400, 1.0), (400.0, 1.0), (1e-300, 1.0), (1e300, 1.0)])
@pytest.mark.parametrize("seconds", [1e-7, 0.5, 86_400.0])
def test_the_refit_is_finite_at_every_bound(prior, speeds, seconds):
    rec = np.array([[r, s, s * s, seconds * (1 + r)] for r in (0, 1) for s in (1.0, 300.0, 512.0)])
    stats = refit.rank_stats(rec, 2, (512.0, 512.0**2))
    cost, fitted = refit.fit(stats, prior, speeds, (512.0, 512.0**2))
    assert all(math.isfinite(v) and 0 <= v <= refit.MAX_COEF for v in cost) and sum(cost) > 0
    Balance.from_state({"cost": list(cost), "speeds": list(fitted), "fitted": True}, 2)  # reloadable
    scaled = refit.prior_scale(stats, prior, (512.0, 512.0**2))
    assert all(math.isfinite(v) for v in scaled) and sum(scaled) > 0


def test_refit_ignores_records_no_rank_should_have_sent():
    rec = np.array(
        [[0, 10.0, 100.0, 0.5], [1, 10.0, 100.0, np.inf], [1, -1.0, 1.0, 0.5], [0, 1.0, 1.0, 1e160]]
    )
    assert refit.valid_records(rec).tolist() == [[0, 10.0, 100.0, 0.5]]


def test_numpy_times_are_numbers_and_a_bool_is_not():
    samplers = group(2)
    kinds = [np.float32(0.01), np.int64(1), np.float64(0.02), 0.01]
    out = run(samplers, lambda r, i, info: kinds[i % len(kinds)], limit=8)
    assert samplers[0].balance_stats()["records"] > 0
    state = samplers[0].state_dict()
    again = group(2)
    for s in again:
        s.load_state_dict(state)
    assert every_sample_once(out, run(again, lambda r, i, info: 0.01)) == (0, 0)
    one = group(2)[0]
    next(iter(one))
    with pytest.raises(ConfigError, match="record_time needs seconds as a number"):
        one.record_time(np.bool_(True))


def test_a_long_forged_history_is_refused_fast_naming_the_segment():
    """65,535 segments alternating 2 and 3 ranks, one step each, re-sealed: the replay stops at the first
    segment whose plan is used up, naming it, without planning the rest."""
    _, _, state = saved_mid_epoch(2, 6)
    b2, b3 = state["history"][0][3], group(3)[0].state_dict()["history"][0][3]
    hist = [[2, 2, 1, b2] if i % 2 == 0 else [3, 2, 1, b3] for i in range(65_535)]
    with pytest.raises(
        StateError, match=r"history\[\d+\] says 1 steps were run, but that segment's plan"
    ) as e:
        load(resealed(state, lambda s: s.__setitem__("history", hist)))
    assert "\n" not in str(e.value)


def test_a_state_nested_thousands_deep_is_one_line(mid_state):
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    for state in ({**mid_state, "extra": deep}, {**mid_state, "identity": {"budget": deep}}):
        with pytest.raises(StateError, match="not plain JSON data") as exc:
            load(state)
        assert "\n" not in str(exc.value)


def test_a_state_without_a_digest_continues_at_a_step_boundary_and_is_refused_mid_step():
    # issue 28: docs/errors.md said such a state is accepted; mid-step it was refused, as "edited mid-step"
    # after a warning that it had been accepted. A state written before digests also lacks `taken`.
    lengths = np.random.default_rng(5).integers(1, 300, 200)
    cfg = PlanConfig(strategy="packed", budget=600, grad_accum=2, seed=2)
    s = PlanBatchSampler(lengths, cfg, rank=0, world_size=2)
    it = iter(s)
    next(it)
    mid = {k: v for k, v in s.state_dict().items() if k not in ("digest", "taken")}
    next(it)
    boundary = {k: v for k, v in s.state_dict().items() if k != "digest"}
    t = PlanBatchSampler(lengths, cfg, rank=0, world_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused outright: no "accepted without a digest" warning first
        with pytest.raises(StateError) as exc:
            t.load_state_dict(mid)
    message = str(exc.value)
    assert "\n" not in message and "edited" not in message, message
    assert message.startswith("a sampler state saved mid-step by an earlier padfree"), message
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "errors.md").read_text().split())
    assert "saved mid-step (`partial` above 0) is refused" in doc and message.split(" (")[0] in doc
    with pytest.warns(StateWarning, match="no digest"):
        t.load_state_dict(boundary)
    assert [list(m) for m in t] == [list(m) for m in it]
