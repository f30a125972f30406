"""Chunked training of a long document: parameter gradients equal training it whole (float32)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers
from conftest import GQA_MODEL

import padfree.torch.documents.attention as pa
from padfree.errors import ConfigError
from padfree.models import build_model
from padfree.torch.execution.chunked import chunk_lengths, chunked_backward
from padfree.torch.feed.loss import token_loss_sum

SMALL = GQA_MODEL
CHUNK = 16


def model_of(family: str, attn: str = "sdpa") -> torch.nn.Module:
    if family == "tiny-lfm2":  # short convolutions + attention, the hybrid whose conv state chunks carry
        if attn.startswith("padfree_"):
            pa.register()
        types = ["conv", "full_attention"] * 2
        cfg = transformers.Lfm2Config(**SMALL | {"num_hidden_layers": 4}, layer_types=types, conv_L_cache=3)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    if family == "tiny-qwen3":  # q/k norms before RoPE; built from its config, nothing downloaded
        cfg = transformers.Qwen3Config(**SMALL, head_dim=16, max_position_embeddings=4096, use_cache=False)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    if attn.startswith("padfree_"):
        pa.register()
    return build_model(family, attn_implementation=attn, **SMALL)


def document(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (length,), generator=gen)
    labels = ids.clone()
    labels[0] = -100  # the collators' rule: nothing predicts a document's first token
    labels[length // 3 : length // 3 + 5] = -100  # a prompt span without loss, across a chunk boundary
    return ids, labels


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def whole(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, scale: float = 1.0) -> float:
    loss = token_loss_sum(model(input_ids=ids[None]).logits, labels[None])
    (loss * scale).backward()
    return float(loss.detach())


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and len(want) > 0
    for name, g in want.items():  # float32 rounding: relative to each tensor's largest entry
        atol = max(1e-6, 1e-5 * float(g.abs().max()))
        torch.testing.assert_close(got[name], g, rtol=2e-4, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("keep", [0, 2])
def test_four_chunk_document_gradients_equal_the_whole_documents(family: str, keep: int) -> None:
    model = model_of(family)
    ids, labels = document(4 * CHUNK - 5)  # 16 + 16 + 16 + 11 tokens
    want_loss = whole(model, ids, labels, scale=0.25)
    want = gradients(model)
    got_loss = chunked_backward(model, ids, labels, CHUNK, scale=0.25, keep=keep)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert_same(gradients(model), want)


@pytest.mark.parametrize("attn", ["sdpa", pa.NAME])
def test_a_hybrids_four_chunk_document_carries_its_conv_state_exactly(attn: str) -> None:
    """LFM2 (short convolutions + attention): each chunk's conv layers read the previous chunk's last inputs,
    and the gradient of that state flows back through the recomputed previous chunk."""
    model = model_of("tiny-lfm2", attn)
    ids, labels = document(4 * CHUNK - 5)
    want_loss = whole(model, ids, labels)
    want = gradients(model)
    for sizes, keep in (
        (CHUNK, 0),
        ([CHUNK, 1, 2, 4 * CHUNK - 5 - CHUNK - 3], 1),
    ):  # chunks under the kernel too
        assert chunked_backward(model, ids, labels, sizes, keep=keep) == pytest.approx(want_loss, rel=1e-5)
        assert_same(gradients(model), want)


def test_a_hybrid_without_its_conv_state_carried_gets_other_gradients(monkeypatch) -> None:
    """The control for the hybrid: chunks whose conv layers start from zeros (attention still carried)."""
    import padfree.torch.execution.chunked as chunked

    model = model_of("tiny-lfm2")
    ids, labels = document(4 * CHUNK)
    whole(model, ids, labels)
    want = gradients(model)
    carrying = chunked._cache_class

    def forgetting():
        class Forgetting(carrying()):  # type: ignore[misc]
            def update_conv_state(self, conv_states, layer_idx, *args, **kwargs):
                self.conv.pop(layer_idx, None)
                return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

        return Forgetting

    monkeypatch.setattr(chunked, "_cache_class", forgetting)
    chunked_backward(model, ids, labels, CHUNK)
    got = gradients(model)
    worst = max(float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want)
    assert worst > 1e-3


def test_a_model_whose_mixer_state_is_not_carried_is_refused() -> None:
    cfg = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=1)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids, labels = document(20)
    with pytest.raises(ConfigError, match="MambaMixer"):
        chunked_backward(model, ids % 64, labels, 8)


def test_documents_of_one_to_eight_chunks_under_padfree_varlen() -> None:
    model = model_of("tiny-llama", pa.NAME)
    for n_chunks in range(1, 9):
        ids, labels = document(n_chunks * CHUNK - (n_chunks % 3), seed=n_chunks)
        whole(model, ids, labels)
        want = gradients(model)
        chunked_backward(model, ids, labels, CHUNK)
        assert_same(gradients(model), want)


def test_chunks_that_do_not_see_their_beginning_give_other_gradients() -> None:
    """The control: training the pieces on their own (``--overlong split``) is measurably not the same, so
    the equality above rests on the carried keys and values."""
    model = model_of("tiny-llama")
    ids, labels = document(4 * CHUNK)
    whole(model, ids, labels)
    want = gradients(model)
    for a in range(0, ids.shape[0], CHUNK):
        chunked_backward(model, ids[a : a + CHUNK], labels[a : a + CHUNK], CHUNK)
    got = gradients(model)
    worst = max(float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want)
    assert worst > 1e-2


def test_uneven_chunk_sizes_accumulate_and_sync_once_at_the_end() -> None:
    model = model_of("tiny-llama")
    ids, labels = document(50)
    whole(model, ids, labels)
    whole(model, ids, labels)
    want = gradients(model)
    calls: list[bool] = []

    def sync(final: bool) -> contextlib.AbstractContextManager:
        calls.append(final)
        return contextlib.nullcontext()

    chunked_backward(model, ids, labels, [20, 7, 23], sync=sync, keep=1)
    chunked_backward(model, ids, labels, [20, 7, 23], sync=sync)  # .grad accumulates like .backward()
    assert_same(gradients(model), want)
    assert calls.count(True) == 2 and calls[-1] is True  # one synchronizing backward per document


def test_bad_arguments_are_one_line_errors() -> None:
    model = model_of("tiny-llama")
    ids, labels = document(20)
    with pytest.raises(ConfigError, match="add up"):
        chunked_backward(model, ids, labels, [8, 8])
    with pytest.raises(ConfigError, match="keep must be"):
        chunked_backward(model, ids, labels, 8, keep=-1)
    with pytest.raises(ConfigError, match="differ in shape"):
        chunked_backward(model, ids, labels[:-1], 8)
    assert chunk_lengths(20, 8) == [8, 8, 4]
    model.config.attention_dropout = 0.1
    model.train()
    with pytest.raises(ConfigError, match="dropout"):
        chunked_backward(model, ids, labels, 8)


def test_a_step_of_a_chunked_plan_gives_the_gradient_of_its_documents_trained_whole() -> None:
    from padfree import PlanConfig
    from padfree.torch import PackCollator, PlanBatchSampler, PlannedDataset, step_loss
    from padfree.torch.execution.chunked import run_step

    lengths = [70, 9, 33, 5, 2 * CHUNK + 3, 12, 4 * CHUNK, 7, 3, 15, 11, CHUNK + 1]
    gen = torch.Generator().manual_seed(3)
    vocab = SMALL["vocab_size"]
    data = [{"input_ids": torch.randint(0, vocab, (n,), generator=gen).tolist()} for n in lengths]
    cfg = PlanConfig(strategy="chunked", budget=CHUNK, grad_accum=5, overlong="truncate", seed=1)
    sampler = PlanBatchSampler(lengths, cfg)
    loader = torch.utils.data.DataLoader(
        PlannedDataset(data), batch_sampler=sampler, collate_fn=PackCollator(chunked=True)
    )
    model = model_of("tiny-llama", pa.NAME)
    step: list = []
    chunked_steps = 0
    for batch in loader:
        step.append(batch)
        if not batch.info.last:
            continue
        tokens = batch.info.step_tokens
        assert tokens == sum(b.loss_tokens for b in step)  # the plan's count is the collated labels'
        seen: dict[int, int] = {}
        for b in step:
            for i, s, n in zip(b.info.indices, b.info.starts, b.info.lengths, strict=True):
                seen[i] = max(seen.get(i, 0), s + n)
        for i, n in seen.items():  # every document of the step, whole (truncated at the reach)
            ids = torch.tensor(data[i]["input_ids"][:n])
            labels = ids.clone()
            labels[0] = -100
            step_loss(token_loss_sum(model(input_ids=ids[None]).logits, labels[None]), tokens).backward()
        want = gradients(model)
        run_step(model, step, 1.0 / tokens)
        assert_same(gradients(model), want)
        chunked_steps += any(b.info.starts[0] > 0 for b in step if b.info.starts)
        step = []
    assert chunked_steps >= 2
