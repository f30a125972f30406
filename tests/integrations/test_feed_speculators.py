"""padfree.integrations.feed against speculators' own DFlashDraftModel and Eagle3DraftModel (their 0.9.0
wheel): fed a packed padfree batch with their own target_layer_ids and their trainer's keywords, every
document's loss equals the document alone, and the packed row's gradient is the alone gradients weighted as
their row mean weighs them."""

import pytest
import torch

from support.peers import peer_missing

REASON = peer_missing("speculators")
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON)

BLOCK, VOCAB = 4, 256


@pytest.fixture(scope="module")
def docs():
    from padfree.drafter.check import fixture_documents
    from support.drafters import fold_tokens

    samples = fold_tokens(fixture_documents(3, 80), VOCAB)  # a small vocabulary keeps their LM heads cheap
    return [{**s, "sample_id": 10 + i} for i, s in enumerate(samples)]


@pytest.fixture(scope="module")
def target(docs):
    from padfree.drafter.target import build_target

    return build_target(vocab_size=VOCAB)


def grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def test_layer_ids_are_hidden_states_indices():
    from padfree.errors import ConfigError
    from padfree.integrations import feed

    assert feed.target_layers([2, 4]) == (1, 3) and feed.their_layer_ids((1, 3)) == [2, 4]
    with pytest.raises(ConfigError, match="embedding output"):
        feed.target_layers([0, 3])


def test_dflash_documents_train_as_alone_through_their_model(docs, target):
    from padfree.drafter import recipes
    from padfree.drafter.collate import DrafterCollator
    from padfree.drafter.target import run_target
    from padfree.integrations import feed
    from support import drafters

    vocab = int(target.config.vocab_size)
    rec = recipes.override(recipes.get("speculators", "dflash"), block_size=BLOCK)
    col = DrafterCollator(
        "dflash", rec.anchor_policy(partial=False), recipe=rec, seed=5, mask_token_id=vocab - 1
    )
    model = drafters.speculators_dflash(target, (1, 3), block_size=BLOCK, mask_token_id=vocab - 1)
    assert model.target_layer_ids == [2, 4]  # theirs: hidden_states indices; padfree's layers 1 and 3
    shapes = feed.ShapeSet.spread(256, 4, anchors=256)
    kwargs = feed.trainer_kwargs(model, rec, loss_implementation="eager", max_anchors=256)
    assert kwargs["per_position_loss_weight"] == "dpace" and kwargs["max_anchors"] == 256

    def forward(batch, doc=None):
        out = run_target(target, batch.contract, feed.target_layers(model))
        inputs, choice = feed.dflash_inputs(batch, out, shapes=shapes)
        assert inputs["input_ids"].shape[1] in shapes.lengths
        if doc is not None:
            inputs = {**inputs, "loss_mask": inputs["loss_mask"] * (inputs["document_ids"] == doc)}
        with feed.anchors_patched(choice):
            return model(**inputs, **kwargs)

    packed = col(docs)
    model.zero_grad()
    forward(packed)[1].backward()
    g_packed = grads(model)
    expected = torch.zeros_like(g_packed)
    total = 0.0
    for d, item in enumerate(docs):
        with torch.no_grad():
            in_row = float(forward(packed, d)[1])
        model.zero_grad()
        _, alone, metrics = forward(col([item]))
        alone.backward()
        alone_loss = float(alone.detach())
        assert abs(in_row - alone_loss) < 1e-5 * max(1.0, abs(alone_loss))
        den = float(metrics["full_acc_total"])  # supervised block slots of the document
        assert den > 0
        expected += den * grads(model)
        total += den
    # their row loss is sum(num_d) / sum(den_d): its gradient weighs each document's by its supervised slots
    assert torch.allclose(g_packed, expected / total, atol=1e-6, rtol=1e-4)

    # their own row-level select_anchors on the same packed row gives the documents other anchors
    out = run_target(target, packed.contract, feed.target_layers(model))
    inputs, _ = feed.dflash_inputs(packed, out)
    torch.manual_seed(0)
    theirs, valid = model._build_attention_mask(inputs["loss_mask"], 64, inputs["document_ids"], "cpu")[2:]
    assert set(theirs[valid].tolist()) != set(packed.fields.anchors.tolist())


def test_eagle3_documents_train_as_alone_through_their_model(docs, target):
    from padfree.drafter import recipes
    from padfree.drafter.collate import DrafterCollator
    from padfree.drafter.methods.eagle3.spec import low_mid_high
    from padfree.drafter.target import run_target
    from padfree.integrations import feed
    from support import drafters

    rec = recipes.get("speculators", "eagle3")
    layers = low_mid_high(int(target.config.num_hidden_layers))
    model = drafters.speculators_eagle3(target, layers, ttt=rec.ttt)
    assert feed.target_layers(model) == layers
    kwargs = feed.trainer_kwargs(model, rec, loss_implementation="eager")
    assert kwargs["ttt_steps"] == rec.ttt == 3
    col = DrafterCollator("eagle3", recipe=rec, seed=5)
    shapes = feed.ShapeSet.spread(256, 4)

    def forward(batch, doc=None):
        inputs = feed.eagle3_inputs(batch, run_target(target, batch.contract, layers), shapes=shapes)
        assert "ttt_steps" not in inputs  # it comes with their trainer's keywords, once
        if doc is not None:
            inputs = {**inputs, "loss_mask": inputs["loss_mask"] * (inputs["document_ids"] == doc)}
        return model(**inputs, **kwargs)

    packed = col(docs)
    model.zero_grad()
    forward(packed)[1].backward()
    assert torch.isfinite(grads(model)).all() and grads(model).abs().sum() > 0
    for d, item in enumerate(docs):
        with torch.no_grad():
            in_row = float(forward(packed, d)[1])
            alone = float(forward(col([item]))[1])
        assert abs(in_row - alone) < 1e-5 * max(1.0, abs(alone)), (d, in_row, alone)
