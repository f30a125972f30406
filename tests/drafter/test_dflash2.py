"""DFlash2 as a registered drafter method, proven with speculators' own ``DFlash2DraftModel`` (their 0.9.0
wheel): on a packed row every document trains as it does alone (loss and gradients, float32), padfree's
reference drafter computes their loss and gradient, its convolution never crosses a block while the
document-blind control (a convolution over the flat query dimension) is caught by ``check-drafter``, the
export loads in their class with equal logits, and ``examples/train_drafter.py --method dflash2`` trains
against a target folder and exports."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from padfree.drafter import methods, recipes
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.export import export_meta, export_models
from padfree.drafter.methods.dflash import spec as dflash_spec
from padfree.drafter.methods.dflash2 import model as dflash2
from padfree.drafter.methods.dflash2 import spec as dflash2_spec
from padfree.drafter.sizes import Sizes
from padfree.drafter.target import build_target, load_target, run_target
from padfree.drafter.train import build_models, loss_sums
from padfree.errors import ConfigError
from padfree.integrations import feed
from support.alone import assert_packed_equals_padded, assert_packed_trains_as_alone
from support.drafter_runs import simulate_drafter, train_drafter
from support.peers import import_peer, peer_missing

REASON = peer_missing("speculators")
needs_speculators = pytest.mark.skipif(bool(REASON), reason=REASON)
VOCAB = 256
MASK = VOCAB - 1
RECIPE = recipes.override(
    recipes.get("speculators", "dflash2"), sliding_window=12, selector_rank=32, max_anchors=6
)
"""The preset with a window the test documents bind (12 positions before each anchor), a smaller selector
rank (a tiny vocabulary) and at most 6 blocks a document (CPU time)."""


def test_the_preset_is_speculators_and_the_default_for_dflash2():
    r = recipes.get(recipes.DEFAULT, "dflash2")
    assert r is recipes.get("speculators", "dflash2")  # SpecForge 0.2.0 trains no DFlash2
    assert (r.block_size, r.objective, r.slot_weights, r.gamma, r.normalization) == (
        8,
        "kl",
        "exp",
        4.0,
        "document",
    )
    assert (r.sliding_window, r.causal_in_block, r.max_anchors, r.anchor_margin) == (2048, False, 512, 8)
    sizes = (r.conv_kernel_size, r.conv_group_size, r.selector_rank, r.selector_top_k, r.selector_loss_alpha)
    assert sizes == (2, 16, 256, 16, 1.0) and sizes[:4] == dflash2_spec.COST_SIZES
    assert "DFlash2Args" in r.source and "models/dflash2" in r.source and r.draft_vocab is None
    spec = methods.get("dflash2")
    assert spec.export_format == "speculators-dflash2" and spec.uses_anchors
    shape = Sizes()
    assert spec.cost(shape, 8, 1).d > dflash_spec.cost(shape, 8).d
    assert spec.cost(shape, 8, 1).source.startswith("drafter dflash2")
    mem = Sizes(hidden=64, heads=4, kv_heads=2, intermediate=128)
    assert spec.memory(mem, r).per_block > methods.get("dflash").memory(mem, r).per_block
    assert "selector top 16 rank 256" in r.describe()
    with pytest.raises(ConfigError, match="conv_kernel_size 9 exceeds block_size 8"):
        recipes.override(r, conv_kernel_size=9)


def test_a_pruned_vocabulary_and_data_ce_are_refused_in_one_line():
    counts = np.arange(VOCAB)[::-1].copy()
    with pytest.raises(ConfigError, match="--draft-vocab none") as info:
        build_models(
            "dflash2", vocab=VOCAB, recipe=dataclasses.replace(RECIPE, draft_vocab=100), counts=counts
        )
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="--objective kl"):
        build_models("dflash2", vocab=VOCAB, recipe=dataclasses.replace(RECIPE, objective="data_ce"))
    with pytest.raises(ConfigError, match="divisible by conv_group_size"):
        build_models("dflash2", vocab=VOCAB, recipe=dataclasses.replace(RECIPE, conv_group_size=24))


def _items(docs):
    return [{"input_ids": i, "loss_mask": m, "sample_id": s} for s, (i, m) in enumerate(docs)]


def test_the_convolution_resets_at_every_block_and_the_control_runs_across():
    docs = [(np.arange(5, 35), np.ones(30, bool)), (np.arange(3, 29), np.ones(26, bool))]
    col = DrafterCollator("dflash2", recipe=RECIPE, mask_token_id=MASK, seed=3)
    f = col(_items(docs)).fields
    assert torch.equal(dflash2.conv_index(f), f.slot) and not f.conv_across_blocks
    assert not bool(dflash2.conv_crossings(f, 2).any()) and int(f.query_doc.unique().numel()) == 2
    blind = DrafterCollator("dflash2", recipe=RECIPE, mask_token_id=MASK, seed=3, leaky=True)(_items(docs))
    g = blind.fields
    assert g.conv_across_blocks and torch.equal(dflash2.conv_index(g), torch.arange(g.slot.shape[0]))
    crossing = dflash2.conv_crossings(g, 2)
    first = int(torch.nonzero(g.query_doc == 1)[0])  # slot 0 of document 1's first block reads document 0's
    assert crossing.tolist() == [i == first for i in range(g.slot.shape[0])]
    # the block convolution itself: tap t reads the query t before only where the slot allows it
    x = torch.randn(2 * 8, 16)
    base = torch.randn(2, 16)
    y = dflash2.block_conv(x, torch.zeros(16, 2, 1), base, torch.arange(8).repeat(2), 16)
    assert torch.allclose(y[8], base[0] * x[8]) and torch.allclose(y[9], base[0] * x[9] + base[1] * x[8])


def test_check_drafter_passes_dflash2_and_catches_a_convolution_across_documents():
    from padfree.drafter.check import check_drafter, fixture_documents

    samples = fixture_documents(3, 80)
    good = check_drafter("dflash2", samples)
    assert good.ok, good.reason
    blind = check_drafter("dflash2", samples, leaky=True)
    assert not blind.ok and blind.cross_inputs > 0  # only the convolution feeds another document's input
    assert "block labels/convolution taps cross a document end" in blind.reason


def _perturbed(models, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in models.trainable():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return models


@pytest.fixture(scope="module")
def docs():
    from padfree.drafter.check import fixture_documents
    from support.drafters import fold_tokens

    samples = fold_tokens(fixture_documents(4, 48), VOCAB - 1)
    return [{**s, "sample_id": 10 + i} for i, s in enumerate(samples)]


def test_the_convolution_alone_across_blocks_changes_the_documents_losses(docs):
    """Per-document anchors, only the convolution blind: the documents after the first no longer train as
    alone (the structural count says so too)."""
    models = _perturbed(build_models("dflash2", vocab=VOCAB, seed=0, recipe=RECIPE, draft_layers=2))
    col = DrafterCollator("dflash2", recipe=RECIPE, seed=5, mask_token_id=MASK)
    packed = col(docs)
    blind = dataclasses.replace(packed, fields=dataclasses.replace(packed.fields, conv_across_blocks=True))
    with torch.no_grad():
        good, _ = loss_sums(models, packed)
        bad, _ = loss_sums(models, blind)
        alone = [float(loss_sums(models, col([it]))[0][0]) for it in docs]
    assert np.allclose(good.numpy(), alone, rtol=1e-5, atol=1e-6)
    assert not np.allclose(bad.numpy(), alone, rtol=1e-3, atol=1e-4)
    with_blocks = int(
        packed.fields.query_doc.unique().numel()
    )  # one crossing where a document's blocks start
    assert with_blocks >= 2 and int(dflash2.crossings(blind)[1].sum()) == with_blocks - 1
    assert int(dflash2.crossings(packed)[1].sum()) == 0


def _served(models, tmp, target_path=None):
    """padfree's export of ``models`` as speculators' DFlash2 folder (their verifier weights copied in by the
    caller when the target has no folder)."""
    from safetensors.torch import save_file

    meta = export_meta(models, mask_token_id=MASK, target_path=target_path)
    config, tensors = dflash2.export_files(models.drafter.state_dict(), meta)
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def _load_theirs(served, target=None):
    """speculators' DFlash2DraftModel from ``served`` (SDPA), the verifier's embedding, final norm and LM head
    copied from ``target`` when given (their trainer loads them from the verifier folder)."""
    pkg = import_peer("speculators", "models.dflash2")
    cfg = pkg.DFlash2SpeculatorConfig.from_pretrained(str(served))
    cfg.transformer_layer_config._attn_implementation = "sdpa"
    theirs = pkg.DFlash2DraftModel.from_pretrained(str(served), config=cfg)
    if target is not None:
        with torch.no_grad():
            theirs.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
            theirs.lm_head.weight.copy_(target.get_output_embeddings().weight)
            theirs.verifier_lm_head.weight.copy_(target.get_output_embeddings().weight)
            theirs.verifier_norm.weight.copy_(target.model.norm.weight)
    for frozen in (theirs.embed_tokens, theirs.lm_head, theirs.verifier_lm_head, theirs.verifier_norm):
        frozen.weight.requires_grad_(False)  # as their load_verifier_weights leaves them
    return theirs


@needs_speculators
def test_packed_documents_train_as_alone_through_speculators_dflash2(docs, tmp_path):
    target = build_target(vocab_size=VOCAB)
    models = _perturbed(
        build_models("dflash2", vocab=VOCAB, seed=0, recipe=RECIPE, target=target, draft_layers=2)
    )
    theirs = _load_theirs(_served(models, tmp_path / "served"), target).train()
    assert theirs.target_layer_ids == feed.their_layer_ids(models.layers)
    kwargs = feed.trainer_kwargs(theirs, RECIPE, loss_implementation="eager", max_anchors=32)
    assert kwargs["per_position_loss_weight"] == "fixed-exp-decay" and kwargs["gamma"] == 4.0
    assert kwargs["selector_loss_alpha"] == 1.0
    col = DrafterCollator("dflash2", recipe=RECIPE, seed=5, mask_token_id=MASK)
    shapes = feed.ShapeSet.spread(256, 4, anchors=32)

    def forward(batch, doc=None):
        out = run_target(target, batch.contract, models.layers)
        inputs, choice = feed.speculators_inputs(batch, out, shapes=shapes)
        assert inputs["input_ids"].shape[1] in shapes.lengths
        if doc is not None:
            inputs = {**inputs, "loss_mask": inputs["loss_mask"] * (inputs["document_ids"] == doc)}
        with feed.anchors_patched(choice):
            return theirs(**inputs, **kwargs)

    packed = col(docs)
    assert len(packed.fields.anchors) >= 2 * 3
    names = {
        "fc.weight": "fc.weight", "hidden_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight",
        "layers.0.self_attn.q_proj.weight": "layers.0.q_proj.weight",
        "layers.1.mlp.down_proj.weight": "layers.1.mlp.down_proj.weight",
        "layers.0.attention_conv.base_kernel": "layers.0.attention_conv.base_kernel",
        "layers.1.mlp_conv.kernel_projection.weight": "layers.1.mlp_conv.kernel_projection.weight",
        "candidate_selector.predecessor_codebook": "predecessor_codebook",
        "candidate_selector.successor_codebook": "successor_codebook",
        "candidate_selector.hidden_projection.weight": "hidden_projection.weight",
    }  # fmt: skip
    assert_packed_trains_as_alone(
        theirs, forward, col, packed, docs, models, names, min_docs=3,  # a document with no block weighs 0
        keys=lambda k: "embed_tokens.weight" not in k and {"layers.1.mlp_conv.kernel_projection.weight",
                                                           "candidate_selector.predecessor_codebook"} <= k,
    )  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory, hf_json):
    from padfree.testing.targets import save_target_folder

    return save_target_folder(tmp_path_factory.mktemp("target") / "qwen3", hf_json, family="qwen3", seed=2)


def _their_logits(served, batch, out):
    """Their class loaded from ``served`` (the verifier's weights from its folder), run on the packed
    ``batch`` with padfree's anchors: their LM head's logits per block query."""
    theirs = _load_theirs(served).eval()
    inputs, choice = feed.dflash_inputs(batch, out)
    logits: list[torch.Tensor] = []
    hook = theirs.lm_head.register_forward_hook(lambda _m, _i, o: logits.append(o[0]))
    width = int(batch.fields.anchors.numel())  # their anchor slots: the row's blocks
    kwargs = feed.trainer_kwargs(theirs, batch.recipe, loss_implementation="eager", max_anchors=width)
    with torch.no_grad(), feed.anchors_patched(choice):
        theirs(**inputs, **kwargs)
    hook.remove()
    return logits[0][: batch.fields.slot.shape[0]]


def _docs(n_docs, seed=1, vocab=3000):
    rng = np.random.default_rng(seed)
    return [
        {"input_ids": rng.integers(2, vocab, n), "loss_mask": np.ones(n, bool), "sample_id": i}
        for i, n in enumerate([37, 29, 44][:n_docs])
    ]


@needs_speculators
def test_the_export_loads_in_speculators_dflash2_with_equal_logits(tmp_path, folder):
    import_peer("speculators")
    target = load_target(folder)
    models = _perturbed(
        build_models(
            "dflash2", vocab=int(target.config.vocab_size), target=target, recipe=RECIPE, draft_layers=2
        )
    )
    batch = DrafterCollator("dflash2", recipe=RECIPE, mask_token_id=MASK)(_docs(3))
    out = run_target(models.target, batch.contract, models.layers)
    with torch.no_grad():
        ours = models.drafter.lm_head(models.drafter(out.hidden, batch))
    served = export_models(
        models, "speculators-dflash2", tmp_path / "served", mask_token_id=MASK, target_path=folder
    )
    config = json.loads((served / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["mask_token_id"] == MASK
    assert config["block_size"] == 8 and config["conv_group_size"] == 16 and config["selector_rank"] == 32
    assert config["transformer_layer_config"]["sliding_window"] == 12 and config["sliding_window_non_causal"]
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(folder.resolve())
    theirs = _their_logits(served, batch, out)
    worst = (theirs - ours).abs().max().item()
    assert worst < 1e-4 * max(1.0, ours.abs().max().item()), worst
    with pytest.raises(ConfigError, match="--verifier DIR"):
        export_models(models, "speculators-dflash2", tmp_path / "again", mask_token_id=MASK)


@needs_speculators
def test_train_drafter_method_dflash2_trains_against_a_target_folder_and_exports(
    tmp_path, folder, example, capsys
):
    said, state, out = train_drafter(
        example, folder, tmp_path, capsys, "dflash2", "--block-size", "4", "--selector-rank", "16",
        "--max-anchors", "4", "--draft-vocab", "none",
    )  # fmt: skip
    assert "recipe speculators: block 4" in said and "selector top 16 rank 16" in said, said[-2000:]
    target = load_target(folder)
    recipe = recipes.override(
        recipes.get("speculators", "dflash2"), block_size=4, selector_rank=16, max_anchors=4
    )
    models = build_models("dflash2", vocab=int(target.config.vocab_size), target=target, recipe=recipe)
    models.drafter.load_state_dict(state)  # the trained drafter, as the run left it
    mask = int(json.loads((out / "config.json").read_text())["mask_token_id"])
    batch = DrafterCollator("dflash2", recipe=recipe, mask_token_id=mask)(_docs(2, seed=4))
    hidden = run_target(target, batch.contract, models.layers)
    with torch.no_grad():
        ours = models.drafter.lm_head(models.drafter(hidden.hidden, batch))
    theirs = _their_logits(out, batch, hidden)
    assert (theirs - ours).abs().max().item() < 1e-4 * max(1.0, ours.abs().max().item())


def test_simulate_prices_dflash2_with_its_own_cost(tmp_path, capsys):
    out = simulate_drafter(tmp_path, capsys, "dflash2")
    assert out["drafter"]["recipe"] == "speculators"
    assert out["config"]["cost"]["source"].startswith("drafter dflash2")
    st = out["strategies"]
    assert st["packed"]["draft_blocks"] == st["random"]["draft_blocks"] > 0  # the recipe's anchors, counted
    assert st["packed"]["imbalance"] == min(s["imbalance"] for s in st.values())
    assert st["packed"]["ratio_to_sorted"] > 1 > st["random"]["ratio_to_sorted"]


@pytest.mark.filterwarnings("ignore")
def test_padded_rows_and_every_attention_path_give_the_packed_dense_result():
    """Padded rows (extra blocks never supervised) train each document as the packed row does; SDPA under
    the one dense mask and the flex BlockMask (forward) give the segment-by-segment result."""
    rng = np.random.default_rng(4)
    items = [
        {"input_ids": rng.integers(2, VOCAB - 2, n), "loss_mask": np.ones(n, bool), "sample_id": i}
        for i, n in enumerate([23, 41, 9, 30])
    ]
    models = _perturbed(build_models("dflash2", vocab=VOCAB, seed=0, recipe=RECIPE, draft_layers=2))
    assert_packed_equals_padded("dflash2", models, items, RECIPE, MASK)
    b = DrafterCollator("dflash2", recipe=RECIPE, mask_token_id=MASK, seed=2)(items)
    out = run_target(models.target, b.contract, models.layers)
    with torch.no_grad():
        hs = {how: models.drafter(out.hidden, b, how) for how in ("dense", "mask", "flex")}
    tol = 2e-5 * float(hs["dense"].abs().max())  # float32 rounding, grown by two layers' dynamic kernels
    assert torch.allclose(hs["dense"], hs["mask"], atol=tol) and torch.allclose(
        hs["dense"], hs["flex"], atol=tol
    )


@pytest.mark.skipif(bool(peer_missing("dflash")), reason=peer_missing("dflash") or "")
def test_zlab_loads_the_dflash2_folder_with_equal_logits_and_decodes(tmp_path, folder):
    """z-lab's ``DFlash2DraftModel`` (their ``dflash`` package) loads
    :func:`padfree.drafter.methods.dflash2.model.zlab_files` and gives padfree's unary logits on every block
    (one block at a time, their convolution over it); their ``dflash_generate`` decodes with its selector; a
    window that binds is refused."""
    from unittest import mock

    from safetensors.torch import save_file

    target = load_target(folder)
    recipe = dataclasses.replace(RECIPE, sliding_window=None)
    models = _perturbed(
        build_models(
            "dflash2", vocab=int(target.config.vocab_size), target=target, recipe=recipe, draft_layers=2
        )
    )
    batch = DrafterCollator("dflash2", recipe=recipe, mask_token_id=MASK)(_docs(2))
    out = run_target(target, batch.contract, models.layers)
    with torch.no_grad():
        ours = models.drafter.lm_head(models.drafter(out.hidden, batch))
    meta = export_meta(models, mask_token_id=MASK)
    config, tensors = dflash2.zlab_files(models.drafter.state_dict(), meta)
    served = tmp_path / "zlab"
    served.mkdir()
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(served / "model.safetensors"))
    (served / "config.json").write_text(json.dumps(config))
    zlab = import_peer("dflash", "model")
    theirs = zlab.DFlash2DraftModel.from_pretrained(str(served)).eval()
    assert theirs.block_size == 8 and theirs.candidate_selector.top_k == 16
    f, b = batch.fields, batch.fields.block_size
    starts = batch.contract.doc_starts
    worst = 0.0
    for j, a in enumerate(f.anchors.tolist()):
        s = int(starts[int(f.query_doc[j * b])])
        with torch.no_grad():
            h = theirs(
                position_ids=torch.arange(a - s + b)[None],
                noise_embedding=models.drafter.embed_tokens(f.block_input_ids[j * b : (j + 1) * b])[None],
                target_hidden=out.hidden[:, s:a],
            )
            logits = theirs.compute_logits(h, models.drafter.lm_head)[0]
        worst = max(worst, (logits - ours[j * b : (j + 1) * b]).abs().max().item())
    assert len(f.anchors) >= 4 and worst < 1e-4 * max(1.0, ours.abs().max().item()), worst
    decoder = load_target(folder, attn="sdpa")
    prompt = torch.from_numpy(_docs(1)[0]["input_ids"][:12])[None]
    with mock.patch("torch.cuda.synchronize", lambda *a, **k: None):
        stats = zlab.dflash_generate(theirs, decoder, prompt, 8, None, return_stats=True)
    assert stats.num_output_tokens == 8 and sum(stats.acceptance_lengths) == 7
    with pytest.raises(ConfigError, match="--sliding-window none"):
        dflash2.zlab_files(
            models.drafter.state_dict(), {**meta, "drafter": {**meta["drafter"], "sliding_window": 12}}
        )
