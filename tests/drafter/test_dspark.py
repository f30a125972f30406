"""DSpark as a registered drafter method, proven with speculators' own ``DSparkDraftModel`` (their 0.9.0
wheel): on a packed row every document trains as it does alone (loss and gradients, float32), padfree's
reference drafter computes their loss and gradient, ``check-drafter`` catches labels sampled across a
document end, the export loads in their class with equal logits, and ``examples/train_drafter.py --method
dspark`` trains against a target folder and exports."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from padfree.drafter import methods, recipes
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.export import export_meta, export_models
from padfree.drafter.methods.dflash import spec as dflash_spec
from padfree.drafter.methods.dspark import model as dspark
from padfree.drafter.sizes import Sizes
from padfree.drafter.target import build_target, load_target, run_target
from padfree.drafter.train import build_models
from padfree.integrations import feed
from support.alone import assert_packed_trains_as_alone
from support.drafter_runs import simulate_drafter, train_drafter
from support.peers import import_peer, peer_missing

REASON = peer_missing("speculators")
needs_speculators = pytest.mark.skipif(bool(REASON), reason=REASON)
VOCAB = 256
RECIPE = recipes.get("speculators", "dspark")
SMALL = dataclasses.replace(RECIPE, markov_rank=8)  # a small Markov head keeps the tests cheap
B = RECIPE.block_size


def test_the_preset_is_deepspecs_recipe_as_speculators_trains_it():
    assert recipes.get(recipes.DEFAULT, "dspark") is RECIPE  # SpecForge trains no DSpark
    r = RECIPE
    assert (r.block_size, r.max_anchors, r.gamma, r.objective, r.normalization) == (
        7,
        512,
        4.0,
        "ce_tv",
        "document",
    )
    assert (r.ce_weight, r.tv_weight, r.confidence_alpha, r.markov_rank, r.min_loss_tokens) == (
        0.1,
        0.9,
        1.0,
        256,
        14,
    )
    assert (r.anchor_eligibility, r.anchor_margin, r.sliding_window, r.causal_in_block) == (
        "self",
        7,
        None,
        False,
    )
    assert r.layer_rule == "spread" and r.fused_layers == 5 and r.draft_vocab is None
    assert methods.LAYER_RULES["spread"](36, 5) == (
        1,
        9,
        17,
        25,
        33,
    )  # DeepSpec's target_layer_ids for Qwen3-4B
    for where in ("dspark_qwen3_4b_online.py", "l1_loss_alpha 0.9", "min_loss_tokens 14", "models/dspark"):
        assert where in r.source, where
    assert recipes.override(r, block_size=5).anchor_margin == 5  # the margin is the block: it follows it
    spec = methods.get("dspark")
    assert spec.export_format == "speculators-dspark" and spec.uses_anchors
    shape = Sizes(hidden=64, layers=2, vocab=100)
    assert spec.cost(shape, 7, 1).d > dflash_spec.cost(shape, 7).d > 0  # its heads cost on top of DFlash's
    sizes = Sizes(hidden=64, heads=4, kv_heads=2, intermediate=128, fused_layers=5)
    dflash_memory = dflash_spec.memory_terms(sizes, block_size=RECIPE.block_size, objective=RECIPE.objective)
    assert spec.memory(sizes, RECIPE).per_block > dflash_memory.per_block
    assert "block 7 sampled from the anchor" in RECIPE.describe()


def _items(docs):
    return [{"input_ids": i, "loss_mask": m, "sample_id": s} for s, (i, m) in enumerate(docs)]


def test_slots_sample_from_the_anchor_inside_its_document():
    rec = recipes.override(SMALL, block_size=3, min_loss_tokens=0, max_anchors=64)
    docs = [(np.arange(10, 20), np.ones(10, bool)), (np.arange(30, 36), np.ones(6, bool))]
    b = DrafterCollator("dspark", recipe=rec, seed=1, mask_token_id=255)(_items(docs))
    f, c = b.fields, b.contract
    a = f.anchors.repeat_interleave(3)
    assert torch.equal(f.target_index, a + f.slot)  # the target's distribution at a + k
    assert torch.equal(f.label_index, a + f.slot + 1)  # predicts the token after it
    doc = c.flat("document_ids")[0]
    assert bool((doc[f.label_index] == f.query_doc).all()) and bool(f.supervised.all())
    assert all(max(x) + 3 < n for x, n in zip(f.anchors_by_doc, (10, 6), strict=True))  # a + B inside
    assert torch.allclose(f.weight[:3], dspark.slot_weights(torch.arange(3), rec.gamma))
    assert float(f.weight[0]) == 1.0  # slot 0 predicts (DFlash's slot 0 holds the anchor and weighs 0)
    leaky = DrafterCollator("dspark", recipe=rec, seed=1, mask_token_id=255, leaky=True)(_items(docs)).fields
    crossing = leaky.labelled & (doc[leaky.label_index.clamp(min=0)] != leaky.query_doc)
    assert int(crossing.sum()) > 0  # row-wide anchors label slots with the next document's tokens
    # a document under min_loss_tokens trains nothing, packed as alone
    short = recipes.override(rec, min_loss_tokens=8)
    b = DrafterCollator("dspark", recipe=short, seed=1, mask_token_id=255)(_items(docs))
    assert b.fields.supervised[b.fields.query_doc == 1].sum() == 0 and b.den.tolist() == [1.0, 0.0]
    alone = DrafterCollator("dspark", recipe=short, seed=1, mask_token_id=255)(_items(docs[1:]))
    assert alone.positions == 0


def test_check_drafter_passes_dspark_and_catches_its_row_wide_labels():
    from padfree.drafter.check import check_drafter, fixture_documents

    samples = fixture_documents(3, 80)
    good = check_drafter("dspark", samples, recipe=SMALL)
    assert good.ok, good.reason
    blind = check_drafter("dspark", samples, recipe=SMALL, leaky=True)
    assert not blind.ok and blind.cross_labels > 0 and blind.cross_inputs > 0
    assert "block labels/previous tokens cross a document end" in blind.reason


@pytest.fixture(scope="module")
def docs():
    from padfree.drafter.check import fixture_documents
    from support.drafters import fold_tokens

    samples = fold_tokens(fixture_documents(8, 60), VOCAB)
    kept = [s for s in samples if np.asarray(s["loss_mask"]).sum() >= RECIPE.min_loss_tokens][:4]
    assert len(kept) == 4  # their class has no min_loss_tokens: compare documents the rule keeps
    return [{**s, "sample_id": 10 + i} for i, s in enumerate(kept)]


def _perturbed(models, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in models.trainable():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return models


def _theirs(models, mask_id):
    """speculators' DSparkDraftModel (SDPA) holding padfree's drafter weights (through padfree's export
    names) and the target's embedding, final norm and LM head."""
    from support.drafters import speculators_dspark

    r = models.recipe
    theirs = speculators_dspark(
        models.target,
        models.layers,
        block_size=r.block_size,
        mask_token_id=mask_id,
        markov_rank=r.markov_rank,
    )
    _, tensors = dspark.export_files(models.drafter.state_dict(), export_meta(models, mask_token_id=mask_id))
    assert theirs.load_state_dict(tensors, strict=False).unexpected_keys == []
    return theirs


@needs_speculators
def test_packed_documents_train_as_alone_through_speculators_dspark(docs):
    mask_id = VOCAB - 1
    models = _perturbed(
        build_models("dspark", vocab=VOCAB, seed=0, recipe=SMALL, target=build_target(vocab_size=VOCAB))
    )
    theirs = _theirs(models, mask_id)
    assert feed.target_layers(theirs) == models.layers
    shapes = feed.ShapeSet.spread(256, 4, anchors=256)
    kwargs = feed.trainer_kwargs(theirs, SMALL, loss_implementation="eager", max_anchors=256)
    assert kwargs["per_position_loss_weight"] == "fixed-exp-decay" and set(kwargs["loss_config"]) == {
        "ce",
        "tv",
    }
    col = DrafterCollator("dspark", recipe=SMALL, seed=5, mask_token_id=mask_id)

    def forward(batch, doc=None):
        out = run_target(models.target, batch.contract, models.layers)
        inputs, choice = feed.speculators_inputs(batch, out, shapes=shapes)
        if doc is not None:
            inputs = {**inputs, "loss_mask": inputs["loss_mask"] * (inputs["document_ids"] == doc)}
        with feed.anchors_patched(choice):
            return theirs(**inputs, **kwargs)

    packed = col(docs)
    assert packed.positions > 0
    _, tensors = dspark.export_files(models.drafter.state_dict(), export_meta(models, mask_token_id=mask_id))
    names = {t: dspark.HEAD_TENSORS.get(t, t.replace("self_attn.", "")) for t in tensors}
    assert_packed_trains_as_alone(
        theirs, forward, col, packed, docs, models, names, min_docs=len(docs), rtol=1e-5, loss_tol=2e-5
    )


@needs_speculators
def test_their_own_anchors_on_the_packed_row_join_documents(docs):
    """The control: their row-level ``select_anchors`` on the same packed row opens blocks whose slots read
    the next document (labels, loss mask, previous tokens)."""
    models = build_models("dspark", vocab=VOCAB, seed=0, recipe=SMALL, target=build_target(vocab_size=VOCAB))
    theirs = _theirs(models, VOCAB - 1)
    items = [{**s, "loss_mask": np.ones(len(s["input_ids"]), bool)} for s in docs]
    packed = DrafterCollator("dspark", recipe=SMALL, seed=5, mask_token_id=VOCAB - 1)(items)
    out = run_target(models.target, packed.contract, models.layers)
    inputs, _ = feed.dflash_inputs(packed, out)
    torch.manual_seed(0)
    anchors, valid = theirs._build_attention_mask(inputs["loss_mask"], 128, inputs["document_ids"], "cpu")[2:]
    doc = inputs["document_ids"][0]
    a = anchors[valid]
    crossing = doc[(a + B - 1).clamp(max=doc.shape[0] - 1)] != doc[a]
    assert int(crossing.sum()) > 0


@pytest.fixture(scope="module")
def folder(tmp_path_factory, hf_json):
    from padfree.testing.targets import save_target_folder

    return save_target_folder(tmp_path_factory.mktemp("target") / "qwen", hf_json, family="llama", seed=2)


def _their_logits(served, batch, out, monkeypatch):
    """Their class loaded from ``served``, run on ``batch`` with its own anchors: the logits (Markov bias
    added) and confidence logits their loss reads, one row per block slot."""
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig, core

    cfg = DSparkSpeculatorConfig.from_pretrained(str(served))
    cfg.transformer_layer_config._attn_implementation = "sdpa"
    theirs = DSparkDraftModel.from_pretrained(str(served), config=cfg).eval()
    seen = {}

    def spy(logits, targets, confidence_logits, *args, **kwargs):
        seen["logits"], seen["confidence"] = logits[0], confidence_logits[0]
        return core.__dict__["_real_compute_metrics"](logits, targets, confidence_logits, *args, **kwargs)

    monkeypatch.setitem(core.__dict__, "_real_compute_metrics", core.compute_metrics)
    monkeypatch.setattr(core, "compute_metrics", spy)
    inputs, choice = feed.dflash_inputs(batch, out)
    n = len(choice.anchors)
    kwargs = feed.trainer_kwargs(theirs, batch.recipe, loss_implementation="eager", max_anchors=n)
    with torch.no_grad(), feed.anchors_patched(choice):
        theirs(**inputs, **kwargs)
    return seen["logits"], seen["confidence"]


def _check_logits(models, batch, out, served, monkeypatch):
    with torch.no_grad():
        x, _ = models.drafter.queries(out, batch)
        ours, conf = models.drafter.lm_head(x), models.drafter.lm_head.confidence(x)
    logits, confidence = _their_logits(served, batch, out, monkeypatch)
    assert logits.shape == ours.shape and ours.shape[0] > 0
    worst = (logits - ours).abs().max().item()
    assert worst < 1e-4 * max(1.0, ours.abs().max().item()), worst
    assert torch.allclose(confidence, conf, atol=1e-5)


@needs_speculators
def test_the_export_loads_in_speculators_dspark_with_equal_logits(tmp_path, folder, monkeypatch):
    import_peer("speculators")
    target = load_target(folder)
    vocab = int(target.config.vocab_size)
    models = _perturbed(build_models("dspark", vocab=vocab, recipe=SMALL, target=target))
    n = 40
    rng = np.random.default_rng(1)
    doc = {"input_ids": rng.integers(2, 3000, n), "loss_mask": np.ones(n, bool), "sample_id": 0}
    batch = DrafterCollator("dspark", recipe=models.recipe, mask_token_id=vocab - 1)([doc])
    out = run_target(models.target, batch.contract, models.layers)
    served = export_models(models, "speculators-dspark", tmp_path / "served", mask_token_id=vocab - 1,
                           target_path=folder)  # fmt: skip
    config = json.loads((served / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["sample_from_anchor"] is True
    assert config["block_size"] == B and config["markov_rank"] == 8
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(folder.resolve())
    _check_logits(models, batch, out, served, monkeypatch)


def test_the_export_needs_a_verifier_the_full_vocabulary_and_full_attention():
    from padfree.drafter.export import check_exportable
    from padfree.errors import ConfigError

    models = build_models("dspark", vocab=64, recipe=SMALL)
    meta = export_meta(models, mask_token_id=63)
    with pytest.raises(ConfigError, match="DSpark format names the verifier"):
        check_exportable(meta, "speculators-dspark")
    with pytest.raises(ConfigError, match="draft-vocab none"):
        check_exportable({**meta, "d2t": [0, 1]}, "speculators-dspark")
    causal = {**meta, "drafter": {**meta["drafter"], "causal_in_block": True}}
    with pytest.raises(ConfigError, match="whole block and context"):
        check_exportable(causal, "speculators-dspark")
    with pytest.raises(ConfigError, match="full vocabulary"):
        build_models(
            "dspark", vocab=64, recipe=dataclasses.replace(SMALL, draft_vocab=32), counts=np.ones(64)
        )


@needs_speculators
def test_train_drafter_method_dspark_trains_against_a_target_folder_and_exports(
    tmp_path, folder, example, capsys, monkeypatch
):
    said, state, out = train_drafter(example, folder, tmp_path, capsys, "dspark", "--markov-rank", "8")
    assert "recipe speculators: block 7 sampled from the anchor" in said, said[-2000:]
    target = load_target(folder)
    vocab = int(target.config.vocab_size)
    models = build_models("dspark", vocab=vocab, target=target, recipe=SMALL)
    models.drafter.load_state_dict(state)  # the trained drafter, as the run left it
    n = 30
    doc = {"input_ids": np.arange(5, 5 + n), "loss_mask": np.ones(n, bool), "sample_id": 0}
    mask = int(json.loads((out / "config.json").read_text())["mask_token_id"])
    batch = DrafterCollator("dspark", recipe=SMALL, mask_token_id=mask)([doc])
    hidden = run_target(target, batch.contract, models.layers)
    _check_logits(models, batch, hidden, out, monkeypatch)


def test_simulate_prices_dspark_with_its_own_cost(tmp_path, capsys):
    out = simulate_drafter(tmp_path, capsys, "dspark")
    d = out["drafter"]
    assert d["recipe"] == "speculators" and d["cache_layers"] == 6  # 5 fused layers and the last
    assert d["memory_model"]["source"] == "analytic dspark h4096 B7"
    assert out["config"]["cost"]["source"].startswith("drafter dspark")
    assert out["strategies"]["packed"]["draft_blocks"] == d["draft_blocks"] > 0  # its anchors are planned
