"""Streams planned in a bounded window (issue 43, item 3): every sample read once, resume exact at the same
shape and exactly once at another world size, a stream that cannot seek refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from padfree import PlanConfig
from padfree.core.lookahead import (
    ArrayLengths,
    IteratorLengths,
    WindowState,
    window_for_steps,
    window_steps,
)
from padfree.data.length_streams import ParquetLengths
from padfree.errors import ConfigError


def _lengths(n: int = 1500, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(5.0, 1.0, n).astype(np.int64) + 1, 1024)


def _ids(steps) -> list[int]:
    return [int(i) for st in steps for mb in st.micro for i in mb]


@pytest.mark.parametrize("strategy", ["packed", "bucketed"])
def test_every_sample_once_in_whole_steps_within_the_budget(strategy: str) -> None:
    lengths = _lengths()
    cfg = PlanConfig(strategy=strategy, budget=1024, world_size=2, grad_accum=2, seed=3)
    steps = list(window_steps(ArrayLengths(lengths), cfg, 200))
    ids = _ids(steps)
    assert sorted(ids) == list(range(lengths.shape[0]))
    assert [s.index for s in steps] == list(range(len(steps)))
    for st in steps:
        assert len(st.micro) == 4
        for mb, ln in zip(st.micro, st.lengths, strict=True):
            assert np.array_equal(lengths[mb], ln)
            cost = ln.sum() if strategy == "packed" else ln.shape[0] * (ln.max() if ln.shape[0] else 0)
            assert cost <= 1024
    # the iterator source reads the same stream the same way
    again = list(window_steps(IteratorLengths(lengths.tolist()), cfg, 200))
    assert _ids(again) == ids


def test_resume_is_exact_at_the_same_shape_and_exactly_once_at_another() -> None:
    lengths = _lengths(2000, 1)
    cfg = PlanConfig(strategy="packed", budget=1024, world_size=2, grad_accum=2, seed=5)
    src = ArrayLengths(lengths)
    whole = list(window_steps(src, cfg, 240))
    head = []
    for st in window_steps(src, cfg, 240):
        head.append(st)
        if len(head) == 7:
            break
    state = json.loads(json.dumps(head[-1].state_after.to_state()))
    loaded = WindowState.from_state(state)
    rest = list(window_steps(src, cfg, 240, state=loaded))
    assert [(s.index, [m.tolist() for m in s.micro]) for s in head + rest] == [
        (s.index, [m.tolist() for m in s.micro]) for s in whole
    ]
    wider = cfg.with_(world_size=4, grad_accum=1)
    more = list(window_steps(src, wider, 240, state=loaded))
    ids = _ids(head) + _ids(more)
    assert sorted(ids) == list(range(lengths.shape[0]))  # every sample once across the two shapes
    assert more[0].index == 7 and all(len(s.micro) == 4 for s in more)
    # the state is O(window): never more samples than the window holds
    assert all(s.state_after.ids.shape[0] <= 240 for s in whole)


def test_an_iterator_cannot_be_resumed_exactly() -> None:
    lengths = _lengths(600)
    cfg = PlanConfig(strategy="packed", budget=1024, world_size=1, grad_accum=2)
    state = next(s.state_after for s in window_steps(ArrayLengths(lengths), cfg, 100) if s.state_after.read)
    it = IteratorLengths(iter(lengths.tolist()), name="tokenizer")
    with pytest.raises(ConfigError, match="source 'tokenizer' cannot seek"):
        list(window_steps(it, cfg, 100, state=state))


def test_bad_windows_are_one_line() -> None:
    cfg = PlanConfig(strategy="packed", budget=1024, world_size=4, grad_accum=2)
    with pytest.raises(ConfigError, match="fewer than two steps"):
        next(iter(window_steps(ArrayLengths(_lengths()), cfg, 10)))
    with pytest.raises(ConfigError, match="length must be >= 1"):
        list(window_steps(ArrayLengths(np.array([5, 0, 3] * 20)), cfg.with_(world_size=1), 30))
    assert window_for_steps(2, cfg, 512.0) == 2 * 8 * 2


def test_parquet_shards_stream_in_order_and_seek(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    lengths = _lengths(900, 4)
    files = []
    for j, (a, b) in enumerate(((0, 250), (250, 610), (610, 900))):
        f = tmp_path / f"shard{j}.parquet"
        pq.write_table(pa.table({"length": lengths[a:b]}), f, row_group_size=64)
        files.append(str(f))
    src = ParquetLengths(files)
    assert np.array_equal(src.read(0, 900), lengths)
    assert np.array_equal(src.read(230, 400), lengths[230:630])  # across shards and row groups
    assert src.read(890, 50).tolist() == lengths[890:].tolist() and src.read(900, 5).shape == (0,)
    cfg = PlanConfig(strategy="packed", budget=1024, world_size=2, grad_accum=2, seed=1)
    whole = list(window_steps(ArrayLengths(lengths), cfg, 120))
    from_shards = list(window_steps(src, cfg, 120))
    assert _ids(from_shards) == _ids(whole)
    state = whole[9].state_after  # resumed over the shards: the rest of the same plan
    rest = list(window_steps(ParquetLengths(files), cfg, 120, state=state))
    assert _ids(whole[:10]) + _ids(rest) == _ids(whole)
