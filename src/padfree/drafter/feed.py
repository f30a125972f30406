"""Feeding a real trainer's drafter (vllm ``speculators``' ``DFlashDraftModel`` / ``Eagle3DraftModel``) from
padfree batches, without the cross-document leaks their row-level code has on packed rows.

Their ``forward`` takes one packed row: ``hidden_states`` (the concatenated target layers), ``input_ids``,
``loss_mask``, ``verifier_last_hidden_states``, ``document_ids`` (-1 on padding) and ``position_ids``. What
goes wrong on packed rows, and what these functions do about it:

* DFlash chooses anchors over the row (``select_anchors``: one quota per row, the row's last block
  excluded) and labels a block slot ``a + k`` by the row's loss mask, even past the document's end.
  :func:`dflash_inputs` returns padfree's per-document anchors and an ``anchor_fn`` with the signature of
  their ``select_anchors`` to put in its place (``speculators.models.dflash.core.select_anchors``). Use an
  :class:`~padfree.core.anchors.AnchorPolicy` with ``partial=False``: every block then ends inside its
  document, so their ``loss_mask[a + k]`` never reads another document.
* EAGLE-3 shifts the whole row by ``k`` at test-time-training step ``k`` (``align_for_step``), so a document's
  last positions are scored against the next document's first ones (and a document's first targets against
  the previous document's last queries). :func:`eagle3_inputs` lays out each document in their shifted
  convention (``shift_batch``: tokens ``1..L-1``, hidden states ``0..L-2``) and takes the loss off the first
  ``ttt - 1`` positions of every document, which is exactly where such pairs land.

``speculators`` is not a padfree dependency (its pins exclude this project's transformers); these functions
only build tensors, and ``tests/drafter/test_feed.py`` replays their indexing rules on them.
"""

from __future__ import annotations

import torch

from padfree.drafter import methods
from padfree.drafter.collate import DrafterBatch
from padfree.drafter.target import TargetOutput
from padfree.errors import ConfigError


def dflash_inputs(batch: DrafterBatch, target: TargetOutput) -> tuple[dict, object]:
    """``(forward kwargs, anchor_fn)`` for ``speculators``' ``DFlashDraftModel`` on a packed padfree batch.

    ``forward kwargs`` includes ``max_anchors`` = the batch's anchor count (padfree's anchors are already
    capped per document). ``anchor_fn(loss_mask, num_anchors, block_size) -> (anchors, valid)`` returns
    padfree's anchors padded to ``num_anchors``; patch it over their ``select_anchors`` while this batch
    runs."""
    f = batch.fields
    c = batch.contract
    if c is None or not methods.get(batch.method).uses_anchors or c.layout != "packed":
        raise ConfigError("dflash_inputs: needs a packed DFlash batch (DrafterCollator('dflash'))")
    anchors = f.anchors.clone()
    if not bool((c.flat("doc_remaining")[0][anchors] >= f.block_size).all()):  # slot B-1 inside the document
        raise ConfigError(
            "dflash_inputs: a block runs past its document's end, which speculators would label from the "
            "next document; build the batch with AnchorPolicy(partial=False)"
        )
    kwargs = {
        "hidden_states": target.hidden,
        "input_ids": c.flat("input_ids"),
        "loss_mask": c.flat("loss_mask").long(),
        "verifier_last_hidden_states": _prenorm(target),
        "document_ids": c.flat("document_ids"),
        "position_ids": c.flat("position_ids"),
        "max_anchors": max(1, len(anchors)),
    }

    def anchor_fn(loss_mask: torch.Tensor, num_anchors: int, block_size: int):
        if block_size != f.block_size or num_anchors < len(anchors):
            raise ConfigError(
                f"anchor_fn: the model asks for {num_anchors} anchors of block {block_size}; the batch has "
                f"{len(anchors)} of block {f.block_size}"
            )
        out = torch.zeros(num_anchors, dtype=torch.long, device=loss_mask.device)
        valid = torch.zeros(num_anchors, dtype=torch.bool, device=loss_mask.device)
        out[: len(anchors)] = anchors.to(loss_mask.device)
        valid[: len(anchors)] = True
        return out, valid

    return kwargs, anchor_fn


def eagle3_inputs(batch: DrafterBatch, target: TargetOutput, ttt: int) -> dict:
    """Forward kwargs for ``speculators``' ``Eagle3DraftModel`` (``ttt_steps=ttt``) on a padfree batch: each
    document shifted as their ``shift_batch`` does, documents back to back, and no loss on the first
    ``ttt - 1`` positions of each document.

    Why that suffices: at step ``k`` they score the logits of position ``t`` against the target and loss
    mask at ``t + k`` over the whole row. A pair joins two documents only when ``t + k`` is among the first
    ``k <= ttt - 1`` positions of a document, which carry no loss here; every scored pair then lies inside
    one document, and the tokens fed on the way there too. The price is ``ttt - 1`` positions per document
    (for chats the start of a user turn, which carries no loss anyway). The same rule applies to a
    document alone, so a packed row trains each document exactly as alone."""
    if isinstance(ttt, bool) or not isinstance(ttt, int) or ttt < 1:
        raise ConfigError(f"ttt must be an integer >= 1 (got {ttt!r})")
    c = batch.contract
    if c is None:
        raise ConfigError("eagle3_inputs: an empty micro-batch has nothing to draft")
    ids = c.flat("input_ids")[0]
    mask = c.flat("loss_mask")[0]
    pos = c.flat("position_ids")[0]
    hid = target.hidden[0]
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
    return {
        "hidden_states": cat["hid"],
        "input_ids": cat["ids"],
        "loss_mask": cat["mask"].long(),
        "verifier_last_hidden_states": cat["last"],
        "document_ids": cat["doc"],
        "position_ids": cat["pos"],
        "ttt_steps": ttt,
    }


def _prenorm(target: TargetOutput) -> torch.Tensor:
    """The last layer's output before the final norm: speculators applies the verifier's norm itself."""
    if target.prenorm is None:
        raise ConfigError("the target output has no pre-norm state: build it with run_target")
    return target.prenorm
