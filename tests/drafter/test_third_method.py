"""A third drafter method is its folder, one registry call and its presets: a toy method (an EAGLE-3 with one
test-time-training step and its own cost, memory, recipe line and export format) is written here as a folder
of its own (``spec.py`` without torch, ``model.py`` with it, as ``padfree/drafter/methods/<name>/``), its
preset added to the presets; it plans through the drafter setup, builds through ``build_models``, trains one
micro-batch and exports through ``export_models`` by its own writer. And no module outside a method's folder,
the registry, the presets and the peers' adapters names a method (a branch on a name would be one more place
a method lives)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import HANG_S, ROOT

from padfree import PlanConfig
from padfree.drafter import methods, recipes
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.export import check_exportable, default_format, export_meta, export_models, formats
from padfree.drafter.recipes import Recipe
from padfree.drafter.setup import TargetShape, drafter_setup
from padfree.drafter.train import build_models, memory_model, train_micro
from padfree.errors import ConfigError
from padfree.integrations.feed import trainer_kwargs
from padfree.torch import PlanBatchSampler, PlannedDataset

PACKAGE = "padfree_test_toy_method"

TOY = {
    "__init__.py": '''
        """Toy: an EAGLE-3 with one step, for the registry's test."""
    ''',
    "spec.py": '''
        """The toy method's spec (no torch)."""
        import sys

        from padfree.core.config import CostModel
        from padfree.drafter import memory
        from padfree.drafter.methods.base import Method


        def cost(sizes, block_size, ttt):
            return CostModel(a=1.0, b=1e-3 * sizes.layers, c=0.0, source=f"toy h{sizes.hidden}")


        def memory_of(sizes, recipe):
            return memory.MemoryModel(
                fixed=1.0, per_token=8.0 * sizes.hidden, per_attention=4.0 * sizes.heads, source="toy"
            )


        METHOD = Method(
            name="toy", title="Toy", spec=sys.modules[__name__], unit="draft positions", knob="ttt",
            cost=cost, memory=memory_of, recipe_line=lambda r: f"recipe {r.name}: toy, ttt {r.ttt}",
            bound=memory.bound_attention, export_format="toy",
        )
    ''',
    "model.py": '''
        """The toy method's torch side: EAGLE-3's fields and drafter, built with one step whatever the
        recipe, and its own export format."""
        from padfree.drafter.methods.eagle3.model import (
            Config, Drafter, Fields, crossings, field_padding, fields,
        )
        import dataclasses

        from padfree.drafter.methods.eagle3 import model as eagle3
        from padfree.errors import ConfigError


        def build(recipe, sizes, args):
            return eagle3.build(recipe, sizes, dataclasses.replace(args, draft_layers=1))


        def export_files(state, meta):
            config = {"architectures": ["ToyDrafter"], "ttt": meta["recipe"]["ttt"]}
            config["layers"] = meta["target_layers"]
            return config, {f"toy.{k}": v for k, v in state.items()}


        def check_export(meta, *, verifier_option="--verifier"):
            if meta["mask_token_id"] != 1:
                raise ConfigError("the toy format keeps mask token 1")
    ''',
}
"""The toy method's folder, file by file: all a new method writes besides its registry call and presets."""

RECIPE = Recipe(
    name="toy", method="toy", ttt=1, objective="kl", normalization="supervised",
    layer_rule="low_mid_high", fused_layers=3, head_init="target", head_trainable=True,
)  # fmt: skip
"""The toy method's one preset."""


@pytest.fixture
def toy(tmp_path, monkeypatch):
    folder = tmp_path / PACKAGE
    folder.mkdir()
    for name, text in TOY.items():
        (folder / name).write_text(textwrap.dedent(text).lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.import_module(f"{PACKAGE}.spec")
    monkeypatch.setitem(recipes.PRESETS, ("toy", "toy"), RECIPE)
    method = methods.register(spec)
    try:
        yield method
    finally:
        methods.unregister("toy")
        for name in [m for m in sys.modules if m.split(".")[0] == PACKAGE]:
            del sys.modules[name]


def test_the_toy_folder_spec_loads_without_torch_and_its_model_beside_it(toy, tmp_path):
    assert sorted(p.name for p in (tmp_path / PACKAGE).iterdir() if p.suffix == ".py") == sorted(TOY)
    assert toy.load().__name__ == f"{PACKAGE}.model" and toy.spec.__name__ == f"{PACKAGE}.spec"
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import {PACKAGE}.spec; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": ""}
    run = [sys.executable, "-c", code]
    out = subprocess.run(run, capture_output=True, text=True, env=env, timeout=HANG_S)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-500:] + out.stdout[:300]


def test_a_toy_third_method_plans_builds_and_trains_through_the_setup(toy):
    recipe = recipes.get(recipes.DEFAULT, "toy")  # its preset, the default of a bare --method toy
    assert recipe is RECIPE
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
    models = build_models("toy", vocab=64, seed=0, lr=1e-3)
    assert models.recipe == recipe
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

    recipe = RECIPE
    models = build_models("toy", vocab=64, seed=0, recipe=recipe)
    assert default_format("toy") == "toy" and formats() == (
        "dflash",
        "speculators",
        "speculators-mtp",
        "speculators-peagle",
        "speculators-dspark",
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
    with pytest.raises(ConfigError, match="'toy' is registered already"):
        methods.register(dataclasses.replace(toy, title="Toy 2"))


def mask_counts(samples: list[dict]) -> np.ndarray:
    return np.array([max(int(s["loss_mask"][1:].sum()), 0) for s in samples], np.int64)


SRC = ROOT / "src" / "padfree"
DESCRIBED = (
    SRC / "drafter" / "methods" / "__init__.py",  # the registry
    SRC / "drafter" / "recipes.py",  # the presets
    SRC / "integrations" / "feed.py",  # speculators' models, by method name
    SRC / "integrations" / "speculators.py",  # their sampler and collate (anchors: DFlash's)
    SRC / "integrations" / "specforge.py",  # SpecForge's patched models, by method name
)
"""Where a method may be named besides its own folder."""


def _defaults(tree: ast.AST) -> set[int]:
    """The nodes that are default values: of a parameter, or an option's ``default=``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arguments):
            out.update(id(d) for d in [*node.defaults, *node.kw_defaults] if d is not None)
        elif isinstance(node, ast.Call):
            out.update(id(k.value) for k in node.keywords if k.arg == "default")
    return out


def test_no_module_outside_the_described_places_names_a_method():
    names = set(methods.METHODS)
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        home = SRC / "drafter" / "methods"
        folder = path.relative_to(home).parts[0] if home in path.parents else None
        if path in DESCRIBED:
            continue
        tree = ast.parse(path.read_text())
        defaults = _defaults(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and node.value in names
                and node.value != folder
                and id(node) not in defaults
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not bad, f"a method named outside its folder, registry, presets and adapters: {', '.join(bad)}"
