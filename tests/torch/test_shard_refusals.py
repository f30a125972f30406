"""Sizes and ranks of sharded rows, and chunked training's setup, refused in one line naming the cause."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODEL

from padfree.errors import ConfigError
from padfree.models import build_model
from padfree.torch import PackCollator
from padfree.torch.execution.chunked import chunked_backward
from padfree.torch.execution.context_parallel import shard_cp
from padfree.torch.execution.sequence_parallel import shard_sp


def test_an_absurd_shard_degree_is_refused_before_any_row_is_built() -> None:
    """``PackCollator(cp=10**9)`` padded every document to 2e9 tokens: a 29.8 GiB MemoryError."""
    rule = r"sp and cp must be integers from 1 to 1024 \(got sp=1, cp=1000000000\)"
    with pytest.raises(ConfigError, match=rule):
        PackCollator(cp=10**9)
    with pytest.raises(ConfigError, match="from 1 to 1024"):
        PackCollator(sp=0)


def test_a_row_padded_past_the_largest_budget_is_refused_before_it_is_allocated() -> None:
    """8193 one-token documents under cp=1024 pad to 2048 tokens each: a 16.8M-token row, over 2^24."""
    with pytest.raises(ConfigError) as refused:
        PackCollator(cp=1024)([{"input_ids": [7]}] * 8193)
    assert str(refused.value).startswith(
        "PackCollator(sp=1, cp=1024): 8193 documents of 8193 tokens pad to a row of 16779264 tokens, over "
        "16777216"
    )
    assert PackCollator(cp=1024)([{"input_ids": [7]}] * 3)["input_ids"].shape == (1, 3 * 2048)


def test_a_shard_rank_out_of_range_is_named_not_blamed_on_the_row() -> None:
    sp_row = PackCollator(sp=2)([{"input_ids": [5, 6]}, {"input_ids": [7, 8, 9]}])
    for rank in (2, -1):
        with pytest.raises(ConfigError, match=rf"^SP: rank {rank} is not in 0\.\.1 \(the ranks of sp=2\)$"):
            shard_sp(sp_row, rank, 2)
    with pytest.raises(ConfigError, match="SP: size must be an integer >= 1"):
        shard_sp(sp_row, 0, 0)  # was a ZeroDivisionError
    cp_row = PackCollator(cp=2)([{"input_ids": [5, 6]}, {"input_ids": [7, 8, 9]}])
    with pytest.raises(ConfigError, match=r"^CP: rank 3 is not in 0\.\.1 \(the ranks of cp=2\)$"):
        shard_cp(cp_row, 3, 2)
    with pytest.raises(ConfigError, match="row of 6 tokens does not split into 4 equal shards"):
        shard_sp(sp_row, 0, 4)  # the row's length is still what a wrong degree is blamed on


def test_chunked_training_under_gradient_checkpointing_names_checkpointing() -> None:
    """It used to blame the model's attention ("does not follow its config's implementation")."""
    model = build_model("tiny-llama", **{**TINY_MODEL, "num_hidden_layers": 2})
    model.train()
    on = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    on({"use_reentrant": False})  # transformers 5.25 renamed it
    ids = torch.randint(1, 128, (20,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError) as refused:
        chunked_backward(model, ids, ids.clone(), 8)
    line = str(refused.value)
    assert line.startswith("chunked training cannot run under gradient checkpointing") and "\n" not in line
    assert "turn gradient checkpointing off" in line and "attention" not in line
    assert all(p.grad is None for p in model.parameters())  # refused before any work
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    assert chunked_backward(model, ids, ids.clone(), 8) > 0  # the same call runs once it is off
