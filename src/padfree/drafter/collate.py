"""Drafter collators: a padfree micro-batch becomes the document contract plus the method's fields that say
which draft positions exist, what each predicts, and whether it is supervised.

One rule for every method, on the contract's flat positions: a draft query anchored at context position
``t`` that predicts the token ``j`` positions later counts iff ``j < doc_remaining[t]`` (the token is in the
same document) and ``loss_mask[t + j]``. Its soft target is the frozen target's prediction at ``t + j - 1``.
How each method lays out its queries is in its own module (:mod:`padfree.drafter.dflash`: blocks opened at
anchors; :mod:`padfree.drafter.eagle3`: test-time-training steps); the registry
(:mod:`padfree.drafter.methods`) finds it by name.

Items are cut to their planned pieces by the same function as the plain collators
(:func:`padfree.torch._collate.planned_pieces`: the "dataset shorter than the plan" check, the
unplanned-dataset warning). An empty micro-batch (an epoch's tail after a re-cut or an elastic resume)
collates to an empty batch (``batch.empty``) that still belongs to its step.

>>> from padfree.core.anchors import AnchorPolicy
>>> col = DrafterCollator("dflash", AnchorPolicy(block_size=4, density=1.0), mask_token_id=1)
>>> b = col([{"input_ids": [5, 6, 7, 8, 9], "loss_mask": [1, 1, 1, 1, 1], "sample_id": 0}])
>>> b.fields.anchors.tolist(), b.fields.supervised.int().tolist()[:4], b.fields.block_input_ids.tolist()[:4]
([0, 1, 2, 3], [0, 1, 1, 1], [5, 1, 1, 1])
>>> b.positions, col([]).empty
(9, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from padfree.core.anchors import AnchorPolicy
from padfree.core.shard import Shard, check_shapes
from padfree.drafter import methods, recipes
from padfree.drafter.contract import Contract, build_contract
from padfree.drafter.objective import loss_scale
from padfree.drafter.recipes import Recipe
from padfree.errors import ConfigError
from padfree.torch._collate import planned_pieces


@dataclass(frozen=True)
class QueryFields:
    """What every method's draft queries carry, one entry per query (flat positions of the contract); each
    method's ``Fields`` adds how its queries are laid out.

    Attributes:
        query_doc: the document of each query.
        label_index: the flat position of the token it predicts (-1: off the row).
        target_index: where the target's prediction of that token is.
        labelled: the construction's structural gate: the query takes ``label_index`` as its label whenever
        that
            token carries loss (``supervised == labelled & gate``); what ``check-drafter`` reads to find
            labels that cross a document end even where the next document's first tokens carry no loss.
        supervised: the rule in the module docstring (and the recipe's gate).
        slot: the query's slot (DFlash: ``k`` in its block; EAGLE-3: the step). weight: the recipe's static
            weight of it. group: what a per-document mean is taken over (DFlash: 0; EAGLE-3: the step).
    """

    query_doc: torch.Tensor
    label_index: torch.Tensor
    target_index: torch.Tensor
    labelled: torch.Tensor
    supervised: torch.Tensor
    slot: torch.Tensor
    weight: torch.Tensor
    group: torch.Tensor


@dataclass(frozen=True)
class FieldOptions:
    """What a method's fields builder reads besides the contract: the recipe, the DFlash anchor policy (the
    recipe's unless given), the anchors' seed and the special tokens."""

    recipe: Recipe
    policy: AnchorPolicy
    seed: int = 0
    mask_token_id: int = 0
    pad_token_id: int = 0

    @property
    def ttt(self) -> int:
        return self.recipe.ttt


@dataclass(frozen=True)
class DrafterBatch:
    """A collated drafter micro-batch.

    Attributes:
        contract: where each document sits in the rows (``None`` for an empty micro-batch).
        method: the drafter method's name. fields: its draft queries (the method module's ``Fields``; every
            method's have ``label_index``, ``target_index``, ``labelled``, ``supervised``, ``query_doc``,
            ``weight`` (the recipe's static weight) and ``group`` (what per-document means are taken over)).
        positions: supervised draft positions (the drafter's loss terms), as ``loss_tokens`` of a plain batch.
        info: the plan's ``MicroInfo`` (``None`` outside a plan). epoch: the epoch the anchors were drawn for.
        recipe: the recipe the fields and the loss follow. seed: the anchors' (and the noise's) seed.
        scale: each draft position's static loss scale (:func:`padfree.drafter.objective.loss_scale`).
        den: per document, what the recipe divides the step's loss by; ``denominator`` is their sum, what a
            training loop all-reduces over the step before any forward.
    """

    contract: Contract | None
    method: str
    fields: Any = None
    positions: int = 0
    info: object = None
    epoch: int = 0
    recipe: Recipe | None = None
    seed: int = 0
    scale: torch.Tensor | None = None
    den: torch.Tensor | None = None

    @property
    def denominator(self) -> float:
        """This micro-batch's share of its step's loss denominator (0 for an empty one)."""
        return 0.0 if self.den is None else float(self.den.sum())

    @property
    def empty(self) -> bool:
        """No document: a step member that trains nothing (the loop still joins the step's collectives)."""
        return self.contract is None

    def keep_own_document(self) -> DrafterBatch:
        """For row-level (leaky) fields: only the positions whose label lies in the query's own document stay
        supervised (a label from the next document is not a draft position of this one). A new batch."""
        import dataclasses

        assert self.contract is not None
        f = self.fields
        doc = self.contract.flat("document_ids")[0]
        label = f.label_index
        same = (label >= 0) & (doc[label.clamp(min=0)] == f.query_doc)
        g = dataclasses.replace(f, supervised=f.supervised & same)
        assert self.recipe is not None
        scale, den = scale_of(g, self.contract, self.recipe)
        return dataclasses.replace(self, fields=g, positions=int(g.supervised.sum()), scale=scale, den=den)

    def covered(self) -> list[frozenset]:
        """Per document: the positions inside it (relative to its start) that a supervised draft position
        predicts."""
        if self.contract is None:
            return []
        c, f = self.contract, self.fields
        labels = f.label_index[f.supervised].numpy()
        doc = c.flat("document_ids")[0].numpy()
        out = []
        for d in range(c.n_docs):
            s = c.doc_slice(d)
            mine = labels[(labels >= s.start) & (labels < s.stop)]
            mine = mine[doc[mine] == d]
            out.append(frozenset((mine - s.start).tolist()))
        return out

    def anchors_by_doc(self) -> tuple[tuple[int, ...], ...]:
        """Each document's anchors relative to its start (empty tuples for a method without anchors)."""
        if self.contract is None:
            return ()
        return getattr(self.fields, "anchors_by_doc", ((),) * self.contract.n_docs)


class DrafterCollator:
    """Collate a micro-batch of ``{"input_ids", "loss_mask"[, "sample_id"]}`` items for drafter training.

    Sample ids (the anchors' key) come from the micro-batch's ``info`` (a
    :class:`~padfree.torch.PlanBatchSampler` through a :class:`~padfree.torch.PlannedDataset`), else from
    each item's ``sample_id``; the epoch from ``info`` or :meth:`set_epoch`. Pieces of truncated or split
    samples are cut as the plan says, and the piece's start enters the anchor key.

    Args:
        method: a registered method (:mod:`padfree.drafter.methods`).
        policy: DFlash anchor policy (default: the recipe's). seed: the anchors' seed (use the plan's).
        recipe: a :class:`~padfree.drafter.recipes.Recipe` for ``method`` (default: the ``specforge`` preset).
        layout: ``"packed"`` (one row, per-document attention) or ``"padded"`` (a row per sample).
        mask_token_id: DFlash's mask token. ttt: EAGLE-3 test-time-training steps (overrides the recipe's).
        leaky: build the field's row-level fields instead (for checks only).
        shapes: the plan's ``shapes`` (:mod:`padfree.core.shard`): rows are the next declared length.
        anchor_shapes: DFlash: the block tensor's anchors per row (the packed row's, the padded rows' most)
            padded to the next declared count (:func:`padfree.drafter.dflash.pad_anchor_slots`: extra blocks
            computed, never supervised), so a compiled drafter sees a small set of shapes too.
    """

    def __init__(
        self,
        method: str = "dflash",
        policy: AnchorPolicy | None = None,
        *,
        recipe: Recipe | None = None,
        seed: int = 0,
        layout: str = "packed",
        pad_token_id: int = 0,
        mask_token_id: int = 0,
        ttt: int | None = None,
        leaky: bool = False,
        shapes: int | tuple[int, ...] | None = None,
        anchor_shapes: int | tuple[int, ...] | None = None,
    ) -> None:
        self.method = methods.get(method)
        self.shapes = check_shapes(shapes)
        self.anchor_shapes = check_shapes(anchor_shapes)
        if self.anchor_shapes is not None and not self.method.uses_anchors:
            raise ConfigError(f"anchor_shapes sizes DFlash's block tensor; {self.method.name} has no anchors")
        if ttt is not None and (isinstance(ttt, bool) or not isinstance(ttt, int) or ttt < 1):
            raise ConfigError(f"ttt must be an integer >= 1 (got {ttt!r})")
        recipe = recipe or recipes.get(recipes.DEFAULT, self.method.name)
        if recipe.method != self.method.name:
            raise ConfigError(f"recipe {recipe.name} is for {recipe.method}, not {self.method.name}")
        recipe = recipes.override(recipe, ttt=ttt)
        policy = policy or recipe.anchor_policy()
        self.options = FieldOptions(recipe, policy, seed, mask_token_id, pad_token_id)
        self.layout = layout
        self.leaky = leaky
        self.epoch = 0
        self._module = self.method.load()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __call__(self, items: list) -> DrafterBatch:
        info = getattr(items, "info", None)
        epoch = int(info.epoch) if info is not None else self.epoch
        ps = planned_pieces(items)
        opts = self.options
        if not ps:
            return DrafterBatch(
                None, self.method.name, info=info, epoch=epoch, recipe=opts.recipe, seed=opts.seed
            )
        c = build_contract(
            [(p.input_ids, p.loss_mask) for p in ps],
            layout=self.layout,
            pad_token_id=self.options.pad_token_id,
            sample_ids=[p.sample_id for p in ps],
            starts=[p.start for p in ps],
            shapes=self.shapes,
        )
        f = self._module.fields(c, opts, epoch=epoch, leaky=self.leaky)
        scale, den = scale_of(f, c, opts.recipe)
        batch = DrafterBatch(
            c, self.method.name, f, int(f.supervised.sum()), info, epoch, opts.recipe, opts.seed, scale, den
        )
        if self.anchor_shapes is not None:
            per_row = (
                [len(a) for a in f.anchors_by_doc] if c.layout == "padded" else [int(f.anchors.shape[0])]
            )
            most = Shard(shapes=self.anchor_shapes).row_length(np.array([max(1, *per_row)]))[0]
            batch = self._module.pad_anchor_slots(batch, opts.mask_token_id, int(most))
        return batch


def scale_of(fields: Any, contract: Contract, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """The static loss scale of every draft position and each document's denominator (the recipe's)."""
    return loss_scale(
        fields.supervised.reshape(-1),
        fields.weight.reshape(-1),
        fields.query_doc.reshape(-1),
        fields.group.reshape(-1),
        torch.tensor(contract.doc_lengths, dtype=torch.int64),
        recipe.normalization,
    )


def no_field_padding(batch: DrafterBatch, mask_token_id: int = 1) -> DrafterBatch:
    """A method's ``field_padding`` when padded rows add nothing to its fields (every position drafts:
    EAGLE-3, MTP, P-EAGLE); DFlash's pads its anchor slots instead."""
    return batch
