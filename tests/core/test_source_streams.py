"""Weighted sources over streams (issue 43, items 1 and 3): every step within one document of each source's
share, each source's drawn prefix once, the same steps after a resume at the same shape and every sample once
after one at another world size; bad streams one line naming the source and the rule."""

from __future__ import annotations

import numpy as np
import pytest

from padfree import PlanConfig
from padfree.core.lookahead import ArrayLengths, window_steps
from padfree.core.source_streams import counters_from_state, mixed_steps, split_id
from padfree.errors import ConfigError, OverlongError, StateError

LENGTHS = {
    "chat": np.random.default_rng(0).integers(5, 300, 2000),
    "code": np.random.default_rng(1).integers(50, 900, 900),
    "math": np.random.default_rng(2).integers(20, 200, 700),
}
WEIGHTS = (("chat", 0.6), ("code", 0.25), ("math", 0.15))


def _streams() -> dict:
    return {k: ArrayLengths(v, name=k) for k, v in LENGTHS.items()}


def _cfg(unit: str, **kw) -> PlanConfig:
    base = {"strategy": "packed", "budget": 1024, "world_size": 2, "grad_accum": 2, "seed": 3}
    return PlanConfig(**{**base, **kw}, sources=WEIGHTS, unit=unit)


def _ids(steps) -> np.ndarray:
    return np.concatenate([m for s in steps for m in s.micro])


@pytest.mark.parametrize("unit", ["documents", "tokens", "loss"])
@pytest.mark.parametrize("strategy", ["packed", "bucketed"])
def test_every_step_holds_its_share_and_each_prefix_is_drawn_once(unit: str, strategy: str) -> None:
    cfg = _cfg(unit, strategy=strategy)
    steps = list(mixed_steps(_streams(), cfg))
    ids = _ids(steps)
    assert np.unique(ids).shape[0] == ids.shape[0]
    src, pos = split_id(ids, 3)
    drawn = steps[-1].state_after.drawn
    w = np.array([w for _, w in WEIGHTS])
    for s in range(len(LENGTHS)):
        assert np.array_equal(np.sort(pos[src == s]), np.arange(drawn[s]))  # the stream's prefix, once
    assert any(d > n - 80 for d, n in zip(drawn, map(len, LENGTHS.values()), strict=True))  # one ran out
    longest = max(min(int(v.max()), 1024) for v in LENGTHS.values())
    one = 1.0 if unit == "documents" else longest
    for st in steps:
        i = np.concatenate(st.micro)
        lens = np.concatenate(st.lengths)
        s_of, p_of = split_id(i, 3)
        full = np.array([LENGTHS[n][p] for n, p in zip(np.array(list(LENGTHS))[s_of], p_of, strict=True)])
        assert np.array_equal(np.minimum(full, 1024), lens)
        vals = {"documents": np.ones(len(i)), "tokens": lens, "loss": np.minimum(full - 1, lens)}[unit]
        units = np.bincount(s_of, weights=vals, minlength=3)
        assert np.abs(units - w * units.sum()).max() <= one + 1e-9
        for ln in st.lengths:
            assert ln.shape[0] > 0
            cost = ln.sum() if strategy == "packed" else ln.shape[0] * ln.max()
            assert cost <= 1024


def test_resume_is_the_same_at_the_same_shape_and_once_at_another() -> None:
    cfg = _cfg("tokens")
    whole = list(mixed_steps(_streams(), cfg))
    state = counters_from_state(whole[9].state_after.to_state(), 3)
    rest = list(mixed_steps(_streams(), cfg, start=state))
    assert [[m.tolist() for m in s.micro] for s in whole[10:]] == [
        [m.tolist() for m in s.micro] for s in rest
    ]
    wider = list(mixed_steps(_streams(), cfg.with_(world_size=4, grad_accum=1), start=state))
    ids = np.concatenate((_ids(whole[:10]), _ids(wider)))
    assert np.unique(ids).shape[0] == ids.shape[0] and wider[0].index == 10
    src, pos = split_id(ids, 3)
    for s in range(3):
        assert np.array_equal(np.sort(pos[src == s]), np.arange(wider[-1].state_after.drawn[s]))


def test_bad_mixtures_of_streams_are_one_line() -> None:
    cfg = _cfg("tokens")
    with pytest.raises(ConfigError, match=r"^source 'math': no stream given$"):
        next(mixed_steps({k: v for k, v in _streams().items() if k != "math"}, cfg))
    with pytest.raises(
        ConfigError, match=r"^source 'extra': a stream given but not in the config's sources$"
    ):
        next(mixed_steps({**_streams(), "extra": ArrayLengths(np.ones(3, np.int64))}, cfg))
    with pytest.raises(ConfigError, match=r"^source 'code': empty \(a source needs at least one sample\)$"):
        next(mixed_steps({**_streams(), "code": ArrayLengths(np.zeros(0, np.int64), name="code")}, cfg))
    long = {**_streams(), "chat": ArrayLengths(np.array([5, 2000, 7] * 50), name="chat")}
    with pytest.raises(OverlongError, match=r"^source 'chat': sample 1 has 2000 tokens, over the budget"):
        next(mixed_steps(long, cfg))
    assert next(mixed_steps(long, cfg.with_(overlong="truncate"))).index == 0
    with pytest.raises(ConfigError, match=r"^source 'code': weight must be a finite number > 0 \(got 0\)$"):
        PlanConfig(strategy="packed", budget=1024, sources=(("chat", 1.0), ("code", 0)))
    with pytest.raises(ConfigError, match=r"^unknown unit 'bytes': a source weight counts documents"):
        PlanConfig(strategy="packed", budget=1024, sources=WEIGHTS, unit="bytes")
    with pytest.raises(ConfigError, match="a window plans one stream"):
        next(window_steps(ArrayLengths(np.ones(9, np.int64)), cfg, 100))
    with pytest.raises(ConfigError, match=r"^source 'nothing': empty"):
        next(window_steps(ArrayLengths(np.zeros(0, np.int64), name="nothing"), cfg.with_(sources=None,
             unit="tokens"), 100))  # fmt: skip
    with pytest.raises(StateError, match="source counters for 2 sources, the config has 3"):
        counters_from_state({"drawn": [1, 2], "got": [1.0, 2.0], "units": 3.0, "tokens": 3, "steps": 1}, 3)
