"""MTP as a registered drafter method, proven with speculators' own ``MTPDraftModel`` (their 0.9.0 wheel):
on a packed row every document trains as it does alone (loss and gradients, float32), padfree's reference
drafter computes their loss and gradient, ``check-drafter`` catches a label shift across documents, the
export loads in their class with equal logits, and ``examples/train_drafter.py --method mtp`` trains against
a target folder and exports."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from padfree.drafter import methods, recipes
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.export import export_meta, export_models
from padfree.drafter.methods.mtp import model as mtp
from padfree.drafter.target import build_target, load_target, run_target
from padfree.drafter.train import build_models
from padfree.integrations import feed
from support.alone import assert_packed_trains_as_alone
from support.drafter_runs import simulate_drafter, train_drafter
from support.peers import import_peer, peer_missing

REASON = peer_missing("speculators")
needs_speculators = pytest.mark.skipif(bool(REASON), reason=REASON)
VOCAB = 256
RECIPE = recipes.get("speculators", "mtp")
K = RECIPE.ttt


def test_the_preset_is_speculators_and_the_default_for_mtp():
    assert recipes.get(recipes.DEFAULT, "mtp") is RECIPE  # SpecForge trains no MTP: a bare --method mtp
    r = RECIPE
    assert (r.ttt, r.step_decay, r.objective, r.normalization) == (3, 0.6, "data_ce", "document")
    assert RECIPE.layer_rule == "last" and RECIPE.draft_vocab is None and not RECIPE.head_trainable
    assert "models/mtp/core.py" in RECIPE.source and "beta 0.6" in RECIPE.source
    spec = methods.get("mtp")
    assert spec.export_format == "speculators-mtp" and not spec.uses_anchors
    assert spec.cost(methods.Sizes(), 16, 4).source.startswith("drafter mtp")
    sizes = methods.Sizes(hidden=64, heads=4, kv_heads=2, intermediate=128, fused_layers=1)
    two, four = spec.memory(sizes, dataclasses.replace(RECIPE, ttt=2)), spec.memory(sizes, RECIPE)
    assert four.per_token > two.per_token and four.per_attention > two.per_attention > 0


def test_labels_stop_at_each_documents_end_and_weights_are_their_step_weights():
    docs = [([5, 6, 7, 8, 9], [1, 1, 1, 1, 1]), ([3, 4, 5], [1, 1, 1])]
    items = [{"input_ids": i, "loss_mask": m, "sample_id": s} for s, (i, m) in enumerate(docs)]
    b = DrafterCollator("mtp", recipe=RECIPE)(items)
    f = b.fields
    assert f.supervised.int().tolist() == [
        [1, 1, 1, 0, 0, 1, 0, 0],  # step 0: x[t + 2] inside t's document
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert f.step_input_ids[:, 0].tolist() == [6, 7, 8]  # step k fed x[t + k + 1]
    w = mtp.step_weights(3, 0.6)
    assert torch.allclose(f.weight[:, 0], w) and abs(float(w.sum()) - 1) < 1e-6
    leaky = DrafterCollator("mtp", recipe=RECIPE, leaky=True)(items).fields
    assert bool(leaky.labelled[0, 3])  # the row-wide shift labels t = 3 with document 1's first token


def test_check_drafter_passes_mtp_and_catches_its_row_wide_label_shift():
    from padfree.drafter.check import check_drafter, fixture_documents

    samples = fixture_documents(3, 80)
    good = check_drafter("mtp", samples)
    assert good.ok, good.reason
    leaky = check_drafter("mtp", samples, leaky=True)
    assert not leaky.ok and leaky.cross_labels > 0 and leaky.cross_inputs > 0
    assert "shifted inputs/labels cross a document end" in leaky.reason


@pytest.fixture(scope="module")
def docs():
    from padfree.drafter.check import fixture_documents
    from support.drafters import fold_tokens

    samples = fold_tokens(fixture_documents(4, 48), VOCAB)
    out = []
    for i, s in enumerate(samples):
        mask = np.asarray(s["loss_mask"]).astype(bool).copy()
        mask[: K + 1] = False  # their row needs each document's first K + 1 labels free (mtp_inputs)
        out.append({**s, "loss_mask": mask, "sample_id": 10 + i})
    return out


def _perturbed(models, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in models.trainable():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return models


def _theirs(models):
    """speculators' MTPDraftModel (SDPA) holding padfree's drafter weights (through padfree's export names)
    and the target's embedding and LM head."""
    from transformers import Qwen3Config

    pkg = import_peer("speculators", "models.mtp")
    from support.drafters import _speculators_config

    d = models.drafter.cfg
    tl = Qwen3Config(
        vocab_size=VOCAB, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        num_attention_heads=d.num_heads, num_key_value_heads=d.num_kv_heads, head_dim=d.head_dim,
        rms_norm_eps=d.eps, rope_parameters={"rope_type": "default", "rope_theta": d.rope_theta},
        num_hidden_layers=int(models.target.config.num_hidden_layers),
    )  # fmt: skip
    tl._attn_implementation = "sdpa"
    cfg = pkg.MTPSpeculatorConfig(
        transformer_layer_config=tl, speculators_config=_speculators_config("mtp", models.target, d.ttt)
    )
    model = pkg.MTPDraftModel(cfg)
    meta = export_meta(models, mask_token_id=0)
    _, tensors = mtp.export_files(models.drafter.state_dict(), meta)
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    assert sorted(missing) == ["embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"]
    with torch.no_grad():
        model.embed_tokens.weight.copy_(models.target.get_input_embeddings().weight)
        model.lm_head.weight.copy_(models.target.get_output_embeddings().weight)
    return model


@needs_speculators
def test_packed_documents_train_as_alone_through_speculators_mtp(docs):
    models = _perturbed(build_models("mtp", vocab=VOCAB, seed=0, target=build_target(vocab_size=VOCAB)))
    theirs = _theirs(models)
    assert theirs.target_layer_ids == [models.layers[0] + 1]  # their verifier_last_hidden_states
    kwargs = feed.trainer_kwargs(theirs, RECIPE)
    assert torch.allclose(torch.tensor(kwargs["step_weights"]).float(), mtp.step_weights(3, 0.6))
    col = DrafterCollator("mtp", recipe=RECIPE, seed=5)
    shapes = feed.ShapeSet.spread(256, 4)

    def forward(batch, doc=None):
        out = run_target(models.target, batch.contract, models.layers)
        inputs, choice = feed.speculators_inputs(batch, out, shapes=shapes)
        assert choice is None and inputs["input_ids"].shape[1] in shapes.lengths
        if doc is not None:
            inputs = {**inputs, "loss_mask": inputs["loss_mask"] * (inputs["document_ids"] == doc)}
        return theirs(**inputs, **kwargs)

    packed = col(docs)
    names = {f"mtp_layers.0.{p}.weight": f"{p}.weight" for p in mtp.LAYER_PARTS}
    names |= {f"mtp_layers.0.self_attn.{p}.weight": f"{p}.weight" for p in mtp.ATTENTION_PARTS}
    assert_packed_trains_as_alone(
        theirs, forward, col, packed, docs, models, names, min_docs=len(docs), keys=lambda k: k == set(names),
        rtol=1e-5,
    )  # fmt: skip


@needs_speculators
def test_their_row_without_padfrees_gate_joins_documents(docs):
    """The control: their packed row as their own collate lays it (no gate, no tail) trains the documents
    otherwise than alone."""
    models = _perturbed(build_models("mtp", vocab=VOCAB, seed=0, target=build_target(vocab_size=VOCAB)))
    theirs = _theirs(models)
    kwargs = feed.trainer_kwargs(theirs, RECIPE)
    items = [{**s, "loss_mask": np.ones(len(s["input_ids"]), bool)} for s in docs]
    col = DrafterCollator("mtp", recipe=RECIPE, seed=5)
    packed = col(items)
    c = packed.contract
    out = run_target(models.target, c, models.layers)
    row = {
        "hidden_states": out.hidden, "input_ids": c.flat("input_ids"),
        "loss_mask": c.flat("loss_mask").long(), "position_ids": c.flat("position_ids"),
    }  # fmt: skip
    doc = c.flat("document_ids")
    differs = 0
    with torch.no_grad():
        for d, item in enumerate(items):
            in_row = float(theirs(**{**row, "loss_mask": row["loss_mask"] * (doc == d)}, **kwargs)[1])
            one = col([item]).contract
            o1 = run_target(models.target, one, models.layers)
            alone = float(
                theirs(hidden_states=o1.hidden, input_ids=one.flat("input_ids"),
                       loss_mask=one.flat("loss_mask").long(), position_ids=one.flat("position_ids"),
                       **kwargs)[1]
            )  # fmt: skip
            differs += abs(in_row - alone) > 1e-4 * max(1.0, alone)
    assert differs >= len(items) - 1


@pytest.fixture(scope="module")
def folder(tmp_path_factory, hf_json):
    from padfree.testing.targets import save_target_folder

    return save_target_folder(tmp_path_factory.mktemp("target") / "qwen", hf_json, family="llama", seed=2)


def _their_logits(served, hidden, ids):
    from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig

    cfg = MTPSpeculatorConfig.from_pretrained(str(served))
    cfg.transformer_layer_config._attn_implementation = "sdpa"
    theirs = MTPDraftModel.from_pretrained(str(served), config=cfg).eval()
    with torch.no_grad():
        logits, _, _ = theirs(input_ids=ids[None], hidden_states=hidden)
    return logits


@needs_speculators
def test_the_export_loads_in_speculators_mtp_with_equal_logits(tmp_path, folder):
    import_peer("speculators")
    target = load_target(folder)
    models = _perturbed(build_models("mtp", vocab=int(target.config.vocab_size), target=target))
    n = 30
    rng = np.random.default_rng(1)
    doc = {"input_ids": rng.integers(2, 3000, n), "loss_mask": np.ones(n, bool), "sample_id": 0}
    batch = DrafterCollator("mtp", recipe=models.recipe)([doc])
    out = run_target(models.target, batch.contract, models.layers)
    with torch.no_grad():
        ours = [models.drafter.lm_head(h) for h in models.drafter(out.hidden, batch)]
    served = export_models(
        models, "speculators-mtp", tmp_path / "served", mask_token_id=0, target_path=folder
    )
    config = json.loads((served / "config.json").read_text())
    assert config["speculators_model_type"] == "mtp" and config["architectures"] == ["MTPDraftModel"]
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(folder.resolve())
    logits = _their_logits(served, out.hidden, torch.from_numpy(doc["input_ids"]))
    assert len(logits) == K
    valid = n - K - 1  # their queries: the row's first n - K - 1 positions
    for k in range(K):
        worst = (logits[k][0] - ours[k][:valid]).abs().max().item()
        assert worst < 1e-4 * max(1.0, ours[k].abs().max().item()), (k, worst)


def test_the_export_needs_a_verifier_and_the_full_vocabulary():
    from padfree.drafter.export import check_exportable
    from padfree.errors import ConfigError

    models = build_models("mtp", vocab=64)
    meta = export_meta(models, mask_token_id=0)
    with pytest.raises(ConfigError, match="MTP format names the verifier.*embedding and LM head"):
        check_exportable(meta, "speculators-mtp")
    with pytest.raises(ConfigError, match="no draft vocabulary"):
        check_exportable({**meta, "d2t": [0, 1]}, "speculators-mtp")
    with pytest.raises(ConfigError, match="full vocabulary"):
        build_models("mtp", vocab=64, recipe=dataclasses.replace(RECIPE, draft_vocab=32), counts=np.ones(64))


@needs_speculators
def test_train_drafter_method_mtp_trains_against_a_target_folder_and_exports(
    tmp_path, folder, example, capsys
):
    said, state, out = train_drafter(example, folder, tmp_path, capsys, "mtp", budget=128)
    assert "recipe speculators: 3 steps" in said, said[-2000:]
    target = load_target(folder)
    models = build_models("mtp", vocab=int(target.config.vocab_size), target=target)
    models.drafter.load_state_dict(state)  # the trained drafter, as the run left it
    n = 24
    doc = {"input_ids": np.arange(5, 5 + n), "loss_mask": np.ones(n, bool), "sample_id": 0}
    batch = DrafterCollator("mtp", recipe=models.recipe)([doc])
    hidden = run_target(target, batch.contract, models.layers).hidden
    with torch.no_grad():
        ours = [models.drafter.lm_head(h) for h in models.drafter(hidden, batch)]
    logits = _their_logits(out, hidden, torch.from_numpy(doc["input_ids"]))
    assert len(logits) == K
    for k in range(K):
        worst = (logits[k][0] - ours[k][: n - K - 1]).abs().max().item()
        assert worst < 1e-4 * max(1.0, ours[k].abs().max().item()), (k, worst)


def test_simulate_prices_mtp_with_its_own_cost_and_cache(tmp_path, capsys):
    out = simulate_drafter(tmp_path, capsys, "mtp")
    d = out["drafter"]
    assert d["recipe"] == "speculators" and d["cache_layers"] == 1  # MTP reads the last layer only
    assert out["config"]["cost"]["source"].startswith("drafter mtp")
    assert "draft_blocks" not in out["strategies"]["packed"]
    assert out["strategies"]["packed"]["imbalance"] < 1.05
