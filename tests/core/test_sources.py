"""Weighted sources: every step holds each source's share within one document (each unit), every source is
drawn exactly once per pass of its quota, and resume and elastic resume keep the deficits (issue 43)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from padfree import PlanConfig, make_plan
from padfree.core import sources as S
from padfree.core.cursor import Cursor, EpochSource
from padfree.core.state_check import DIGEST, seal
from padfree.errors import ConfigError, OverlongError, StateError

WEIGHTS = (("chat", 0.6), ("code", 0.25), ("math", 0.15))


def _lengths(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "chat": np.minimum(rng.lognormal(5.5, 1.0, 900).astype(np.int64) + 2, 1024),
        "code": np.minimum(rng.lognormal(6.3, 0.7, 250).astype(np.int64) + 2, 1024),
        "math": np.minimum(rng.lognormal(4.5, 0.5, 40).astype(np.int64) + 2, 1024),  # small: upsampled
    }


def _loss(lengths: dict[str, np.ndarray], seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.random(v.shape[0]) * (v - 1)).astype(np.int64) for k, v in lengths.items()}


def _cfg(unit: str, strategy: str = "packed", **kw: object) -> PlanConfig:
    base: dict = dict(strategy=strategy, budget=1024, world_size=4, grad_accum=2, sources=WEIGHTS, unit=unit)
    base.update(kw)
    if "epoch_tokens" not in base:
        base.setdefault("epoch_steps", 25)
    return PlanConfig(**base)


def _brute_shares(plan, data: S.SourceData) -> np.ndarray:
    """Each step's units per source, sample by sample."""
    k = plan.config.micro_per_step
    out = np.zeros((plan.n_steps, len(data.names)))
    for j in range(plan.n_micro):
        for i, piece in zip(plan.micro(j), plan.lengths[plan.offsets[j] : plan.offsets[j + 1]], strict=True):
            s = int(np.searchsorted(data.starts, i, side="right")) - 1
            if data.unit == "documents":
                v = 1.0
            elif data.unit == "tokens":
                v = float(piece)
            else:
                loss = data.lengths[i] - 1 if data.loss is None else data.loss[i]
                v = float(min(loss, piece))
            out[j // k, s] += v
    return out


@pytest.mark.parametrize("strategy", ["packed", "bucketed"])
@pytest.mark.parametrize("unit", S.UNITS)
def test_every_step_holds_its_share_within_one_document(unit: str, strategy: str) -> None:
    lengths = _lengths()
    cfg = _cfg(unit, strategy)
    data = S.source_data(lengths, cfg, _loss(lengths) if unit == "loss" else None)
    plan, trace = S.plan_sources(data, cfg, 0)
    assert plan.n_steps == 25 and plan.n_micro == 25 * 8
    shares = _brute_shares(plan, data)
    assert np.allclose(shares, S.step_shares(plan, data))
    err = np.abs(shares - data.weights * shares.sum(axis=1, keepdims=True))
    if unit == "documents":
        one = 1.0
        assert (err < 1.0).all()  # floor or ceil of w * n: strictly within one sample
    else:
        vals = np.minimum(data.lengths, 1024) if unit == "tokens" else np.minimum(data.loss, data.lengths)
        one = float(vals.max())
    assert (err <= one).all(), err.max() / one
    assert np.allclose(S.share_error(plan, data), err.max(axis=1) / one)
    # micro-batches are packed or bucketed within the budget, and the deficits carried stay bounded
    lens = np.split(plan.lengths, plan.offsets[1:-1])
    if strategy == "packed":
        assert max(int(x.sum()) for x in lens) <= 1024
    else:
        assert max(int(x.shape[0] * x.max()) for x in lens) <= 1024
    assert all(len(x) for x in lens)
    assert np.abs(trace[-1].deficits(data.weights)).max() <= 2 * one


def test_exactly_once_within_each_quota_and_repetition() -> None:
    lengths = _lengths()
    cfg = _cfg("tokens", epoch_steps=60)
    data = S.source_data(lengths, cfg)
    plan, trace = S.plan_sources(data, cfg, 0)
    rep = S.repetition(plan, data)
    assert rep["math"]["passes"] > 1 > rep["chat"]["passes"]  # a small set upsampled, a large one capped
    src = data.source_of(plan.indices)
    for s, name in enumerate(data.names):
        local = plan.indices[src == s] - data.starts[s]
        drawn, n = local.shape[0], int(data.sizes[s])
        assert drawn == trace[-1].drawn[s] == rep[name]["drawn"]
        counts = np.bincount(local, minlength=n)
        full, rest = divmod(drawn, n)
        assert set(np.unique(counts)) <= {full, full + 1}  # each sample once per pass
        assert int((counts == full + 1).sum()) == rest
        # brute force: the quota is the first `drawn` of the source's passes, each a shuffle of it
        passes = [S._pass_perm(data, cfg, 0, s, p) for p in range(full + 1)]
        expect = np.concatenate(passes)[:drawn]
        assert np.array_equal(np.sort(local), np.sort(expect))
    assert abs(rep["math"]["share"] - 0.15) < 0.01
    lines = S.summary_lines(plan, data)
    assert "upsampled" in lines[3] and "capped" in lines[1]


def test_epoch_in_tokens_rounds_up_to_whole_steps() -> None:
    lengths = _lengths()
    cfg = _cfg("documents", strategy="bucketed", epoch_tokens=50_000)
    data = S.source_data(lengths, cfg)
    plan, trace = S.plan_sources(data, cfg, 0)
    assert trace[-1].tokens >= 50_000 > trace[-2].tokens
    assert int(plan.lengths.sum()) == trace[-1].tokens
    default = S.plan_sources(data, cfg.with_(epoch_tokens=None), 0)[1][-1]  # default: every source's tokens
    assert default.tokens >= int(data.lengths.sum()) > default.tokens - 8 * 1024


def _run(cursors: list[Cursor], steps: int | None) -> list[list[list[int]]]:
    """Every step's micro-batches (rank by rank) for ``steps`` steps (None: to the end)."""
    out = []
    while steps is None or len(out) < steps:
        got = [[c.take() for _ in range(c.config.grad_accum)] for c in cursors]
        if got[0][0] is None:
            break
        out.append([n.ids for r in got for n in r])  # type: ignore[union-attr]
    return out


@pytest.mark.parametrize("unit", S.UNITS)
def test_resume_and_elastic_resume_keep_the_deficits(unit: str) -> None:
    lengths = _lengths(3)
    loss = _loss(lengths)
    cfg = _cfg(unit, world_size=2, grad_accum=2, epoch_steps=14)
    src = EpochSource.of(lengths, cfg, loss)
    data = src.mixture
    assert data is not None
    unbroken = _run([Cursor(src, cfg, r) for r in range(2)], None)
    first = [Cursor(src, cfg, r) for r in range(2)]
    done = _run(first, 5)
    assert done == unbroken[:5]
    state = json.loads(json.dumps(first[0].state_dict()))
    # the counters recorded are what the consumed samples add up to (brute force)
    ids = np.array([i for step in done for mb in step for i in mb])
    s_of = data.source_of(ids)
    if unit == "documents":
        vals = np.ones(ids.shape[0])
    elif unit == "tokens":
        vals = data.lengths[ids].astype(float)
    else:
        assert data.loss is not None
        vals = data.loss[ids].astype(float)
    assert state["sources"]["drawn"] == np.bincount(s_of, minlength=3).tolist()
    assert np.allclose(state["sources"]["got"], np.bincount(s_of, weights=vals, minlength=3))
    assert state["sources"]["steps"] == 5
    # same shape: the rest of the unbroken run, exactly
    same = [Cursor(src, cfg, r) for r in range(2)]
    for c in same:
        c.load_state_dict(state)
    assert _run(same, None) == unbroken[5:]
    # another world size: the rest planned at 4 x 1 from the counters, as planning from them directly does
    cfg4 = cfg.with_(world_size=4, grad_accum=1)
    more = [Cursor(src, cfg4, r) for r in range(4)]
    for c in more:
        c.load_state_dict(state)
    assert more[0].counters().to_state() == state["sources"]
    rest = _run(more, None)
    start = S.Counters(**{**state["sources"], "drawn": tuple(state["sources"]["drawn"]),
                          "got": tuple(state["sources"]["got"])})  # fmt: skip
    direct, trace = S.plan_sources(data, cfg4, 0, start=start, assign=False)
    assert len(rest) == direct.n_steps == 14 - 5
    for t, step in enumerate(rest):
        a, b = direct.offsets[t * 4], direct.offsets[(t + 1) * 4]
        assert sorted(i for mb in step for i in mb) == sorted(direct.indices[a:b].tolist())
    # every source's quota over the whole (resumed) epoch is drawn exactly once per pass
    all_ids = np.array([i for step in done + rest for mb in step for i in mb])
    for s in range(3):
        local = all_ids[data.source_of(all_ids) == s] - data.starts[s]
        counts = np.bincount(local, minlength=int(data.sizes[s]))
        assert counts.max() - counts.min() <= 1
    assert trace[-1].drawn == tuple(np.bincount(data.source_of(all_ids), minlength=3).tolist())


def test_edited_counters_are_refused() -> None:
    lengths = _lengths()
    cfg = _cfg("tokens", world_size=2, grad_accum=1)
    src = EpochSource.of(lengths, cfg)
    cur = Cursor(src, cfg, 0)
    _run([cur], 3)
    state = cur.state_dict()
    body = {k: v for k, v in state.items() if k != DIGEST}
    body["sources"] = {**body["sources"], "got": [0.0, 0.0, 0.0]}
    other = Cursor(src, cfg, 0)
    with pytest.raises(StateError, match="source counters"):
        other.load_state_dict(seal(body))
    other.load_state_dict(state)  # the unedited state loads
    assert other.counters() == cur.counters()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(sources=(("a", 1.0), ("b", 0.0))), "source 'b': weight must be a finite number > 0"),
        (dict(sources=(("a", 1.0), ("b", -2))), "source 'b': weight must be"),
        (dict(sources=(("a", 1.0), ("a", 2.0))), "source 'a': named twice"),
        (dict(sources=(("a", 1.0),), unit="bytes"), "unknown unit 'bytes'"),
        (dict(sources=(("a", 1.0),), strategy="random"), "packed or bucketed"),
        (dict(unit="documents"), "weighted sources only"),
        (dict(sources=(("a", 1.0),), epoch_steps=3, epoch_tokens=9), "not both"),
    ],
)
def test_bad_config_is_one_line(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PlanConfig(**{"strategy": "packed", **change})


def test_bad_lengths_name_the_source() -> None:
    cfg = PlanConfig(strategy="packed", budget=64, sources=(("a", 1.0), ("b", 1.0)))
    with pytest.raises(ConfigError, match="source 'b': empty"):
        S.source_data({"a": [3, 4], "b": []}, cfg)
    with pytest.raises(ConfigError, match="source 'b': no lengths given"):
        S.source_data({"a": [3, 4]}, cfg)
    with pytest.raises(ConfigError, match="source 'c': lengths given but not in"):
        S.source_data({"a": [3], "b": [4], "c": [5]}, cfg)
    with pytest.raises(OverlongError, match="source 'b': 1 sample"):
        make_plan({"a": [3, 4], "b": [4, 99]}, cfg)
    plan = make_plan({"a": [3, 4], "b": [4, 99]}, cfg.with_(overlong="truncate"))
    assert plan.truncated == 1 and int(plan.lengths.max()) <= 64


def test_plans_without_sources_read_as_before() -> None:
    cfg = PlanConfig(strategy="packed")
    assert not {"sources", "unit", "epoch_steps", "epoch_tokens"} & set(cfg.to_dict())
    mixed = _cfg("tokens").to_dict()
    assert mixed["sources"] == [["chat", 0.6], ["code", 0.25], ["math", 0.15]]
    back = PlanConfig(**{k: v for k, v in mixed.items() if k != "cost"})  # a JSON round trip
    assert back.sources == WEIGHTS


def test_token_sums_per_source() -> None:
    ids = np.array([[0, 0, 1, 2, -1]])
    loss = np.array([[1.0, 2.0, 3.0, 4.0, 5.0]])
    mask = np.array([[True, False, True, True, True]])
    assert S.source_token_sums(ids, loss, 3, mask).tolist() == [1.0, 3.0, 4.0]
    assert S.source_token_sums(ids, np.ones_like(loss), 3).tolist() == [2.0, 1.0, 1.0]
