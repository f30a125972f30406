"""Shapes a compiler keeps (``PlanConfig(shapes=...)``): every collated row length (padded, packed, SP/CP,
drafter) is one of the declared set, and what the collators compute is what the plan's metrics count."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree import ConfigError, PlanConfig, make_plan
from padfree.core.shard import Shard, geometric_shapes
from padfree.torch import PackCollator, PadCollator, PlanBatchSampler, PlannedDataset

BUDGET = 512


def _allowed(shard: Shard, cap: int) -> set[int]:
    if isinstance(shard.shapes, tuple):
        return set(shard.shapes)
    return set(range(shard.step, cap + 1, shard.step))


def _declared(kind: str, grain: int, ratio: float, shard: Shard) -> int | tuple[int, ...]:
    if kind == "grain":
        return grain
    return geometric_shapes(32, shard.group * BUDGET, ratio, multiple=shard.row_multiple)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 700), min_size=5, max_size=120),
    strategy=st.sampled_from(["packed", "bucketed", "sorted", "random"]),
    degrees=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)]),
    kind=st.sampled_from(["grain", "ladder"]),
    grain=st.sampled_from([16, 48, 100]),
    ratio=st.sampled_from([1.5, 2.0]),
    seed=st.integers(0, 3),
)
def test_every_collated_row_length_is_a_declared_shape(lengths, strategy, degrees, kind, grain, ratio, seed):
    sp, cp = degrees
    packed = strategy == "packed"
    if not packed and cp > 1:
        cp = 1  # padded rows are sharded by SP only
    base = Shard(sp, cp)
    shapes = _declared(kind, grain, ratio, base)
    cfg = PlanConfig(
        strategy=strategy, budget=BUDGET, sp=sp, cp=cp, shapes=shapes, overlong="truncate", seed=seed
    )
    shard = cfg.shard
    cap = shard.capacity(BUDGET)
    allowed = _allowed(shard, cap)
    lens = np.array(lengths, dtype=np.int64)
    data = [{"input_ids": np.arange(1, n + 1)} for n in lens]
    collate = PackCollator(sp=sp, cp=cp, shapes=shapes) if packed else PadCollator(shapes=shapes)
    plan = make_plan(lens, cfg, 0)
    slots = plan.shapes().slots
    ds = PlannedDataset(data)
    for k, mb in enumerate(PlanBatchSampler(lens, cfg)):
        batch = collate(ds.__getitems__(mb))
        rows, width = batch["input_ids"].shape
        assert width in allowed, (width, sorted(allowed)[:10])
        assert rows * width == slots[k]  # the metrics count every pad the collator computes
        if packed:
            assert int(batch["cu_seq_lens_q_padded" if sp * cp > 1 else "cu_seq_lens_q"][-1]) == width


@pytest.mark.filterwarnings("ignore:padfree. a micro-batch reached")
def test_shapes_off_leaves_configs_and_rows_as_they_were() -> None:
    cfg = PlanConfig(strategy="packed", budget=BUDGET)
    assert "shapes" not in cfg.to_dict() and not cfg.shard.pads
    b = PackCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    assert b["input_ids"].shape == (1, 5)
    b = PackCollator(shapes=8)([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    assert b["input_ids"].shape == (1, 8) and b["labels"][0, 5:].eq(-100).all()
    assert b["cu_seq_lens_q"].tolist() == [0, 3, 8] and b.tokens == 5


def test_padding_from_shapes_counts_in_the_metrics_and_caps_rows() -> None:
    rng = np.random.default_rng(0)
    lens = rng.integers(20, 500, 400)
    off = make_plan(lens, PlanConfig(strategy="packed", budget=1000), 0)
    on = make_plan(lens, PlanConfig(strategy="packed", budget=1000, shapes=(256, 512, 768)), 0)
    assert on.shapes().slots.sum() > on.shapes().real.sum() == off.shapes().real.sum()
    assert set(on.shapes().slots.tolist()) <= {256.0, 512.0, 768.0}  # 768: the largest shape within 1000
    assert on.shapes().real.max() <= 768


@pytest.mark.parametrize(
    ("kw", "rule"),
    [
        ({"shapes": (101, 300), "sp": 2}, "shape 101 is not a multiple of the SP/CP row multiple 2"),
        ({"shapes": (2000,)}, "smallest shape 2000 is over the row capacity"),
        ({"shapes": 0}, "granularity from 1"),
        ({"shapes": "512"}, "shapes must be None"),
        ({"shapes": 64, "strategy": "chunked"}, "chunked strategy is not planned with shapes"),
        ({"shapes": 64, "attn_budget": 10_000}, "shapes with attn_budget"),
    ],
)
def test_bad_shapes_are_one_config_error(kw, rule) -> None:
    with pytest.raises(ConfigError, match=rule):
        PlanConfig(**{"strategy": "packed", "budget": 1000, **kw})


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 300), min_size=3, max_size=40),
    layout=st.sampled_from(["packed", "padded"]),
    shapes=st.sampled_from([64, (128, 256, 512)]),
    anchor_shapes=st.sampled_from([8, (4, 16, 64, 256)]),
)
def test_drafter_rows_and_anchor_widths_are_declared_shapes(lengths, layout, shapes, anchor_shapes):
    from padfree.core.anchors import AnchorPolicy
    from padfree.drafter.collate import DrafterCollator

    strategy = "packed" if layout == "packed" else "bucketed"
    cfg = PlanConfig(strategy=strategy, budget=BUDGET, shapes=shapes, seed=1)
    lens = np.array(lengths, dtype=np.int64)
    data = [{"input_ids": np.arange(2, n + 2), "loss_mask": np.ones(n, np.int64)} for n in lens]
    col = DrafterCollator("dflash", AnchorPolicy(block_size=4, density=0.5), layout=layout, mask_token_id=1,
                          shapes=shapes, anchor_shapes=anchor_shapes)  # fmt: skip
    bare = DrafterCollator("dflash", AnchorPolicy(block_size=4, density=0.5), layout=layout, mask_token_id=1)
    row_ok = _allowed(cfg.shard, cfg.shard.capacity(BUDGET))
    anchor_ok = set(anchor_shapes) if isinstance(anchor_shapes, tuple) else set(range(8, 4096, 8))
    slots = make_plan(lens, cfg, 0).shapes().slots
    ds = PlannedDataset(data)
    for k, mb in enumerate(PlanBatchSampler(lens, cfg)):
        b = col(ds.__getitems__(mb))
        c = b.contract
        assert c is not None
        assert int(c.input_ids.shape[1]) in row_ok and c.width == slots[k]
        segs = c.segments()  # still every position, the shapes tail included
        assert sum(s.stop - s.start for s in segs) == c.width
        blocks = int(b.fields.anchors.shape[0])
        per_row = blocks // (c.n_docs if layout == "padded" else 1)
        assert per_row in anchor_ok and blocks == per_row * (c.n_docs if layout == "padded" else 1)
        plain = bare(
            ds.__getitems__(mb)
        )  # the same anchors without anchor_shapes: the extra blocks add no loss
        assert int(b.fields.supervised.sum()) == int(plain.fields.supervised.sum())


def test_cli_shapes_option(tmp_path, capsys) -> None:
    from padfree.cli import main

    lens = tmp_path / "l.npy"
    np.save(lens, np.random.default_rng(0).integers(20, 900, 300))
    out = tmp_path / "p.jsonl"
    argv = ["plan", str(lens), "--strategy", "packed", "--budget", "2048", "--world-size", "1"]
    assert main([*argv, "--shapes", "512,1024,2048", "--out", str(out)]) == 0
    capsys.readouterr()
    pads = []
    for extra in ([], ["--shapes", "512,1024,2048"]):  # the report counts the shapes' padding
        assert main(["analyze", str(lens), "--budget", "2048", "--world-size", "1", *extra]) == 0
        row = next(x for x in capsys.readouterr().out.splitlines() if "padding efficiency" in x)
        pads.append(float(row.strip(" │|").split()[-1]))
    assert pads[0] == 1.0 and pads[1] < 0.99  # the packed column
    assert main([*argv, "--shapes", "big", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--shapes" in err[0] and "comma-separated" in err[0]
    assert main([*argv, "--shapes", "4096", "--out", str(out)]) == 2
    assert "over the row capacity" in capsys.readouterr().err
