"""Drafter collators: a padfree micro-batch becomes the document contract plus the DFlash or EAGLE-3 fields
that say which draft positions exist, what each predicts, and whether it is supervised.

One rule for both methods, on the contract's flat positions: a draft query anchored at context position
``t`` that predicts the token ``j`` positions later counts iff ``j < doc_remaining[t]`` (the token is in the
same document) and ``loss_mask[t + j]``. Its soft target is the frozen target's prediction at ``t + j - 1``.

* **DFlash**: anchors come from :func:`padfree.core.anchors.choose_anchors` per document, keyed by
  ``(seed, epoch, sample id, piece start)``; block slot ``k`` of anchor ``a`` predicts ``a + k`` (``j = k``,
  slot 0 holds the anchor's own token and predicts nothing).
* **EAGLE-3**: query ``t`` is fed the target's hidden state at ``t`` and token ``t + 1``; at
  test-time-training step ``k`` it is fed token ``t + 1 + k`` (teacher forcing; padding past the
  document's end, never the next document's token) and predicts ``t + 2 + k`` (``j = k + 2``).

:func:`leaky_dflash_fields` and :func:`leaky_eagle3_fields` reproduce what the field's packers do (anchors
chosen per row, labels and the shift running across the row), for ``padfree check-drafter --leaky``.

>>> from padfree.core.anchors import AnchorPolicy
>>> col = DrafterCollator("dflash", AnchorPolicy(block_size=4, density=1.0), mask_token_id=1)
>>> b = col([{"input_ids": [5, 6, 7, 8, 9], "loss_mask": [1, 1, 1, 1, 1], "sample_id": 0}])
>>> b.dflash.anchors.tolist(), b.dflash.supervised.int().tolist()[:4], b.dflash.block_input_ids.tolist()[:4]
([0, 1, 2, 3], [0, 1, 1, 1], [5, 1, 1, 1])
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from padfree.core.anchors import AnchorPolicy, anchor_quota, choose_anchors
from padfree.drafter.contract import Contract, build_contract
from padfree.errors import ConfigError, InputError

METHODS = ("dflash", "eagle3")


@dataclass(frozen=True)
class DFlashFields:
    """DFlash draft queries of a micro-batch (flat positions of the contract).

    Attributes:
        block_size: ``B``.
        anchors: ``(n,)`` anchor positions, grouped by document, sorted.
        anchors_by_doc: each document's anchors relative to its start (what must not depend on packing).
        query_doc: ``(n * B,)`` the document of each draft query (its anchor's).
        block_input_ids: ``(n * B,)`` the anchor's token at slot 0, ``mask_token_id`` elsewhere.
        block_position_ids: ``(n * B,)`` ``position_ids[a] + k`` (position inside the document).
        label_index: ``(n * B,)`` ``a + k``, the predicted token's flat position (may leave the row: -1).
        target_index: ``(n * B,)`` ``a + k - 1``: where the target's prediction of that token is.
        labelled: ``(n * B,)`` bool, the construction's structural gate: the slot takes ``label_index`` as
            its label whenever that token carries loss (``supervised == labelled & loss_mask[label]``).
            What ``check-drafter`` reads to find labels that cross a document end even where the next
            document's first tokens carry no loss.
        supervised: ``(n * B,)`` bool, the rule in the module docstring.
    """

    block_size: int
    anchors: torch.Tensor
    anchors_by_doc: tuple[tuple[int, ...], ...]
    query_doc: torch.Tensor
    block_input_ids: torch.Tensor
    block_position_ids: torch.Tensor
    label_index: torch.Tensor
    target_index: torch.Tensor
    labelled: torch.Tensor
    supervised: torch.Tensor


@dataclass(frozen=True)
class Eagle3Fields:
    """EAGLE-3 draft queries: one per flat position and test-time-training step.

    Attributes:
        ttt: steps.
        step_input_ids: ``(ttt, T)`` token fed at each step (padding past the document end).
        input_index: ``(ttt, T)`` the flat position whose token ``step_input_ids`` holds (-1: padding).
        label_index: ``(ttt, T)`` ``t + 2 + k`` (the predicted token; -1 off the row).
        target_index: ``(ttt, T)`` ``t + 1 + k`` (the target's prediction of it; clamped into the row).
        labelled: ``(ttt, T)`` bool, the structural gate (as :class:`DFlashFields`).
        supervised: ``(ttt, T)`` bool.
    """

    ttt: int
    step_input_ids: torch.Tensor
    input_index: torch.Tensor
    label_index: torch.Tensor
    target_index: torch.Tensor
    labelled: torch.Tensor
    supervised: torch.Tensor


@dataclass(frozen=True)
class DrafterBatch:
    """A collated drafter micro-batch: the contract and the method's fields (the other is ``None``)."""

    contract: Contract
    dflash: DFlashFields | None = None
    eagle3: Eagle3Fields | None = None
    info: object = None
    epoch: int = 0


def dflash_fields(
    contract: Contract, policy: AnchorPolicy, *, seed: int, epoch: int, mask_token_id: int
) -> DFlashFields:
    """DFlash fields with anchors chosen per document (the correct way)."""
    mask = contract.flat("loss_mask")[0].numpy()
    per_doc = []
    for d in range(contract.n_docs):
        s = contract.doc_slice(d)
        sid = contract.sample_ids[d]
        if sid < 0:
            raise ConfigError(
                f"document {d} has no sample id: DFlash anchors are keyed by it (pass sample_ids, items "
                "from a padfree PlannedDataset, or a 'sample_id' key per item)"
            )
        a = choose_anchors(mask[s], policy, seed=seed, epoch=epoch, sample_id=sid, start=contract.starts[d])
        per_doc.append(a)
    flat = np.concatenate([a + contract.doc_starts[d] for d, a in enumerate(per_doc)] or [np.zeros(0)])
    return _block_fields(contract, flat.astype(np.int64), policy.block_size, mask_token_id, per_doc, True)


def leaky_dflash_fields(
    contract: Contract, policy: AnchorPolicy, *, seed: int, epoch: int, mask_token_id: int
) -> DFlashFields:
    """What a row-level packer does (speculators' ``select_anchors``): valid anchors over the whole row
    (only the row's last block excluded), one quota for the row, and block labels running into the next
    document. Deliberately WRONG; for ``check-drafter --leaky`` and tests."""
    mask = contract.flat("loss_mask")[0].numpy().astype(bool)
    n = mask.shape[0]
    ok = np.zeros(n, bool)
    ok[:-1] = mask[:-1] & mask[1:]
    ok[max(0, n - policy.block_size) :] = False
    valid = np.flatnonzero(ok)
    q = int(anchor_quota(np.array([valid.shape[0]]), policy)[0])
    rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, epoch, *contract.sample_ids])))
    flat = np.sort(valid[np.argsort(rng.random(valid.shape[0]), kind="stable")[:q]])
    doc = contract.flat("document_ids")[0].numpy()
    per_doc = [flat[doc[flat] == d] - contract.doc_starts[d] for d in range(contract.n_docs)]
    return _block_fields(contract, flat, policy.block_size, mask_token_id, per_doc, False)


def _block_fields(contract, flat, block, mask_token_id, per_doc, per_document) -> DFlashFields:
    ids = contract.flat("input_ids")[0]
    doc = contract.flat("document_ids")[0]
    pos = contract.flat("position_ids")[0]
    rem = contract.flat("doc_remaining")[0]
    lmask = contract.flat("loss_mask")[0]
    width = ids.shape[0]
    anchors = torch.from_numpy(np.asarray(flat, np.int64))
    a = anchors.repeat_interleave(block)
    k = torch.arange(block).repeat(anchors.shape[0])
    label = a + k
    inside_row = label < width
    safe = label.clamp(max=max(width - 1, 0))
    if per_document:
        labelled = (k >= 1) & (k < rem[a])
    else:  # row-wide: any token of the row, whichever document it belongs to
        row = contract.input_ids.shape[1]
        labelled = (k >= 1) & inside_row & (label // row == a // row)
    block_ids = torch.full_like(a, mask_token_id)
    block_ids[k == 0] = ids[anchors]
    return DFlashFields(
        block_size=block,
        anchors=anchors,
        anchors_by_doc=tuple(tuple(int(x) for x in d) for d in per_doc),
        query_doc=doc[a],
        block_input_ids=block_ids,
        block_position_ids=pos[a] + k,
        label_index=torch.where(inside_row, label, -1),
        target_index=(label - 1).clamp(min=0, max=max(width - 1, 0)),
        labelled=labelled,
        supervised=labelled & lmask[safe],
    )


def eagle3_fields(
    contract: Contract, ttt: int, *, pad_token_id: int = 0, leaky: bool = False
) -> Eagle3Fields:
    """EAGLE-3 fields; ``leaky=True`` shifts across the whole row, as packers that shift the packed row do
    (deliberately WRONG; for ``check-drafter --leaky``)."""
    if isinstance(ttt, bool) or not isinstance(ttt, int) or ttt < 1:
        raise ConfigError(f"ttt must be an integer >= 1 (got {ttt!r})")
    ids = contract.flat("input_ids")[0]
    rem = contract.flat("doc_remaining")[0]
    lmask = contract.flat("loss_mask")[0]
    width = ids.shape[0]
    t = torch.arange(width)
    k = torch.arange(ttt)[:, None]
    fed = t + 1 + k
    label = t + 2 + k
    fed_safe = fed.clamp(max=width - 1)
    label_safe = label.clamp(max=width - 1)
    if leaky:
        row = contract.input_ids.shape[1]  # a row-wide shift stays inside its row (padded: one document)
        fed_ok = (fed < width) & (fed // row == t // row)
        real = contract.flat("document_ids")[0] >= 0
        labelled = (label < width) & (label // row == t // row) & real
    else:
        fed_ok = (k + 1) < rem
        labelled = (k + 2) < rem
    return Eagle3Fields(
        ttt=ttt,
        step_input_ids=torch.where(fed_ok, ids[fed_safe], pad_token_id),
        input_index=torch.where(fed_ok, fed, -1),
        label_index=torch.where(label < width, label, -1),
        target_index=fed_safe,
        labelled=labelled,
        supervised=labelled & lmask[label_safe],
    )


class DrafterCollator:
    """Collate a micro-batch of ``{"input_ids", "loss_mask"[, "sample_id"]}`` items for drafter training.

    Sample ids (the anchors' key) come from the micro-batch's ``info`` (a
    :class:`~padfree.torch.PlanBatchSampler` through a :class:`~padfree.torch.PlannedDataset`), else from
    each item's ``sample_id``; the epoch from ``info`` or :meth:`set_epoch`. Pieces of truncated or split
    samples are cut as the plan says (``info.starts`` / ``info.lengths``), and the piece's start enters the
    anchor key.

    Args:
        method: ``"dflash"`` or ``"eagle3"``.
        policy: DFlash anchor policy. seed: the anchors' seed (use the plan's).
        layout: ``"packed"`` (one row, per-document attention) or ``"padded"`` (a row per sample).
        mask_token_id: DFlash's mask token. ttt: EAGLE-3 test-time-training steps.
        leaky: build the field's row-level fields instead (for checks only).
    """

    def __init__(
        self,
        method: str = "dflash",
        policy: AnchorPolicy | None = None,
        *,
        seed: int = 0,
        layout: str = "packed",
        pad_token_id: int = 0,
        mask_token_id: int = 0,
        ttt: int = 7,
        leaky: bool = False,
    ) -> None:
        if method not in METHODS:
            raise ConfigError(f"method must be one of {', '.join(METHODS)} (got {method!r})")
        self.method = method
        self.policy = policy or AnchorPolicy()
        self.seed = seed
        self.layout = layout
        self.pad_token_id = pad_token_id
        self.mask_token_id = mask_token_id
        self.ttt = ttt
        self.leaky = leaky
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __call__(self, items: list) -> DrafterBatch:
        info = getattr(items, "info", None)
        docs, sids, starts = [], [], []
        for j, item in enumerate(items):
            if not isinstance(item, Mapping) or "input_ids" not in item:
                raise InputError("a drafter item is a mapping with input_ids and loss_mask", sample=j)
            ids = np.asarray(item["input_ids"]).reshape(-1)
            m = item.get("loss_mask")
            mask = np.ones(ids.shape[0], bool) if m is None else np.asarray(m).reshape(-1).astype(bool)
            start = 0
            if info is not None:
                start = 0 if info.starts is None else int(info.starts[j])
                length = int(info.lengths[j])
                ids, mask = ids[start : start + length], mask[start : start + length]
                sid = int(info.indices[j])
            else:
                sid = int(item.get("sample_id", -1))
            docs.append((ids, mask))
            sids.append(sid)
            starts.append(start)
        epoch = int(info.epoch) if info is not None else self.epoch
        c = build_contract(
            docs, layout=self.layout, pad_token_id=self.pad_token_id, sample_ids=sids, starts=starts
        )
        if self.method == "dflash":
            make = leaky_dflash_fields if self.leaky else dflash_fields
            f = make(c, self.policy, seed=self.seed, epoch=epoch, mask_token_id=self.mask_token_id)
            return DrafterBatch(c, dflash=f, info=info, epoch=epoch)
        e = eagle3_fields(c, self.ttt, pad_token_id=self.pad_token_id, leaky=self.leaky)
        return DrafterBatch(c, eagle3=e, info=info, epoch=epoch)
