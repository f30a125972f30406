"""How much memory a drafter micro-batch takes, from its shapes, and the anchor budget a memory budget allows:
so that no plan padfree makes (or its report recommends) runs out of memory at the recipes' density. No torch.

A drafter step keeps, for its backward, activations that grow with the micro-batch's *tokens* (the target's
fused hidden states, the drafter's context keys and values), its *blocks* (DFlash: ``block_size`` queries
each, through every draft layer), its *reach* (DFlash: each block's attention scores over its document's
context; ``reach`` as :mod:`padfree.core.cost` counts it, half a block's context) and, for EAGLE-3, its
*attention* (``L x (L + k)`` scores per document and test-time-training step). The LM head's logits never
exist for more than one chunk of draft positions (:func:`padfree.drafter.objective.chunk_positions`), a
constant. So the peak a micro-batch adds to the process is linear in the same
:class:`~padfree.core.cost.Shapes` the cost model reads::

    bytes = fixed + per_token * slots + per_block * blocks + per_reach * reach + per_attention * attention

:func:`common_terms` and the copies below give every method's analytic coefficients from its
:class:`~padfree.drafter.sizes.Sizes` (float32 activations, the tensors padfree's reference drafters keep,
times the copies autograd and softmax hold, measured on this CPU: see ``tests/drafter/test_memory.py``); each
method's spec adds its own terms (``methods/<name>/spec.py``). :func:`fit` takes them from measured peaks
(``padfree calibrate --drafter``). A method's memory bound limits its micro-batches by draft blocks
(:func:`bound_blocks`) or attention (:func:`bound_attention`).

>>> m = MemoryModel(fixed=10.0, per_token=1.0, per_block=100.0, per_reach=0.5)
>>> float(m.peak_of(slots=1000, blocks=20, reach=4000))
5010.0
>>> anchor_budget(m, memory=10_000, budget=1000)  # (10000 - 10 - 1000) // (100 + 0.5 * 1000 / 2)
25
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from padfree.core.config import PlanConfig
from padfree.core.cost import Shapes
from padfree.drafter.sizes import Sizes
from padfree.errors import ConfigError

FLOAT = 4
"""Bytes of a float32 activation."""

COPIES_ATTENTION = 3.5
"""Score-sized tensors a softmax attention holds at its peak per layer (scores, masked scores, probabilities,
their gradient), fitted to peaks measured on this CPU (torch 2.13): 3.4 for DFlash's context scores."""

COPIES_ACTIVATION = 1.5
"""Hidden-sized tensors held per projection at the peak, fitted likewise (DFlash block queries)."""

COPIES_STEP = 0.6
"""EAGLE-3: hidden-sized tensors held per projection and test-time-training step, fitted likewise (its steps
reuse one layer, so autograd keeps less than a layer's worth each)."""

COPIES_STEP_ATTENTION = 1.0
"""EAGLE-3: ``l x l`` score tensors held per step (the probabilities), fitted likewise."""

CHUNK_BYTES = 256 * 2**20
"""Bytes of float32 logits one LM-head chunk holds at most
(:func:`padfree.drafter.objective.chunk_positions`)."""

LOGIT_COPIES = {"data_ce": 4.0, "argmax_ce": 4.0, "kl": 12.0}
"""Chunk-of-logits-sized tensors the loss holds by objective (drafter logits, log-softmax, gradient; KL adds
the target's logits, their restriction, log-softmax and probabilities), fitted likewise."""


@dataclass(frozen=True)
class MemoryModel:
    """Peak bytes a drafter micro-batch adds to the resident process, linear in its shapes (module docstring).

    Attributes:
        fixed: bytes any micro-batch adds (one chunk of LM-head logits and its softmax).
        per_token, per_block, per_reach, per_attention: bytes per unit of each shape.
        source: where the coefficients come from (``analytic ...`` or ``fit ...``).
    """

    fixed: float = 0.0
    per_token: float = 0.0
    per_block: float = 0.0
    per_reach: float = 0.0
    per_attention: float = 0.0
    source: str = "manual"

    def peak_of(
        self, *, slots: float | np.ndarray, blocks=0.0, reach=0.0, attention=0.0
    ) -> float | np.ndarray:
        """Bytes for micro-batches of these shapes (numbers or arrays)."""
        return (
            self.fixed
            + self.per_token * slots
            + self.per_block * np.asarray(blocks)
            + self.per_reach * np.asarray(reach)
            + self.per_attention * np.asarray(attention)
        )

    def parts_of(self, shapes: Shapes, i: int) -> dict[str, float]:
        """Micro-batch ``i``'s bytes by what holds them: ``tokens`` (the fixed LM-head chunk, the target's
        states and the drafter's context per token), ``draft_queries`` (DFlash's block queries through every
        draft layer) and ``attention`` (score tensors: DFlash's context scores, EAGLE-3's ``l x l`` per
        step). Their sum is :meth:`micro_bytes`'s ``i``-th."""
        blocks = 0.0 if shapes.blocks is None else float(shapes.blocks[i])
        reach = 0.0 if shapes.reach is None else float(shapes.reach[i])
        return {
            "tokens": self.fixed + self.per_token * float(shapes.slots[i]),
            "draft_queries": self.per_block * blocks,
            "attention": self.per_reach * reach + self.per_attention * float(shapes.attn[i]),
        }

    def micro_bytes(self, shapes: Shapes) -> np.ndarray:
        """Bytes of every micro-batch of a plan (:func:`padfree.core.cost.micro_shapes`)."""
        zero = np.zeros_like(shapes.slots, dtype=np.float64)
        return np.asarray(
            self.peak_of(
                slots=shapes.slots.astype(np.float64),
                blocks=zero if shapes.blocks is None else shapes.blocks,
                reach=zero if shapes.reach is None else shapes.reach,
                attention=shapes.attn.astype(np.float64),
            ),
            dtype=np.float64,
        )


def common_terms(s: Sizes, objective: str, chunk_bytes: int = CHUNK_BYTES) -> tuple[float, float]:
    """``(fixed, per token)`` bytes every method keeps: one LM-head chunk of
    :func:`padfree.drafter.objective.chunk_positions` (its copies by ``objective``), and per token the
    target's fused layers and final states, the fused context and its keys/values."""
    d = s.hidden // s.heads
    act = COPIES_ACTIVATION * FLOAT
    v = s.head_vocab
    chunk = max(1, chunk_bytes // (16 * max(v, 1))) * v * FLOAT  # one chunk's float32 logits
    fixed = float(LOGIT_COPIES.get(objective, 12.0) * chunk)
    token = FLOAT * (2 * s.fused_layers + 3) * s.hidden + act * s.draft_layers * (
        s.hidden + 2 * s.kv_heads * d
    )
    return fixed, token


def fit(rows: list[dict], source: str = "fit") -> MemoryModel:
    """Coefficients from measured peaks: ``rows`` of ``{"slots", "blocks", "reach", "attention", "bytes"}``,
    least squares with every coefficient kept >= 0 (a negative one is dropped and the rest refitted)."""
    names = ("fixed", "slots", "blocks", "reach", "attention")
    x = np.array([[1.0] + [float(r.get(k, 0.0)) for k in names[1:]] for r in rows])
    y = np.array([float(r["bytes"]) for r in rows])
    keep = [j for j in range(x.shape[1]) if x[:, j].any()]
    coef = np.zeros(x.shape[1])
    while keep:
        sol = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (sol >= 0).all():
            coef[keep] = sol
            break
        keep = [k for k, s in zip(keep, sol, strict=True) if s >= 0]
    fixed, token, block, reach, attention = (float(c) for c in coef)
    return MemoryModel(fixed, token, block, reach, attention, source)


def anchor_budget(model: MemoryModel, memory: float, budget: int, *, block_cap: int | None = None) -> int:
    """The most DFlash blocks a micro-batch of ``budget`` tokens may open within ``memory`` bytes, whatever
    the documents (each block reading up to the whole budget as context). A memory that cannot hold even the
    tokens is a one-line :class:`ConfigError`."""
    spare = memory - model.fixed - model.per_token * budget
    per_block = model.per_block + model.per_reach * budget / 2.0
    if spare <= 0 or (per_block > 0 and spare < per_block):
        need = model.fixed + model.per_token * budget + per_block
        raise ConfigError(
            f"a memory budget of {memory / 2**30:.2f} GiB cannot hold one micro-batch of {budget} tokens and "
            f"one draft block ({need / 2**30:.2f} GiB by {model.source}); raise it or lower --budget"
        )
    n = int(spare // per_block) if per_block > 0 else 2**31 - 1
    return max(1, min(n, block_cap if block_cap is not None else n))


def check_anchors_fit(blocks: int | None, anchors, memory: float, budget: int) -> None:
    """Refuse, in one line naming the options that fix it, a sample whose anchors exceed the ``blocks`` a
    micro-batch may open within ``--memory-gb`` (``memory`` bytes; :func:`anchor_budget`): its blocks cannot
    be split across micro-batches. ``--max-anchors`` (the recipe's cap per document; ``report``,
    ``simulate`` and ``examples/train_drafter.py`` take it), a larger ``--memory-gb`` or a smaller
    ``--budget`` (more blocks fit) each work; the planner's own error would name its ``anchor_budget``."""
    if blocks is None or anchors is None or len(anchors) == 0:
        return
    a = np.asarray(anchors, dtype=np.int64)
    i = int(np.argmax(a))
    if int(a[i]) > blocks:
        raise ConfigError(
            f"--memory-gb {memory / 2**30:g} allows {blocks} draft blocks per micro-batch of --budget "
            f"{budget} tokens, fewer than sample {i}'s {int(a[i])} anchors: pass --max-anchors {blocks} "
            "(anchors per document at most), raise --memory-gb or lower --budget"
        )


def attention_budget(model: MemoryModel, memory: float, budget: int) -> int | None:
    """EAGLE-3: the ``l x l`` score budget (:class:`~padfree.core.config.PlanConfig` ``attn_budget``) a memory
    budget allows a micro-batch of ``budget`` tokens; ``None`` when attention costs nothing in the model."""
    if model.per_attention <= 0:
        return None
    spare = memory - model.fixed - model.per_token * budget
    if spare < model.per_attention:
        raise ConfigError(
            f"a memory budget of {memory / 2**30:.2f} GiB cannot hold one micro-batch of {budget} tokens "
            f"({model.source}); raise it or lower --budget"
        )
    return int(spare // model.per_attention)


def bound_blocks(
    recipe: Any, config: PlanConfig, model: MemoryModel, memory: float | None, blocks: int | None
) -> tuple[PlanConfig, int | None]:
    """A method whose work opens at anchors (DFlash): its micro-batches hold at most ``blocks`` draft blocks
    (the user's ``anchor_budget``) and at most what ``memory`` bytes allow (:func:`anchor_budget`; None:
    no memory bound). Returns the config and the blocks the memory allows."""
    by_memory = None if memory is None else anchor_budget(model, memory, config.budget)
    bound = blocks if by_memory is None else min(blocks or by_memory, by_memory)
    return config.with_(anchor_budget=bound), by_memory


def bound_attention(
    recipe: Any, config: PlanConfig, model: MemoryModel, memory: float | None, blocks: int | None
) -> tuple[PlanConfig, None]:
    """A method whose work scales with each document's attention (EAGLE-3): ``memory`` bytes bound the
    ``l x (l + ttt - 1)`` scores a micro-batch holds, per document on a packed row (padfree's drafters attend
    document by document, and :meth:`MemoryModel.micro_bytes` prices them so); it counts no blocks."""
    if memory is not None:
        config = config.with_(
            attn_budget=attention_budget(model, memory, config.budget),
            attn_extra=recipe.ttt - 1,
            attn_per_document=config.packed,
        )
    return config.with_(anchor_budget=None), None
