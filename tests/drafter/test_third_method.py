"""A third drafter method is its module and one registry line: a toy method (an EAGLE-3 with one
test-time-training step and its own cost, memory, recipe line and export format), defined here only, plans
through the drafter setup, builds through ``build_models``, trains one micro-batch and exports through
``export_models`` by its own writer."""

from __future__ import annotations

import dataclasses
import json
import sys
import types

import numpy as np
import pytest
import torch

from padfree import PlanConfig
from padfree.core.config import CostModel
from padfree.drafter import eagle3, methods
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.export import check_exportable, default_format, export_meta, export_models, formats
from padfree.drafter.memory import MemoryModel
from padfree.drafter.recipes import Recipe
from padfree.drafter.setup import TargetShape, drafter_setup
from padfree.drafter.train import build_models, memory_model, train_micro
from padfree.errors import ConfigError
from padfree.integrations.feed import trainer_kwargs
from padfree.torch import PlanBatchSampler, PlannedDataset

MODULE = "padfree_test_toy_method"


def toy_cost(shape: methods.DrafterShape, block_size: int, ttt: int) -> CostModel:
    return CostModel(a=1.0, b=1e-3 * shape.layers, c=0.0, source=f"toy h{shape.hidden}")


def toy_memory(sizes: methods.MemorySizes, recipe: Recipe) -> MemoryModel:
    return MemoryModel(fixed=1.0, per_token=8.0 * sizes.hidden, per_attention=4.0 * sizes.heads, source="toy")


def toy_module() -> types.ModuleType:
    """The toy method's torch side: EAGLE-3's fields and drafter, built with one step whatever the recipe."""
    mod = types.ModuleType(MODULE)
    mod.Fields = eagle3.Fields  # type: ignore[attr-defined]
    mod.fields = eagle3.fields  # type: ignore[attr-defined]
    mod.crossings = eagle3.crossings  # type: ignore[attr-defined]
    mod.field_padding = eagle3.field_padding  # type: ignore[attr-defined]
    mod.Config, mod.Drafter = eagle3.Config, eagle3.Drafter  # type: ignore[attr-defined]

    def build(recipe, sizes, *, n_fused, draft_layers, weights, vocab):
        return eagle3.build(recipe, sizes, n_fused=n_fused, draft_layers=1, weights=weights, vocab=vocab)

    def export_files(state, meta):
        config = {
            "architectures": ["ToyDrafter"],
            "ttt": meta["recipe"]["ttt"],
            "layers": meta["target_layers"],
        }
        return config, {f"toy.{k}": v for k, v in state.items()}

    def check_export(meta, *, verifier_option="--verifier"):
        if meta["mask_token_id"] != 1:
            raise ConfigError("the toy format keeps mask token 1")

    mod.build = build  # type: ignore[attr-defined]
    mod.export_files, mod.check_export = export_files, check_export  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def toy():
    sys.modules[MODULE] = toy_module()
    method = methods.register(
        methods.Method(
            "toy",
            "Toy",
            MODULE,
            False,
            "draft positions",
            "ttt",
            toy_cost,
            toy_memory,
            lambda r: f"recipe {r.name}: toy, ttt {r.ttt}",
            "toy",
        )  # fmt: skip
    )
    try:
        yield method
    finally:
        methods.unregister("toy")
        del sys.modules[MODULE]


def test_a_toy_third_method_plans_builds_and_trains_through_the_setup(toy):
    recipe = Recipe(
        name="toy", method="toy", ttt=1, objective="kl", normalization="supervised",
        layer_rule="low_mid_high", fused_layers=3, head_init="target", head_trainable=True,
    )  # fmt: skip
    assert recipe.describe() == "recipe toy: toy, ttt 1"
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, 40, size=12)
    samples = [
        {
            "input_ids": rng.integers(2, 64, size=int(n)),
            "loss_mask": (np.arange(n) >= n // 3).astype(np.int64),
        }
        for n in lengths
    ]
    mask = np.concatenate([s["loss_mask"] for s in samples]).astype(bool)
    models = build_models("toy", vocab=64, seed=0, recipe=recipe, lr=1e-3)
    target = TargetShape.of_config(models.target.config)
    setup = drafter_setup(
        recipe, PlanConfig(strategy="packed", budget=64), target=target, lengths=lengths, loss_mask=mask,
        memory_gb=1.0,
    )  # fmt: skip
    assert setup.method is toy and setup.anchors is None
    assert setup.config.cost.source == "toy h64" and setup.memory.source == "toy"
    assert setup.memory == memory_model(models)  # the setup and the built models agree on the memory
    assert setup.config.attn_budget is not None  # the memory bound holds the attention, as EAGLE-3's
    sampler = PlanBatchSampler(lengths, setup.config, loss_tokens=mask_counts(samples), rank=0, world_size=1)
    plan = sampler.plan
    assert sorted(plan.indices.tolist()) == list(range(len(lengths)))
    assert setup.heaviest_bytes(plan) > 0
    collate = DrafterCollator("toy", recipe=recipe, seed=0, layout="packed", mask_token_id=1)
    data = PlannedDataset(samples)
    mb = next(iter(sampler))
    batch = collate(data.__getitems__(mb))
    before = [p.detach().clone() for p in models.trainable()]
    assert train_micro(models, batch) > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, models.trainable(), strict=True))


def test_the_toy_method_exports_by_its_own_writer(toy, tmp_path):
    from safetensors.torch import load_file

    recipe = Recipe(
        name="toy", method="toy", ttt=1, objective="kl", normalization="supervised",
        layer_rule="low_mid_high", fused_layers=3, head_init="target", head_trainable=True,
    )  # fmt: skip
    models = build_models("toy", vocab=64, seed=0, recipe=recipe)
    assert default_format("toy") == "toy" and formats() == (
        "dflash",
        "speculators",
        "speculators-mtp",
        "speculators-peagle",
        "speculators-dflash2",
        "toy",
    )
    out = export_models(models, "toy", tmp_path / "served", mask_token_id=1)
    config = json.loads((out / "config.json").read_text())
    assert config == {
        "architectures": ["ToyDrafter"],
        "ttt": 1,
        "layers": list(models.layers),
        "dtype": "float32",
    }
    written = load_file(str(out / "model.safetensors"))
    state = models.drafter.state_dict()
    assert sorted(written) == sorted(f"toy.{k}" for k in state)
    assert all(torch.equal(written[f"toy.{k}"], v) for k, v in state.items())
    meta = export_meta(models, mask_token_id=2)
    with pytest.raises(ConfigError, match="the toy format keeps mask token 1"):
        check_exportable(meta, "toy")
    with pytest.raises(ConfigError, match="this drafter is toy \\(export it with --format toy\\)"):
        check_exportable(meta, "speculators")
    with pytest.raises(ConfigError, match="speculators has no Toy model to feed"):
        trainer_kwargs(object(), recipe)
    with pytest.raises(ConfigError, match="holds toy drafters already"):
        methods.register(dataclasses.replace(toy, name="toy2"))


def mask_counts(samples: list[dict]) -> np.ndarray:
    return np.array([max(int(s["loss_mask"][1:].sum()), 0) for s in samples], np.int64)
