"""PadCollator and PackCollator on small hand-checked cases, and PackCollator against transformers'
DataCollatorWithFlattening(return_flash_attn_kwargs=True)."""

import numpy as np
import pytest
import torch

from padfree.errors import ConfigError
from padfree.torch import PackCollator, PadCollator
from padfree.torch.feed.dataset import Fetched
from padfree.torch.feed.sampler import MicroInfo


def info(lengths, starts=None):
    return MicroInfo(0, 0, 0, True, 0, 1, 1, None, starts, tuple(lengths))


def test_pad_collator_hand_checked():
    items = [
        {"input_ids": [11, 12, 13]},
        {"input_ids": [21, 22, 23, 24, 25], "labels": [-100, -100, 23, 24, -100]},
        {"input_ids": torch.tensor([31, 32]), "loss_mask": [1, 1]},
    ]
    b = PadCollator(pad_token_id=7, pad_to_multiple_of=4)(items)
    assert b["input_ids"].tolist() == [
        [11, 12, 13, 7, 7, 7, 7, 7],
        [21, 22, 23, 24, 25, 7, 7, 7],
        [31, 32, 7, 7, 7, 7, 7, 7],
    ]
    assert b["attention_mask"].tolist() == [[1] * 3 + [0] * 5, [1] * 5 + [0] * 3, [1] * 2 + [0] * 6]
    x = -100
    assert b["labels"].tolist() == [
        [x, 12, 13, x, x, x, x, x],
        [x, x, 23, 24, x, x, x, x],
        [x, 32, x, x, x, x, x, x],
    ]
    assert b.loss_tokens == 5 and b.tokens == 10 and b.info is None
    assert b["input_ids"].dtype == torch.long


def test_pack_collator_hand_checked():
    items = [{"input_ids": [11, 12, 13]}, {"input_ids": [21, 22], "loss_mask": [0, 1]}, [31, 32, 33, 34]]
    b = PackCollator()(items)
    x = -100
    assert b["input_ids"].tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34]]
    assert b["labels"].tolist() == [[x, 12, 13, x, 22, x, 32, 33, 34]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert b[key].dtype == torch.int32 and b[key].tolist() == [0, 3, 5, 9]
    assert b["max_length_q"] == b["max_length_k"] == 4 and isinstance(b["max_length_q"], int)
    assert b.loss_tokens == 6 and b.tokens == 9


@pytest.mark.parametrize("with_labels", [False, True])
def test_pack_collator_matches_transformers_flattening(with_labels):
    from transformers import DataCollatorWithFlattening

    rng = np.random.default_rng(0)
    items = []
    for n in (5, 1, 9, 3):
        ids = rng.integers(1, 100, n).tolist()
        item = {"input_ids": ids}
        if with_labels:
            item["labels"] = [t if rng.random() < 0.5 else -100 for t in ids]
        items.append(item)
    ours = PackCollator()(items)
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(items)
    assert set(theirs) <= set(ours)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype, key
            assert torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


def test_collators_cut_planned_pieces_of_split_and_truncated_samples():
    items = Fetched([{"input_ids": list(range(100, 110))}, {"input_ids": list(range(200, 210))}])
    items.info = info(lengths=(4, 3), starts=(4, 0))
    b = PackCollator()(items)
    assert b["input_ids"].tolist() == [[104, 105, 106, 107, 200, 201, 202]]
    assert b["labels"].tolist() == [[-100, 105, 106, 107, -100, 201, 202]]
    assert b.info is items.info
    p = PadCollator()(items)
    assert p["input_ids"].tolist() == [[104, 105, 106, 107], [200, 201, 202, 0]]
    bad = Fetched([{"input_ids": [1, 2]}], info(lengths=(5,)))
    with pytest.raises(ConfigError, match="plan expects"):
        PadCollator()(bad)


def test_empty_micro_batch_is_a_placeholder_row_without_loss():
    for collator in (PadCollator(), PackCollator()):
        b = collator(Fetched([], info(lengths=())))
        assert b["input_ids"].shape == (1, 1) and b.loss_tokens == 0 and b.tokens == 0
        assert (b["labels"] == -100).all()


def test_global_loss_tokens_without_a_process_group_is_the_local_count():
    from padfree.torch import global_loss_tokens

    batches = [PadCollator()([[1, 2, 3], [4, 5]]), PackCollator()([[6, 7, 8, 9]])]
    assert global_loss_tokens(batches) == 3 + 3 == sum(b.loss_tokens for b in batches)


def test_attention_switch_uses_padfree_varlen_only_for_packed_rows_when_available(monkeypatch):
    import padfree.torch.documents.attention as pa

    assert pa.attention_implementation("bucketed") == "sdpa"
    assert pa.attention_implementation("packed") == "padfree_varlen"
    # without transformers' attention interface, packed rows fall back to sdpa (position_ids block mask)
    monkeypatch.setattr(pa, "_registered", False)
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    assert pa.attention_implementation("packed") == "sdpa"


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-qwen2"])
def test_right_padded_causal_rows_need_no_mask_same_loss_and_gradients(model_name):
    from padfree.models import build_model
    from padfree.torch import token_loss_sum

    torch.manual_seed(0)
    items = [
        {"input_ids": list(np.random.default_rng(i).integers(1, 100, n))} for i, n in enumerate((9, 3, 6))
    ]
    model = build_model(model_name, attn_implementation="sdpa", seed=0, vocab_size=128, hidden_size=32,
                        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2).double()  # fmt: skip

    def run(collate):
        model.zero_grad(set_to_none=True)
        batch = collate(items)
        labels = batch.pop("labels")
        logits = model(**batch).logits
        loss = token_loss_sum(logits, labels)
        loss.backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        return batch, logits.detach(), loss.detach(), grads

    with_mask, logits_m, loss_m, grads_m = run(PadCollator(attention_mask=True))
    without, logits_n, loss_n, grads_n = run(PadCollator(attention_mask=False))
    assert "attention_mask" in with_mask and "attention_mask" not in without
    real = torch.tensor([[1] * 9, [1] * 3 + [0] * 6, [1] * 6 + [0] * 3], dtype=torch.bool)
    torch.testing.assert_close(logits_n[real], logits_m[real], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(loss_n, loss_m, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads_n, grads_m, rtol=1e-9, atol=1e-12)
    # the pads' own outputs do differ (they now see the row before them): only the loss ignores them
    assert not torch.allclose(logits_n[~real], logits_m[~real])


def test_an_item_shorter_than_its_planned_length_names_the_sample() -> None:
    """Lengths longer than the data stop the loader with the sample id, not the position in the batch."""
    from torch.utils.data import DataLoader

    from padfree import PlanConfig
    from padfree.torch import PlanBatchSampler, PlannedDataset

    data = [{"input_ids": np.arange(n)} for n in (5, 6, 7, 8, 9, 10)]
    sampler = PlanBatchSampler(
        np.array([5, 6, 7, 8, 9, 13]), PlanConfig(strategy="packed", budget=64), rank=0, world_size=1
    )
    loader = DataLoader(PlannedDataset(data), batch_sampler=sampler, collate_fn=PackCollator())
    with pytest.raises(ConfigError, match=r"^sample 5 has 10 tokens but the plan expects at least 13"):
        list(loader)
