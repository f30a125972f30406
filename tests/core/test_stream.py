"""The stream planner (huge epochs, window by window): the plan's invariants on small inputs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree import PlanConfig, make_plan
from padfree.core import planner as plan_module
from padfree.core.items import Items, validate_lengths
from padfree.core.plan import plan_items
from padfree.core.stream import deal_windows, plan_stream
from padfree.errors import ConfigError, InputError, OverlongError

STRATEGIES = ("sorted", "random", "bucketed", "packed")


@pytest.fixture(scope="module")
def lengths(seed_mix: np.ndarray) -> np.ndarray:
    """20K lengths resampled from seed_mix, as int32 like a huge array would be."""
    rng = np.random.default_rng(7)
    return seed_mix[rng.integers(0, seed_mix.shape[0], 20_000)].astype(np.int32)


def _check(plan, lengths: np.ndarray, cfg: PlanConfig) -> None:
    """Exactly once, whole steps with equal per-rank counts, budget respected."""
    k = cfg.micro_per_step
    assert plan.n_micro % k == 0 and plan.n_micro > 0
    counts = np.diff(plan.offsets)
    assert counts.min() >= 1 and int(counts.sum()) == plan.indices.shape[0]
    per_rank = [plan.micro_ids(r).shape[0] for r in range(cfg.world_size)]
    assert per_rank == [plan.n_steps * cfg.grad_accum] * cfg.world_size
    lens = plan.lengths.astype(np.int64)
    if plan.starts is not None:
        # every token of every sample exactly once: pieces tile [0, length)
        order = np.lexsort((plan.starts, plan.indices))
        ids, at, ln = plan.indices[order], plan.starts[order].astype(np.int64), lens[order]
        assert np.array_equal(np.bincount(ids, weights=ln, minlength=lengths.shape[0]), lengths)
        first = np.r_[True, ids[1:] != ids[:-1]]
        assert np.all(at[first] == 0)
        assert np.array_equal(at[~first], (at + ln)[:-1][~first[1:]])
    else:
        assert cfg.overlong != "split" or lengths.max() <= cfg.budget
        want = (
            np.flatnonzero(lengths <= cfg.budget) if cfg.overlong == "drop" else np.arange(lengths.shape[0])
        )
        assert np.array_equal(np.sort(plan.indices), want)
        expect = np.minimum(lengths[plan.indices], cfg.budget)
        assert np.array_equal(lens, expect)
    starts = plan.offsets[:-1]
    if cfg.packed:
        assert np.add.reduceat(lens, starts).max() <= cfg.budget
    else:
        assert (counts * np.maximum.reduceat(lens, starts)).max() <= cfg.budget


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("overlong", ["error", "split", "drop"])
def test_stream_invariants(lengths: np.ndarray, strategy: str, overlong: str):
    budget = 16384 if overlong == "error" else 2048
    cfg = PlanConfig(strategy=strategy, budget=budget, world_size=4, grad_accum=2, seed=5, overlong=overlong)
    calls = []
    plan = plan_stream(lengths, cfg, 3, window=3_000, progress=lambda d, t: calls.append((d, t)))
    assert len(calls) == 7 and calls[-1] == (7, 7)
    _check(plan, lengths.astype(np.int64), cfg)
    assert plan.indices.dtype == np.int32 and plan.lengths.dtype == np.int32
    again = plan_stream(lengths, cfg, 3, window=3_000)
    for a, b in [(plan.indices, again.indices), (plan.offsets, again.offsets), (plan.lengths, again.lengths)]:
        assert np.array_equal(a, b)
    other = plan_stream(lengths, cfg, 4, window=3_000)
    assert not np.array_equal(plan.indices, other.indices)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_window_is_the_in_memory_plan(lengths: np.ndarray, strategy: str):
    cfg = PlanConfig(strategy=strategy, budget=4096, world_size=2, grad_accum=3, seed=2, overlong="truncate")
    a = plan_stream(lengths, cfg, 1, window=lengths.shape[0])
    b = make_plan(lengths, cfg, 1, stream=False)
    for name in ("indices", "offsets", "lengths"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.truncated == b.truncated > 0


def test_make_plan_switches_to_the_stream_above_the_threshold(lengths, monkeypatch: pytest.MonkeyPatch):
    cfg = PlanConfig(strategy="packed", budget=16384, world_size=2, grad_accum=2, seed=1)
    monkeypatch.setattr(plan_module, "STREAM_THRESHOLD", 10_000)
    auto = make_plan(lengths, cfg, 0, window=4_000)
    forced = plan_stream(lengths, cfg, 0, window=4_000)
    assert np.array_equal(auto.indices, forced.indices) and np.array_equal(auto.offsets, forced.offsets)
    assert auto.indices.dtype == np.int32
    small = make_plan(lengths[:5_000], cfg, 0)  # below the threshold: the in-memory path
    assert small.indices.dtype == np.int64
    assert np.array_equal(make_plan(lengths, cfg, 0, stream=True, window=4_000).indices, forced.indices)


def test_sorted_keeps_its_micro_batches_across_epochs(lengths: np.ndarray):
    cfg = PlanConfig(strategy="sorted", budget=16384, world_size=2, grad_accum=2, seed=1)
    a, b = (plan_stream(lengths, cfg, e, window=5_000) for e in (0, 1))
    batches = [{tuple(sorted(m.tolist())) for m in p.micro_batches()} for p in (a, b)]
    # the same sorted cut every epoch; only each window's last step (cut anew to make it whole) may differ
    shared = len(batches[0] & batches[1]) / len(batches[0])
    n_windows = -(-lengths.shape[0] // 5_000)
    assert shared >= 1 - n_windows * cfg.micro_per_step / len(batches[0]), shared
    assert not np.array_equal(a.indices, b.indices)


def test_stream_mixes_lengths_in_every_window(lengths: np.ndarray):
    """Windows are random subsets: each window's mean length is close to the dataset's."""
    cfg = PlanConfig(strategy="bucketed", budget=16384, world_size=2, grad_accum=2, seed=1)
    w = deal_windows(lengths, cfg, 0, window=4_000)
    means = [lengths[w.samples(j)].mean() for j in range(w.n_windows)]
    assert w.n_windows == 5
    assert max(abs(m / lengths.mean() - 1) for m in means) < 0.15
    assert sorted(np.concatenate([w.samples(j) for j in range(w.n_windows)]).tolist()) == list(range(20_000))


def test_tiny_windows_are_merged_until_each_fills_a_step():
    lengths = np.arange(1, 51, dtype=np.int32)
    cfg = PlanConfig(strategy="packed", budget=64, world_size=2, grad_accum=2, seed=0)
    w = deal_windows(lengths, cfg, 0, window=3)
    assert w.items.min() >= 4 and int(w.items.sum()) == 50
    _check(plan_stream(lengths, cfg, 0, window=3), lengths.astype(np.int64), cfg)


def test_stream_refuses_what_the_in_memory_path_refuses(lengths: np.ndarray):
    cfg = PlanConfig(budget=1024, world_size=2, grad_accum=2)
    with pytest.raises(OverlongError) as a:
        plan_stream(lengths, cfg, 0, window=3_000)
    with pytest.raises(OverlongError) as b:
        make_plan(lengths, cfg, 0, stream=False)
    assert str(a.value) == str(b.value)
    with pytest.raises(OverlongError, match="every sample is longer"):
        plan_stream(np.full(100, 50), cfg.with_(budget=10, overlong="drop"), 0, window=30)
    with pytest.raises(ConfigError, match="cannot fill one step"):
        plan_stream(np.full(3, 5), cfg, 0, window=2)
    with pytest.raises(ConfigError, match="window must be"):
        plan_stream(lengths, cfg, 0, window=0)
    with pytest.raises(InputError, match="sample 2: length must be a positive integer"):
        plan_stream(np.array([3, 4, 0, 5]), cfg, 0, window=2)


def test_a_misspelled_planning_keyword_is_refused_not_ignored():
    from padfree.core.planner import plan_pieces

    lengths, cfg = np.arange(1, 41), PlanConfig(budget=64, world_size=2, grad_accum=2)
    with pytest.raises(TypeError, match="'windw'"):
        make_plan(lengths, cfg, 0, stream=True, windw=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'anchors'"):  # drafter anchors are make_plan's alone
        next(plan_pieces(lengths, cfg, 0, anchors=np.zeros(40, dtype=np.int64)))  # type: ignore[call-arg]
    assert make_plan(lengths, cfg, 0, stream=True, window=20).n_micro > 0


def test_validate_lengths_compact_keeps_int32_without_a_copy():
    a = np.array([3, 9, 1], dtype=np.int32)
    out = validate_lengths(a, compact=True)
    assert out.dtype == np.int32 and np.shares_memory(out, a)
    assert validate_lengths(a).dtype == np.int64
    assert validate_lengths(np.array([3, 9], np.uint16), compact=True).dtype == np.int32
    assert validate_lengths(np.array([3, 9], np.int64), compact=True).dtype == np.int64
    assert validate_lengths(np.array([3.0, 9.0]), compact=True).dtype == np.int64
    with pytest.raises(InputError, match="sample 1: length must be a positive integer"):
        validate_lengths(np.array([3, -1], np.int32), compact=True)
    with pytest.raises(InputError, match="absurdly large"):
        validate_lengths(np.array([3, 2**31], np.uint32), compact=True)
    with pytest.raises(InputError, match="1-D array of integers"):
        validate_lengths([[1, 2], [3]])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_core_plans_int32_items_like_int64(lengths: np.ndarray, strategy: str):
    cfg = PlanConfig(strategy=strategy, budget=16384, world_size=4, grad_accum=2, seed=9)
    n = lengths.shape[0]
    a = plan_items(Items(lengths, None, None, n), cfg, 2)
    b = plan_items(Items(lengths.astype(np.int64), None, None, n), cfg, 2)
    for name in ("indices", "offsets", "lengths"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_analyze_measures_stream_plans_with_window_progress(
    lengths: np.ndarray, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    from padfree.advice.analyze import analyze_strategies
    from padfree.core import stream

    monkeypatch.setattr(plan_module, "STREAM_THRESHOLD", 10_000)
    monkeypatch.setattr(stream, "DEFAULT_WINDOW", 5_000)
    # mix=8: with windows of 5K samples the default 128 would merge most buckets
    configs = {
        s: PlanConfig(strategy=s, budget=16384, world_size=2, grad_accum=2, mix=8, seed=1) for s in STRATEGIES
    }
    res = analyze_strategies(lengths, configs, progress=True)
    assert capsys.readouterr().out == ""  # the progress bar goes to stderr
    monkeypatch.setattr(plan_module, "STREAM_THRESHOLD", 10**9)
    ref = analyze_strategies(lengths, configs)
    for s in STRATEGIES:
        got, want = res["strategies"][s], ref["strategies"][s]
        assert got["steps"] > 0 and 0 <= got["cobatch_repeat"] <= 1
        # windows of 5K samples cost bucketed a few points (at the default 4M windows: ~0.1 point)
        assert abs(got["padding_efficiency"] - want["padding_efficiency"]) < 0.06, s
    assert res["dataset"] == ref["dataset"]


def test_stream_on_random_inputs(refusals):
    """Any input: a valid plan, or the typed error that says why there cannot be one."""

    @settings(deadline=None)
    @given(
        lengths=st.lists(st.integers(1, 300), min_size=12, max_size=400),  # tiny: see test_stream_refuses_*
        strategy=st.sampled_from(STRATEGIES),
        overlong=st.sampled_from(["error", "truncate", "split", "drop"]),
        budget=st.integers(1, 900),
        world=st.integers(1, 4),
        accum=st.integers(1, 3),
        window=st.integers(1, 500),
        epoch=st.integers(0, 3),
    )
    def check(lengths, strategy, overlong, budget, world, accum, window, epoch):
        refusals.seen()
        arr = np.array(lengths, dtype=np.int32)
        cfg = PlanConfig(
            strategy=strategy,
            budget=budget,
            world_size=world,
            grad_accum=accum,
            overlong=overlong,
            seed=epoch,
        )
        try:
            plan = plan_stream(arr, cfg, epoch, window=window)
        except (ConfigError, OverlongError) as exc:
            assert "\n" not in str(exc)
            if isinstance(exc, OverlongError):
                assert overlong in ("error", "drop") and int(arr.max()) > budget
            refusals.refuse()
        _check(plan, arr.astype(np.int64), cfg)

    check()
    refusals.check(most=0.7)  # refused: overlong="error" under the longest sample, too few items
