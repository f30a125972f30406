"""P-EAGLE's spec: its FLOP cost, activation memory, recipe line and memory bound. No torch (its torch side
is :mod:`padfree.drafter.methods.peagle.model`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from padfree.core.config import CostModel
from padfree.drafter import memory as m
from padfree.drafter.methods.base import Method, check_steps, flops, line
from padfree.drafter.methods.eagle3.spec import memory_terms, vocabulary
from padfree.drafter.sizes import Sizes

if TYPE_CHECKING:
    from padfree.drafter.recipes import Recipe

COD_RATIOS = (0.7, 0.2)
"""P-EAGLE's COD keep ratio per depth and its floor (speculators 0.9.0 ``PEagleArgs``): what its cost
reads."""


def cost(shape: Sizes, block_size: int, ttt: int) -> CostModel:
    """Per token, fuse 3 hidden states (3h -> dh), then its ``ttt`` depths through the draft layer forward
    and backward (padfree's reference drafter runs every depth at every position, each with EAGLE-3's
    attention), the LM head only on the elements COD sampling keeps (``1 + sum_d max(r^d, r_min)`` a token):
    it scales with tokens and attention, so it folds into ``a`` and ``b``.

    >>> c = cost(Sizes(hidden=64, layers=2, vocab=100), 16, 8)
    >>> c.a, 0 < c.b < 1, c.source
    (1.0, True, 'drafter peagle h64 l2 dh64')
    """
    check_steps(ttt)
    target, t_attn, _, d_attn, dh = flops(shape)
    r, r_min = COD_RATIOS
    kept = 1.0 + sum(max(r**d, r_min) for d in range(1, ttt))
    layer = 6.0 * 12 * shape.draft_layers * dh * dh
    per_token = target + 6.0 * 3 * shape.hidden * dh + ttt * layer + kept * 6.0 * shape.head_vocab * dh
    return CostModel(
        a=1.0,
        b=(t_attn + ttt * d_attn) / per_token,
        c=0.0,
        source=f"drafter peagle h{shape.hidden} l{shape.layers} dh{dh}",
    )


def memory(s: Sizes, r: Recipe) -> m.MemoryModel:
    """EAGLE-3's activation memory at ``ttt`` steps (the reference drafter's depths hold one step's
    activations each), named for P-EAGLE."""
    return memory_terms(
        s, ttt=r.ttt, objective=r.objective, source=f"analytic peagle h{s.hidden} depths{r.ttt}"
    )


def recipe_line(r: Recipe) -> str:
    """The recipe line: depths, COD ratios, gate, objective, vocabulary, normalization."""
    cod = f"COD keep max({r.cod_ratio:g}^d, {r.cod_ratio_min:g})"
    gate = f"gate loss_mask[t+d+{r.loss_gate}]"
    return line(r, f"{r.ttt} parallel depths", cod, gate, r.objective, vocabulary(r))


METHOD = Method(
    name="peagle", title="P-EAGLE", spec=sys.modules[__name__], cost=cost, memory=memory,
    recipe_line=recipe_line, export_format="speculators-peagle", draft_layers=1,
    crossing="chain labels/inputs", shifted_inputs=True,
)  # fmt: skip
