"""The drafter speed benchmark's pieces: every arm covers each sample once within its budget, SpecForge-style
block padding changes no loss, coverage is the same packed as alone (and not with row-level anchors)."""

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from padfree.baselines import samples_per_batch  # noqa: E402
from padfree.bench.drafter import (  # noqa: E402
    ARMS,
    bench_models,
    collator,
    coverage,
    epoch_rate,
    items_of,
    make_arms,
    modeled_imbalance,
    sample_anchors,
    speed,
)
from padfree.bench.measure import covers_each_once  # noqa: E402
from padfree.core.anchors import AnchorPolicy  # noqa: E402
from padfree.core.config import CostModel  # noqa: E402
from padfree.core.cost import micro_shapes  # noqa: E402
from padfree.drafter.dflash import pad_anchor_slots  # noqa: E402
from padfree.drafter.methods import cost_model  # noqa: E402

FIX = Path(__file__).resolve().parents[2] / "fixtures"
POLICY = AnchorPolicy(block_size=4)


@pytest.fixture(scope="module")
def samples():
    from padfree.data.samples import load_samples

    got = load_samples(
        [str(FIX / "samples/gsm8k.jsonl.gz"), str(FIX / "samples/hh_rlhf_harmless_test.jsonl.gz")],
        str(FIX / "tokenizers/llama_sp32k.model"),
        None,
        "assistant",
        256,
        per_file=20,
    )
    return [
        {"input_ids": np.asarray(s["input_ids"]) % 256, "loss_mask": np.asarray(s["loss_mask"])} for s in got
    ]


def test_arms_cover_every_sample_once_within_budget(samples):
    lengths = np.array([len(s["input_ids"]) for s in samples])
    anchors = sample_anchors(samples, POLICY)
    cost = cost_model("dflash", hidden=32, layers=2, vocab=256, block_size=4)
    arms = make_arms(lengths, anchors, 512, 0, cost, world_size=2)
    assert set(arms) == set(ARMS)
    for name, arm in arms.items():
        b = arm.batching
        if name == "multipack_row_anchors":  # a trailing odd row is left out when dealt to 2 ranks
            assert b.order.shape[0] >= lengths.shape[0] - int(np.diff(b.offsets).max())
        else:
            assert covers_each_once(b, lengths.shape[0]), name
        sh = micro_shapes(lengths[b.order], b.offsets, b.packed)
        if name not in ("specforge_random", "sorted_fixed"):  # a fixed sample count may exceed the budget
            assert sh.slots.max() <= 512, name
        assert modeled_imbalance(arm, lengths, anchors, 2, cost) >= 1.0


def test_sorted_fixed_is_length_sorted_with_a_fixed_count(samples):
    lengths = np.array([len(s["input_ids"]) for s in samples])
    arms = make_arms(lengths, sample_anchors(samples, POLICY), 512, 0, CostModel())
    count = samples_per_batch(lengths, 512)
    assert count == 512 // lengths.mean() and count > 1
    for name in ("sorted_fixed", "specforge_random"):
        sizes = np.diff(arms[name].batching.offsets)
        assert (sizes[sizes != count].shape[0] <= 1) and sizes.sum() == lengths.shape[0], name
    b = arms["sorted_fixed"].batching
    lo = np.array([lengths[b.order[a:z]].min() for a, z in zip(b.offsets[:-1], b.offsets[1:])])
    hi = np.array([lengths[b.order[a:z]].max() for a, z in zip(b.offsets[:-1], b.offsets[1:])])
    k = np.argsort(lo, kind="stable")
    assert np.all(hi[k][:-1] <= lo[k][1:])  # batches are disjoint length ranges: a global sort
    assert not np.all(np.diff(lo) >= 0)  # ... dealt in random order
    padded = micro_shapes(lengths[b.order], b.offsets, False).slots.sum()
    rand = arms["specforge_random"].batching
    assert padded < micro_shapes(lengths[rand.order], rand.offsets, False).slots.sum()


def test_padding_blocks_changes_no_loss(samples):
    from padfree.drafter.target import run_target
    from padfree.drafter.train import loss_sums

    models = bench_models("dflash", vocab=256, hidden=32, layers=2, intermediate=64, block_size=4)
    lengths = np.array([len(s["input_ids"]) for s in samples])
    arms = make_arms(lengths, sample_anchors(samples, POLICY), 512, 0, CostModel())
    arm = arms["sorted_budget"]
    col = collator("dflash", arm, POLICY, 0, 7)
    b = arm.batching
    j = int(np.argmax(np.diff(b.offsets)))  # the micro-batch with the most rows
    batch = col(items_of(samples, b.order[b.offsets[j] : b.offsets[j + 1]]))
    padded = pad_anchor_slots(batch)
    n_rows, most = len(batch.fields.anchors_by_doc), max(len(a) for a in batch.fields.anchors_by_doc)
    assert padded.fields.anchors.shape[0] == n_rows * most > batch.fields.anchors.shape[0]
    with torch.no_grad():
        out = run_target(models.target, batch.contract, models.layers)
        num, den = loss_sums(models, batch, out=out)
        num2, den2 = loss_sums(models, padded, out=out)
    assert torch.equal(den, den2)
    torch.testing.assert_close(num, num2, rtol=1e-5, atol=1e-6)


def test_coverage_same_packed_as_alone_and_row_anchors_differ(samples):
    lengths = np.array([len(s["input_ids"]) for s in samples])
    arms = make_arms(lengths, sample_anchors(samples, POLICY), 512, 0, CostModel())
    packed = coverage("dflash", arms["padfree_packed"], samples, POLICY, seed=0, ttt=3)
    padded = coverage("dflash", arms["sorted_budget"], samples, POLICY, seed=0, ttt=3)
    rows = coverage("dflash", arms["multipack_row_anchors"], samples, POLICY, seed=0, ttt=3)
    assert packed["same_as_alone"] and padded["same_as_alone"]
    assert packed["anchor_coverage"] == padded["anchor_coverage"] > 0
    assert not rows["same_as_alone"]
    assert rows["anchor_coverage"] < packed["anchor_coverage"]


def test_speed_counts_supervised_positions(samples):
    lengths = np.array([len(s["input_ids"]) for s in samples])
    arms = make_arms(lengths, sample_anchors(samples, POLICY), 512, 0, CostModel())
    arms = {k: arms[k] for k in ("padfree_packed", "specforge_random")}
    models = bench_models("eagle3", vocab=256, hidden=32, layers=2, intermediate=64, ttt=2)
    rows = speed("eagle3", arms, samples, models, POLICY, micro=2, seed=0, ttt=2, rounds_warmup=0)
    for r in rows.values():
        assert r["draft_positions"] > 0 and r["cpu_seconds"] > 0 and r["draft_pos_per_s"] > 0
    assert rows["padfree_packed"]["padding_efficiency"] == 1.0
    assert rows["specforge_random"]["padding_efficiency"] < 1.0


def test_speed_with_cost_times_the_stratified_micro_batches(samples):
    lengths = np.array([len(s["input_ids"]) for s in samples])
    anchors = sample_anchors(samples, POLICY)
    arms = make_arms(lengths, anchors, 512, 0, CostModel())
    arms = {k: arms[k] for k in ("sorted_fixed",)}
    models = bench_models("dflash", vocab=256, hidden=32, layers=2, intermediate=64, block_size=4)
    rows = speed("dflash", arms, samples, models, POLICY, micro=3, seed=0, ttt=2, rounds_warmup=0,
                 cost=CostModel(), anchors=anchors)  # fmt: skip
    b = arms["sorted_fixed"].batching
    row = rows["sorted_fixed"]
    assert row["micro_batches"] == min(3, b.n_micro) < b.n_micro
    assert row["draft_positions"] > 0 and row["epoch_cpu_seconds"] > row["cpu_seconds"]
    assert 0 < row["epoch_padding_efficiency"] < 1
    cov = coverage("dflash", arms["sorted_fixed"], samples, POLICY, seed=0, ttt=2)
    assert cov["epoch_draft_positions"] > row["draft_positions"]
    both = epoch_rate({**row, **cov})
    assert both["sampled_pos_per_s"] == row["draft_pos_per_s"]
    assert both["draft_pos_per_s"] == cov["epoch_draft_positions"] / row["epoch_cpu_seconds"]
    assert epoch_rate({"draft_pos_per_s": 1.0}) == {"draft_pos_per_s": 1.0}  # no estimate: unchanged
