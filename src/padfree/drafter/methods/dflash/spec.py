"""DFlash's spec: its FLOP cost, activation memory, recipe line, anchors and memory bound, and z-lab's
target-layer rule. No torch (its torch side is :mod:`padfree.drafter.methods.dflash.model`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from padfree.core.config import CostModel
from padfree.drafter import memory as m
from padfree.drafter.methods.base import Method, flops, line
from padfree.drafter.sizes import Sizes
from padfree.errors import ConfigError

if TYPE_CHECKING:
    from padfree.core.anchors import AnchorPolicy
    from padfree.drafter.recipes import Recipe


def spread_layers(n_layers: int, n_fused: int) -> tuple[int, ...]:
    """z-lab DFlash's choice: ``n_fused`` target layers spread evenly from layer 1 to ``n - 3`` (one fused
    layer: the middle one).

    >>> spread_layers(36, 5), spread_layers(6, 2), spread_layers(8, 1)
    ((1, 9, 17, 25, 33), (1, 3), (4,))
    >>> spread_layers(6, 5)  # layers 1 .. 3 are all a 6-layer target has between 1 and n - 3
    (1, 2, 3)
    """
    if n_fused < 1 or n_layers < 1:
        raise ConfigError(f"target layers: need >= 1 layer and >= 1 fused layer (got {n_layers}, {n_fused})")
    if n_fused == 1:
        return (n_layers // 2,)
    end = max(1, n_layers - 3)
    n_fused = min(n_fused, end)  # a small target fuses the distinct layers it has
    if n_fused == 1:
        return (1,)
    return tuple(round(1 + i * (end - 1) / (n_fused - 1)) for i in range(n_fused))


def cost(shape: Sizes, block_size: int, ttt: int = 1) -> CostModel:
    """The target runs forward only (2*N FLOPs a token, attention 2*layers*hidden per l^2); each block runs
    ``block_size`` queries through the drafter forward and backward (6*Nd FLOPs a query, Nd =
    12*draft_layers*dh^2 + draft_vocab*dh, the LM head included) and reads its context (keys and values of the
    target's hidden states: 6*draft_layers*dh per query and key).

    >>> c = cost(Sizes(hidden=64, layers=2, vocab=100), 16)
    >>> c.a, c.d > 0, c.e > 0
    (1.0, True, True)
    """
    if block_size < 1:
        raise ConfigError(f"drafter shape: block size must be >= 1 (got {block_size})")
    target, t_attn, draft, d_attn, dh = flops(shape)
    return CostModel(
        a=1.0,
        b=t_attn / target,
        c=0.0,
        source=f"drafter dflash h{shape.hidden} l{shape.layers} dh{dh}",
        d=block_size * (draft + d_attn * block_size) / target,
        e=block_size * d_attn / target,
    )


def memory_terms(
    s: Sizes, *, block_size: int = 16, objective: str = "data_ce", chunk_bytes: int = m.CHUNK_BYTES
) -> m.MemoryModel:
    """The coefficients from the sizes of the reference drafter (float32): per token, per block (its queries
    through every draft layer and their in-block scores) and per unit of reach (context scores)."""
    fixed, token = m.common_terms(s, objective, chunk_bytes)
    d = s.hidden // s.heads
    act = m.COPIES_ACTIVATION * m.FLOAT
    per_query = act * s.draft_layers * (6 * s.hidden + 3 * s.intermediate + 2 * s.kv_heads * d)
    block = block_size * (per_query + m.COPIES_ATTENTION * m.FLOAT * s.draft_layers * s.heads * block_size)
    reach = 2 * block_size * m.COPIES_ATTENTION * m.FLOAT * s.draft_layers * s.heads
    return m.MemoryModel(fixed, token, block, reach, 0.0, f"analytic dflash h{s.hidden} B{block_size}")


def memory(s: Sizes, r: Recipe) -> m.MemoryModel:
    """The activation memory at the recipe's block size and objective."""
    return memory_terms(s, block_size=r.block_size, objective=r.objective)


def recipe_line(r: Recipe) -> str:
    """The recipe line: block, anchors, objective, slot weights and normalization."""
    w = {"exp": f"exp(-(k-1)/{r.gamma:g})", "dpace": f"D-PACE a={r.dpace_alpha:g}"}.get(
        r.slot_weights, "uniform"
    )
    density = "" if r.anchor_density == 1 else f" x{r.anchor_density:g}"
    anchors = f"anchors min(valid, {r.max_anchors}){density}"
    return line(r, f"block {r.block_size}", anchors, r.objective, f"slot weights {w}")


def block_method(**fields: Any) -> Method:
    """A method that drafts in blocks opened at anchors (DFlash and the methods built on it): its
    :class:`Method` of ``fields``, counted in draft blocks, bound by them, sized by its block."""
    return Method(
        unit="draft blocks", knob="block_size", bound=m.bound_blocks, anchors=anchor_policy, **fields
    )


def anchor_policy(r: Recipe) -> AnchorPolicy:
    """The recipe's anchor rule (:meth:`Recipe.anchor_policy`)."""
    return r.anchor_policy()


METHOD = block_method(
    name="dflash", title="DFlash", spec=sys.modules[__name__], cost=cost, memory=memory,
    recipe_line=recipe_line, export_format="dflash", crossing="block labels",
)  # fmt: skip
