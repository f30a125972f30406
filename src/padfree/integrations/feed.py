"""Feeding vllm speculators' own drafters (``DFlashDraftModel``, ``DFlash2DraftModel``, ``Eagle3DraftModel``,
``MTPDraftModel``) from padfree batches.

Their inputs, their trainer's call arguments, their layer numbering, and shapes a compiled model keeps.

Their ``forward`` takes one packed row: ``hidden_states`` (the concatenated target layers), ``input_ids``,
``loss_mask``, ``verifier_last_hidden_states`` (the last layer before the final norm), ``document_ids`` (-1 on
padding) and ``position_ids``, plus the keywords their trainer passes (``get_trainer_kwargs``). What this
module does about each of their conventions:

* **Layers.** Their ``target_layer_ids`` are Hugging Face ``hidden_states`` indices (index 0 is the
  embedding output, index ``i`` the output of decoder layer ``i - 1``; their DFlash converter adds 1 to
  z-lab's ids). padfree's :func:`~padfree.drafter.target.run_target` counts decoder layer outputs from 0, so
  :func:`target_layers` subtracts 1: ``run_target(target, contract, target_layers(model))`` reads the layers
  vLLM serves, not the ones above them.
* **Their trainer's keywords.** :func:`trainer_kwargs` calls the model class's own ``get_trainer_kwargs``
  with the recipe's values (loss, slot weights, D-PACE alpha, anchor width; EAGLE-3 ttt and step decay). The
  inputs built here never repeat a keyword it returns (``ttt_steps``, ``max_anchors``), so
  ``model(**inputs, **kwargs)`` is the call their trainer makes.
* **DFlash anchors.** Their ``select_anchors`` chooses anchors over the row. :func:`dflash_inputs` returns
  padfree's per-document anchors as an :class:`AnchorChoice` callable with their signature (today's and the
  one their PR #1071 proposes, with ``document_ids``); :func:`anchors_patched` puts it in place for a block.
  Blocks must end inside their document (their labels read ``loss_mask[a + k]`` without a document check):
  build the batch with ``AnchorPolicy(partial=False)`` (``recipe.anchor_policy(partial=False)``).
* **EAGLE-3 shifts.** Their ``align_for_step`` scores position ``t`` against ``t + k`` over the whole row.
  :func:`eagle3_inputs` lays out each document in their shifted convention (``shift_batch``: tokens
  ``1..L-1``, hidden states ``0..L-2``) and takes the loss off each document's first ``ttt - 1`` positions,
  exactly where a pair could join two documents; a document alone gets the same rule.
* **MTP shifts.** Their ``MTPDraftModel`` shifts labels by ``k + 2`` over the whole row and drops the row's
  last ``K + 1`` positions as queries: :func:`mtp_inputs` takes the loss off each document's first ``K + 1``
  positions and ends the row with ``K + 1`` loss-free positions.
* **Noise.** Their dataset adds uniform noise ``+-std`` to ``hidden_states`` (``AddUniformNoise``, 0.05 at
  c05b95b3; the 0.9.0 wheel adds none; the speculators recipe's ``noise``). Here it is drawn per document
  from (seed, epoch, sample id, piece start) (:mod:`padfree.core.document_rng`), so a document gets the same
  noise packed or alone, on any rank, after any resume, and the same as padfree's own trainer gives it.
* **Stable shapes.** A :class:`ShapeSet` pads every row to one of a few lengths and the DFlash anchor slots
  to one fixed width, so ``torch.compile`` (their ``forward`` is compiled on GPU) meets a handful of shapes
  instead of one per batch.

``speculators`` is not a padfree dependency; only :func:`trainer_kwargs` and :func:`anchors_patched` import
it. ``tests/integrations/test_feed_speculators.py`` runs their real models on these inputs.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from padfree.core.anchors import AnchorPolicy
from padfree.drafter import methods
from padfree.drafter.collate import DrafterBatch
from padfree.drafter.methods.peagle.model import row_chains
from padfree.drafter.objective import with_document_noise
from padfree.drafter.recipes import Recipe
from padfree.drafter.target import TargetOutput
from padfree.errors import ConfigError
from padfree.integrations._common import doc_anchors
from padfree.integrations.shapes import ShapeSet, anchor_slots, pad_rows, slot_width


def target_layers(model_or_ids: Any) -> tuple[int, ...]:
    """padfree layer ids (decoder layer outputs, from 0) of a speculators model's ``target_layer_ids`` (or of
    those ids given directly): each minus one. Id 0 (the embedding output) has no decoder layer.

    >>> target_layers([2, 18, 33])
    (1, 17, 32)
    """
    ids = getattr(model_or_ids, "target_layer_ids", model_or_ids)
    out = tuple(int(i) - 1 for i in ids)
    if not out or min(out) < 0:
        raise ConfigError(
            f"target_layer_ids {list(ids)}: Hugging Face hidden_states indices from 1 (index 0 is the "
            "embedding output, which no decoder layer produces)"
        )
    return out


def their_layer_ids(layers: Sequence[int]) -> list[int]:
    """speculators' ``target_layer_ids`` for padfree layer ids: each plus one (the inverse of
    :func:`target_layers`).

    >>> their_layer_ids((1, 17, 32))
    [2, 18, 33]
    """
    return [int(i) + 1 for i in layers]


class AnchorChoice:
    """padfree's anchors of one row in the shape of speculators' ``select_anchors``: called with today's
    ``(loss_mask, num_anchors, block_size)`` it returns ``num_anchors`` slots; called with ``document_ids``
    (their PR #1071, where ``num_anchors`` is per document and the row's slots are not ``num_anchors``) it
    returns ``width`` slots. Either way ``(anchors, valid)``: the row's anchors first, then padding (position
    0, ``valid`` False), which their loss masks out."""

    def __init__(self, anchors: torch.Tensor, block_size: int, width: int) -> None:
        self.anchors = anchors.reshape(-1).to(torch.long)
        self.block_size = int(block_size)
        self.width = int(width)
        if self.anchors.numel() > self.width:
            raise ConfigError(f"{self.anchors.numel()} anchors do not fit {self.width} anchor slots")

    def __call__(
        self,
        loss_mask: torch.Tensor,
        num_anchors: int,
        block_size: int,
        document_ids: torch.Tensor | None = None,
        **_options: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if block_size != self.block_size:
            raise ConfigError(f"the model's block size {block_size} is not the batch's {self.block_size}")
        slots = self.width if document_ids is not None else int(num_anchors)
        n = self.anchors.numel()
        if n > slots:
            raise ConfigError(
                f"the model asks for {slots} anchor slots; the row has {n} anchors: pass max_anchors >= {n} "
                "(trainer_kwargs(..., max_anchors=width))"
            )
        out, valid = anchor_slots([self.anchors], slots)
        return out[0].to(loss_mask.device), valid[0].to(loss_mask.device)


@contextlib.contextmanager
def anchors_patched(choice: Any) -> Iterator[None]:
    """Inside the block, speculators' DFlash models take their anchors from ``choice`` (an
    :class:`AnchorChoice`) instead of ``select_anchors`` (the name ``speculators.models.dflash.core``
    calls); a choice that names what it ``patches`` (P-EAGLE's :class:`ChainChoice`) replaces that."""
    where, name = getattr(choice, "patches", ("speculators.models.dflash.core", "select_anchors"))
    core: Any = importlib.import_module(where)
    theirs = getattr(core, name)
    setattr(core, name, choice)
    try:
        yield
    finally:
        setattr(core, name, theirs)


def trainer_kwargs(
    model: Any,
    recipe: Recipe,
    *,
    loss_implementation: str = "fused",
    max_anchors: int | None = None,
) -> dict:
    """The keywords speculators' trainer passes to ``model`` (``train_call_kwargs``), from the model class's
    own ``get_trainer_kwargs`` given the recipe's values as its method reads them
    (:attr:`SpeculatorsModel.kwargs`: DFlash's loss, slot weights and anchor width ``max_anchors``,
    default the recipe's cap; EAGLE-3's ttt and step decay). ``loss_implementation="eager"`` runs without
    Triton (CPU)."""
    keywords = speculators_model(recipe.method).kwargs(recipe, max_anchors)
    train, _ = type(model).get_trainer_kwargs(loss_implementation=loss_implementation, **keywords)
    return dict(train)


def speculators_inputs(
    batch: DrafterBatch,
    target: TargetOutput,
    *,
    shapes: ShapeSet | None = None,
    noise: float | None = None,
) -> tuple[dict, AnchorChoice | None]:
    """``(forward inputs, anchor choice or None)`` for speculators' model of the batch's method, built by
    the method's own feed (:func:`dflash_inputs`, :func:`eagle3_inputs`); an anchor choice goes in
    :func:`anchors_patched` around the call."""
    return speculators_model(batch.method).inputs(batch, target, shapes=shapes, noise=noise)


def speculators_model(name: str) -> SpeculatorsModel:
    """How padfree feeds speculators' model of method ``name`` (:data:`SPECULATORS`); a registered method
    speculators has no model of, or an unknown one, is one line."""
    m = methods.get(name)
    if name not in SPECULATORS:
        raise ConfigError(f"speculators has no {m.title} model to feed")
    return SPECULATORS[name]


def _padded(kwargs: dict, shapes: ShapeSet | None) -> dict:
    n = int(kwargs["input_ids"].shape[1])
    return kwargs if shapes is None else pad_rows(kwargs, n, shapes.width(n))


def _noise(batch: DrafterBatch, target: TargetOutput, noise: float | None) -> torch.Tensor:
    assert batch.contract is not None
    std = (batch.recipe.noise if batch.recipe is not None else 0.0) if noise is None else float(noise)
    return with_document_noise(target.hidden, batch.contract, std, seed=batch.seed, epoch=batch.epoch)


def dflash_inputs(
    batch: DrafterBatch,
    target: TargetOutput,
    *,
    shapes: ShapeSet | None = None,
    noise: float | None = None,
) -> tuple[dict, AnchorChoice]:
    """``(forward inputs, anchor choice)`` for speculators' ``DFlashDraftModel`` on a packed padfree batch.

    Call ``model(**inputs, **trainer_kwargs(model, recipe, max_anchors=width))`` inside
    ``with anchors_patched(choice):``. ``shapes`` pads the row to one of its lengths and fixes the anchor
    slots; ``noise``: the uniform noise on the target layers (default: the batch's recipe's)."""
    f = batch.fields
    c = batch.contract
    if c is None or getattr(f, "anchors", None) is None or c.layout != "packed":
        raise ConfigError("dflash_inputs: needs a packed DFlash batch (DrafterCollator('dflash'))")
    anchors = f.anchors.clone()
    if not bool((c.flat("doc_remaining")[0][anchors] >= f.block_size).all()):  # slot B-1 inside the document
        raise ConfigError(
            "dflash_inputs: a block runs past its document's end, which speculators would label from the "
            "next document; build the batch with AnchorPolicy(partial=False)"
        )
    kwargs = {
        "hidden_states": _noise(batch, target, noise),
        "input_ids": c.flat("input_ids"),
        "loss_mask": c.flat("loss_mask").long(),
        "verifier_last_hidden_states": _prenorm(target),
        "document_ids": c.flat("document_ids"),
        "position_ids": c.flat("position_ids"),
    }
    return _padded(kwargs, shapes), AnchorChoice(anchors, f.block_size, slot_width(shapes, len(anchors)))


def eagle3_inputs(
    batch: DrafterBatch,
    target: TargetOutput,
    ttt: int | None = None,
    *,
    shapes: ShapeSet | None = None,
    noise: float | None = None,
) -> dict:
    """Forward inputs for speculators' ``Eagle3DraftModel`` on a padfree batch: each document shifted as
    their ``shift_batch`` does, documents back to back, and no loss on the first ``ttt - 1`` positions of
    each document (``ttt``: their ``ttt_steps``, default the batch's recipe's). ``ttt_steps`` itself is not
    among the inputs: it comes with :func:`trainer_kwargs`.

    Why the gate suffices: at step ``k`` they score the logits of position ``t`` against the target and loss
    mask at ``t + k`` over the whole row. A pair joins two documents only when ``t + k`` is among the first
    ``k <= ttt - 1`` positions of a document, which carry no loss here; every scored pair then lies inside
    one document, and the tokens fed on the way there too. The price is ``ttt - 1`` positions per document
    (for chats the start of a user turn, which carries no loss anyway)."""
    if ttt is None:
        ttt = batch.recipe.ttt if batch.recipe is not None else 1
    if isinstance(ttt, bool) or not isinstance(ttt, int) or ttt < 1:
        raise ConfigError(f"ttt must be an integer >= 1 (got {ttt!r})")
    c = batch.contract
    if c is None:
        raise ConfigError("eagle3_inputs: an empty micro-batch has nothing to draft")
    ids = c.flat("input_ids")[0]
    mask = c.flat("loss_mask")[0]
    pos = c.flat("position_ids")[0]
    hid = _noise(batch, target, noise)[0]
    last = _prenorm(target)[0]
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("ids", "mask", "pos", "doc", "hid", "last")}
    for d in range(c.n_docs):
        s = c.doc_slice(d)
        n = c.doc_lengths[d] - 1
        if n <= 0:
            continue
        m = mask[s][1:].clone()
        m[: ttt - 1] = False
        parts["ids"].append(ids[s][1:])
        parts["mask"].append(m)
        parts["pos"].append(pos[s][1:])
        parts["doc"].append(torch.full((n,), d, dtype=torch.long))
        parts["hid"].append(hid[s][:-1])
        parts["last"].append(last[s][1:])
    if not parts["ids"]:
        raise ConfigError("eagle3_inputs: every document has a single token; nothing to draft")
    cat = {k: torch.cat(v)[None] for k, v in parts.items()}
    kwargs = {
        "hidden_states": cat["hid"],
        "input_ids": cat["ids"],
        "loss_mask": cat["mask"].long(),
        "verifier_last_hidden_states": cat["last"],
        "document_ids": cat["doc"],
        "position_ids": cat["pos"],
    }
    return _padded(kwargs, shapes)


def eagle3_feed(
    batch: DrafterBatch, target: TargetOutput, *, shapes: ShapeSet | None = None, noise: float | None = None
) -> tuple[dict, None]:
    """:func:`eagle3_inputs` at the batch's recipe's ttt, as :func:`speculators_inputs` returns it."""
    return eagle3_inputs(batch, target, shapes=shapes, noise=noise), None


def mtp_inputs(
    batch: DrafterBatch,
    target: TargetOutput,
    *,
    shapes: ShapeSet | None = None,
    noise: float | None = None,
) -> dict:
    """Forward inputs for speculators' ``MTPDraftModel`` on a padfree MTP batch (its target output read at
    the target's last layer, :func:`padfree.drafter.methods.mtp.spec.last_layer`): documents back to back,
    positions restarting at 0 per document (transformers' causal mask reads them as packed documents),
    no loss on each
    document's first ``K + 1`` positions (``K``: the recipe's steps), and ``K + 1`` loss-free positions after
    the last document (pad token, zero hidden state). A document alone gets the same rule.

    Why: their step ``k`` scores position ``t`` against ``input_ids[t + k + 2]`` and ``loss_mask[t + k + 2]``
    over the whole row. A label joins two documents only when it is among the first ``k + 2 <= K + 1``
    positions of a document, which carry no loss here; every supervised pair and every token fed on the way
    to it then lies inside one document. They also drop the row's last ``K + 1`` positions as queries
    (``valid_len``): those are the tail, so every document keeps all of its queries, as padfree's own MTP
    drafter trains it. The price is ``K - 1`` labels per document (positions ``2 .. K``; a chat's first
    turn, which carries no loss anyway)."""
    c = batch.contract
    if c is None:
        raise ConfigError("mtp_inputs: an empty micro-batch has nothing to draft")
    model = SPECULATORS["mtp"]
    tail = model.tail(batch.recipe) if batch.recipe is not None else 0
    gated = model.head(batch.recipe) if batch.recipe is not None else 0
    keep = torch.cat(
        [torch.arange(c.doc_starts[d], c.doc_starts[d] + n) for d, n in enumerate(c.doc_lengths)]
    )
    pos = c.flat("position_ids")[0][keep]
    mask = c.flat("loss_mask")[0][keep] & (pos >= gated)
    doc = c.flat("document_ids")[0][keep]
    hid = _noise(batch, target, noise)[0][keep]
    ids = c.flat("input_ids")[0][keep]
    kwargs = {
        "hidden_states": hid[None],
        "input_ids": ids[None],
        "loss_mask": mask.long()[None],
        "document_ids": doc[None],
        "position_ids": pos[None],
    }
    n = int(ids.shape[0])
    width = n + tail if shapes is None else shapes.width(n + tail)
    return pad_rows(kwargs, n, width)


def mtp_feed(
    batch: DrafterBatch, target: TargetOutput, *, shapes: ShapeSet | None = None, noise: float | None = None
) -> tuple[dict, None]:
    """:func:`mtp_inputs`, as :func:`speculators_inputs` returns it."""
    return mtp_inputs(batch, target, shapes=shapes, noise=noise), None


@dataclass(frozen=True)
class ChainChoice:
    """padfree's P-EAGLE chains as speculators' ``generate_cod_sample_indices`` returns them for a row:
    ``(anchor_pos, depth)``, every row position at depth 0, then each kept chain's deeper elements in row
    order. Called with their signature; refuses a row of another length (a choice for another batch)."""

    anchor_pos: torch.Tensor
    depth: torch.Tensor
    width: int
    patches: tuple[str, str] = ("speculators.models.peagle.core", "generate_cod_sample_indices")

    def __call__(self, seq_length: int, loss_mask: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        if int(seq_length) != self.width:
            raise ConfigError(f"P-EAGLE chains for a row of {self.width} positions, called for {seq_length}")
        dev = loss_mask.device
        return self.anchor_pos.to(dev), self.depth.to(dev)


def peagle_inputs(
    batch: DrafterBatch,
    target: TargetOutput,
    *,
    shapes: ShapeSet | None = None,
    noise: float | None = None,
) -> tuple[dict, ChainChoice]:
    """``(forward inputs, chain choice)`` for speculators' ``PEagleDraftModel`` on a padfree P-EAGLE batch:
    EAGLE-3's row (:func:`eagle3_inputs`: each document shifted, back to back) whose loss mask is the
    batch's depth-0 supervision, and the batch's own chains (put in place by :func:`anchors_patched`).

    Why: their sampler extends a chain along the row's loss mask, whatever the document; a chain joins two
    documents only through a document's first position, which carries no loss here (nor in padfree's own
    fields), nor does a position whose label lies past its document's end. Their mask keeps every element
    inside its anchor's document, and their rotary positions (row offsets) differ from each document's by
    a constant, which attention does not see."""
    c, f = batch.contract, batch.fields
    if c is None:
        raise ConfigError("peagle_inputs: an empty micro-batch has nothing to draft")
    kwargs = eagle3_inputs(batch, target, 1, noise=noise)
    sup0 = f.supervised[0]
    masks, offset = [], 0
    row_of = torch.full((c.width,), -1, dtype=torch.long)
    for d in range(c.n_docs):
        s = c.doc_slice(d)
        n = c.doc_lengths[d] - 1
        if n <= 0:
            continue
        masks.append(sup0[s][:n])
        row_of[s.start : s.start + n] = torch.arange(offset, offset + n)
        offset += n
    kwargs["loss_mask"] = torch.cat(masks).long()[None]
    kwargs = _padded(kwargs, shapes)
    width = int(kwargs["input_ids"].shape[1])
    anchors, depths = [torch.arange(width)], [torch.zeros(width, dtype=torch.long)]
    for k in range(1, f.ttt):
        t = torch.nonzero(f.present[k]).reshape(-1)
        p = row_of[t]
        if bool((p < 0).any()):
            raise ConfigError("peagle_inputs: a chain anchored on a document's last position")
        anchors.append(p.sort().values)
        depths.append(torch.full((p.shape[0],), k, dtype=torch.long))
    return kwargs, ChainChoice(torch.cat(anchors), torch.cat(depths), width)


def peagle_feed(
    batch: DrafterBatch, target: TargetOutput, *, shapes: ShapeSet | None = None, noise: float | None = None
) -> tuple[dict, ChainChoice]:
    """:func:`peagle_inputs`, as :func:`speculators_inputs` returns it (the choice goes in
    :func:`anchors_patched`)."""
    return peagle_inputs(batch, target, shapes=shapes, noise=noise)


def _prenorm(target: TargetOutput) -> torch.Tensor:
    """The last layer's output before the final norm: speculators applies the verifier's norm itself."""
    if target.prenorm is None:
        raise ConfigError("the target output has no pre-norm state: build it with run_target")
    return target.prenorm


_LOSS_FN = {"argmax_ce": "ce", "kl": "kl_div"}
_SLOT_WEIGHTS = {"dpace": "dpace", "exp": "fixed-exp-decay"}


def dspark_kwargs(r: Recipe, max_anchors: int | None) -> dict[str, Any]:
    """speculators' DSpark trainer keywords: the compound ``loss_fn`` ``{"ce": a, "tv": b}``, fixed
    exponential slot weights with the recipe's gamma, the confidence weight and the anchor width."""
    import json

    if r.objective != "ce_tv":
        raise ConfigError(
            f"recipe {r.name}: speculators' DSpark trains the ce_tv objective, not {r.objective}"
        )
    return {
        "loss_fn": json.dumps({"ce": r.ce_weight, "tv": r.tv_weight}),
        "dflash_decay_gamma": r.gamma,
        "max_anchors": r.max_anchors if max_anchors is None else int(max_anchors),
        "per_position_loss_weight": "fixed-exp-decay",
        "confidence_head_alpha": r.confidence_alpha,
    }


def dflash_kwargs(r: Recipe, max_anchors: int | None) -> dict[str, Any]:
    """speculators' DFlash trainer keywords: ``loss_fn`` (``ce`` for ``argmax_ce``, ``kl_div`` for ``kl``),
    slot weights (``dpace`` or ``fixed-exp-decay`` with the recipe's gamma), ``dpace_alpha`` and
    ``max_anchors`` (the fixed anchor width; default the recipe's cap).

    >>> from padfree.drafter.recipes import get as recipe
    >>> dflash_kwargs(recipe("speculators", "dflash"), 64)["per_position_loss_weight"]
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


def dflash2_kwargs(r: Recipe, max_anchors: int | None) -> dict[str, Any]:
    """speculators' DFlash2 trainer keywords: DFlash's (:func:`dflash_kwargs`) and the selector's loss
    weight ``selector_loss_alpha``.

    >>> from padfree.drafter.recipes import get as recipe
    >>> kw = dflash2_kwargs(recipe("speculators", "dflash2"), None)
    >>> kw["selector_loss_alpha"], kw["max_anchors"], kw["per_position_loss_weight"]
    (1.0, 512, 'fixed-exp-decay')
    """
    return {**dflash_kwargs(r, max_anchors), "selector_loss_alpha": r.selector_loss_alpha}


def eagle3_kwargs(r: Recipe, max_anchors: int | None) -> dict[str, Any]:
    """speculators' EAGLE-3 trainer keywords: KL loss, ``ttt_steps`` and ``ttt_step_loss_decay``."""
    return {"loss_fn": "kl_div", "ttt_steps": r.ttt, "ttt_step_loss_decay": r.step_decay}


def mtp_kwargs(r: Recipe, max_anchors: int | None) -> dict[str, Any]:
    """speculators' MTP trainer keywords: ``num_speculative_steps`` and ``step_weight_beta`` (their class
    turns them into the normalised step weights)."""
    return {"num_speculative_steps": r.ttt, "step_weight_beta": r.step_decay}


def peagle_kwargs(r: Recipe, max_anchors: int | None) -> dict[str, Any]:
    """speculators' P-EAGLE trainer keywords: KL loss, ``num_depths`` and the COD ratios (no anchor cap:
    padfree's chains are drawn per document and put in place by the feed)."""
    return {
        "loss_fn": "kl_div",
        "num_depths": r.ttt,
        "down_sample_ratio": r.cod_ratio,
        "down_sample_ratio_min": r.cod_ratio_min,
    }


def whole_blocks(recipe: Recipe) -> AnchorPolicy:
    """The recipe's anchor rule with whole blocks inside their document: speculators labels a block slot by
    the row's ``loss_mask[a + k]``, which must not read the next document."""
    return recipe.anchor_policy(partial=False)


@dataclass(frozen=True)
class RowDocs:
    """The documents of one of speculators' collated rows: where each starts, its positions, its sample id,
    the recipe, the anchors' seed and epoch, and the shapes the row is padded to."""

    starts: np.ndarray
    lens: list[int]
    sample_ids: list[int]
    recipe: Recipe
    seed: int
    epoch: int
    shapes: ShapeSet | None


def anchor_columns(out: dict, row: RowDocs) -> dict:
    """DFlash: each document's anchors from its own loss mask and (seed, epoch, sample id), at the row's
    anchor width (``padfree_anchors``, ``padfree_anchor_valid``)."""
    mask = out["loss_mask"][0].numpy().astype(bool)
    a = doc_anchors(
        mask, row.starts, row.lens, row.sample_ids, policy=whole_blocks(row.recipe), seed=row.seed,
        epoch=row.epoch,
    )  # fmt: skip
    anchors, valid = anchor_slots([a], slot_width(row.shapes, len(a)))
    out["padfree_anchors"], out["padfree_anchor_valid"] = anchors[0], valid[0]
    return out


def chain_columns(out: dict, row: RowDocs) -> dict:
    """P-EAGLE: the row's loss mask gated at each document's ends and each document's own chains
    (``padfree_chains``, :func:`padfree.drafter.methods.peagle.model.row_chains`)."""
    lm = out["loss_mask"]
    gate, chains = row_chains(
        lm[0].cpu().numpy(), row.starts, row.lens, row.sample_ids, row.recipe, seed=row.seed, epoch=row.epoch
    )
    out["loss_mask"] = torch.as_tensor(gate, device=lm.device)[None].to(lm.dtype)
    out["padfree_chains"] = torch.from_numpy(chains)
    return out


@dataclass(frozen=True, kw_only=True)
class SpeculatorsModel:
    """How padfree feeds speculators' model of one drafter method (:data:`SPECULATORS`, by method name).

    Attributes:
        kwargs: ``(recipe, max_anchors) -> keywords`` of their model class's ``get_trainer_kwargs`` for the
            recipe (one line when speculators trains no such recipe).
        inputs: ``(batch, target, *, shapes, noise) -> (forward inputs, choice or None)`` from a padfree
            batch (:func:`speculators_inputs`); a choice goes in :func:`anchors_patched`.
        head: ``recipe -> n``: the positions at each document's start that carry no loss in their packed row
            (EAGLE-3: ``ttt - 1``, where a shifted pair could join two documents; MTP: ``ttt + 1``).
        tail: ``recipe -> n``: loss-free positions their row needs after its last document (MTP: ``ttt +
            1``, the queries their class drops at a row's end).
        columns: ``(collated row, RowDocs) -> row``: what :class:`padfree.integrations.speculators.
            PadfreeCollate` adds to their row (DFlash's anchors, P-EAGLE's chains); None: nothing.
        anchors: their rows open blocks at per-document anchors the sampler's plan counts (DFlash).
    """

    kwargs: Callable[[Recipe, int | None], dict[str, Any]]
    inputs: Callable[..., tuple[dict, Any]]
    head: Callable[[Recipe], int] = lambda r: 0
    tail: Callable[[Recipe], int] = lambda r: 0
    columns: Callable[[dict, RowDocs], dict] | None = None
    anchors: bool = False


SPECULATORS: dict[str, SpeculatorsModel] = {
    "dflash": SpeculatorsModel(
        kwargs=dflash_kwargs, inputs=dflash_inputs, columns=anchor_columns, anchors=True
    ),
    "dspark": SpeculatorsModel(
        kwargs=dspark_kwargs, inputs=dflash_inputs, columns=anchor_columns, anchors=True
    ),
    "dflash2": SpeculatorsModel(
        kwargs=dflash2_kwargs, inputs=dflash_inputs, columns=anchor_columns, anchors=True
    ),
    "eagle3": SpeculatorsModel(kwargs=eagle3_kwargs, inputs=eagle3_feed, head=lambda r: r.ttt - 1),
    "mtp": SpeculatorsModel(
        kwargs=mtp_kwargs, inputs=mtp_feed, head=lambda r: r.ttt + 1, tail=lambda r: r.ttt + 1
    ),
    "peagle": SpeculatorsModel(
        kwargs=peagle_kwargs, inputs=peagle_feed, head=lambda r: 1, columns=chain_columns
    ),
}
"""speculators' models padfree feeds, by drafter method name (a method speculators has no model of has no
entry)."""
