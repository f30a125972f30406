"""DSpark's spec: its FLOP cost and activation memory (DFlash's block terms plus its two heads), its recipe
line, anchors and memory bound. No torch (its torch side is :mod:`padfree.drafter.methods.dspark.model`)."""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

from padfree.core.config import CostModel
from padfree.drafter import memory as m
from padfree.drafter.methods.base import flops, line
from padfree.drafter.methods.dflash import spec as dflash
from padfree.drafter.sizes import Sizes

if TYPE_CHECKING:
    from padfree.drafter.recipes import Recipe

MARKOV_RANK = 256
"""DSpark's Markov head rank in its cost (DeepSpec's and speculators' default ``markov_rank``)."""


def cost(shape: Sizes, block_size: int, ttt: int = 1) -> CostModel:
    """DFlash's block cost (:func:`padfree.drafter.methods.dflash.spec.cost`) plus, per block query, the
    Markov head's bias (rank ``r`` -> draft vocabulary) and the confidence head, forward and backward.

    >>> s = Sizes(hidden=64, layers=2, vocab=100)
    >>> cost(s, 7).d > dflash.cost(s, 7).d, cost(s, 7).source
    (True, 'drafter dspark h64 l2 dh64')
    """
    base = dflash.cost(shape, block_size, ttt)
    target, _, _, _, dh = flops(shape)
    heads = 6.0 * (MARKOV_RANK * shape.head_vocab + dh + MARKOV_RANK)
    return dataclasses.replace(
        base,
        d=base.d + block_size * heads / target,
        source=f"drafter dspark h{shape.hidden} l{shape.layers} dh{dh}",
    )


def memory(s: Sizes, r: Recipe) -> m.MemoryModel:
    """DFlash's activation memory at the recipe's block and objective plus, per block, each query's Markov
    embedding and confidence input (the bias adds into the loss chunk's logits)."""
    base = dflash.memory_terms(s, block_size=r.block_size, objective=r.objective)
    per_block = r.block_size * m.COPIES_ACTIVATION * m.FLOAT * (2 * r.markov_rank + s.hidden)
    return dataclasses.replace(
        base, per_block=base.per_block + per_block, source=f"analytic dspark h{s.hidden} B{r.block_size}"
    )


def recipe_line(r: Recipe) -> str:
    """The recipe line: block sampled from the anchor, anchors, loss weights, heads, normalization."""
    block = f"block {r.block_size} sampled from the anchor, anchors min(valid, {r.max_anchors})"
    loss = f"{r.ce_weight:g} ce + {r.tv_weight:g} tv + {r.confidence_alpha:g} confidence"
    heads = f"slot weights exp(-k/{r.gamma:g}), markov rank {r.markov_rank}"
    return line(r, block, loss, heads, f"documents under {r.min_loss_tokens} loss tokens dropped")


METHOD = dflash.block_method(
    name="dspark", title="DSpark", spec=sys.modules[__name__], cost=cost, memory=memory,
    recipe_line=recipe_line, export_format="speculators-dspark", crossing="block labels/previous tokens",
)  # fmt: skip
