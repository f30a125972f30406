"""The drafter memory model: its fit recovers known coefficients, a memory budget bounds every micro-batch a
plan makes, and the analytic model tracks the peak a real micro-batch takes on this CPU (the loss is chunked,
so the vocabulary's logits never exist for every draft position at once)."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import HANG_S

from padfree import PlanConfig, make_plan
from padfree.core.cost import micro_shapes
from padfree.drafter import memory
from padfree.drafter.methods.dflash.spec import memory_terms as dflash_memory
from padfree.drafter.methods.eagle3.spec import memory_terms as eagle3_memory
from padfree.drafter.sizes import Sizes


def test_fit_recovers_known_coefficients():
    truth = memory.MemoryModel(fixed=5e6, per_token=2e3, per_block=7e4, per_reach=9e2)
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(12):
        slots, blocks = rng.integers(100, 4000), rng.integers(1, 600)
        reach = blocks * rng.integers(50, 2000)
        rows.append({"slots": slots, "blocks": blocks, "reach": reach, "attention": 0, "bytes": 0.0})
        rows[-1]["bytes"] = float(truth.peak_of(slots=slots, blocks=blocks, reach=reach))
    got = memory.fit(rows)
    for name in ("fixed", "per_token", "per_block", "per_reach"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6)


def test_a_memory_budget_bounds_every_micro_batch_of_a_plan():
    model = dflash_memory(Sizes(hidden=256, heads=4, kv_heads=1, intermediate=768, vocab=32000))
    lengths = np.random.default_rng(1).integers(20, 2000, 3000)
    anchors = np.minimum(lengths - 1, 512)
    limit = 3 * 2**30
    budget = memory.anchor_budget(model, limit, 4096)
    for strategy in ("packed", "bucketed", "sorted"):
        cfg = PlanConfig(strategy=strategy, budget=4096, anchor_budget=budget, world_size=2)
        plan = make_plan(lengths, cfg, 0, anchors=anchors)
        shapes = micro_shapes(plan.lengths, plan.offsets, plan.config.packed, plan.anchors)
        assert model.micro_bytes(shapes).max() <= limit, strategy
    unbounded = make_plan(lengths, PlanConfig(strategy="packed", budget=4096), 0, anchors=anchors)
    shapes = micro_shapes(unbounded.lengths, unbounded.offsets, True, unbounded.anchors)
    assert model.micro_bytes(shapes).max() > limit  # the bound is what kept the plan under it
    with pytest.raises(Exception, match="cannot hold one micro-batch"):
        memory.anchor_budget(model, 0.1 * 2**30, 4096)


_MEASURE = """
import ctypes, gc, json, sys
import numpy as np
import torch
from padfree.core.cost import micro_shapes
from padfree.drafter import proc
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.train import build_models, loss_sums, memory_model

method = sys.argv[1]
torch.set_num_threads(1)
vocab = 16000
models = build_models(method, vocab=vocab, seed=0, ttt=3)
col = DrafterCollator(method, recipe=models.recipe, mask_token_id=1)
g = np.random.default_rng(0)
n, length = 2, 768
items = [{"input_ids": g.integers(2, vocab, length), "loss_mask": np.ones(length, bool), "sample_id": i}
         for i in range(n)]
batch = col(items)
for _ in range(2):  # the first pass allocates what stays (autograd's buffers, the allocator's arenas)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = proc.resident_bytes()
    proc.reset_peak()
    num, den = loss_sums(models, batch)
    (num.sum() / den.sum()).backward()
    models.drafter.zero_grad(set_to_none=True)
    del num, den
    peak = proc.peak_resident_bytes() - base
anchors = np.array([len(a) for a in batch.anchors_by_doc()]) if models.method.uses_anchors else None
shapes = micro_shapes(np.full(n, length), np.array([0, n]), True, anchors)
print(json.dumps({"predicted": float(memory_model(models).micro_bytes(shapes)[0]), "peak": float(peak)}))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the resident high-water mark in /proc"
)
@pytest.mark.parametrize("method", ["dflash", "eagle3", "mtp"])
def test_analytic_model_tracks_a_measured_micro_batch_peak(method):
    """One packed micro-batch at the recipe's density with a 16K vocabulary: the peak it adds to the process
    (``VmHWM`` reset before it, freed heap returned first) is within the analytic model's reach. Measured in
    a fresh process: what earlier tests left in this one's heap (arenas the allocator reuses) would hide part
    of the peak."""
    pytest.importorskip("torch")
    res = subprocess.run(
        [sys.executable, "-c", _MEASURE, method], capture_output=True, text=True, timeout=HANG_S
    )
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    predicted, peak = got["predicted"], got["peak"]
    assert 0.6 < predicted / peak < 1.7, (predicted / 2**20, peak / 2**20)


def test_an_eagle3_memory_bound_keeps_packed_rows_near_the_budget_and_within_memory():
    """Issue 33 item 6: padfree's EAGLE-3 drafter attends document by document on a packed row, and the memory
    model prices it so (``micro_shapes``: the documents' l x l); the plan bound used one T x T over the whole
    row, which cut a 2,048-token budget to rows of ~sqrt(attn_budget) tokens. Per document, rows fill the
    budget with short documents, every row stays within the memory, and only documents too long for it alone
    are cut (at the cap the plan reports)."""
    from padfree.core.budget import Budget
    from padfree.core.capacity import attention_cap

    model = eagle3_memory(Sizes(hidden=64, heads=4, kv_heads=1, intermediate=256, vocab=2048), ttt=7)
    lengths = np.random.default_rng(2).lognormal(5.5, 0.9, 4000).astype(np.int64) + 2  # chat-like
    budget, limit = 2048, 0.4 * 2**30
    attn = memory.attention_budget(model, limit, budget)
    row_wide = PlanConfig(
        strategy="packed", budget=budget, attn_budget=attn, attn_extra=6, overlong="truncate"
    )
    per_doc = row_wide.with_(attn_per_document=True)
    cap = attention_cap(per_doc)
    assert cap < budget // 2  # this memory cannot hold one document of the budget's length
    assert Budget.of(per_doc).item == cap and Budget.of(per_doc).cap == budget
    plan = make_plan(lengths, per_doc, 0)
    shapes = micro_shapes(plan.lengths, plan.offsets, True, None)
    assert model.micro_bytes(shapes).max() <= limit
    assert plan.lengths.max() == cap and (plan.lengths <= cap).all()  # documents cut at the cap said
    per_row = np.add.reduceat(plan.lengths, plan.offsets[:-1])
    old = make_plan(lengths, row_wide, 0)
    assert np.add.reduceat(old.lengths, old.offsets[:-1]).max() <= cap  # rows cut to the cap before
    assert np.median(per_row) > 1.5 * cap and plan.n_micro < old.n_micro / 1.5
