"""Packed rows sharded over 2 gloo ranks (Ulysses SP, zigzag CP) give the unsharded row's logits and
parameter gradients (float32) for a tiny llama and qwen3; the leaky control's sharding is caught as a leak."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from padfree.errors import ConfigError

SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}  # fmt: skip
DOCS = (13, 29, 5, 18)  # odd lengths: every document gets pads under CP, the row under SP


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("mode", ["sp", "cp"])
def test_sharded_row_equals_unsharded(family, mode):
    from padfree.checks.sharded import check_sharded

    r = check_sharded(family, overrides=SMALL, doc_lengths=DOCS, seed=3, **{mode: 2})
    assert r.impl == ("padfree_ulysses" if mode == "sp" else "padfree_zigzag_cp")
    assert (
        r.row_tokens > sum(DOCS) and r.row_tokens % (4 if mode == "cp" else 2) == 0
    )  # padded for the shards
    assert r.logit_diff <= 1e-5 and r.grad_diff <= 1e-5 and r.alone_diff <= 1e-5, r
    assert r.exact and not r.leaked


@pytest.mark.parametrize("mode", ["sp", "cp"])
def test_leaky_sharding_is_caught(mode):
    from padfree.checks.sharded import check_sharded

    r = check_sharded("tiny-llama", overrides=SMALL, doc_lengths=DOCS, attn="leaky", **{mode: 2})
    assert r.impl == ("padfree_ulysses_leaky" if mode == "sp" else "padfree_zigzag_cp_leaky")
    assert r.leaked and not r.exact and r.alone_diff > 1e-2, r


def test_zigzag_shards_partition_each_document():
    from padfree.torch import PackCollator
    from padfree.torch.execution.context_parallel import shard_cp, zigzag_indices

    row = PackCollator(cp=2)([{"input_ids": np.arange(1, n + 1)} for n in DOCS])
    cu = row["cu_seq_lens_q_padded"]
    parts = [zigzag_indices(cu, r, 2) for r in range(2)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(int(cu[-1])))
    assert len(parts[0]) == len(parts[1])
    spans = np.diff(cu.numpy())
    for r, idx in enumerate(parts):  # pieces r and 3 - r of every document, each a quarter of its span
        doc = np.searchsorted(cu.numpy(), idx, side="right") - 1
        assert np.bincount(doc, minlength=len(DOCS)).tolist() == (spans // 2).tolist()
        piece = (idx - cu.numpy()[doc]) // (spans[doc] // 4)
        assert set(piece.tolist()) == {r, 3 - r}
    shard = shard_cp(row, 1, 2)
    assert shard["position_ids"].tolist() == [row["position_ids"][0, parts[1]].tolist()]
    with pytest.raises(ConfigError, match="multiple of 2 x cp = 4"):
        shard_cp(PackCollator()([{"input_ids": [1, 2, 3]}]), 0, 2)


def test_thd_row_runs_whole_under_padfree_varlen():
    """A row collated for SP/CP (pads inside each document's span) runs unsharded too: padfree_varlen takes
    the padded boundaries, and every document's real tokens equal the document alone."""
    from padfree.models import build_model
    from padfree.torch import PackCollator

    net = build_model("tiny-qwen3", attn_implementation="padfree_varlen", seed=1, **SMALL).eval()
    docs = [torch.randint(1, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in DOCS]
    row = PackCollator(sp=2, cp=2)([{"input_ids": d.numpy()} for d in docs])
    assert int(row["cu_seq_lens_q"][-1]) == sum(DOCS) < row["input_ids"].shape[1]
    with torch.no_grad():
        logits = net(**{k: v for k, v in row.items() if k != "labels"}).logits[0]
        for i, d in enumerate(docs):
            start = int(row["cu_seq_lens_q_padded"][i])
            alone = net(input_ids=d[None]).logits[0]
            torch.testing.assert_close(logits[start : start + len(d)], alone, rtol=0, atol=1e-5)


def test_sharded_attention_needs_a_group():
    from padfree.models import build_model
    from padfree.torch import PackCollator
    from padfree.torch.execution.sequence_parallel import NAME, shard_sp

    net = build_model("tiny-llama", attn_implementation=NAME, **SMALL)
    shard = shard_sp(PackCollator(sp=2)([{"input_ids": [1, 2, 3]}]), 0, 2)
    shard.pop("shift_labels")
    with pytest.raises(ConfigError, match="shard_group"):
        net(**shard)
    with pytest.raises(ConfigError, match="does not split into 2 equal shards"):
        shard_sp(PackCollator()([{"input_ids": [1, 2, 3]}]), 0, 2)
