"""The one constructor of a frozen target plus a drafter, and the reference training step on a collated
micro-batch: what ``check-drafter``, the benchmarks, ``calibrate --drafter`` and ``examples/train_drafter.py``
all build and run.

The drafter takes the target's sizes (hidden, heads, key-value heads, intermediate) and starts from its
embedding and LM head (:func:`padfree.drafter.target.shared_weights`); the target layers it fuses follow the
method's rule (:mod:`padfree.drafter.methods`).

>>> m = build_models("eagle3", vocab=64, seed=0)
>>> m.layers, sum(p.numel() for p in m.trainable()) > 0
((0, 2, 4), True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from padfree.drafter import methods
from padfree.drafter.collate import DrafterBatch
from padfree.drafter.target import TINY_TARGET, build_target, lm_head, run_target, shared_weights


@dataclass
class DrafterModels:
    """A frozen target, the layers the drafter fuses, the drafter and (when built with ``lr``) its
    optimizer."""

    method: methods.Method
    target: Any
    layers: tuple[int, ...]
    drafter: nn.Module
    head: nn.Module
    optimizer: torch.optim.Optimizer | None = None

    def trainable(self) -> list[nn.Parameter]:
        """The drafter's trainable parameters (the shared embedding and a frozen head excluded)."""
        return [p for p in self.drafter.parameters() if p.requires_grad]


def build_models(
    method: str,
    *,
    vocab: int,
    seed: int = 0,
    target: Any = None,
    block_size: int = 16,
    ttt: int = 7,
    draft_layers: int = 1,
    fused_layers: int | None = None,
    lr: float | None = None,
    **target_sizes: Any,
) -> DrafterModels:
    """The target (``target``, or the tiny random one: :data:`padfree.drafter.target.TINY_TARGET` sizes, with
    ``target_sizes`` overriding them) and a drafter of its width with random weights
    (``torch.manual_seed(seed)`` first). ``fused_layers``: target layers DFlash fuses (default 2 on a tiny
    target; EAGLE-3 always 3). With ``lr`` an AdamW optimizer over the drafter's trainable parameters is made
    too."""
    spec = methods.get(method)
    if target is None:
        target = build_target(seed=seed, vocab_size=vocab, **target_sizes)
    cfg = target.config
    n_fused = fused_layers if fused_layers is not None else (2 if spec.uses_anchors else spec.fused_layers)
    layers = spec.target_layers(cfg.num_hidden_layers, n_fused)
    heads = cfg.num_attention_heads
    sizes = {
        "hidden_size": cfg.hidden_size,
        "num_heads": heads,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "intermediate_size": cfg.intermediate_size,
    }
    own = {"num_layers": draft_layers, "block_size": block_size, "n_target_layers": len(layers)}
    mod = spec.load()
    config = mod.Config(**sizes, **(own if spec.knob == "block_size" else {"ttt": ttt}))
    torch.manual_seed(seed)
    drafter = mod.Drafter(config, *shared_weights(target))
    models = DrafterModels(spec, target, layers, drafter, lm_head(target))
    if lr is not None:
        models.optimizer = torch.optim.AdamW(models.trainable(), lr=lr, weight_decay=0.0)
    return models


def zero_loss(params: list[nn.Parameter]) -> torch.Tensor:
    """A zero that depends on every parameter: a micro-batch with no document, no anchor or no supervised
    position still gives each of them a (zero) gradient, so DDP's all-reduces stay the same on every rank."""
    if not params:
        return torch.zeros(())
    return sum((p.reshape(-1)[:1].sum() for p in params), torch.zeros((), device=params[0].device)) * 0.0


def loss_sums(models: DrafterModels, batch: DrafterBatch, attention: str = "dense", out: Any = None):
    """Per-document ``(numerator, denominator)`` of the drafter's loss on ``batch`` (the target's forward
    under ``no_grad``, unless its output ``out`` is given); an empty micro-batch gives one zero numerator
    that still reaches every parameter."""
    params = models.trainable()
    if batch.empty:
        return zero_loss(params).reshape(1), torch.zeros(1)
    if out is None:
        assert batch.contract is not None
        with torch.no_grad():
            out = run_target(models.target, batch.contract, models.layers)
    num, den = models.drafter.loss(out, models.head, batch, attention)  # type: ignore[operator]
    return num + zero_loss(params), den


def train_micro(models: DrafterModels, batch: DrafterBatch) -> int:
    """One micro-batch as one optimizer step: the drafter's loss over its supervised draft positions (their
    mean), backward and the optimizer's step; returns the supervised draft positions."""
    assert models.optimizer is not None, "build_models(..., lr=...) makes the optimizer"
    num, den = loss_sums(models, batch)
    total = den.sum()
    (num.sum() / total.clamp(min=1.0)).backward()
    models.optimizer.step()
    models.optimizer.zero_grad(set_to_none=True)
    return int(total.item())


__all__ = ["TINY_TARGET", "DrafterModels", "build_models", "loss_sums", "train_micro", "zero_loss"]
