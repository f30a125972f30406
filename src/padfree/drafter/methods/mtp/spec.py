"""MTP's spec: its FLOP cost, activation memory, recipe line and memory bound, and its one target layer (the
last). No torch (its torch side is :mod:`padfree.drafter.methods.mtp.model`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from padfree.core.config import CostModel
from padfree.drafter import memory as m
from padfree.drafter.methods.base import Method, check_steps, flops, line
from padfree.drafter.methods.eagle3.spec import step_terms
from padfree.drafter.sizes import Sizes
from padfree.errors import ConfigError

if TYPE_CHECKING:
    from padfree.drafter.recipes import Recipe


def last_layer(n_layers: int, n_fused: int = 1) -> tuple[int, ...]:
    """MTP's one layer: the target's last decoder layer (its output before the final norm, what
    speculators' ``verifier_last_hidden_states`` holds). ``n_fused`` must be 1.

    >>> last_layer(36)
    (35,)
    """
    if n_fused != 1 or n_layers < 1:
        raise ConfigError(f"MTP reads the target's last layer only (got {n_fused} fused of {n_layers})")
    return (n_layers - 1,)


def cost(shape: Sizes, block_size: int, ttt: int) -> CostModel:
    """Per token, ``ttt`` steps each projecting ``[embedding ; hidden]`` (2h -> dh) and running the draft
    layer forward and backward with its own causal attention over the document: it scales with tokens and
    attention, so it folds into ``a`` and ``b``.

    >>> c = cost(Sizes(hidden=64, layers=2, vocab=100), 16, 3)
    >>> c.a, 0 < c.b < 1
    (1.0, True)
    """
    check_steps(ttt)
    target, t_attn, draft, d_attn, dh = flops(shape)
    per_token = target + ttt * (6.0 * 2 * shape.hidden * dh + draft)
    return CostModel(
        a=1.0,
        b=(t_attn + ttt * d_attn) / per_token,
        c=0.0,
        source=f"drafter mtp h{shape.hidden} l{shape.layers} dh{dh}",
    )


def memory_terms(
    s: Sizes, *, ttt: int = 3, objective: str = "data_ce", chunk_bytes: int = m.CHUNK_BYTES
) -> m.MemoryModel:
    """The coefficients from the sizes of the reference drafter (float32): per token its ``ttt`` steps (each
    projects ``[embedding ; hidden]`` down, runs the draft layer and a final norm: EAGLE-3's step plus the
    projection's input) and per ``l x l`` causal score and step."""
    fixed, token, score = step_terms(s, ttt, objective, 10, chunk_bytes)
    return m.MemoryModel(fixed, token, 0.0, 0.0, score, f"analytic mtp h{s.hidden} steps{ttt}")


def memory(s: Sizes, r: Recipe) -> m.MemoryModel:
    """The activation memory at the recipe's steps and objective."""
    return memory_terms(s, ttt=r.ttt, objective=r.objective)


def recipe_line(r: Recipe) -> str:
    """The recipe line: steps, their weights, objective, normalization."""
    label = f"step weights {r.step_decay:g}^k normalised, label x[t+k+2] gated by its own loss mask"
    return line(r, f"{r.ttt} steps", label, r.objective, "full vocabulary")


METHOD = Method(
    name="mtp", title="MTP", spec=sys.modules[__name__], cost=cost, memory=memory, recipe_line=recipe_line,
    export_format="speculators-mtp", draft_layers=1, crossing="shifted inputs/labels", shifted_inputs=True,
)  # fmt: skip
