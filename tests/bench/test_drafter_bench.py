"""The drafter speed benchmark's pieces: every arm covers each sample once within its budget, SpecForge's and
speculators' anchor-slot padding changes no loss, coverage is the same packed as alone (and per row, not per
document, with speculators' row-level anchors), and ``drafter_speed.py --quick`` writes the JSON the issue
names."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lab.drafter import (  # noqa: E402
    ARMS,
    SHARE_GRID,
    arm_shapes,
    as_trained,
    auto_share,
    bench_models,
    collator,
    cost_folded_imbalance,
    coverage,
    epoch_rate,
    items_of,
    make_arms,
    modeled_imbalance,
    sample_anchors,
    speed,
    supervised_after_first,
)
from padfree.baselines import samples_per_batch  # noqa: E402
from padfree.bench.measure import covers_each_once  # noqa: E402
from padfree.core.anchors import valid_anchor_positions  # noqa: E402
from padfree.core.config import CostModel  # noqa: E402
from padfree.core.cost import micro_shapes  # noqa: E402
from padfree.drafter import recipes  # noqa: E402
from padfree.drafter.methods import cost_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "fixtures"
DFLASH = recipes.override(recipes.get("specforge", "dflash"), block_size=4)
EAGLE3 = recipes.override(recipes.get("specforge", "eagle3"), ttt=2)
POLICY = DFLASH.anchor_policy()
FILES = [str(FIX / "samples/gsm8k.jsonl.gz"), str(FIX / "samples/hh_rlhf_harmless_test.jsonl.gz")]
TOKENIZER = str(FIX / "tokenizers/llama_sp32k.model")


@pytest.fixture(scope="module")
def samples():
    from padfree.data.samples import load_samples

    got = load_samples(FILES, TOKENIZER, None, "assistant", 256, per_file=20)
    return [
        {"input_ids": np.asarray(s["input_ids"]) % 256, "loss_mask": np.asarray(s["loss_mask"])} for s in got
    ]


def lengths_of(samples):
    return np.array([len(s["input_ids"]) for s in samples])


def test_arms_cover_every_sample_once_within_budget(samples):
    lengths = lengths_of(samples)
    anchors = sample_anchors(samples, POLICY)
    cost = cost_model("dflash", hidden=32, layers=2, vocab=256, block_size=4)
    arms = make_arms(lengths, anchors, 512, 0, cost, world_size=2, anchor_budget=256)
    assert set(arms) == set(ARMS)
    for name, arm in arms.items():
        b = arm.batching
        if name == "speculators_rows":  # a trailing odd row is left out when dealt to 2 ranks
            assert b.order.shape[0] >= lengths.shape[0] - int(np.diff(b.offsets).max())
        else:
            assert covers_each_once(b, lengths.shape[0]), name
        sh = micro_shapes(lengths[b.order], b.offsets, b.packed, anchors[b.order])
        if name not in ("specforge_random", "sorted_fixed"):  # a fixed sample count may exceed the budget
            assert sh.slots.max() <= 512, name
        if name.startswith("padfree"):  # padfree's plans hold the anchor budget too
            assert sh.blocks.max() <= 256, name
        assert modeled_imbalance(arm, lengths, anchors, 2, cost) >= 1.0
    assert arms["speculators_rows"].leaky and arms["speculators_rows"].layout == "packed"


def test_sorted_fixed_is_length_sorted_with_a_fixed_count(samples):
    lengths = lengths_of(samples)
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


@pytest.mark.parametrize("name", ["specforge_random", "speculators_rows"])
def test_anchor_slot_padding_changes_no_loss(samples, name):
    """SpecForge's padded block tensor (every row to the batch's most anchors) and speculators' fixed
    ``max_anchors`` anchor tensor add computed blocks that change no document's loss."""
    from padfree.drafter.target import run_target
    from padfree.drafter.train import loss_sums

    recipe = DFLASH
    models = bench_models("dflash", vocab=256, hidden=32, layers=2, intermediate=64, recipe=recipe)
    arm = make_arms(lengths_of(samples), sample_anchors(samples, POLICY), 512, 0, CostModel())[name]
    b = arm.batching
    j = int(np.argmax(np.diff(b.offsets)))  # the micro-batch with the most rows / documents
    plain = collator("dflash", arm, recipe, 0)(items_of(samples, b.order[b.offsets[j] : b.offsets[j + 1]]))
    if arm.leaky:
        plain = plain.keep_own_document()
        assert plain.fields.anchors.shape[0] < 512  # a row of 512 tokens has fewer valid positions
    padded = as_trained(plain, arm)
    n = padded.fields.anchors.shape[0]
    if arm.leaky:
        assert n == 512  # speculators' anchor tensor is max_anchors wide
    else:
        rows, most = len(plain.fields.anchors_by_doc), max(len(a) for a in plain.fields.anchors_by_doc)
        assert n == rows * most
    assert n > plain.fields.anchors.shape[0] and padded.positions == plain.positions
    with torch.no_grad():
        out = run_target(models.target, plain.contract, models.layers)
        num, den = loss_sums(models, plain, out=out)
        num2, den2 = loss_sums(models, padded, out=out)
    assert torch.equal(den, den2)
    torch.testing.assert_close(num, num2, rtol=1e-5, atol=1e-6)


def test_coverage_same_packed_as_alone_and_per_row_for_speculators(samples):
    recipe = recipes.override(DFLASH, max_anchors=24)  # a cap a packed row of several documents exceeds
    lengths = lengths_of(samples)
    arms = make_arms(lengths, sample_anchors(samples, recipe.anchor_policy()), 512, 0, CostModel())
    packed = coverage("dflash", arms["padfree_packed"], samples, recipe, seed=0)
    padded = coverage("dflash", arms["sorted_budget"], samples, recipe, seed=0)
    rows = coverage("dflash", arms["speculators_rows"], samples, recipe, seed=0)
    assert packed["same_as_alone"] and padded["same_as_alone"]
    assert packed["anchor_coverage"] == padded["anchor_coverage"] > 0
    assert not rows["same_as_alone"]
    assert rows["anchor_coverage"] < packed["anchor_coverage"]
    # speculators' quota is the row's: min(valid positions of the row, cap), valid = mask[a] before the row's
    # last block, whatever the documents; per document it would be the sum of each document's quota
    arm = arms["speculators_rows"]
    b = arm.batching
    col = collator("dflash", arm, recipe, 0)
    differs = 0
    for j in range(b.n_micro):
        ids = b.order[b.offsets[j] : b.offsets[j + 1]]
        batch = col(items_of(samples, ids))
        mask = np.concatenate([samples[int(i)]["loss_mask"] for i in ids]).astype(bool)
        valid = int(mask[: max(0, mask.shape[0] - recipe.block_size)].sum())
        assert batch.fields.anchors.shape[0] == min(valid, recipe.max_anchors)
        per_doc = sample_anchors([samples[int(i)] for i in ids], recipe.anchor_policy()).sum()
        differs += int(per_doc != batch.fields.anchors.shape[0])
    assert differs > b.n_micro // 2


def test_anchor_slot_efficiency(samples):
    lengths = lengths_of(samples)
    anchors = sample_anchors(samples, POLICY)
    arms = make_arms(lengths, anchors, 512, 0, CostModel())
    eff = {
        n: coverage("dflash", a, samples, DFLASH, seed=0)["anchor_slot_efficiency"] for n, a in arms.items()
    }
    assert eff["padfree_packed"] == 1.0
    for name in ("specforge_random", "sorted_fixed"):  # SpecForge's width: the batch's most anchors a row
        b = arms[name].batching
        sh = micro_shapes(lengths[b.order], b.offsets, False, anchors[b.order])
        assert eff[name] == pytest.approx(sh.anchors.sum() / sh.blocks.sum()) and eff[name] < 1.0
    assert eff["specforge_random"] < eff["sorted_fixed"]
    rows = arms["speculators_rows"]
    sh = arm_shapes(rows, lengths, anchors, DFLASH.max_anchors)
    assert sh.blocks.sum() == DFLASH.max_anchors * rows.batching.n_micro
    assert 0 < eff["speculators_rows"] < 1.0  # 512-wide rows of fewer valid positions
    # EAGLE-3 has no anchors: the per-position analogue, real query slots / computed = token padding eff.
    e = make_arms(lengths, np.zeros_like(lengths), 512, 0, CostModel())
    for name in ("padfree_packed", "specforge_random"):
        b = e[name].batching
        sh = micro_shapes(lengths[b.order], b.offsets, b.packed)
        got = coverage("eagle3", e[name], samples, EAGLE3, seed=0)["anchor_slot_efficiency"]
        assert got == pytest.approx(sh.real.sum() / sh.slots.sum())


def test_seed_mix_anchors_and_the_cost_folded_what_if():
    pol = recipes.get("specforge", "dflash").anchor_policy()
    lengths = np.random.default_rng(0).integers(2, 3000, 2000)
    a = supervised_after_first(lengths, pol)
    masks = [np.arange(n) > 0 for n in lengths[:50]]
    assert a[:50].tolist() == [min(len(valid_anchor_positions(m, 16)), 512) for m in masks]
    cost = cost_model("dflash", hidden=4096, layers=32, vocab=128256)
    arms = make_arms(lengths, a, 16384, 0, cost, world_size=8)
    imb, n_micro = cost_folded_imbalance(lengths, a, 16384, 8, cost)
    assert n_micro > arms["padfree_packed"].batching.n_micro
    assert imb < modeled_imbalance(arms["padfree_packed"], lengths, a, 8, cost)


def test_auto_anchor_share_is_the_least_imbalanced_on_the_grid():
    lengths = np.random.default_rng(1).integers(2, 3000, 3000)
    a = supervised_after_first(lengths, recipes.get("specforge", "dflash").anchor_policy())
    cost = cost_model("dflash", hidden=4096, layers=32, vocab=128256)
    share, tried = auto_share(lengths, a, 4096, 4, cost)
    assert list(tried) == list(SHARE_GRID) and tried[share] == min(tried.values())
    arms = make_arms(lengths, a, 4096, 0, cost, world_size=4, anchor_budget=max(512, round(4096 * share)))
    assert modeled_imbalance(arms["padfree_packed"], lengths, a, 4, cost) == pytest.approx(tried[share])
    assert len(set(tried.values())) > 1  # the share moves the plan: the choice is not a tie


def test_speed_counts_supervised_positions(samples):
    lengths = lengths_of(samples)
    arms = make_arms(lengths, np.zeros_like(lengths), 512, 0, CostModel())
    arms = {k: arms[k] for k in ("padfree_packed", "specforge_random", "speculators_rows")}
    models = bench_models("eagle3", vocab=256, hidden=32, layers=2, intermediate=64, recipe=EAGLE3)
    rows = speed("eagle3", arms, samples, models, micro=2, seed=0, rounds_warmup=0)
    for r in rows.values():
        assert r["draft_positions"] > 0 and r["cpu_seconds"] > 0 and r["draft_pos_per_s"] > 0
    assert rows["padfree_packed"]["padding_efficiency"] == 1.0
    assert rows["specforge_random"]["padding_efficiency"] < 1.0


def test_speed_with_cost_times_the_stratified_micro_batches(samples):
    lengths = lengths_of(samples)
    anchors = sample_anchors(samples, POLICY)
    arms = make_arms(lengths, anchors, 512, 0, CostModel())
    arms = {k: arms[k] for k in ("sorted_fixed",)}
    models = bench_models("dflash", vocab=256, hidden=32, layers=2, intermediate=64, recipe=DFLASH)
    rows = speed("dflash", arms, samples, models, micro=3, seed=0, rounds_warmup=0, cost=CostModel(),
                 anchors=anchors)  # fmt: skip
    b = arms["sorted_fixed"].batching
    row = rows["sorted_fixed"]
    assert row["micro_batches"] == min(3, b.n_micro) < b.n_micro
    assert row["draft_positions"] > 0 and row["epoch_cpu_seconds"] > row["cpu_seconds"]
    assert 0 < row["epoch_padding_efficiency"] < 1
    cov = coverage("dflash", arms["sorted_fixed"], samples, DFLASH, seed=0)
    assert cov["epoch_draft_positions"] > row["draft_positions"]
    both = epoch_rate({**row, **cov})
    assert both["sampled_pos_per_s"] == row["draft_pos_per_s"]
    assert both["draft_pos_per_s"] == cov["epoch_draft_positions"] / row["epoch_cpu_seconds"]
    assert epoch_rate({"draft_pos_per_s": 1.0}) == {"draft_pos_per_s": 1.0}  # no estimate: unchanged


def test_speed_times_every_micro_batch_once_each_when_micro_covers_the_epoch(samples):
    lengths = lengths_of(samples)
    anchors = sample_anchors(samples, POLICY)
    arms = make_arms(lengths, anchors, 512, 0, CostModel())
    few, most = (
        min(arms, key=lambda k: arms[k].batching.n_micro),
        max(arms, key=lambda k: arms[k].batching.n_micro),
    )
    arms = {k: arms[k] for k in (few, most)}
    n = {k: a.batching.n_micro for k, a in arms.items()}
    assert n[few] < n[most]
    models = bench_models("dflash", vocab=256, hidden=32, layers=2, intermediate=64, recipe=DFLASH)
    rows = speed("dflash", arms, samples, models, micro=10_000, seed=0, rounds_warmup=0, cost=CostModel(),
                 anchors=anchors)  # fmt: skip
    for k, row in rows.items():
        assert row["micro_batches"] == n[k]
    once = rows[most]  # every micro-batch timed once: the epoch's seconds are the ones timed
    assert once["epoch_cpu_seconds"] == pytest.approx(once["cpu_seconds"])
    again = rows[few]  # its micro-batches timed again while the other arm's rounds go on, averaged
    assert again["epoch_cpu_seconds"] < again["cpu_seconds"]


def test_quick_run_writes_the_issue_json(tmp_path):
    spec = importlib.util.spec_from_file_location("drafter_speed", ROOT / "benchmarks/drafter_speed.py")
    assert spec is not None and spec.loader is not None
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    lengths = tmp_path / "lengths.npy"
    np.save(lengths, np.random.default_rng(0).integers(2, 1024, 400))
    argv = ["--quick", "--out", str(tmp_path), "--data", *FILES, "--tokenizer", TOKENIZER, "--per-file", "5",
            "--budget", "256", "--micro", "1", "--vocab", "256", "--hidden", "32", "--layers", "2",
            "--block-size", "4", "--lengths", str(lengths), "--imbalance-budget", "1024",
            "--world", "2"]  # fmt: skip
    assert ds.main(argv) == 0
    got = json.loads((tmp_path / "drafter_speed_quick.json").read_text())
    assert got["recipe"] == "specforge"
    keys = {"draft_pos_per_s", "anchor_coverage", "imbalance", "same_as_alone", "anchor_slot_efficiency"}
    for method in ("dflash", "eagle3"):
        rows = got["method"][method]
        assert {"padfree_packed", "specforge_random", "sorted_fixed", "speculators_rows"} <= set(rows)
        for arm in rows.values():
            assert keys <= set(arm)
        assert (
            rows["padfree_packed"]["anchor_slot_efficiency"] == 1.0
            and rows["padfree_packed"]["same_as_alone"]
        )
    assert not got["method"]["dflash"]["speculators_rows"]["same_as_alone"]  # anchors per row
    share = got["recipes"]["dflash"]["anchor_share"]  # --anchor-share auto, the default
    assert share["share"] in SHARE_GRID and share["imbalance_by_share"][f"{share['share']:.2f}"] == min(
        share["imbalance_by_share"].values()
    )
    assert got["recipes"]["eagle3"]["anchor_share"]["share"] is None
    assert (tmp_path / "drafter_speed_quick.md").read_text().startswith("# drafter_speed_quick")
