"""The drafter setup is the one decision every caller plans with: its memory model is the built drafter's, its
memory bound limits what the method's micro-batches hold, and a sample the bound cannot hold is one line."""

from __future__ import annotations

import numpy as np
import pytest

from padfree import PlanConfig
from padfree.drafter import memory, recipes
from padfree.drafter.setup import TargetShape, drafter_setup
from padfree.drafter.train import build_models, memory_model
from padfree.errors import ConfigError


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_the_setup_prices_memory_as_the_built_drafter_does(method):
    recipe = recipes.override(
        recipes.get("specforge", method), draft_vocab=40 if method == "eagle3" else None
    )
    models = build_models(method, vocab=64, seed=0, recipe=recipe, counts=np.arange(64), draft_layers=2)
    lengths = np.array([30, 50, 70])
    setup = drafter_setup(
        recipe, PlanConfig(strategy="packed", budget=128), target=TargetShape.of_config(models.target.config),
        lengths=lengths, loss_mask=np.ones(int(lengths.sum()), bool), draft_layers=2,
    )  # fmt: skip
    assert setup.memory == memory_model(models)
    assert (setup.anchors is not None) == (method == "dflash")


def test_a_memory_bound_limits_blocks_or_attention_by_the_method():
    target = TargetShape.common(hidden=512, layers=8, vocab=1000)
    lengths = np.array([100, 200, 300, 400])
    cfg = PlanConfig(strategy="packed", budget=512)
    gb = 1.0
    d = drafter_setup(recipes.get("specforge", "dflash"), cfg, target=target, lengths=lengths, memory_gb=gb)
    assert d.config.anchor_budget == memory.anchor_budget(d.memory, gb * 2**30, 512) == d.by_memory
    e = drafter_setup(recipes.get("specforge", "eagle3"), cfg, target=target, lengths=lengths, memory_gb=gb)
    assert e.config.anchor_budget is None and e.config.attn_per_document
    assert e.config.attn_budget == memory.attention_budget(e.memory, gb * 2**30, 512)
    tighter = drafter_setup(
        recipes.get("specforge", "dflash"), cfg, target=target, lengths=lengths, memory_gb=gb, anchor_budget=3
    )
    assert tighter.config.anchor_budget == 3


def test_a_sample_with_more_blocks_than_the_bound_allows_is_one_line_naming_the_fix():
    target = TargetShape.common(hidden=512, layers=8, vocab=1000)
    lengths = np.array([400, 60])
    cfg = PlanConfig(strategy="packed", budget=512, overlong="truncate")
    setup = drafter_setup(
        recipes.get("specforge", "dflash"), cfg, target=target, lengths=lengths, loss_mask=np.ones(460, bool),
        anchor_budget=8,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"sample 0 has \d+ draft blocks .*--anchor-budget 8"):
        setup.check_fit(lengths)
