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

:func:`analytic` derives the coefficients from the model's sizes (float32 activations, the tensors padfree's
reference drafters keep, times the copies autograd and softmax hold, measured on this CPU: see
``tests/drafter/test_memory.py``); :func:`fit` takes them from measured peaks (``padfree calibrate
--drafter``).

>>> m = MemoryModel(fixed=10.0, per_token=1.0, per_block=100.0, per_reach=0.5)
>>> float(m.peak_of(slots=1000, blocks=20, reach=4000))
5010.0
>>> anchor_budget(m, memory=10_000, budget=1000)  # (10000 - 10 - 1000) // (100 + 0.5 * 1000 / 2)
25
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from padfree.core.cost import Shapes
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


@dataclass(frozen=True)
class MemorySizes:
    """The sizes a method's activation memory model reads: the target's width, the drafter's heads,
    key-value heads and MLP width, its layers, the target layers it fuses and its LM head's vocabulary."""

    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    draft_layers: int = 1
    fused_layers: int = 3
    vocab: int = 32000


def _common(s: MemorySizes, objective: str, chunk_bytes: int) -> tuple[float, float]:
    """``(fixed, per token)`` bytes every method keeps: one LM-head chunk of
    :func:`padfree.drafter.objective.chunk_positions` (its copies by ``objective``), and per token the
    target's fused layers and final states, the fused context and its keys/values."""
    d = s.hidden // s.heads
    act = COPIES_ACTIVATION * FLOAT
    chunk = max(1, chunk_bytes // (16 * max(s.vocab, 1))) * s.vocab * FLOAT  # one chunk's float32 logits
    fixed = float(LOGIT_COPIES.get(objective, 12.0) * chunk)
    token = FLOAT * (2 * s.fused_layers + 3) * s.hidden + act * s.draft_layers * (
        s.hidden + 2 * s.kv_heads * d
    )
    return fixed, token


def block_memory(
    s: MemorySizes, *, block_size: int = 16, objective: str = "data_ce", chunk_bytes: int = 256 * 2**20
) -> MemoryModel:
    """DFlash's coefficients from the sizes of the reference drafter (float32): per token, per block (its
    queries through every draft layer and their in-block scores) and per unit of reach (context scores)."""
    fixed, token = _common(s, objective, chunk_bytes)
    d = s.hidden // s.heads
    act = COPIES_ACTIVATION * FLOAT
    per_query = act * s.draft_layers * (6 * s.hidden + 3 * s.intermediate + 2 * s.kv_heads * d)
    block = block_size * (per_query + COPIES_ATTENTION * FLOAT * s.draft_layers * s.heads * block_size)
    reach = 2 * block_size * COPIES_ATTENTION * FLOAT * s.draft_layers * s.heads
    return MemoryModel(fixed, token, block, reach, 0.0, f"analytic dflash h{s.hidden} B{block_size}")


def unrolled_memory(
    s: MemorySizes, *, ttt: int = 7, objective: str = "data_ce", chunk_bytes: int = 256 * 2**20
) -> MemoryModel:
    """EAGLE-3's coefficients from the sizes of the reference drafter (float32): per token (its ``ttt``
    steps' projections) and per ``l x l`` score and test-time-training step."""
    fixed, token = _common(s, objective, chunk_bytes)
    d = s.hidden // s.heads
    per_step = COPIES_STEP * FLOAT * (8 * s.hidden + 3 * s.intermediate + 2 * s.kv_heads * d)
    return MemoryModel(
        fixed,
        token + ttt * per_step,
        0.0,
        0.0,
        COPIES_STEP_ATTENTION * FLOAT * s.heads * ttt,
        f"analytic eagle3 h{s.hidden} ttt{ttt}",
    )


def stepped_memory(
    s: MemorySizes, *, ttt: int = 3, objective: str = "data_ce", chunk_bytes: int = 256 * 2**20
) -> MemoryModel:
    """MTP's coefficients from the sizes of the reference drafter (float32): per token its ``ttt`` steps
    (each projects ``[embedding ; hidden]`` down, runs the draft layer and a final norm: EAGLE-3's step plus
    the projection's input) and per ``l x l`` causal score and step."""
    fixed, token = _common(s, objective, chunk_bytes)
    d = s.hidden // s.heads
    per_step = COPIES_STEP * FLOAT * (10 * s.hidden + 3 * s.intermediate + 2 * s.kv_heads * d)
    return MemoryModel(
        fixed,
        token + ttt * per_step,
        0.0,
        0.0,
        COPIES_STEP_ATTENTION * FLOAT * s.heads * ttt,
        f"analytic mtp h{s.hidden} steps{ttt}",
    )


def analytic(
    blocks: bool,
    *,
    block_size: int = 16,
    ttt: int = 7,
    objective: str = "data_ce",
    chunk_bytes: int = 256 * 2**20,
    **sizes: int,
) -> MemoryModel:
    """:func:`block_memory` (``blocks``: DFlash) or :func:`unrolled_memory` (EAGLE-3) of ``sizes``
    (:class:`MemorySizes`' fields); a method's own coefficients are
    :attr:`padfree.drafter.methods.Method.memory`."""
    s = MemorySizes(**sizes)
    if blocks:
        return block_memory(s, block_size=block_size, objective=objective, chunk_bytes=chunk_bytes)
    return unrolled_memory(s, ttt=ttt, objective=objective, chunk_bytes=chunk_bytes)


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


def available_bytes() -> int | None:
    """Memory this machine can still give a process without swapping (Linux ``MemAvailable``; None where
    unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resident_bytes() -> int:
    """This process's resident memory now (Linux ``/proc``; 0 elsewhere)."""
    return _status("VmRSS")


def peak_resident_bytes() -> int:
    """This process's resident high-water mark (Linux ``/proc``; 0 elsewhere)."""
    return _status("VmHWM")


def reset_peak() -> None:
    """Restart the high-water mark at the current resident memory (Linux ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _status(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
