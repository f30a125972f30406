"""Drafter batches train each document as if it were alone: per-document anchors through padfree's sampler
at any world size and after a resume, and DFlash / EAGLE-3 losses and gradients (CPU, dense masks) of a
packed or padded row equal to those of each document alone; the row-level (leaky) construction differs."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree import PlanConfig
from padfree.core.anchors import AnchorPolicy, choose_anchors
from padfree.drafter import recipes
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.target import build_target, run_target
from padfree.drafter.train import build_models, loss_sums
from padfree.errors import ConfigError
from padfree.torch import PlanBatchSampler, PlannedDataset

V = 97
POLICY = AnchorPolicy(block_size=4, density=0.25)


def dataset(lens, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, V - 1, n), "loss_mask": rng.random(n) < 0.7} for n in lens]


def anchors_seen(ds, cfg, world, epoch=0, layout="packed"):
    """Each sample's anchors (relative to the sample) as the collators of ``world`` ranks build them."""
    lengths = np.array([len(x["input_ids"]) for x in ds])
    col = DrafterCollator("dflash", POLICY, seed=11, layout=layout, mask_token_id=V - 1)
    seen = {}
    for rank in range(world):
        sampler = PlanBatchSampler(lengths, cfg, rank=rank, world_size=world, epoch=epoch)
        for mb in sampler:
            b = col(PlannedDataset(ds).__getitems__(mb))
            for sid, a in zip(b.contract.sample_ids, b.fields.anchors_by_doc, strict=True):
                assert sid not in seen
                seen[sid] = a
    return seen


@settings(max_examples=10, deadline=None)
@given(
    st.lists(st.integers(1, 90), min_size=12, max_size=40),
    st.integers(2, 4),
    st.sampled_from(["packed", "bucketed", "random"]),
    st.integers(0, 2),
)
def test_anchor_sets_through_the_sampler_ignore_packing_and_world_size(lens, world, strategy, epoch):
    ds = dataset(lens, seed=len(lens))
    budget = 2 * max(lens) + 10
    one = anchors_seen(ds, PlanConfig(strategy="packed", budget=budget, seed=1), 1, epoch)
    layout = "packed" if strategy == "packed" else "padded"
    many = anchors_seen(ds, PlanConfig(strategy=strategy, budget=budget, seed=5), world, epoch, layout)
    assert one.keys() == many.keys() == set(range(len(lens)))
    for i, a in one.items():
        assert a == many[i]
        expect = choose_anchors(ds[i]["loss_mask"], POLICY, seed=11, epoch=epoch, sample_id=i)
        assert list(a) == expect.tolist()


def test_anchor_sets_survive_a_resume():
    ds = dataset([37, 5, 60, 12, 80, 44, 9, 70, 23, 51, 66, 30])
    lengths = np.array([len(x["input_ids"]) for x in ds])
    cfg = PlanConfig(strategy="packed", budget=120, seed=3)
    col = DrafterCollator("dflash", POLICY, seed=11, mask_token_id=V - 1)
    full = {}
    for mb in PlanBatchSampler(lengths, cfg, rank=0, world_size=1, epoch=1):
        b = col(PlannedDataset(ds).__getitems__(mb))
        full.update(zip(b.contract.sample_ids, b.fields.anchors_by_doc, strict=True))
    sampler = PlanBatchSampler(lengths, cfg, rank=0, world_size=1, epoch=1)
    it = iter(sampler)
    resumed = {}
    for _ in range(2):
        b = col(PlannedDataset(ds).__getitems__(next(it)))
        resumed.update(zip(b.contract.sample_ids, b.fields.anchors_by_doc, strict=True))
    state = sampler.state_dict()
    again = PlanBatchSampler(lengths, cfg, rank=0, world_size=1, epoch=1)
    again.load_state_dict(state)
    for mb in again:
        b = col(PlannedDataset(ds).__getitems__(mb))
        for sid, a in zip(b.contract.sample_ids, b.fields.anchors_by_doc, strict=True):
            assert sid not in resumed
            resumed[sid] = a
    assert resumed == full


def test_dflash_supervision_rule_stays_inside_each_document():
    docs = dataset([3, 9, 2, 30, 17], seed=4)
    for i, d in enumerate(docs):
        d["sample_id"] = i
    b = DrafterCollator("dflash", AnchorPolicy(block_size=8, density=1.0), mask_token_id=V - 1)(docs)
    f, c = b.fields, b.contract
    doc = c.flat("document_ids")[0]
    mask = c.flat("loss_mask")[0]
    sup = f.supervised.nonzero().reshape(-1)
    assert len(sup) > 0
    assert (doc[f.label_index[sup]] == f.query_doc[sup]).all()  # labels never leave the document
    assert mask[f.label_index[sup]].all()
    assert (f.target_index[sup] == f.label_index[sup] - 1).all()
    # the short document (3 tokens) still gets a partial block
    assert len(f.anchors_by_doc[0]) >= 1 or not (docs[0]["loss_mask"][:-1] & docs[0]["loss_mask"][1:]).any()
    leaky = DrafterCollator(
        "dflash", AnchorPolicy(block_size=8, density=1.0), mask_token_id=V - 1, leaky=True
    )
    lf = leaky(docs).fields
    lsup = lf.supervised.nonzero().reshape(-1)
    assert (doc[lf.label_index[lsup]] != lf.query_doc[lsup]).any()  # the field's packers: labels cross


def test_collator_needs_sample_ids_for_dflash():
    with pytest.raises(ConfigError, match="no sample id"):
        DrafterCollator("dflash")([{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}])
    with pytest.raises(ConfigError, match="method"):
        DrafterCollator("medusa")


@pytest.fixture(scope="module")
def target():
    return build_target(vocab_size=V, num_hidden_layers=4)


RECIPES = ("specforge", "speculators")


def models_for(method, target, recipe="specforge", **changes):
    r = recipes.override(recipes.get(recipe, method), block_size=4, ttt=3, **changes)
    return build_models(method, vocab=V, target=target, recipe=r)


def drafter_for(method, target):
    return models_for(method, target).drafter


def step(models, items, layout="packed", leaky=False, norm=None):
    col = DrafterCollator(
        models.method.name, recipe=models.recipe, seed=2, layout=layout, mask_token_id=V - 1, leaky=leaky
    )
    b = col(items)
    num, den = loss_sums(models, b)
    models.drafter.zero_grad()
    (num.sum() / (norm if norm is not None else den.sum())).backward()
    grads = [p.grad.clone() for p in models.trainable()]
    return num.detach(), den.detach(), grads


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("method", ["dflash", "eagle3", "mtp"])
def test_packed_and_padded_rows_train_like_each_document_alone(method, recipe, target):
    """Under each recipe a packed row (and padded rows) gives every document the numerator and denominator it
    gets alone, and the step's gradient is the sum of the documents' gradients alone over the step's
    denominator. Under speculators' per-document mean "alone" is the document's own mean with denominator 1:
    one document per row, rows averaged."""
    items = dataset([23, 41, 3, 64, 17], seed=7)
    for i, d in enumerate(items):
        d["sample_id"] = 100 + i
    models = models_for(method, target, recipe)
    num, den, grads = step(models, items)
    total = den.sum()
    assert total > 0 and num.abs().sum() > 0
    if models.recipe.normalization == "document":
        assert set(den.tolist()) <= {0.0, 1.0}
    alone_grads = [torch.zeros_like(g) for g in grads]
    for i, item in enumerate(items):
        n1, d1, g1 = step(models, [item], norm=total)
        assert d1.item() == pytest.approx(den[i].item(), rel=1e-6)
        assert n1.item() == pytest.approx(num[i].item(), rel=1e-5, abs=1e-6)
        alone_grads = [a + g for a, g in zip(alone_grads, g1, strict=True)]
    for g, a in zip(grads, alone_grads, strict=True):
        assert torch.allclose(g, a, atol=1e-6, rtol=1e-4)
    pn, pd, pg = step(models, items, layout="padded")
    assert torch.allclose(pd, den) and torch.allclose(pn, num, rtol=1e-5, atol=1e-6)
    for g, a in zip(grads, pg, strict=True):
        assert torch.allclose(g, a, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("method", ["dflash", "eagle3", "mtp"])
def test_row_level_batches_change_the_documents_losses(method, target):
    rng = np.random.default_rng(3)
    lens = [30, 25, 40]
    items = [{"input_ids": rng.integers(0, V - 1, n), "loss_mask": np.ones(n, bool)} for n in lens]
    for i, item in enumerate(items):
        item["sample_id"] = i
    models = models_for(method, target)
    num, den, _ = step(models, items)
    ln, ld, _ = step(models, items, leaky=True)
    assert not (torch.equal(ld, den) and torch.allclose(ln, num))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("method", ["dflash", "eagle3", "mtp"])
def test_flex_block_mask_path_gives_the_dense_result(method, target):
    """The GPU path (flex attention over the same predicate) agrees with the dense CPU path; checked here in
    the forward pass (flex attention has no CPU backward in this torch)."""
    items = dataset([23, 41, 3, 64], seed=9)
    for i, d in enumerate(items):
        d["sample_id"] = i
    models = models_for(method, target)
    drafter = models.drafter
    b = DrafterCollator(method, POLICY, recipe=models.recipe, mask_token_id=V - 1)(items)
    out = run_target(target, b.contract, models.layers)
    with torch.no_grad():
        dense, flex = drafter(out.hidden, b, "dense"), drafter(out.hidden, b, "flex")
    if method == "dflash":
        dense, flex = [dense], [flex]
    for x, y in zip(dense, flex, strict=True):
        assert x.shape == y.shape and x.numel() > 0
        assert torch.allclose(x, y, atol=1e-5)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("method", ["dflash", "eagle3", "mtp"])
def test_segmented_default_path_equals_one_mask_over_the_flat_row(target, method, layout, recipe):
    """The default CPU path runs attention segment by segment (documents of a packed row, padded rows; DFlash
    with each query's context and own block only, EAGLE-3 with T x (T + k) scores per step); the same as SDPA
    over the whole flat row under the one dense mask, forward and backward, with speculators' sliding window
    (here 8 positions) and causal blocks too."""
    items = dataset([23, 41, 3, 30], seed=5)
    for i, d in enumerate(items):
        d["sample_id"] = i
    changes = {"sliding_window": 8} if recipe == "speculators" and method == "dflash" else {}
    models = models_for(method, target, recipe, **changes)
    drafter = models.drafter
    b = DrafterCollator(method, recipe=models.recipe, layout=layout, mask_token_id=V - 1)(items)
    out = run_target(target, b.contract, models.layers)
    grads = {}
    for how in ("dense", "mask"):
        drafter.zero_grad()
        hs = drafter(out.hidden, b, how)
        hs = [hs] if method == "dflash" else hs
        sum(drafter.lm_head(h).logsumexp(-1).sum() for h in hs).backward()
        grads[how] = (
            [h.detach() for h in hs],
            [p.grad.clone() for p in drafter.parameters() if p.requires_grad],
        )
    for x, y in zip(grads["dense"][0], grads["mask"][0], strict=True):
        assert torch.allclose(x, y, atol=1e-5)
    for x, y in zip(grads["dense"][1], grads["mask"][1], strict=True):
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-4)
