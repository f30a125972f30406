"""One reader of a packed row's boundaries, taken by every attention and mixer path from the call itself:
checkpointed layers replayed after other forwards or in another thread, THD rows, rows whose positions
continue, empty documents and models configured by hand are exact against each document alone through the
model's own attention, or refused in one line (issue 41)."""

from __future__ import annotations

import threading

import pytest
import torch

from padfree.checks.families import tiny_config
from padfree.errors import ConfigError
from padfree.torch import PackCollator
from padfree.torch.documents.boundaries import read_boundaries

FAMILIES = ("lfm2", "mamba", "qwen3_next")
ROWS = ((10, 22), (20, 12))  # two rows of the same length, documents cut at other places


def _model(family: str, attn: str, seed: int = 0):
    import transformers

    import padfree.torch.documents.attention  # noqa: F401  (registers padfree_varlen)

    cfg = tiny_config(family)
    if family == "bamba":
        cfg.attn_layer_indices = [1]  # a hybrid: Mamba-2, then attention
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()


def _docs(vocab: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [[torch.randint(0, vocab, (n,), generator=g) for n in row] for row in ROWS]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    target = labels[0, 1:]
    return torch.nn.functional.cross_entropy(logits[0, :-1], target, ignore_index=-100, reduction="sum")


def _alone_grads(family: str, rows) -> dict[str, torch.Tensor]:
    """Each document alone through the model's own (eager) attention."""
    ref = _model(family, "eager").train()
    for row in rows:
        for ids in row:
            _loss(ref(input_ids=ids[None], use_cache=False).logits, ids[None]).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def _packed(model, row) -> torch.Tensor:
    batch = dict(PackCollator()([{"input_ids": ids} for ids in row]))
    labels = batch.pop("labels")
    return _loss(model(**batch, use_cache=False).logits, labels)


def _assert_grads(model, expected: dict[str, torch.Tensor]) -> None:
    worst = 0.0
    for n, p in model.named_parameters():
        if n in expected:
            err = (p.grad - expected[n]).norm() / expected[n].norm().clamp_min(1e-12)
            worst = max(worst, float(err))
    assert worst < 1e-4, f"relative gradient error {worst:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("pattern", ["two_forwards", "backward_in_a_thread"])
def test_checkpointed_mixers_replay_with_their_own_boundaries(
    family: str, reentrant: bool, pattern: str
) -> None:
    model = _model(family, "padfree_varlen")
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    model.train()
    rows = _docs(model.config.vocab_size)
    expected = _alone_grads(family, rows)
    if pattern == "two_forwards":  # both rows' forwards, then one backward replaying both
        loss = _packed(model, rows[0]) + _packed(model, rows[1])
        loss.backward()
    else:  # each row's backward (its replay) runs in a thread of its own
        errors: list[BaseException] = []
        for row in rows:
            loss = _packed(model, row)

            def back(loss: torch.Tensor = loss) -> None:
                try:
                    loss.backward()
                except BaseException as exc:  # noqa: BLE001  (re-raised in the test's thread)
                    errors.append(exc)

            t = threading.Thread(target=back)
            t.start()
            t.join()
            if errors:
                raise errors[0]
    _assert_grads(model, expected)


@pytest.mark.parametrize("family", ["lfm2", "mamba"])
def test_layers_wrapped_by_torch_checkpoint_wrapper_replay_exactly(family: str) -> None:
    """torch's checkpoint_wrapper (what FSDP's activation checkpointing applies) replays a layer with its
    hooks: the layer finds the boundaries of the forward it replays, after another row's forward too."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _model(family, "padfree_varlen").train()
    inner = model.model if hasattr(model, "model") else model.backbone
    for i, layer in enumerate(inner.layers):
        inner.layers[i] = checkpoint_wrapper(layer)
    rows = _docs(model.config.vocab_size)
    expected = list(_alone_grads(family, rows).values())
    (_packed(model, rows[0]) + _packed(model, rows[1])).backward()
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert float((g - e).norm() / e.norm().clamp_min(1e-12)) < 1e-4


def test_a_replay_padfree_cannot_see_is_refused_in_one_line() -> None:
    """A mixer recomputed in backward by a checkpoint that runs no hook of padfree's: refused, not guessed."""
    model = _model("lfm2", "padfree_varlen").train()
    layer = model.model.layers[0]
    row = _docs(model.config.vocab_size)[0]
    batch = dict(PackCollator()([{"input_ids": ids} for ids in row]))
    original = layer.forward
    layer.forward = lambda *a, **k: torch.utils.checkpoint.checkpoint(  # type: ignore[method-assign]
        lambda *a2: original(*a2, **k), *a, use_reentrant=True
    )
    labels = batch.pop("labels")
    loss = _loss(model(**batch, use_cache=False).logits, labels)
    with pytest.raises(ConfigError, match="recomputed in the backward pass without the document boundaries"):
        loss.backward()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_thd_row_runs_mixers_per_padded_span(family: str) -> None:
    """A row laid out for SP/CP (documents padded inside their spans): attention and mixers both split it at
    the padded spans, and every real token equals its document alone."""
    model = _model(family, "padfree_varlen").eval()
    ref = _model(family, "eager").eval()
    row = _docs(model.config.vocab_size)[0]
    batch = dict(PackCollator(cp=4)([{"input_ids": ids} for ids in row]))
    batch.pop("labels")
    spans = batch["cu_seq_lens_q_padded"].tolist()
    assert batch["cu_seq_lens_q"].tolist()[-1] != spans[-1]  # the real lengths do not cover the row
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        for start, ids in zip(spans, row, strict=False):
            alone = ref(input_ids=ids[None], use_cache=False).logits[0]
            torch.testing.assert_close(packed[start : start + len(ids)], alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["lfm2", "bamba"])
def test_a_model_configured_by_hand_is_refused_in_one_line(family: str) -> None:
    """Its config names padfree_varlen, but its mixers never went through padfree: refused, not mixed."""
    model = _model(family, "eager").eval()
    model.config._attn_implementation = "padfree_varlen"
    for m in model.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = "padfree_varlen"
    row = _docs(model.config.vocab_size)[0]
    batch = dict(PackCollator()([{"input_ids": ids} for ids in row]))
    batch = {k: batch[k] for k in ("input_ids", "position_ids")}  # transformers' own packing rule
    with pytest.raises(ConfigError, match="was not prepared by padfree") as err, torch.no_grad():
        model(**batch, use_cache=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_learned_positions_restart_per_document(family: str) -> None:
    """GPT-2 and OPT given cu_seq_lens_q and no position_ids: positions restart per document (exact);
    given position_ids that continue across documents: refused in one line."""
    model = _model(family, "padfree_varlen").eval()
    ref = _model(family, "eager").eval()
    row = _docs(model.config.vocab_size)[0]
    batch = dict(PackCollator()([{"input_ids": ids} for ids in row]))
    batch.pop("labels")
    batch.pop("position_ids")
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        start = 0
        for ids in row:
            alone = ref(input_ids=ids[None], use_cache=False).logits[0]
            torch.testing.assert_close(packed[start : start + len(ids)], alone, rtol=1e-4, atol=1e-5)
            start += len(ids)
        batch["position_ids"] = torch.arange(sum(ROWS[0]))[None]
        with pytest.raises(ConfigError, match="position_ids do not restart at document 1"):
            model(**batch, use_cache=False)


@pytest.mark.parametrize("family", ["llama", "lfm2", "mamba"])
def test_an_empty_document_holds_no_token(family: str) -> None:
    """cu_seq_lens_q with an empty document (two equal entries): the empty one is dropped, the rest exact."""
    model = _model(family, "padfree_varlen").eval()
    ref = _model(family, "eager").eval()
    row = _docs(model.config.vocab_size)[0]
    batch = dict(PackCollator()([{"input_ids": ids} for ids in row]))
    batch.pop("labels")
    cu = batch["cu_seq_lens_q"]
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.cat([cu[:2], cu[1:]])  # [0, 10, 10, 32]
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        start = 0
        for ids in row:
            alone = ref(input_ids=ids[None], use_cache=False).logits[0]
            torch.testing.assert_close(packed[start : start + len(ids)], alone, rtol=1e-4, atol=1e-5)
            start += len(ids)


def test_the_reader_gives_every_form_once() -> None:
    kw = {
        "cu_seq_lens_q": torch.tensor([0, 3, 5], dtype=torch.int32),
        "cu_seq_lens_q_padded": torch.tensor([0, 4, 8], dtype=torch.int32),
    }
    b = read_boundaries(kw, 1, 8)
    assert b is not None and b.spans == (4, 4) and b.real == (3, 2) and b.padded and b.covers(1, 8)
    assert b.cu_seqlens(padded=False).tolist() == [0, 3, 5] and b.seq_idx().tolist() == [[0] * 4 + [1] * 4]
    assert read_boundaries(kw, 1, 8) is b  # read once for the same tensors
    with pytest.raises(ConfigError, match="goes backwards at document 1"):
        read_boundaries({"cu_seq_lens_q": torch.tensor([0, 5, 3])}, 1, 3)
