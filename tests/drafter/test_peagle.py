"""P-EAGLE as a registered drafter method, proven with speculators' own ``PEagleDraftModel`` (their 0.9.0
wheel): on a packed row every document trains as it does alone (loss and gradients, float32), padfree's
reference drafter computes their loss and gradient, ``check-drafter`` catches chains that run across
documents, the export loads in their class with equal logits at every depth, and
``examples/train_drafter.py --method peagle`` trains against a target folder and exports."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from padfree.drafter import methods, recipes
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.export import export_meta, export_models
from padfree.drafter.methods.peagle import model as peagle
from padfree.drafter.target import build_target, load_target, run_target
from padfree.drafter.train import build_models, loss_sums
from padfree.integrations import feed
from support.alone import assert_packed_equals_padded, assert_packed_trains_as_alone
from support.drafter_runs import simulate_drafter, train_drafter
from support.peers import import_peer, peer_missing

REASON = peer_missing("speculators")
needs_speculators = pytest.mark.skipif(bool(REASON), reason=REASON)
VOCAB = 256
MASK = VOCAB - 1
RECIPE = dataclasses.replace(recipes.get("speculators", "peagle"), ttt=4, draft_vocab=None)
K = RECIPE.ttt


def test_the_preset_is_speculators_and_the_default_for_peagle():
    r = recipes.get(recipes.DEFAULT, "peagle")
    assert r is recipes.get("speculators", "peagle")  # SpecForge trains no P-EAGLE: a bare --method peagle
    assert (r.ttt, r.cod_ratio, r.cod_ratio_min, r.objective, r.loss_gate) == (8, 0.7, 0.2, "kl", 1)
    assert "PEagleArgs" in r.source and "models/peagle" in r.source and not r.head_trainable
    spec = methods.get("peagle")
    assert spec.export_format == "speculators-peagle" and not spec.uses_anchors
    assert spec.cost(methods.Sizes(), 16, 8).source.startswith("drafter peagle")
    deeper = spec.cost(methods.Sizes(), 16, 8)
    assert deeper.b != spec.cost(methods.Sizes(), 16, 2).b
    sizes = methods.Sizes(hidden=64, heads=4, kv_heads=2, intermediate=128)
    two, eight = spec.memory(sizes, recipes.override(r, ttt=2)), spec.memory(sizes, r)
    assert eight.per_token > two.per_token and eight.source.startswith("analytic peagle")


def _items(docs):
    return [{"input_ids": i, "loss_mask": m, "sample_id": s} for s, (i, m) in enumerate(docs)]


def test_chains_stop_at_each_documents_end_and_are_drawn_per_document():
    docs = [(np.arange(5, 35), np.ones(30, bool)), (np.arange(3, 19), np.ones(16, bool))]
    col = DrafterCollator("peagle", recipe=RECIPE, mask_token_id=MASK, seed=3)
    b = col(_items(docs))
    f, c = b.fields, b.contract
    doc = c.flat("document_ids")[0]
    rem = c.flat("doc_remaining")[0]
    depth = torch.arange(K)[:, None]
    assert bool(f.present[0].all()) and bool((f.present[1:] <= f.present[:-1]).all())  # nested chains
    assert bool((~f.supervised | (depth + 2 < rem)).all())  # labels inside the anchor's document
    assert not bool(f.supervised[0, c.doc_starts[1]]) and not bool(f.supervised[0, 0])  # first positions
    assert bool((f.step_input_ids[1:] == MASK).all()) and bool((f.input_index[1:] == -1).all())
    # depth d keeps int((n - d) * max(0.7^d, 0.2)) chains of the document (n: its depth-0 positions)
    for d_i in range(2):
        s = c.doc_slice(d_i)
        n = int(f.supervised[0, s].sum())
        kept = f.present[:, s].sum(1).tolist()
        assert kept[1] == int((n - 1) * 0.7) and kept[2] == int((n - 2) * 0.49)
    for d_i, item in enumerate(_items(docs)):  # the same chains alone
        one = col([item]).fields
        s = c.doc_slice(d_i)
        assert torch.equal(one.present, f.present[:, s]) and torch.equal(one.supervised, f.supervised[:, s])
    assert bool((doc[f.label_index.clamp(min=0)][f.labelled] == f.query_doc[f.labelled]).all())


def test_check_drafter_passes_peagle_and_catches_chains_across_documents():
    from padfree.drafter.check import check_drafter, fixture_documents

    samples = fixture_documents(3, 80)
    good = check_drafter("peagle", samples, ttt=3)
    assert good.ok, good.reason
    leaky = check_drafter("peagle", samples, ttt=3, leaky=True)
    assert not leaky.ok and leaky.cross_labels > 0 and leaky.cross_inputs > 0
    assert "chain labels/inputs cross a document end" in leaky.reason


@pytest.fixture(scope="module")
def docs():
    from padfree.drafter.check import fixture_documents
    from support.drafters import fold_tokens

    samples = fold_tokens(fixture_documents(4, 40), VOCAB - 1)
    return [{**s, "sample_id": 10 + i} for i, s in enumerate(samples)]


def _perturbed(models, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in models.trainable():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return models


def _theirs(models, draft_vocab=VOCAB):
    """speculators' PEagleDraftModel (SDPA) holding padfree's drafter weights (through padfree's export names)
    and the target's final norm and LM head as their verifier's."""
    from transformers import LlamaConfig

    from support.drafters import _speculators_config

    pkg = import_peer("speculators", "models.peagle")
    d = models.drafter.cfg
    tl = LlamaConfig(
        vocab_size=VOCAB, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        num_attention_heads=d.num_heads, num_key_value_heads=d.num_kv_heads, head_dim=d.head_dim,
        rms_norm_eps=d.eps, rope_parameters={"rope_type": "default", "rope_theta": d.rope_theta},
        num_hidden_layers=1,
    )  # fmt: skip
    tl._attn_implementation = "sdpa"
    cfg = pkg.PEagleSpeculatorConfig(
        transformer_layer_config=tl, speculators_config=_speculators_config("peagle", models.target, K),
        draft_vocab_size=draft_vocab, norm_before_residual=False, norm_before_fc=False, norm_output=False,
        eagle_aux_hidden_state_layer_ids=feed.their_layer_ids(models.layers), mask_token_id=MASK,
    )  # fmt: skip
    model = pkg.PEagleDraftModel(cfg)
    meta = export_meta(models, mask_token_id=MASK)
    if models.drafter.vocab is not None:
        meta["d2t"] = models.drafter.vocab.d2t.tolist()
    _, tensors = peagle.export_files(models.drafter.state_dict(), meta)
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    assert sorted(missing) == ["verifier_lm_head.weight", "verifier_norm.weight"]
    with torch.no_grad():
        rows = (
            models.target.get_output_embeddings().weight
        )  # their verifier head: the draft vocabulary's rows
        model.verifier_lm_head.weight.copy_(
            rows if models.drafter.vocab is None else rows[models.drafter.vocab.d2t]
        )
        model.verifier_norm.weight.copy_(models.target.model.norm.weight)
    return model


@needs_speculators
def test_packed_documents_train_as_alone_through_speculators_peagle(docs):
    models = _perturbed(
        build_models("peagle", vocab=VOCAB, seed=0, recipe=RECIPE, target=build_target(vocab_size=VOCAB))
    )
    theirs = _theirs(models)
    kwargs = feed.trainer_kwargs(theirs, RECIPE, loss_implementation="eager")
    assert (kwargs["num_depths"], kwargs["down_sample_ratio"]) == (K, 0.7)
    col = DrafterCollator("peagle", recipe=RECIPE, seed=5, mask_token_id=MASK)
    shapes = feed.ShapeSet.spread(256, 4)
    cod = import_peer("speculators", "models.peagle.data")

    def forward(batch, doc=None):
        out = run_target(models.target, batch.contract, models.layers)
        inputs, choice = feed.speculators_inputs(batch, out, shapes=shapes)
        assert inputs["input_ids"].shape[1] in shapes.lengths
        # a choice their own sampler could make: every chain's labels carry loss on their row
        m = inputs["loss_mask"][0]
        deep = choice.depth > 0
        assert int(deep.sum()) == int(batch.fields.present[1:].sum())
        for j in range(1, K):
            on = deep & (choice.depth >= j)
            assert bool((m[choice.anchor_pos[on] + j] == 1).all())
        if doc is not None:
            inputs = {**inputs, "loss_mask": inputs["loss_mask"] * (inputs["document_ids"] == doc)}
        with feed.anchors_patched(choice):
            return theirs(**inputs, **kwargs)

    packed = col(docs)
    assert int(packed.fields.present[1:].sum()) > len(docs)  # chains to compare
    theirs_names = {
        "fc.weight": "fc.weight", "mask_hidden": "mask_hidden",
        "embed_tokens.weight": "embed_tokens.weight", "layers.0.self_attn.q_proj.weight": "q_proj.weight",
        "layers.0.mlp.down_proj.weight": "mlp.down_proj.weight",
        "layers.0.hidden_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight",
    }  # fmt: skip
    assert_packed_trains_as_alone(  # a document with no loss weighs 0
        theirs, forward, col, packed, docs, models, theirs_names, min_docs=2,
        keys=lambda k: {"mask_hidden", "embed_tokens.weight"} <= k,
    )  # fmt: skip
    assert cod.generate_cod_sample_indices.__module__ == "speculators.models.peagle.data"  # put back


@needs_speculators
def test_their_sampler_on_an_ungated_row_joins_documents(docs):
    """The control: their own sampler on the row with each document's first position carrying loss extends
    chains from one document into the next (labels from another document)."""
    cod = import_peer("speculators", "models.peagle.data")
    models = build_models("peagle", vocab=VOCAB, seed=0, recipe=RECIPE, target=build_target(vocab_size=VOCAB))
    col = DrafterCollator("peagle", recipe=RECIPE, seed=5, mask_token_id=MASK)
    packed = col(docs)
    inputs, _ = feed.peagle_inputs(packed, run_target(models.target, packed.contract, models.layers))
    doc = inputs["document_ids"][0]
    ungated = torch.ones_like(inputs["loss_mask"])
    torch.manual_seed(0)
    anchor, depth = cod.generate_cod_sample_indices(
        doc.shape[0], ungated, num_depths=K, down_sample_ratio=1.0
    )
    crossing = doc[anchor] != doc[(anchor + depth).clamp(max=doc.shape[0] - 1)]
    assert int(crossing.sum()) > 0
    gated = inputs["loss_mask"]
    for _ in range(5):
        anchor, depth = cod.generate_cod_sample_indices(
            doc.shape[0], gated, num_depths=K, down_sample_ratio=1.0
        )
        assert not bool((doc[anchor] != doc[anchor + depth]).any())  # padfree's gate: none crosses


@pytest.fixture(scope="module")
def folder(tmp_path_factory, hf_json):
    from padfree.testing.targets import save_target_folder

    return save_target_folder(tmp_path_factory.mktemp("target") / "llama", hf_json, family="llama", seed=2)


def _their_logits(served, batch, out):
    """Their class loaded from ``served``, run on the one-document ``batch`` with its own chains: their LM
    head's logits per element, keyed ``(depth, position)``."""
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    cfg = PEagleSpeculatorConfig.from_pretrained(str(served))
    cfg.transformer_layer_config._attn_implementation = "sdpa"
    theirs = PEagleDraftModel.from_pretrained(str(served), config=cfg).eval()
    inputs, choice = feed.peagle_inputs(batch, out)
    logits: list[torch.Tensor] = []
    hook = theirs.lm_head.register_forward_hook(lambda _m, _i, o: logits.append(o[0]))
    kwargs = feed.trainer_kwargs(theirs, batch.recipe, loss_implementation="eager")
    with torch.no_grad(), feed.anchors_patched(choice):
        theirs(**inputs, **kwargs)
    hook.remove()
    keys = zip(choice.depth.tolist(), choice.anchor_pos.tolist(), strict=True)
    return dict(zip(keys, logits[0], strict=True))


def _check_logits(theirs, ours, batch):
    f = batch.fields
    checked = 0
    for (d, t), row in theirs.items():
        if t >= batch.contract.doc_lengths[0] - 1:
            continue
        worst = (row - ours[d][t]).abs().max().item()
        assert worst < 1e-4 * max(1.0, ours[d].abs().max().item()), (d, t, worst)
        checked += d > 0
    assert checked == int(f.present[1:].sum()) > 0


@needs_speculators
@pytest.mark.parametrize("draft_vocab", [None, 300])
def test_the_export_loads_in_speculators_peagle_with_equal_logits(tmp_path, folder, draft_vocab):
    from padfree.drafter.train import token_counts

    import_peer("speculators")
    target = load_target(folder)
    n = 30
    rng = np.random.default_rng(1)
    doc = {"input_ids": rng.integers(2, 3000, n), "loss_mask": np.ones(n, bool), "sample_id": 0}
    vocab = int(target.config.vocab_size)
    recipe = dataclasses.replace(RECIPE, draft_vocab=draft_vocab)
    counts = token_counts([doc], vocab)
    models = _perturbed(build_models("peagle", vocab=vocab, target=target, recipe=recipe, counts=counts))
    assert (models.drafter.vocab is None) == (draft_vocab is None)
    batch = DrafterCollator("peagle", recipe=models.recipe, mask_token_id=MASK)([doc])
    out = run_target(models.target, batch.contract, models.layers)
    with torch.no_grad():
        ours = [models.drafter.lm_head(h) for h in models.drafter(out.hidden, batch)]
    served = export_models(
        models, "speculators-peagle", tmp_path / "served", mask_token_id=MASK, target_path=folder
    )
    config = json.loads((served / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == MASK
    assert config["draft_vocab_size"] == (draft_vocab or vocab)
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(folder.resolve())
    _check_logits(_their_logits(served, batch, out), ours, batch)


@needs_speculators
def test_train_drafter_method_peagle_trains_against_a_target_folder_and_exports(
    tmp_path, folder, example, capsys
):
    said, state, out = train_drafter(
        example, folder, tmp_path, capsys, "peagle", "--ttt", "3", "--draft-vocab", "none"
    )  # fmt: skip
    assert "recipe speculators: 3 parallel depths" in said, said[-2000:]
    target = load_target(folder)
    recipe = dataclasses.replace(recipes.get("speculators", "peagle"), ttt=3, draft_vocab=None)
    models = build_models("peagle", vocab=int(target.config.vocab_size), target=target, recipe=recipe)
    models.drafter.load_state_dict(state)  # the trained drafter, as the run left it
    n = 24
    doc = {"input_ids": np.arange(5, 5 + n), "loss_mask": np.ones(n, bool), "sample_id": 0}
    mask = int(json.loads((out / "config.json").read_text())["mask_token_id"])
    batch = DrafterCollator("peagle", recipe=recipe, mask_token_id=mask)([doc])
    hidden = run_target(target, batch.contract, models.layers)
    with torch.no_grad():
        ours = [models.drafter.lm_head(h) for h in models.drafter(hidden.hidden, batch)]
    _check_logits(_their_logits(out, batch, hidden), ours, batch)


def test_simulate_prices_peagle_with_its_own_cost(tmp_path, capsys):
    out = simulate_drafter(tmp_path, capsys, "peagle")
    assert out["drafter"]["recipe"] == "speculators"
    assert out["config"]["cost"]["source"].startswith("drafter peagle")
    assert "draft_blocks" not in out["strategies"]["packed"]
    assert out["strategies"]["packed"]["imbalance"] < 1.05


def test_report_prices_peagle_as_simulate_does(fixtures_dir, tmp_path, capsys):
    from padfree.cli import main

    lengths = fixtures_dir / "lengths" / "gsm8k.cl100k.npy"
    setup = ["--budget", "2048", "--world-size", "2", "--grad-accum", "1", "--drafter", "peagle",
             "--target-hidden", "1024", "--target-layers", "8", "--vocab", "32000"]  # fmt: skip
    rc = main(["report", str(lengths), "--out", str(tmp_path / "site"), "--growths", "1.5",
               "--bucket-counts", "4", "--mixes", "16", *setup])  # fmt: skip
    assert rc == 0
    d = json.loads((tmp_path / "site" / "report.json").read_text())["drafter"]
    capsys.readouterr()
    assert main(["simulate", str(lengths), "--no-naive", "--json", *setup]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert d["cost"]["source"] == sim["config"]["cost"]["source"] == "drafter peagle h1024 l8 dh1024"
    assert d["cache_layers"] == 4 and d["cache_bytes"] == sim["drafter"]["cache_bytes"]  # 3 fused + the last
    for s, row in d["strategies"].items():
        assert row["tokens_per_unit"] == pytest.approx(sim["strategies"][s]["tokens_per_unit"]), s
    assert d["strategies"]["packed"]["ratio_to_sorted"] > d["strategies"]["random"]["ratio_to_sorted"]
    assert "Drafter setup: peagle" in (tmp_path / "site" / "index.html").read_text()


@pytest.mark.filterwarnings("ignore")
def test_padded_rows_and_every_attention_path_give_the_packed_dense_result():
    """Padded rows train each document as the packed row does; SDPA under the one dense mask (forward and
    backward) and the flex BlockMask (forward: no CPU backward) give the segment-by-segment result."""
    rng = np.random.default_rng(4)
    items = [
        {"input_ids": rng.integers(2, VOCAB - 2, n), "loss_mask": np.ones(n, bool), "sample_id": i}
        for i, n in enumerate([23, 41, 3, 30])
    ]
    models = _perturbed(build_models("peagle", vocab=VOCAB, seed=0, recipe=RECIPE))
    assert_packed_equals_padded("peagle", models, items, RECIPE, MASK)
    b = DrafterCollator("peagle", recipe=RECIPE, mask_token_id=MASK, seed=2)(items)
    out = run_target(models.target, b.contract, models.layers)
    drafter, grads = models.drafter, {}
    for how in ("dense", "mask"):
        drafter.zero_grad()
        hs = drafter(out.hidden, b, how)
        sum(drafter.lm_head(h).logsumexp(-1).sum() for h in hs).backward()
        grads[how] = ([h.detach() for h in hs], [p.grad.clone() for p in models.trainable()])
    with torch.no_grad():
        flex = drafter(out.hidden, b, "flex")
    for x, y, z in zip(grads["dense"][0], grads["mask"][0], flex, strict=True):
        assert torch.allclose(x, y, atol=1e-5) and torch.allclose(x, z, atol=1e-5)
    for x, y in zip(grads["dense"][1], grads["mask"][1], strict=True):
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-4)


@needs_speculators
def test_with_a_draft_vocabulary_padfree_computes_their_loss(docs):
    """KL to the target restricted to the draft vocabulary and renormalised (``out_of_vocab`` keep), as their
    verifier head over the draft vocabulary's rows gives it: each document's loss is theirs."""
    from padfree.drafter.train import token_counts

    recipe = dataclasses.replace(RECIPE, draft_vocab=100)
    target = build_target(vocab_size=VOCAB)
    models = _perturbed(
        build_models(
            "peagle", vocab=VOCAB, seed=0, recipe=recipe, target=target, counts=token_counts(docs, VOCAB)
        )
    )
    theirs = _theirs(models, draft_vocab=100)
    assert theirs.verifier_lm_head.weight.shape[0] == 100
    kwargs = feed.trainer_kwargs(theirs, recipe, loss_implementation="eager")
    col = DrafterCollator("peagle", recipe=recipe, seed=5, mask_token_id=MASK)
    compared = 0
    for item in docs:
        b = col([item])
        out = run_target(target, b.contract, models.layers)
        inputs, choice = feed.speculators_inputs(b, out)
        with torch.no_grad(), feed.anchors_patched(choice):
            loss = float(theirs(**inputs, **kwargs)[1])
            num, den = loss_sums(models, b)
        assert abs(float(num[0]) - loss) < 1e-5 * max(1.0, loss), (float(num[0]), loss)
        compared += float(den[0]) > 0
    assert compared >= 2
