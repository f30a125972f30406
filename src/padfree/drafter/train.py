"""The one constructor of a frozen target plus a drafter under a recipe, and the reference training step on a
collated micro-batch: what ``check-drafter``, the benchmarks, ``calibrate --drafter`` and
``examples/train_drafter.py`` all build and run.

The drafter takes the target's sizes (hidden, heads, key-value heads, intermediate) and starts from its
embedding and LM head (:func:`padfree.drafter.target.shared_weights`); the target layers it fuses follow the
recipe's rule; its attention, fed state, head and vocabulary follow the recipe
(:mod:`padfree.drafter.recipes`). The loss is :func:`padfree.drafter.objective.document_losses`.

>>> m = build_models("eagle3", vocab=64, seed=0)
>>> m.layers, m.recipe.name, sum(p.numel() for p in m.trainable()) > 0
((0, 2, 4), 'specforge', True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from padfree.drafter import methods, recipes
from padfree.drafter.collate import DrafterBatch
from padfree.drafter.memory import MemoryModel
from padfree.drafter.methods.base import BuildArgs
from padfree.drafter.objective import Queries, VocabMap, document_losses, with_document_noise
from padfree.drafter.recipes import Recipe
from padfree.drafter.sizes import Sizes
from padfree.drafter.target import (
    TINY_TARGET,
    TargetOutput,
    as_float,
    build_target,
    lm_head,
    run_target,
    shared_weights,
)
from padfree.errors import ConfigError


@dataclass
class DrafterModels:
    """A frozen target, the layers the drafter fuses, the drafter, its recipe and (when built with ``lr``) its
    optimizer."""

    method: methods.Method
    target: Any
    layers: tuple[int, ...]
    drafter: Any
    head: nn.Module
    recipe: Recipe
    optimizer: torch.optim.Optimizer | None = None

    def trainable(self) -> list[nn.Parameter]:
        """The drafter's trainable parameters (the shared embedding and a frozen head excluded)."""
        return [p for p in self.drafter.parameters() if p.requires_grad]


def target_layers(recipe: Recipe, n_layers: int, fused_layers: int | None = None) -> tuple[int, ...]:
    """The target layers (decoder layer outputs, from 0) the recipe's drafter fuses, on a target of
    ``n_layers`` (``fused_layers`` overrides the recipe's count; a target too small for it fuses what it
    has)."""
    return methods.LAYER_RULES[recipe.layer_rule](n_layers, fused_layers or recipe.fused_layers)


def draft_vocab(recipe: Recipe, vocab: int, token_counts: np.ndarray | None) -> VocabMap | None:
    """The recipe's draft vocabulary: the ``recipe.draft_vocab`` most frequent target tokens of the user's
    data (``token_counts[t]``: occurrences of token ``t``, ties to the lower id), or ``None`` (the full
    vocabulary) when the recipe has none or it is not smaller than the target's."""
    size = recipe.draft_vocab
    if size is None or size >= vocab:
        return None
    if token_counts is None:
        raise ConfigError(
            f"recipe {recipe.name}: a draft vocabulary of {size} of the target's {vocab} tokens is built "
            "from the data's token counts; pass them (or --draft-vocab none for the full vocabulary)"
        )
    counts = np.zeros(vocab, np.int64)
    c = np.asarray(token_counts, np.int64)[:vocab]
    counts[: c.shape[0]] = c
    top = np.lexsort((np.arange(vocab), -counts))[:size]
    return VocabMap.from_ids(torch.from_numpy(np.sort(top)), vocab)


def token_counts(samples: list[dict], vocab: int) -> np.ndarray:
    """Occurrences of each token id among the supervised tokens of ``samples`` (all tokens where none is)."""
    ids = [
        np.asarray(s["input_ids"])[np.asarray(s.get("loss_mask", np.ones(len(s["input_ids"]))), bool)]
        for s in samples
    ]
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    if flat.size == 0:
        flat = np.concatenate([np.asarray(s["input_ids"]) for s in samples]) if samples else flat
    return np.bincount(flat.astype(np.int64), minlength=vocab)[:vocab]


def build_models(
    method: str,
    *,
    vocab: int,
    seed: int = 0,
    recipe: Recipe | None = None,
    target: Any = None,
    block_size: int | None = None,
    ttt: int | None = None,
    draft_layers: int = 1,
    fused_layers: int | None = None,
    counts: np.ndarray | None = None,
    lr: float | None = None,
    **target_sizes: Any,
) -> DrafterModels:
    """The target (``target``, or the tiny random one: :data:`padfree.drafter.target.TINY_TARGET` sizes, with
    ``target_sizes`` overriding them) and a drafter of its width with random weights
    (``torch.manual_seed(seed)`` first) under ``recipe`` (default: the ``specforge`` preset; ``block_size`` /
    ``ttt`` override it). ``fused_layers``: target layers DFlash fuses (default: the recipe's, at most what a
    tiny target has). ``counts``: the data's token counts, for a draft vocabulary. With ``lr`` an AdamW
    optimizer over the drafter's trainable parameters is made too."""
    spec = methods.get(method)
    recipe = recipes.override(
        recipe or recipes.get(recipes.DEFAULT, spec.name), block_size=block_size, ttt=ttt
    )
    if recipe.method != spec.name:
        raise ConfigError(f"recipe {recipe.name} is for {recipe.method}, not {spec.name}")
    if target is None:
        target = build_target(seed=seed, vocab_size=vocab, **target_sizes)
    cfg = target.config
    layers = target_layers(recipe, cfg.num_hidden_layers, fused_layers)
    sizes = Sizes.of_config(cfg)
    vmap = draft_vocab(recipe, int(cfg.vocab_size), counts)
    mod = spec.load()
    torch.manual_seed(seed)
    drafter = mod.build(recipe, sizes, BuildArgs(len(layers), draft_layers, shared_weights(target), vmap))
    models = DrafterModels(spec, target, layers, drafter, lm_head(target), recipe)
    if lr is not None:
        models.optimizer = torch.optim.AdamW(models.trainable(), lr=lr, weight_decay=0.0)
    return models


def memory_model(models: DrafterModels) -> MemoryModel:
    """The activation memory model of these models' sizes (their method's
    :attr:`~padfree.drafter.methods.base.Method.memory`)."""
    dcfg = models.drafter.cfg
    sizes = Sizes.of_config(models.target.config).with_(
        heads=dcfg.num_heads,
        kv_heads=dcfg.num_kv_heads,
        intermediate=dcfg.intermediate_size,
        draft_layers=getattr(dcfg, "num_layers", 1),
        fused_layers=len(models.layers),
        draft_vocab=int(models.drafter.lm_head.weight.shape[0]),
    )
    return models.method.memory(sizes, models.recipe)


def zero_loss(params: list[nn.Parameter]) -> torch.Tensor:
    """A zero that depends on every parameter: a micro-batch with no document, no anchor or no supervised
    position still gives each of them a (zero) gradient, so DDP's all-reduces stay the same on every rank."""
    if not params:
        return torch.zeros(())
    return sum((p.reshape(-1)[:1].sum() for p in params), torch.zeros((), device=params[0].device)) * 0.0


def with_noise(out: TargetOutput, batch: DrafterBatch) -> TargetOutput:
    """The target's fused hidden states plus the recipe's uniform noise, drawn per document from its own key
    (the same packed or alone, and the same as :mod:`padfree.integrations.feed` gives speculators)."""
    r, c = batch.recipe, batch.contract
    if r is None or r.noise <= 0 or c is None:
        return out
    hidden = with_document_noise(out.hidden, c, r.noise, seed=batch.seed, epoch=batch.epoch)
    return TargetOutput(hidden, out.last, out.prenorm)


def loss_sums(models: DrafterModels, batch: DrafterBatch, attention: str = "dense", out: Any = None):
    """Per-document ``(numerator, denominator)`` of the drafter's loss on ``batch`` under its recipe (the
    target's forward under ``no_grad``, unless its output ``out`` is given). A step's loss is the sum of its
    numerators over the sum of its ``batch.denominator`` on all ranks. An empty micro-batch gives one zero
    numerator that still reaches every parameter."""
    params = models.trainable()
    if batch.empty:
        return zero_loss(params).reshape(1), torch.zeros(1)
    c, f = batch.contract, batch.fields
    assert c is not None and batch.scale is not None and batch.den is not None and batch.recipe is not None
    if out is None:
        with torch.no_grad():
            out = run_target(models.target, c, models.layers)
    drafter = models.drafter
    out = as_float(out, drafter.lm_head.weight.dtype)
    hidden, block = drafter.queries(with_noise(out, batch), batch, attention)
    sup = f.supervised.reshape(-1).to(hidden.device)
    selector = getattr(drafter, "selector_loss", None)  # a drafter that reranks candidates (DFlash2)
    recipe = batch.recipe
    ids = c.flat("input_ids")[0].to(hidden.device)
    label = f.label_index.reshape(-1).to(hidden.device)
    tgt = f.target_index.reshape(-1).to(hidden.device)
    q = Queries(
        hidden=hidden[sup],
        scale=batch.scale.to(hidden.device)[sup],
        doc=f.query_doc.reshape(-1).to(hidden.device)[sup],
        label=ids[label.clamp(min=0)][sup] if recipe.objective == "data_ce" else None,
        target_state=None if recipe.objective == "data_ce" else out.last[0, tgt[sup]],
        block=None if block is None else block.to(hidden.device)[sup],
        predecessor=None if selector is None else ids[tgt[sup]],
    )
    num = document_losses(q, drafter.lm_head, models.head, recipe, c.n_docs, drafter.vocab, selector=selector)
    return num + zero_loss(params), batch.den.to(num.device)


def train_micro(models: DrafterModels, batch: DrafterBatch, attention: str = "dense") -> int:
    """One micro-batch as one optimizer step under the batch's recipe (its numerators over its denominator),
    backward and the optimizer's step; returns the supervised draft positions. ``attention``: the drafter's
    (``dense`` on a CPU, ``flex`` on a GPU)."""
    assert models.optimizer is not None, "build_models(..., lr=...) makes the optimizer"
    num, den = loss_sums(models, batch, attention)
    (num.sum() / den.sum().clamp(min=1e-6)).backward()
    models.optimizer.step()
    models.optimizer.zero_grad(set_to_none=True)
    return batch.positions


__all__ = [
    "TINY_TARGET",
    "DrafterModels",
    "build_models",
    "draft_vocab",
    "loss_sums",
    "memory_model",
    "target_layers",
    "token_counts",
    "train_micro",
    "zero_loss",
]
