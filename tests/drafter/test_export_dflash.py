"""A DFlash drafter exported by padfree loads in z-lab's ``dflash`` package
(``DFlashDraftModel.from_pretrained``) and gives the same logits as padfree's forward on the same blocks, for
every block of a packed row of two documents, under every recipe the format can hold (SpecForge's: full
attention in the block; speculators' without a binding window: causal in the block); their
``dflash_generate`` decodes with it (its CUDA timer given a no-op synchronize). A drafter trained with a
context window that binds (speculators' preset) is refused in one line: z-lab's class slides its window per
query, and gives other logits."""

import dataclasses
import json
from unittest import mock

import numpy as np
import pytest
import torch

from padfree.drafter import recipes
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.export import export_meta, export_models
from padfree.drafter.methods.dflash.model import export_files
from padfree.drafter.target import load_target, run_target
from padfree.drafter.train import build_models
from padfree.errors import ConfigError
from padfree.testing.targets import save_target_folder
from support.peers import import_peer, peer_missing

REASON = peer_missing("dflash")
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON)

MASK = 7
LENGTHS = (37, 23)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, hf_json):
    return save_target_folder(tmp_path_factory.mktemp("target") / "qwen3", hf_json, family="qwen3", seed=1)


def _recipe(name: str, window: int | None) -> recipes.Recipe:
    r = recipes.override(recipes.get(name, "dflash"), block_size=4, max_anchors=6)
    return dataclasses.replace(r, sliding_window=window)


def _trained(folder, recipe):
    """A drafter with trained-looking weights (norms away from 1, projections moved) on the target of
    ``folder``, a packed row of two documents, and padfree's logits for every block query."""
    target = load_target(folder)
    m = build_models("dflash", vocab=target.config.vocab_size, recipe=recipe, target=target, draft_layers=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.trainable():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    rng = np.random.default_rng(0)
    docs = []
    for i, n in enumerate(LENGTHS):
        mask = np.zeros(n, bool)
        mask[n // 3 :] = True
        docs.append({"input_ids": rng.integers(2, 5000, n), "loss_mask": mask, "sample_id": i})
    batch = DrafterCollator("dflash", recipe=recipe, layout="packed", mask_token_id=MASK)(docs)
    out = run_target(m.target, batch.contract, m.layers)
    with torch.no_grad():
        ours = m.drafter.lm_head(m.drafter(out.hidden, batch))
    return m, docs, batch, out, ours


def _worst(theirs, m, batch, out, ours) -> float:
    """The largest difference between z-lab's logits and ``ours`` over every block: their model sees one
    document, its context before the anchor, then the block."""
    f, b = batch.fields, batch.fields.block_size
    starts = batch.contract.doc_starts
    assert len(f.anchors) >= 8
    worst = 0.0
    for j, a in enumerate(f.anchors.tolist()):
        s = int(starts[int(f.query_doc[j * b])])
        with torch.no_grad():
            h = theirs(
                position_ids=torch.arange(a - s + b)[None],
                noise_embedding=m.drafter.embed_tokens(f.block_input_ids[j * b : (j + 1) * b])[None],
                target_hidden=out.hidden[:, s:a],
            )
            logits = theirs.compute_logits(h, m.drafter.lm_head)[0]
        worst = max(worst, (logits - ours[j * b : (j + 1) * b]).abs().max().item())
    return worst


@pytest.mark.parametrize(
    ("name", "window"),
    [("specforge", None), ("speculators", None), ("speculators", 4096)],
    ids=["specforge", "speculators-no-window", "speculators-window-spans-context"],
)
def test_zlab_loads_the_export_and_computes_the_same_logits(tmp_path, folder, name, window):
    recipe = _recipe(name, window)
    m, docs, batch, out, ours = _trained(folder, recipe)
    export_models(m, "dflash", tmp_path / "served", mask_token_id=MASK, target_path=folder)

    zlab = import_peer("dflash", "model")
    theirs = zlab.DFlashDraftModel.from_pretrained(str(tmp_path / "served")).eval()
    assert (
        theirs.target_layer_ids == list(m.layers) and theirs.block_size == 4 and theirs.mask_token_id == MASK
    )
    assert all(layer.self_attn.is_causal == recipe.causal_in_block for layer in theirs.layers)
    worst = _worst(theirs, m, batch, out, ours)
    assert worst < 1e-4 * max(1.0, ours.abs().max().item()), worst

    decoder = load_target(folder, attn="sdpa")
    prompt = torch.from_numpy(docs[0]["input_ids"][:12])[None]
    with mock.patch("torch.cuda.synchronize", lambda *a, **k: None):
        stats = zlab.dflash_generate(theirs, decoder, prompt, 8, None, return_stats=True)
    # the prefill gives the first token, each verification step the accepted drafts plus the target's own
    assert stats.num_output_tokens == 8 and sum(stats.acceptance_lengths) == 7
    assert min(stats.acceptance_lengths) >= 1


@pytest.mark.parametrize("window", [8, 2048])
def test_a_binding_window_is_refused_in_one_line(tmp_path, folder, window):
    recipe = _recipe("speculators", window)
    target = load_target(folder)
    m = build_models("dflash", vocab=target.config.vocab_size, recipe=recipe, target=target, draft_layers=2)
    with pytest.raises(ConfigError) as info:
        export_models(m, "dflash", tmp_path / "served", mask_token_id=MASK, target_path=folder)
    line = str(info.value)
    assert "\n" not in line and f"seeing the {window} positions before its anchor" in line, line
    assert "--sliding-window none" in line and not (tmp_path / "served").exists()


def test_zlab_window_gives_other_logits_than_trained(tmp_path, folder):
    """Why the refusal: z-lab's class, given the window in its config, is served with other attention."""
    m, _docs, batch, out, ours = _trained(folder, _recipe("speculators", 8))
    state = {k: v.detach() for k, v in m.drafter.state_dict().items()}
    config, tensors = export_files(state, export_meta(m, mask_token_id=MASK, target_path=folder))
    assert config["sliding_window"] == 8 and config["layer_types"] == ["sliding_attention"] * 2
    served = tmp_path / "served"
    served.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(served / "model.safetensors"))
    (served / "config.json").write_text(json.dumps(config))
    zlab = import_peer("dflash", "model")
    theirs = zlab.DFlashDraftModel.from_pretrained(str(served)).eval()
    assert _worst(theirs, m, batch, out, ours) > 1e-2
