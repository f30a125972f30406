"""Inputs for vllm speculators' drafters built from padfree batches: replaying their indexing rules (DFlash
block labels ``loss_mask[a + k]``, EAGLE-3 ``align_for_step`` shifts over the row) on what we hand them,
no supervised position reads another document; the leaky packed row does."""

import numpy as np
import pytest
import torch

from padfree.core.anchors import AnchorPolicy
from padfree.drafter import recipes
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.target import TargetOutput
from padfree.errors import ConfigError
from padfree.integrations.feed import dflash_inputs, eagle3_inputs, speculators_inputs, trainer_kwargs


def items(lens, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lens):
        out.append({"input_ids": rng.integers(0, 50, n), "loss_mask": np.ones(n, bool), "sample_id": i})
    return out


def fake_target(c, layers=2, h=8):
    g = torch.Generator().manual_seed(0)
    last = torch.randn(1, c.width, h, generator=g)
    return TargetOutput(torch.randn(1, c.width, layers * h, generator=g), last, last + 1)


def test_dflash_inputs_keep_speculators_labels_inside_documents():
    b = DrafterCollator("dflash", AnchorPolicy(block_size=4, density=0.5, partial=False), mask_token_id=49)(
        items([9, 30, 5, 22])
    )
    kw, anchor_fn = dflash_inputs(b, fake_target(b.contract))
    assert "max_anchors" not in kw  # their trainer passes it (feed.trainer_kwargs), once
    anchors, valid = anchor_fn(kw["loss_mask"], len(b.fields.anchors) + 3, 4)
    assert valid.sum() == len(b.fields.anchors) and torch.equal(anchors[valid], b.fields.anchors)
    doc, mask = kw["document_ids"][0], kw["loss_mask"][0]
    a = anchors[valid].repeat_interleave(4) + torch.arange(4).repeat(int(valid.sum()))
    labelled = (torch.arange(len(a)) % 4 != 0) & mask[a].bool()  # their aligned_loss_mask, slot 0 dropped
    assert labelled.any()
    assert (doc[a[labelled]] == doc[anchors[valid].repeat_interleave(4)[labelled]]).all()
    with pytest.raises(ConfigError, match="partial=False"):
        partial = DrafterCollator("dflash", AnchorPolicy(block_size=4, density=1.0), mask_token_id=49)
        b2 = partial(items([9, 30, 5, 22]))
        dflash_inputs(b2, fake_target(b2.contract))


def crossings(doc, mask, ttt):
    """Scored (step, position) pairs joining two documents under their rule: at step ``k`` the logits of
    position ``t`` meet the target and loss mask of ``t + k``, over the whole row."""
    n = doc.shape[0]
    count = 0
    for k in range(ttt):
        for t in range(n - k):
            if mask[t + k] and doc[t + k] != doc[t]:
                count += 1
    return count


def test_eagle3_inputs_leave_no_scored_pair_across_documents():
    ttt = 4
    b = DrafterCollator("eagle3", ttt=ttt)(items([9, 30, 2, 22]))
    kw = eagle3_inputs(b, fake_target(b.contract, layers=3), ttt)
    doc, mask = kw["document_ids"][0], kw["loss_mask"][0]
    assert crossings(doc, mask, ttt) == 0
    assert kw["hidden_states"].shape[1] == doc.shape[0] == 8 + 29 + 1 + 21
    assert mask.sum() == (8 - 3) + (29 - 3) + 0 + (21 - 3)  # the first ttt - 1 positions carry no loss
    # their shift_batch convention: tokens 1..L-1 against hidden states 0..L-2, per document
    c = b.contract
    first = c.doc_slice(0)
    assert torch.equal(kw["input_ids"][0, :8], c.flat("input_ids")[0, first][1:])
    assert torch.equal(
        kw["verifier_last_hidden_states"][0, :8], fake_target(c, layers=3).prenorm[0, first][1:]
    )
    # the plain packed row (what a row-level packer hands them) is scored across documents
    assert crossings(doc, torch.ones_like(mask), ttt) > 0


def test_a_document_gets_the_same_noise_and_anchors_through_padfree_and_through_feed():
    """One keyed generator per document: padfree's trainer (``with_noise``) and the speculators feed add the
    same noise to a document's target layers, packed or alone, and its anchors are the ones it gets alone."""
    from padfree.core.anchors import choose_anchors
    from padfree.drafter import recipes
    from padfree.drafter.train import with_noise

    rec = recipes.get("speculators", "dflash")
    assert rec.noise > 0
    policy = rec.anchor_policy(partial=False)
    collate = DrafterCollator("dflash", policy, recipe=rec, seed=7, mask_token_id=49)
    collate.set_epoch(2)
    docs = items([40, 64, 33], seed=3)
    packed = collate(docs)
    target = fake_target(packed.contract)
    mine = with_noise(target, packed).hidden
    theirs, _ = dflash_inputs(packed, target)
    noise = mine - target.hidden
    assert torch.equal(mine, theirs["hidden_states"]) and noise.abs().max() <= rec.noise
    assert noise.abs().min() > 0  # every position of every document is noised
    c, anchors = packed.contract, packed.fields.anchors
    for d, doc in enumerate(docs):  # each document alone: the same noise and the same anchors
        s = c.doc_slice(d)
        alone = collate([doc])
        alone_target = TargetOutput(target.hidden[:, s], target.last[:, s], target.prenorm[:, s])
        alone_hidden = with_noise(alone_target, alone).hidden
        assert torch.allclose(alone_hidden - alone_target.hidden, noise[:, s], atol=1e-6)
        assert torch.equal(dflash_inputs(alone, alone_target)[0]["hidden_states"], alone_hidden)
        want = choose_anchors(doc["loss_mask"], policy, seed=7, epoch=2, sample_id=d) + s.start
        assert anchors[(anchors >= s.start) & (anchors < s.stop)].tolist() == want.tolist()
    other = DrafterCollator("dflash", policy, recipe=rec, seed=8, mask_token_id=49)(docs)
    assert not torch.equal(with_noise(target, other).hidden, mine)  # the seed enters the key


class _Their:
    """A speculators model class whose ``get_trainer_kwargs`` hands back the keywords it was given."""

    @classmethod
    def get_trainer_kwargs(cls, **kw):
        return kw, {}


def test_each_method_builds_its_own_speculators_inputs_and_trainer_kwargs():
    b = DrafterCollator("dflash", AnchorPolicy(block_size=4, density=0.5, partial=False), mask_token_id=49)(
        items([9, 30, 5, 22])
    )
    kw, choice = speculators_inputs(b, fake_target(b.contract))
    theirs, their_choice = dflash_inputs(b, fake_target(b.contract))
    assert choice is not None and torch.equal(choice.anchors, their_choice.anchors)
    assert all(torch.equal(kw[k], theirs[k]) for k in theirs)
    e = DrafterCollator("eagle3", ttt=3)(items([9, 30, 2, 22]))
    kw, choice = speculators_inputs(e, fake_target(e.contract, layers=3))
    assert choice is None and torch.equal(
        kw["loss_mask"], eagle3_inputs(e, fake_target(e.contract, layers=3))["loss_mask"]
    )
    d = trainer_kwargs(
        _Their(), recipes.get("speculators", "dflash"), max_anchors=64, loss_implementation="eager"
    )
    assert d["max_anchors"] == 64 and d["loss_implementation"] == "eager" and "ttt_steps" not in d
    e3 = recipes.get("speculators", "eagle3")
    assert trainer_kwargs(_Their(), e3)["ttt_steps"] == e3.ttt and "max_anchors" not in trainer_kwargs(
        _Their(), e3
    )
    with pytest.raises(ConfigError, match="speculators' DFlash trains"):
        trainer_kwargs(_Their(), recipes.get("specforge", "dflash"))
