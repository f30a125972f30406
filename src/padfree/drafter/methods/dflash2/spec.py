"""DFlash2's spec: its FLOP cost and activation memory (DFlash's plus its convolutions and selector), its
recipe line, anchors and memory bound. No torch (its torch side is
:mod:`padfree.drafter.methods.dflash2.model`)."""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

from padfree.core.config import CostModel
from padfree.drafter import memory as m
from padfree.drafter.methods.base import flops
from padfree.drafter.methods.dflash import spec as dflash
from padfree.drafter.sizes import Sizes

if TYPE_CHECKING:
    from padfree.drafter.recipes import Recipe

COST_SIZES = (2, 16, 256, 16)
"""DFlash2's convolution taps and channels per dynamic kernel, its selector's rank and candidates (speculators
0.9.0 ``DFlash2Args``): what its cost reads."""


def cost(shape: Sizes, block_size: int, ttt: int = 1) -> CostModel:
    """DFlash's (:func:`padfree.drafter.methods.dflash.spec.cost`) plus, per block query and draft layer, its
    two dynamic convolutions (a kernel projection ``dh -> 2 K dh / g`` each, and ``2 x K`` multiply-adds a
    channel on each side of its sublayer), and per query the candidate selector (``dh -> r``, ``k``
    candidates of rank ``r``), forward and backward.

    >>> s = Sizes(hidden=64, layers=2, vocab=100)
    >>> c, b = cost(s, 8), dflash.cost(s, 8)
    >>> c.d > b.d, c.e == b.e, c.source
    (True, True, 'drafter dflash2 h64 l2 dh64')
    """
    base = dflash.cost(shape, block_size)
    target, _, _, _, dh = flops(shape)
    kernel, group, rank, top = COST_SIZES
    conv = 2 * (dh * 2 * kernel * dh // group + 2 * 2 * kernel * dh)
    per_query = 6.0 * (shape.draft_layers * conv + dh * rank + 2 * top * rank)
    return dataclasses.replace(
        base,
        d=base.d + block_size * per_query / target,
        source=f"drafter dflash2 h{shape.hidden} l{shape.layers} dh{dh}",
    )


def memory(s: Sizes, r: Recipe) -> m.MemoryModel:
    """DFlash's activation memory at the recipe's block size plus, per block, each draft layer's four
    convolution outputs and two kernels per query, named for DFlash2."""
    base = dflash.memory_terms(s, block_size=r.block_size, objective=r.objective)
    per_query = m.COPIES_ACTIVATION * m.FLOAT * s.draft_layers * 6 * s.hidden
    return dataclasses.replace(
        base,
        per_block=base.per_block + r.block_size * per_query,
        source=f"analytic dflash2 h{s.hidden} B{r.block_size}",
    )


def recipe_line(r: Recipe) -> str:
    """DFlash2's recipe line: DFlash's, its convolution and its selector."""
    return (
        f"{dflash.recipe_line(r)}; conv {r.conv_kernel_size} taps x {r.conv_group_size} channels inside each "
        f"block, selector top {r.selector_top_k} rank {r.selector_rank} x{r.selector_loss_alpha:g}"
    )


METHOD = dflash.block_method(
    name="dflash2", title="DFlash2", spec=sys.modules[__name__], cost=cost, memory=memory,
    recipe_line=recipe_line, export_format="speculators-dflash2", crossing="block labels/convolution taps",
)  # fmt: skip
