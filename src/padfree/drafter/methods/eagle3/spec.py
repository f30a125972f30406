"""EAGLE-3's spec: its FLOP cost, activation memory, recipe line and memory bound, and its low, middle and
high target layers. No torch (its torch side is :mod:`padfree.drafter.methods.eagle3.model`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from padfree.core.config import CostModel
from padfree.drafter import memory as m
from padfree.drafter.methods.base import Method, check_steps, flops, line
from padfree.drafter.sizes import Sizes
from padfree.errors import ConfigError

if TYPE_CHECKING:
    from padfree.drafter.recipes import Recipe


def low_mid_high(n_layers: int, n_fused: int = 3) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers: ``(1, n // 2 - 1, n - 4)``; below 8 layers, spread evenly over
    ``0 .. n - 2``. ``n_fused`` must be 3 (the method fuses three).

    >>> low_mid_high(36), low_mid_high(6)
    ((1, 17, 32), (0, 2, 4))
    """
    if n_fused != 3:
        raise ConfigError(f"EAGLE-3 fuses 3 target layers (got {n_fused})")
    if n_layers >= 8:
        return (1, n_layers // 2 - 1, n_layers - 4)
    if n_layers < 2:
        raise ConfigError(f"EAGLE-3 needs a target with at least 2 layers (got {n_layers})")
    top = n_layers - 2
    return tuple(round(i * top / 2) for i in range(3))


def cost(shape: Sizes, block_size: int, ttt: int) -> CostModel:
    """Per token, fuse 3 hidden states (3h -> dh), then ``ttt`` drafter steps forward and backward, each
    with its causal attention: it scales with tokens and attention, so it folds into ``a`` and ``b``."""
    check_steps(ttt)
    target, t_attn, draft, d_attn, dh = flops(shape)
    per_token = target + 6.0 * 3 * shape.hidden * dh + ttt * draft
    return CostModel(
        a=1.0,
        b=(t_attn + ttt * d_attn) / per_token,
        c=0.0,
        source=f"drafter eagle3 h{shape.hidden} l{shape.layers} dh{dh}",
    )


def step_terms(s: Sizes, ttt: int, objective: str, projected: int, chunk_bytes: int) -> tuple[float, ...]:
    """``(fixed, per token, per score)`` bytes of a drafter of ``ttt`` steps each through one draft layer
    whose projections hold ``projected`` hidden-sized inputs (EAGLE-3: 8; MTP: 10), with an ``l x l``
    score per step."""
    fixed, token = m.common_terms(s, objective, chunk_bytes)
    d = s.hidden // s.heads
    per_step = m.COPIES_STEP * m.FLOAT * (projected * s.hidden + 3 * s.intermediate + 2 * s.kv_heads * d)
    return fixed, token + ttt * per_step, m.COPIES_STEP_ATTENTION * m.FLOAT * s.heads * ttt


def memory_terms(
    s: Sizes,
    *,
    ttt: int = 7,
    objective: str = "data_ce",
    chunk_bytes: int = m.CHUNK_BYTES,
    source: str | None = None,
) -> m.MemoryModel:
    """The coefficients from the sizes of the reference drafter (float32): per token (its ``ttt`` steps'
    projections) and per ``l x l`` score and test-time-training step (``source``: the model's name)."""
    fixed, token, score = step_terms(s, ttt, objective, 8, chunk_bytes)
    return m.MemoryModel(fixed, token, 0.0, 0.0, score, source or f"analytic eagle3 h{s.hidden} ttt{ttt}")


def memory(s: Sizes, r: Recipe) -> m.MemoryModel:
    """The activation memory at the recipe's test-time-training steps and objective."""
    return memory_terms(s, ttt=r.ttt, objective=r.objective)


def vocabulary(r: Recipe) -> str:
    """The recipe's draft vocabulary in words."""
    return "full vocabulary" if r.draft_vocab is None else f"draft vocabulary {r.draft_vocab}"


def recipe_line(r: Recipe) -> str:
    """The recipe line: test-time-training steps, decay, gate, objective, vocabulary, normalization."""
    gate = f"gate loss_mask[t+k+{r.loss_gate}]"
    return line(r, f"ttt {r.ttt}", f"step decay {r.step_decay:g}", gate, r.objective, vocabulary(r))


METHOD = Method(
    name="eagle3", title="EAGLE-3", spec=sys.modules[__name__], cost=cost, memory=memory,
    recipe_line=recipe_line, export_format="speculators", draft_layers=1, crossing="shifted inputs/labels",
    shifted_inputs=True,
)  # fmt: skip
