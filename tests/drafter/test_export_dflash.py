"""A DFlash drafter exported by padfree loads in z-lab's ``dflash`` package
(``DFlashDraftModel.from_pretrained``) and gives the same logits as padfree's forward on the same blocks, for
every block of a packed row of two documents; their ``dflash_generate`` decodes with it (its CUDA timer given
a no-op synchronize)."""

from unittest import mock

import numpy as np
import pytest
import torch

from padfree.drafter import recipes
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.export import export_models
from padfree.drafter.target import load_target, run_target
from padfree.drafter.train import build_models
from padfree.testing.peers import import_peer, peer_missing
from padfree.testing.targets import save_target_folder

REASON = peer_missing("dflash")
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON)


def test_zlab_loads_the_export_and_computes_the_same_logits(tmp_path, hf_json):
    folder = save_target_folder(tmp_path / "qwen3", hf_json, family="qwen3", seed=1)
    target = load_target(folder)
    recipe = recipes.override(recipes.get("specforge", "dflash"), block_size=4, max_anchors=6)
    m = build_models("dflash", vocab=target.config.vocab_size, recipe=recipe, target=target, draft_layers=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained-looking weights: norms away from 1, projections moved
        for p in m.trainable():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    rng = np.random.default_rng(0)
    docs = []
    for i, n in enumerate((37, 23)):
        mask = np.zeros(n, bool)
        mask[n // 3 :] = True
        docs.append({"input_ids": rng.integers(2, 5000, n), "loss_mask": mask, "sample_id": i})
    batch = DrafterCollator("dflash", recipe=recipe, layout="packed", mask_token_id=7)(docs)
    out = run_target(m.target, batch.contract, m.layers)
    with torch.no_grad():
        ours = m.drafter.lm_head(m.drafter(out.hidden, batch))
    export_models(m, "dflash", tmp_path / "served", mask_token_id=7, target_path=folder)

    zlab = import_peer("dflash", "model")
    theirs = zlab.DFlashDraftModel.from_pretrained(str(tmp_path / "served")).eval()
    assert theirs.target_layer_ids == list(m.layers) and theirs.block_size == 4 and theirs.mask_token_id == 7
    f, b = batch.fields, 4
    starts = batch.contract.doc_starts
    assert len(f.anchors) == 12  # 6 blocks in each document
    worst = 0.0
    for j, a in enumerate(f.anchors.tolist()):
        d = int(f.query_doc[j * b])
        s = int(starts[d])
        with torch.no_grad():  # their model sees one document: its context before the anchor, then the block
            h = theirs(
                position_ids=torch.arange(a - s + b)[None],
                noise_embedding=m.drafter.embed_tokens(f.block_input_ids[j * b : (j + 1) * b])[None],
                target_hidden=out.hidden[:, s:a],
            )
            logits = theirs.compute_logits(h, m.drafter.lm_head)[0]
        worst = max(worst, (logits - ours[j * b : (j + 1) * b]).abs().max().item())
    assert worst < 1e-4 * max(1.0, ours.abs().max().item()), worst

    decoder = load_target(folder, attn="sdpa")
    prompt = torch.from_numpy(docs[0]["input_ids"][:12])[None]
    with mock.patch("torch.cuda.synchronize", lambda *a, **k: None):
        stats = zlab.dflash_generate(theirs, decoder, prompt, 8, None, return_stats=True)
    # the prefill gives the first token, each verification step the accepted drafts plus the target's own
    assert stats.num_output_tokens == 8 and sum(stats.acceptance_lengths) == 7
    assert min(stats.acceptance_lengths) >= 1
