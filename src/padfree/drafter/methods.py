"""The drafter methods padfree trains, registered by name: what the planner, the CLI and the checks need to
know of each method, in one place (no torch here; the method's model and fields live in its own module).

A method is described once, by a :class:`Method`: its name and title, the module that holds its torch side
(fields builder, config, drafter, leak counts), whether its draft work is opened at *anchors* that the planner
counts (DFlash blocks) and its FLOP cost terms. Which target layers a drafter fuses is a recipe's choice
(:mod:`padfree.drafter.recipes`), by one of the :data:`LAYER_RULES` here. Everything outside this module
and the methods' own modules asks the registry instead of comparing names, so a third method (MTP fine-tuning,
DSpark) is one more entry here plus its own module.

>>> sorted(METHODS)
['dflash', 'dflash2', 'eagle3', 'mtp', 'peagle']
>>> get("dflash").uses_anchors, get("eagle3").uses_anchors
(True, False)
>>> LAYER_RULES["spread"](36, 5), LAYER_RULES["low_mid_high"](36, 3)
((1, 9, 17, 25, 33), (1, 17, 32))
>>> get("medusa")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
padfree.errors.ConfigError: unknown drafter method 'medusa': choose dflash or eagle3 or mtp or peagle or ...
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from padfree.core.config import CostModel
from padfree.drafter import memory as _memory
from padfree.drafter.memory import MemoryModel, MemorySizes
from padfree.errors import ConfigError

if TYPE_CHECKING:
    from padfree.drafter.recipes import Recipe


@dataclass(frozen=True)
class DrafterShape:
    """The sizes the cost model reads: the target's, and the drafter's where they differ (``None``: the
    target's hidden size and vocabulary)."""

    hidden: int = 4096
    layers: int = 32
    vocab: int = 32000
    draft_hidden: int | None = None
    draft_layers: int = 1
    draft_vocab: int | None = None

    def __post_init__(self) -> None:
        dh, dv = (
            self.draft_hidden or self.hidden,
            self.vocab if self.draft_vocab is None else self.draft_vocab,
        )
        if min(self.hidden, self.layers, dh, self.draft_layers) < 1 or min(self.vocab, dv) < 0:
            raise ConfigError("drafter shape: sizes must be >= 1 and vocabularies >= 0")


class MethodModule(Protocol):
    """What a method's torch module provides (mypy checks the modules against it in
    :mod:`padfree.drafter.train`): its draft queries of a micro-batch, its drafter built from a recipe and
    the target's sizes, the pairs a leak check counts, and its export format's writer
    (:mod:`padfree.drafter.export` dispatches to it): ``export_files(state, meta) -> (config, tensors)``
    and ``check_export(meta, verifier_option=...)``, which refuses in one line what the format cannot
    hold."""

    @property
    def Fields(self) -> type: ...  # noqa: N802 (the module's class)

    def fields(self, contract: Any, options: Any, *, epoch: int, leaky: bool = False) -> Any: ...

    def build(
        self,
        recipe: Recipe,
        sizes: dict[str, Any],
        *,
        n_fused: int,
        draft_layers: int,
        weights: tuple,
        vocab: Any,
    ) -> Any: ...

    def crossings(self, batch: Any) -> tuple[int, Any, Any]: ...

    def field_padding(self, batch: Any, mask_token_id: int = 1) -> Any: ...

    def export_files(self, state: dict, meta: dict) -> tuple[dict, dict]: ...

    def check_export(self, meta: dict, *, verifier_option: str | None = ...) -> None: ...


@dataclass(frozen=True)
class Method:
    """One drafter method.

    Attributes:
        name: registry key and CLI choice. title: how prose names it.
        module: the module with the method's torch side: ``Fields`` (its draft queries of a micro-batch),
            ``fields(contract, options, *, epoch, leaky)``, ``Config``, ``Drafter`` and ``crossings(batch)``
            (the attended pairs and fed inputs that join two documents, for ``check-drafter``).
        uses_anchors: draft work is opened at anchors chosen per document (:mod:`padfree.core.anchors`),
            which plans count, budget and balance.
        unit: what one unit of the method's draft work is called in reports.
        knob: the method's own size option (``block_size`` or ``ttt``), printed beside its name.
        fused_layers: target layers fused by default (an offline hidden-state cache keeps these plus the
        last). target_layers: ``(target layers, fused layers) -> layer ids`` (decoder layer outputs, from 0).
        cost: ``(shape, block_size, ttt) -> CostModel``: FLOP-derived, in target-forward token units.
        memory: ``(sizes, recipe) -> MemoryModel``: the activation memory of a micro-batch
            (:mod:`padfree.drafter.memory`).
        recipe_line: ``recipe -> str``: the recipe's values that set this method's work and loss, one line.
        export_format: the served format a checkpoint of this method exports to (its module writes it:
            ``export_files`` and ``check_export``); one method per format.
        speculators_kwargs: ``(recipe, max_anchors) -> keywords`` of vllm speculators' model class's
            ``get_trainer_kwargs`` for the recipe (one line when speculators trains no such recipe); None:
            speculators has no model of this method.
        speculators_inputs: ``"module:function"`` building that model's forward inputs from a padfree batch,
            ``(batch, target, *, shapes, noise) -> (inputs, anchor choice or None)``
            (:func:`padfree.integrations.feed.speculators_inputs` dispatches to it; needs torch).
        speculators_head: ``recipe -> n``: the positions at each document's start that carry no loss in
            speculators' packed row (EAGLE-3: ``ttt - 1``, where a shifted pair could join two documents;
            MTP: ``ttt + 1``).
        speculators_tail: loss-free positions speculators' row needs after its last document (MTP: ``ttt +
            1``, the queries their class drops at a row's end).
        speculators_columns: ``"module:function"`` that gates a speculators row's loss mask and gives the
            columns the method adds to it, ``(loss mask, starts, lens, sample ids, recipe, *, seed, epoch) ->
            (loss mask, chains)`` (P-EAGLE's per-document chains, :func:`padfree.drafter.peagle.row_chains`;
            :class:`padfree.integrations.speculators.PadfreeCollate` calls it); None: none.
        draft_layers: the drafter's layers where the method fixes them (EAGLE-3: one decoder layer); None:
            the caller's choice (``--draft-layers``).
        crossing: what of the drafter's labels (and fed inputs) can cross a document end, as
            ``check-drafter`` names them.
        shifted_inputs: the drafter is fed inputs shifted along the row (EAGLE-3's next tokens), which can
            come from another document (``check-drafter`` counts them).
        specforge_packed: SpecForge has a patched model that trains this method on packed rows.
    """

    name: str
    title: str
    module: str
    uses_anchors: bool
    unit: str
    knob: str
    cost: Callable[[DrafterShape, int, int], CostModel]
    memory: Callable[[MemorySizes, Recipe], MemoryModel]
    recipe_line: Callable[[Recipe], str]
    export_format: str
    speculators_kwargs: Callable[[Recipe, int | None], dict[str, Any]] | None = None
    speculators_inputs: str | None = None
    speculators_head: Callable[[Recipe], int] = lambda r: 0
    speculators_tail: Callable[[Recipe], int] = lambda r: 0
    speculators_columns: str | None = None
    draft_layers: int | None = None
    crossing: str = "labels"
    shifted_inputs: bool = False
    specforge_packed: bool = False

    def load(self) -> ModuleType:
        """The method's torch module (needs torch; it provides :class:`MethodModule`)."""
        return importlib.import_module(self.module)

    def layers(self, draft_layers: int) -> int:
        """The drafter's layers when ``draft_layers`` are asked for: the method's own where it fixes them."""
        return draft_layers if self.draft_layers is None else self.draft_layers

    def describe(self, block_size: int, ttt: int) -> str:
        """The method with its own size: ``"dflash (block 16)"``, ``"eagle3 (ttt 7)"``."""
        return (
            f"{self.name} (block {block_size})" if self.knob == "block_size" else f"{self.name} (ttt {ttt})"
        )


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


def _flops(s: DrafterShape) -> tuple[float, float, float, float, int]:
    """``(target per token, target attention per l^2, drafter per query, drafter attention per pair, dh)``."""
    dh = s.draft_hidden or s.hidden
    dv = s.vocab if s.draft_vocab is None else s.draft_vocab
    target = 2.0 * (12 * s.layers * s.hidden * s.hidden + s.vocab * s.hidden)
    draft = 6.0 * (12 * s.draft_layers * dh * dh + dv * dh)
    return target, 2.0 * s.layers * s.hidden, draft, 6.0 * s.draft_layers * dh, dh


def block_cost(shape: DrafterShape, block_size: int, ttt: int = 1) -> CostModel:
    """DFlash: the target runs forward only (2*N FLOPs a token, attention 2*layers*hidden per l^2); each
    block runs ``block_size`` queries through the drafter forward and backward (6*Nd FLOPs a query, Nd =
    12*draft_layers*dh^2 + draft_vocab*dh, the LM head included) and reads its context (keys and values of the
    target's hidden states: 6*draft_layers*dh per query and key).

    >>> m = block_cost(DrafterShape(hidden=64, layers=2, vocab=100), 16)
    >>> m.a, m.d > 0, m.e > 0
    (1.0, True, True)
    """
    if block_size < 1:
        raise ConfigError(f"drafter shape: block size must be >= 1 (got {block_size})")
    target, t_attn, draft, d_attn, dh = _flops(shape)
    return CostModel(
        a=1.0,
        b=t_attn / target,
        c=0.0,
        source=f"drafter dflash h{shape.hidden} l{shape.layers} dh{dh}",
        d=block_size * (draft + d_attn * block_size) / target,
        e=block_size * d_attn / target,
    )


def unrolled_cost(shape: DrafterShape, block_size: int, ttt: int) -> CostModel:
    """EAGLE-3: per token, fuse 3 hidden states (3h -> dh), then ``ttt`` drafter steps forward and backward,
    each with its causal attention: it scales with tokens and attention, so it folds into ``a`` and ``b``."""
    if ttt < 1:
        raise ConfigError(f"drafter shape: ttt must be >= 1 (got {ttt})")
    target, t_attn, draft, d_attn, dh = _flops(shape)
    per_token = target + 6.0 * 3 * shape.hidden * dh + ttt * draft
    return CostModel(
        a=1.0,
        b=(t_attn + ttt * d_attn) / per_token,
        c=0.0,
        source=f"drafter eagle3 h{shape.hidden} l{shape.layers} dh{dh}",
    )


def last_layer(n_layers: int, n_fused: int = 1) -> tuple[int, ...]:
    """MTP's one layer: the target's last decoder layer (its output before the final norm, what
    speculators' ``verifier_last_hidden_states`` holds). ``n_fused`` must be 1.

    >>> last_layer(36)
    (35,)
    """
    if n_fused != 1 or n_layers < 1:
        raise ConfigError(f"MTP reads the target's last layer only (got {n_fused} fused of {n_layers})")
    return (n_layers - 1,)


def stepped_cost(shape: DrafterShape, block_size: int, ttt: int) -> CostModel:
    """MTP: per token, ``ttt`` steps each projecting ``[embedding ; hidden]`` (2h -> dh) and running the
    draft layer forward and backward with its own causal attention over the document: it scales with tokens
    and attention, so it folds into ``a`` and ``b``.

    >>> m = stepped_cost(DrafterShape(hidden=64, layers=2, vocab=100), 16, 3)
    >>> m.a, 0 < m.b < 1
    (1.0, True)
    """
    if ttt < 1:
        raise ConfigError(f"drafter shape: ttt must be >= 1 (got {ttt})")
    target, t_attn, draft, d_attn, dh = _flops(shape)
    per_token = target + ttt * (6.0 * 2 * shape.hidden * dh + draft)
    return CostModel(
        a=1.0,
        b=(t_attn + ttt * d_attn) / per_token,
        c=0.0,
        source=f"drafter mtp h{shape.hidden} l{shape.layers} dh{dh}",
    )


LAYER_RULES: dict[str, Callable[[int, int], tuple[int, ...]]] = {
    "spread": spread_layers,
    "low_mid_high": low_mid_high,
    "last": last_layer,
}
"""Target-layer rules by name: ``(target layers, fused layers) -> layer ids`` (decoder layer outputs, from
0)."""


def block_line(r: Recipe) -> str:
    """DFlash's recipe line: block, anchors, objective, slot weights and normalization."""
    w = {"exp": f"exp(-(k-1)/{r.gamma:g})", "dpace": f"D-PACE a={r.dpace_alpha:g}"}.get(
        r.slot_weights, "uniform"
    )
    return (
        f"recipe {r.name}: block {r.block_size}, anchors min(valid, {r.max_anchors})"
        f"{'' if r.anchor_density == 1 else f' x{r.anchor_density:g}'}, {r.objective}, slot "
        f"weights {w}, {r.normalization} mean"
    )


def unrolled_line(r: Recipe) -> str:
    """EAGLE-3's recipe line: test-time-training steps, decay, gate, objective, vocabulary, normalization."""
    vocab = "full vocabulary" if r.draft_vocab is None else f"draft vocabulary {r.draft_vocab}"
    return (
        f"recipe {r.name}: ttt {r.ttt}, step decay {r.step_decay:g}, gate loss_mask[t+k+"
        f"{r.loss_gate}], {r.objective}, {vocab}, {r.normalization} mean"
    )


_LOSS_FN = {"argmax_ce": "ce", "kl": "kl_div"}
_SLOT_WEIGHTS = {"dpace": "dpace", "exp": "fixed-exp-decay"}


def block_trainer_kwargs(r: Recipe, max_anchors: int | None) -> dict[str, Any]:
    """speculators' DFlash trainer keywords: ``loss_fn`` (``ce`` for ``argmax_ce``, ``kl_div`` for ``kl``),
    slot weights (``dpace`` or ``fixed-exp-decay`` with the recipe's gamma), ``dpace_alpha`` and
    ``max_anchors`` (the fixed anchor width; default the recipe's cap).

    >>> from padfree.drafter.recipes import get as recipe
    >>> block_trainer_kwargs(recipe("speculators", "dflash"), 64)["per_position_loss_weight"]
    'dpace'
    """
    if r.objective not in _LOSS_FN or r.slot_weights not in _SLOT_WEIGHTS:
        raise ConfigError(
            f"recipe {r.name}: speculators' DFlash trains {' or '.join(_LOSS_FN)} with "
            f"{' or '.join(_SLOT_WEIGHTS)} slot weights, not {r.objective} with {r.slot_weights}"
        )
    return {
        "loss_fn": _LOSS_FN[r.objective],
        "dflash_decay_gamma": r.gamma,
        "max_anchors": r.max_anchors if max_anchors is None else int(max_anchors),
        "per_position_loss_weight": _SLOT_WEIGHTS[r.slot_weights],
        "dpace_alpha": r.dpace_alpha,
    }


def unrolled_trainer_kwargs(r: Recipe, max_anchors: int | None) -> dict[str, Any]:
    """speculators' EAGLE-3 trainer keywords: KL loss, ``ttt_steps`` and ``ttt_step_loss_decay``."""
    return {"loss_fn": "kl_div", "ttt_steps": r.ttt, "ttt_step_loss_decay": r.step_decay}


def stepped_line(r: Recipe) -> str:
    """MTP's recipe line: steps, their weights, objective, normalization."""
    return (
        f"recipe {r.name}: {r.ttt} steps, step weights {r.step_decay:g}^k normalised, label "
        f"x[t+k+2] gated by its own loss mask, {r.objective}, full vocabulary, {r.normalization} mean"
    )


def stepped_trainer_kwargs(r: Recipe, max_anchors: int | None) -> dict[str, Any]:
    """speculators' MTP trainer keywords: ``num_speculative_steps`` and ``step_weight_beta`` (their class
    turns them into the normalised step weights)."""
    return {"num_speculative_steps": r.ttt, "step_weight_beta": r.step_decay}


def stepped_memory(sizes: MemorySizes, r: Recipe) -> MemoryModel:
    """MTP's activation memory at the recipe's steps and objective."""
    return _memory.stepped_memory(sizes, ttt=r.ttt, objective=r.objective)


def block_memory(sizes: MemorySizes, r: Recipe) -> MemoryModel:
    """DFlash's activation memory at the recipe's block size and objective."""
    return _memory.block_memory(sizes, block_size=r.block_size, objective=r.objective)


def unrolled_memory(sizes: MemorySizes, r: Recipe) -> MemoryModel:
    """EAGLE-3's activation memory at the recipe's test-time-training steps and objective."""
    return _memory.unrolled_memory(sizes, ttt=r.ttt, objective=r.objective)


DFLASH = Method(
    "dflash", "DFlash", "padfree.drafter.dflash", True, "draft blocks", "block_size", block_cost,
    block_memory, block_line, "dflash", block_trainer_kwargs,
    "padfree.integrations.feed:dflash_inputs", crossing="block labels", specforge_packed=True,
)  # fmt: skip
EAGLE3 = Method(
    "eagle3", "EAGLE-3", "padfree.drafter.eagle3", False, "draft positions", "ttt", unrolled_cost,
    unrolled_memory, unrolled_line, "speculators", unrolled_trainer_kwargs,
    "padfree.integrations.feed:eagle3_feed", speculators_head=lambda r: r.ttt - 1, draft_layers=1,
    crossing="shifted inputs/labels", shifted_inputs=True,
)  # fmt: skip

MTP = Method(
    "mtp", "MTP", "padfree.drafter.mtp", False, "draft positions", "ttt", stepped_cost, stepped_memory,
    stepped_line, "speculators-mtp", stepped_trainer_kwargs, "padfree.integrations.feed:mtp_feed",
    speculators_head=lambda r: r.ttt + 1, speculators_tail=lambda r: r.ttt + 1, draft_layers=1,
    crossing="shifted inputs/labels", shifted_inputs=True,
)  # fmt: skip

COD_RATIOS = (0.7, 0.2)
"""P-EAGLE's COD keep ratio per depth and its floor (speculators 0.9.0 ``PEagleArgs``): what its cost
reads."""


def parallel_cost(shape: DrafterShape, block_size: int, ttt: int) -> CostModel:
    """P-EAGLE: per token, fuse 3 hidden states (3h -> dh), then its ``ttt`` depths through the draft layer
    forward and backward (padfree's reference drafter runs every depth at every position, each with
    EAGLE-3's attention), the LM head only on the elements COD sampling keeps
    (``1 + sum_d max(r^d, r_min)`` a token): it scales with tokens and attention, so it folds into ``a`` and
    ``b``.

    >>> m = parallel_cost(DrafterShape(hidden=64, layers=2, vocab=100), 16, 8)
    >>> m.a, 0 < m.b < 1, m.source
    (1.0, True, 'drafter peagle h64 l2 dh64')
    """
    if ttt < 1:
        raise ConfigError(f"drafter shape: ttt must be >= 1 (got {ttt})")
    target, t_attn, _, d_attn, dh = _flops(shape)
    dv = shape.vocab if shape.draft_vocab is None else shape.draft_vocab
    r, r_min = COD_RATIOS
    kept = 1.0 + sum(max(r**d, r_min) for d in range(1, ttt))
    layer = 6.0 * 12 * shape.draft_layers * dh * dh
    per_token = target + 6.0 * 3 * shape.hidden * dh + ttt * layer + kept * 6.0 * dv * dh
    return CostModel(
        a=1.0,
        b=(t_attn + ttt * d_attn) / per_token,
        c=0.0,
        source=f"drafter peagle h{shape.hidden} l{shape.layers} dh{dh}",
    )


def parallel_line(r: Recipe) -> str:
    """P-EAGLE's recipe line: depths, COD ratios, gate, objective, vocabulary, normalization."""
    vocab = "full vocabulary" if r.draft_vocab is None else f"draft vocabulary {r.draft_vocab}"
    return (
        f"recipe {r.name}: {r.ttt} parallel depths, COD keep max({r.cod_ratio:g}^d, {r.cod_ratio_min:g}), "
        f"gate loss_mask[t+d+{r.loss_gate}], {r.objective}, {vocab}, {r.normalization} mean"
    )


def parallel_trainer_kwargs(r: Recipe, max_anchors: int | None) -> dict[str, Any]:
    """speculators' P-EAGLE trainer keywords: KL loss, ``num_depths`` and the COD ratios (no anchor cap:
    padfree's chains are drawn per document and put in place by the feed)."""
    return {
        "loss_fn": "kl_div",
        "num_depths": r.ttt,
        "down_sample_ratio": r.cod_ratio,
        "down_sample_ratio_min": r.cod_ratio_min,
    }


def parallel_memory(sizes: MemorySizes, r: Recipe) -> MemoryModel:
    """P-EAGLE's activation memory: EAGLE-3's at ``ttt`` steps (the reference drafter's depths hold one
    step's activations each), named for P-EAGLE."""
    m = _memory.unrolled_memory(sizes, ttt=r.ttt, objective=r.objective)
    return dataclasses.replace(m, source=f"analytic peagle h{sizes.hidden} depths{r.ttt}")


PEAGLE = Method(
    "peagle", "P-EAGLE", "padfree.drafter.peagle", False, "draft positions", "ttt", parallel_cost,
    parallel_memory, parallel_line, "speculators-peagle", parallel_trainer_kwargs,
    "padfree.integrations.feed:peagle_feed", speculators_head=lambda r: 1,
    speculators_columns="padfree.drafter.peagle:row_chains", draft_layers=1,
    crossing="chain labels/inputs", shifted_inputs=True,
)  # fmt: skip

DFLASH2_SIZES = (2, 16, 256, 16)
"""DFlash2's convolution taps and channels per dynamic kernel, its selector's rank and candidates (speculators
0.9.0 ``DFlash2Args``): what its cost reads."""


def conv_block_cost(shape: DrafterShape, block_size: int, ttt: int = 1) -> CostModel:
    """DFlash2: DFlash's (:func:`block_cost`) plus, per block query and draft layer, its two dynamic
    convolutions (a kernel projection ``dh -> 2 K dh / g`` each, and ``2 x K`` multiply-adds a channel on
    each side of its sublayer), and per query the candidate selector (``dh -> r``, ``k`` candidates of rank
    ``r``), forward and backward.

    >>> m, b = conv_block_cost(DrafterShape(hidden=64, layers=2, vocab=100), 8), block_cost(
    ...     DrafterShape(hidden=64, layers=2, vocab=100), 8)
    >>> m.d > b.d, m.e == b.e, m.source
    (True, True, 'drafter dflash2 h64 l2 dh64')
    """
    m = block_cost(shape, block_size)
    target, _, _, _, dh = _flops(shape)
    kernel, group, rank, top = DFLASH2_SIZES
    conv = 2 * (dh * 2 * kernel * dh // group + 2 * 2 * kernel * dh)
    per_query = 6.0 * (shape.draft_layers * conv + dh * rank + 2 * top * rank)
    return dataclasses.replace(
        m,
        d=m.d + block_size * per_query / target,
        source=f"drafter dflash2 h{shape.hidden} l{shape.layers} dh{dh}",
    )


def selector_trainer_kwargs(r: Recipe, max_anchors: int | None) -> dict[str, Any]:
    """speculators' DFlash2 trainer keywords: DFlash's (:func:`block_trainer_kwargs`) and the selector's
    loss weight."""
    return {**block_trainer_kwargs(r, max_anchors), "selector_loss_alpha": r.selector_loss_alpha}


def selector_line(r: Recipe) -> str:
    """DFlash2's recipe line: DFlash's, its convolution and its selector."""
    return (
        f"{block_line(r)}; conv {r.conv_kernel_size} taps x {r.conv_group_size} channels inside each block, "
        f"selector top {r.selector_top_k} rank {r.selector_rank} x{r.selector_loss_alpha:g}"
    )


def conv_block_memory(sizes: MemorySizes, r: Recipe) -> MemoryModel:
    """DFlash2's activation memory: DFlash's at the recipe's block size plus, per block, each draft layer's
    four convolution outputs and two kernels per query, named for DFlash2."""
    m = _memory.block_memory(sizes, block_size=r.block_size, objective=r.objective)
    per_query = _memory.COPIES_ACTIVATION * _memory.FLOAT * sizes.draft_layers * 6 * sizes.hidden
    return dataclasses.replace(
        m,
        per_block=m.per_block + r.block_size * per_query,
        source=f"analytic dflash2 h{sizes.hidden} B{r.block_size}",
    )


DFLASH2 = Method(
    "dflash2", "DFlash2", "padfree.drafter.dflash2", True, "draft blocks", "block_size", conv_block_cost,
    conv_block_memory, selector_line, "speculators-dflash2", selector_trainer_kwargs,
    "padfree.integrations.feed:dflash_inputs", crossing="block labels/convolution taps",
)  # fmt: skip

METHODS: dict[str, Method] = {}
"""Every drafter method by name (the CLI's ``--method`` / ``--drafter`` choices are its keys)."""


def register(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` (a third method: its module and one ``register`` call)."""
    if method.name in METHODS and METHODS[method.name] is not method:
        raise ConfigError(f"drafter method {method.name!r} is registered already")
    holder = next((m for m in METHODS.values() if m.export_format == method.export_format), method)
    if holder.name != method.name:
        raise ConfigError(f"export format {method.export_format!r} holds {holder.name} drafters already")
    METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a method registered by :func:`register` (tests)."""
    METHODS.pop(name, None)


for _m in (DFLASH, EAGLE3, MTP, PEAGLE, DFLASH2):
    register(_m)


def get(name: str) -> Method:
    """The method registered as ``name``; anything else is a one-line :class:`ConfigError`."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown drafter method {name!r}: choose {' or '.join(METHODS)}") from None


def cost_model(method: str, *, block_size: int = 16, ttt: int = 7, **shape: int) -> CostModel:
    """The FLOP-derived cost model of ``method`` for a target (and drafter) ``shape``
    (:class:`DrafterShape`'s fields).

    >>> cost_model("dflash", hidden=64, layers=2, vocab=100).d > 0
    True
    """
    return get(method).cost(DrafterShape(**shape), block_size, ttt)
