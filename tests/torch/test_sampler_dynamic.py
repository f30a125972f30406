"""Dynamic balancing in PlanBatchSampler, ranks as threads exchanging through an in-process board: a slow rank
is learned and given less, every sample is consumed once per epoch, and a state saved at any point (mid-step
included) resumes exactly, at the same or another world size, into a dynamic or a static sampler."""

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from padfree import ConfigError, PlanConfig, StateError, make_plan
from padfree.core.state_check import seal
from padfree.testing.threadranks import Board, run_ranks
from padfree.torch import PlanBatchSampler

STRATEGIES = ["sorted", "random", "bucketed", "packed"]
TRUE = (1e-4, 2e-8, 2e-3)  # the simulated machine: seconds = (a*slots + b*attention + c) / speed


def group(lengths, cfg, world, board=None, **kw):
    board = board or Board(world)
    return [
        PlanBatchSampler(lengths, cfg, rank=r, world_size=world, balance_exchange=board.exchange(r), **kw)
        for r in range(world)
    ]


def seconds(info, packed, speed):
    lens = np.array(info.lengths, dtype=np.float64)
    if lens.size == 0:
        return TRUE[2] / speed
    slots, attn = (
        (lens.sum(), (lens**2).sum()) if packed else (len(lens) * lens.max(), len(lens) * lens.max() ** 2)
    )
    return (TRUE[0] * slots + TRUE[1] * attn + TRUE[2]) / speed


def run(samplers, speeds, limit=None):
    """Every rank in a thread: take ``limit`` micro-batches (None: to the end), report simulated times."""
    return run_ranks(samplers, lambda r, i, mb: seconds(mb.info, samplers[r].config.packed, speeds[r]), limit)


def pieces(per_rank):
    return Counter(
        (i, s)
        for mbs in per_rank
        for mb in mbs
        for i, s in zip(mb.info.indices, mb.info.starts or [0] * len(mb), strict=True)
    )


def lengths_for(n=1500, seed=0, budget=4096):
    return np.minimum(np.random.default_rng(seed).lognormal(5.5, 1.2, n).astype(np.int64) + 2, budget)


def busy_imbalance(per_rank, speeds, packed, first_step=0):
    steps = {}
    for r, mbs in enumerate(per_rank):
        for mb in mbs:
            if mb.info.step >= first_step:
                steps.setdefault(mb.info.step, [0.0] * len(per_rank))[r] += seconds(
                    mb.info, packed, speeds[r]
                )
    per = np.array(list(steps.values()))
    return float((per.max(1) / per.mean(1)).mean())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_slow_rank_is_learned_and_given_less_and_every_sample_runs_once(strategy):
    lengths = lengths_for()
    cfg = PlanConfig(strategy=strategy, budget=4096, grad_accum=4, seed=1, overlong="truncate")
    speeds = (1.0, 1 / 1.5)
    dyn = group(lengths, cfg, 2, balance="dynamic", balance_every=2)
    got = run(dyn, speeds)
    assert pieces(got) == Counter((i, 0) for i in range(len(lengths)))
    stats = dyn[0].balance_stats()
    timing = {k: v for k, v in stats.items() if k.endswith("_seconds")}  # this rank's own clock
    assert stats == dyn[1].balance_stats() | timing
    assert np.allclose(stats["speeds"], (1.2, 0.8), rtol=0.01) and stats["fitted"]
    # speeds are normalized to mean 1 (1 and 2/3 become 1.2 and 0.8), the coefficients follow
    assert np.allclose(stats["cost"], np.multiply(TRUE, 1.2), rtol=0.05) and stats["heldout_rel_error"] < 0.01
    static = run(group(lengths, cfg, 2), speeds)
    assert busy_imbalance(got, speeds, cfg.packed, 4) < busy_imbalance(static, speeds, cfg.packed, 4) - 0.05
    # re-cut micro-batches stay within the budget, and the plan left headroom
    infos = [mb.info for r in got for mb in r]
    sizes = [sum(i.lengths) if cfg.packed else len(i.lengths) * max(i.lengths, default=0) for i in infos]
    assert max(sizes) <= 4096
    assert stats["plan_budget"] == int(4096 * 0.85) and stats["recut"]


@pytest.mark.parametrize("strategy", ["bucketed", "packed"])
def test_kill_mid_step_and_resume_continues_the_step_exactly(strategy):
    lengths = lengths_for(800, seed=3)
    cfg = PlanConfig(strategy=strategy, budget=4096, grad_accum=3, seed=2, overlong="truncate")
    speeds = (1.0, 0.6)
    ref = run(group(lengths, cfg, 2, balance="dynamic", balance_every=2), speeds)
    first = group(lengths, cfg, 2, balance="dynamic", balance_every=2)
    head = run(first, speeds, limit=3 * 7 + 1)  # 7 steps and one micro-batch: past 3 exchanges
    state = json.loads(json.dumps(first[0].state_dict()))
    assert first[1].state_dict() == state and state["partial"] == 1 and state["balance"]["fitted"]
    second = group(lengths, cfg, 2, balance="dynamic", balance_every=2)
    for s in second:
        s.load_state_dict(state)
    tail = run(second, speeds)
    assert pieces([h + t for h, t in zip(head, tail, strict=True)]) == Counter(
        (i, 0) for i in range(len(lengths))
    )
    for r in range(2):  # the rest of the interrupted step is what the uninterrupted run had
        assert [list(m) for m in tail[r][:2]] == [list(m) for m in ref[r][22:24]]


def test_elastic_resume_restarts_speeds_and_a_static_sampler_finishes_a_dynamic_step():
    lengths = lengths_for(900, seed=4)
    cfg = PlanConfig(strategy="packed", budget=4096, grad_accum=2, seed=3, overlong="truncate")
    first = group(lengths, cfg, 2, balance="dynamic", balance_every=2)
    head = run(first, (1.0, 0.5), limit=2 * 6)
    state = first[0].state_dict()
    assert state["balance"]["speeds"] is not None
    third = group(lengths, cfg, 3, balance="dynamic", balance_every=2)
    for s in third:
        s.load_state_dict(state)
    assert third[0].balance_stats()["speeds"] == (1.0, 1.0, 1.0)
    assert third[0].balance_stats()["cost"] == tuple(state["balance"]["cost"])  # coefficients carry over
    tail = run(third, (1.0, 0.5, 1.0))
    assert pieces(head + tail) == Counter((i, 0) for i in range(len(lengths)))

    # mid-step state of a dynamic run, loaded by static samplers: the step is finished as it was cut
    mid = group(lengths, cfg, 2, balance="dynamic", balance_every=2)
    a = run(mid, (1.0, 0.5), limit=2 * 6 + 1)
    cont = group(lengths, cfg, 2)  # static
    for s in cont:
        s.load_state_dict(mid[0].state_dict())
    b = run(cont, (1.0, 0.5))
    assert pieces(a + b) == Counter((i, 0) for i in range(len(lengths)))
    assert all(sum(mb.info.lengths) <= 4096 for r in b for mb in r)


def test_ranks_resumed_from_different_states_are_stopped():
    lengths = lengths_for(600, seed=5)
    cfg = PlanConfig(strategy="bucketed", budget=4096, grad_accum=2, seed=3)
    first = group(lengths, cfg, 2, balance="dynamic", balance_every=2)
    run(first, (1.0, 0.5), limit=2 * 5)
    state = first[0].state_dict()
    other = json.loads(json.dumps(state))
    other["balance"]["cost"][2] *= 2
    second = group(lengths, cfg, 2, balance="dynamic", balance_every=2)
    with pytest.raises(StateError, match="digest .* does not match its content"):
        second[1].load_state_dict(other)  # an edited state is refused...
    second[0].load_state_dict(state)
    second[1].load_state_dict(seal(other))  # ... unless re-sealed: two ranks, two genuine states
    with pytest.raises(StateError, match="ranks disagree on the balance"):
        run(second, (1.0, 0.5))


def test_static_samplers_ignore_times_and_exchange_nothing():
    cfg = PlanConfig(strategy="packed", budget=4096, grad_accum=2)
    never = lambda p: pytest.fail("no exchange when static")  # noqa: E731
    s = PlanBatchSampler(lengths_for(200), cfg, rank=0, world_size=2, balance_exchange=never)
    for _ in s:
        with s.timed():
            pass
        s.record_time(0.1)
    assert s.balance_stats()["exchanges"] == 0 and s.balance_stats()["mode"] == "static"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    strategy=st.sampled_from(STRATEGIES),
    worlds=st.tuples(st.integers(2, 3), st.integers(1, 3)),
    accum=st.integers(1, 3),
    cut=st.integers(0, 40),
    every=st.integers(1, 3),
    slow=st.floats(0.4, 1.0),
    window=st.sampled_from([None, 70]),
)
def test_dynamic_save_load_drain_consumes_every_sample_once(
    strategy, worlds, accum, cut, every, slow, window
):
    lengths = lengths_for(300, seed=cut)
    cfg = PlanConfig(strategy=strategy, budget=4096, grad_accum=accum, seed=cut % 5, overlong="truncate")
    w1, w2 = worlds
    kw = {"balance": "dynamic", "balance_every": every, "window": window}
    try:  # a shape the windowed planner refuses for the whole epoch is not a resume question
        make_plan(lengths, cfg.with_(world_size=max(worlds)), 0, stream=window is not None, window=window)
    except ConfigError:
        assume(False)
    first = group(lengths, cfg, w1, **kw)
    speeds = [slow] + [1.0] * 3
    cut = min(cut, len(first[0]) - 1)
    head = run(first, speeds, limit=cut)
    state = json.loads(json.dumps(first[0].state_dict()))
    if state["partial"] and w2 != w1:
        w2 = w1
    second = group(lengths, cfg, w2, **kw)
    for s in second:
        s.load_state_dict(state)
    tail = run(second, speeds)
    assert pieces(head + tail) == Counter((i, 0) for i in range(len(lengths)))
    # a plan with headroom packs below the budget but cuts (truncates) items at the budget, never below
    assert all(mb.info.lengths == tuple(lengths[list(mb)]) for r in head + tail for mb in r)


def test_timed_stops_at_the_last_gradient_and_gpu_timings_wait_until_they_completed():
    import time

    import torch

    from padfree.torch.feed.balance import DynamicBalancer

    d = DynamicBalancer(2, 8, (1.0, 1.0), exchange=lambda p: np.stack([p, p]))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    got = []
    with d.timer(lambda sec, info: got.append(sec), model, None):
        time.sleep(0.05)
        model(torch.ones(2, 4)).sum().backward()
        time.sleep(0.3)  # after the last gradient: what DDP's all-reduce wait would be
    assert 0.05 <= got[0] < 0.25

    class Running:  # a CUDA-event timing whose end has not completed yet
        value = None

        def seconds(self):
            return self.value

    d.yielded(("e", 0, 0), 10.0, 100.0)
    d.yielded(("e", 0, 1), 20.0, 400.0)
    running = Running()
    d.record(running)
    d.record(0.5)
    assert d._ready().tolist() == [[20.0, 400.0, 0.5]]  # never waits for the GPU
    running.value = 0.25
    assert d._ready().tolist() == [[10.0, 100.0, 0.25]]  # read at a later exchange
    for bad in (float("nan"), float("inf"), -1.0, 0.0, 1e160):  # screened out and counted, never raised
        d.yielded(("e", 0, 2), 1.0, 1.0)
        d.record(bad)
    assert d._ready().shape == (0, 3) and d.dropped == 5
    with pytest.raises(Exception, match="seconds as a number"):
        d.yielded(("e", 0, 3), 1.0, 1.0)
        d.record("0.5")


def test_an_empty_micro_batch_a_loop_skipped_reports_no_time_and_is_kept():
    """Issue 28: a training loop that skips an empty micro-batch (a slow rank's share re-cut to nothing)
    reports 0 s. The screen, which wants times > 0, dropped it, and with nothing saying what a micro-batch
    costs with nothing in it the refit's fixed cost ``c`` floated up on noise (0.17-0.29 s a micro-batch in
    dynamic_balance --quick, where it had found 0, its held-out error 0.13-0.35 instead of 0.07-0.09). It is
    kept; 0 s for a micro-batch with rows is still dropped, and no rank can send one that others keep."""
    from padfree.core import refit
    from padfree.torch.feed.balance import DynamicBalancer

    d = DynamicBalancer(2, 8, (1.0, 1.0), exchange=lambda p: np.stack([p, p]))
    for i, (slots, attn, sec) in enumerate([(0.0, 0.0, 0.0), (20.0, 400.0, 0.5), (10.0, 100.0, 0.0)]):
        d.yielded(("e", 0, i), slots, attn)
        d.record(sec)
    assert d._ready().tolist() == [[0.0, 0.0, 0.0], [20.0, 400.0, 0.5]] and d.dropped == 1
    rows = np.array([[0, 0.0, 0.0, 0.0], [1, 10.0, 100.0, 0.0], [1, 0.0, 0.0, -1.0], [0, 20.0, 400.0, 0.5]])
    assert refit.valid_records(rows).tolist() == [[0, 0.0, 0.0, 0.0], [0, 20.0, 400.0, 0.5]]
