"""The drafter's loss under a recipe, one formula for every method: which label each supervised draft position
is trained toward, how it is weighted, and what the step divides by; computed in chunks of draft positions so
that the logits over the vocabulary never exist for all of them at once.

A micro-batch's supervised draft positions ``q`` (DFlash block slots, EAGLE-3 steps x positions) each get

* a loss ``l_q``: cross-entropy on the data token (``data_ce``), on the target's argmax (``argmax_ce``),
  ``KL(target || drafter)`` (``kl``), or DSpark's compound of the argmax cross-entropy, the total
  variation and its confidence head (``ce_tv``), over the draft vocabulary when the recipe has one (the
  target restricted to it and renormalised; a position whose label or target argmax falls outside is
  dropped under ``out_of_vocab="drop"``);
* a static scale ``s_q`` known before any forward (:func:`loss_scale`): the slot weight (DFlash
  ``exp(-(k - 1) / gamma)``, EAGLE-3 ``step_decay ** k``) times the recipe's per-document normalisation
  (``document``: divided by the document's supervised positions of that step);
* under D-PACE a dynamic weight from the drafter's own confidence (no gradient);
* where the drafter reranks candidates (DFlash2's selector), its cross-entropy over them toward the target's
  argmax, weighed by the recipe's ``selector_loss_alpha``, added to ``l_q`` (same scale, same mask);

and a document's numerator is ``sum_q s_q * dynamic_q * l_q``. The step's loss is the sum of every numerator
of the step on all ranks over the sum of the micro-batches' denominators (``batch.den``: what the recipe
divides by, counted from the batch alone), so packing never changes what a document contributes.

>>> import torch
>>> w = slot_weights_of(torch.tensor([0, 1, 2, 0, 1, 2]), "exp", gamma=1.0)
>>> [round(x, 3) for x in w.tolist()]
[0.0, 1.0, 0.368, 0.0, 1.0, 0.368]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from padfree.core.document_rng import document_noise
from padfree.drafter.contract import Contract
from padfree.drafter.recipes import Recipe

LOSS_CHUNK_BYTES = 256 * 2**20
"""Default memory for one chunk of draft-position logits (their float32 values, softmax and gradient)."""


def chunk_positions(vocab: int, budget_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Draft positions per loss chunk so that a chunk's float32 logits, their softmax and gradient (and the
    target's, for KL) stay within ``budget_bytes``.

    >>> chunk_positions(32000, 256 * 2**20)
    524
    """
    return max(1, int(budget_bytes // (16 * max(int(vocab), 1))))


def slot_weights_of(slot: torch.Tensor, kind: str, *, gamma: float = 7.0) -> torch.Tensor:
    """Static DFlash slot weights: ``exp(-(k - 1) / gamma)`` for ``k >= 1`` (``exp``), 1 (``uniform``,
    ``dpace``: its weights come after the forward); slot 0 holds the anchor and weighs 0."""
    k = slot.to(torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / gamma) if kind == "exp" else torch.ones_like(k)
    return w * (slot > 0)


def loss_scale(
    supervised: torch.Tensor,
    weight: torch.Tensor,
    doc: torch.Tensor,
    group: torch.Tensor,
    doc_lengths: torch.Tensor,
    normalization: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale per draft position, denominator per document)`` under ``normalization`` (see
    :data:`padfree.drafter.recipes.NORMALIZATIONS`), from what the batch alone says: supervised positions,
    their static ``weight``, document and ``group`` (EAGLE-3's step, DFlash 0) of each, tokens per document.

    >>> sup = torch.tensor([True, True, False, True]); w = torch.ones(4)
    >>> doc = torch.tensor([0, 0, 0, 1]); g = torch.zeros(4, dtype=torch.long)
    >>> s, d = loss_scale(sup, w, doc, g, torch.tensor([5, 3]), "document")
    >>> s.tolist(), d.tolist()
    ([0.5, 0.5, 0.0, 1.0], [1.0, 1.0])
    """
    n_docs = int(doc_lengths.shape[0])
    w = torch.where(supervised, weight.to(torch.float32), 0.0)
    d = doc.clamp(min=0)
    if normalization == "document":
        n_groups = int(group.max()) + 1 if group.numel() else 1
        key = d * n_groups + group
        count = torch.zeros(n_docs * n_groups).index_add(0, key, supervised.to(torch.float32))
        scale = torch.where(supervised, w / count[key].clamp(min=1.0), 0.0)
        den = (count.reshape(n_docs, n_groups).sum(1) > 0).to(torch.float32)
        return scale, den
    if normalization == "weighted":
        den = torch.zeros(n_docs).index_add(0, d, w)
    elif normalization == "supervised":
        den = torch.zeros(n_docs).index_add(0, d, supervised.to(torch.float32))
    else:  # positions: every real token of the document
        den = doc_lengths.to(torch.float32).clone()
    return w, den


@dataclass(frozen=True)
class VocabMap:
    """A draft vocabulary inside the target's: ``d2t[i]`` the target id of draft id ``i``; ``t2d[t]`` the
    draft id of target id ``t`` (-1 outside). SpecForge and speculators store ``d2t`` as offsets ``target -
    draft``."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    @classmethod
    def from_ids(cls, target_ids: torch.Tensor, vocab: int) -> VocabMap:
        ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values
        t2d = torch.full((int(vocab),), -1, dtype=torch.long)
        t2d[ids] = torch.arange(ids.shape[0])
        return cls(ids, t2d)


@dataclass
class Queries:
    """The supervised draft positions of a micro-batch, in order (a block's slots contiguous and
    ascending)."""

    hidden: torch.Tensor  # (N, H) the drafter's output
    scale: torch.Tensor  # (N,)
    doc: torch.Tensor  # (N,)
    label: torch.Tensor | None = None  # (N,) data token ids (data_ce)
    target_state: torch.Tensor | None = None  # (N, H) the target's final hidden state (argmax_ce, kl)
    block: torch.Tensor | None = None  # (N,) block of each position (D-PACE)
    predecessor: torch.Tensor | None = None  # (N,) the token before each label (a candidate selector)


def document_losses(
    q: Queries,
    head: Callable[[torch.Tensor], torch.Tensor],
    target_head: Callable[[torch.Tensor], torch.Tensor] | None,
    recipe: Recipe,
    n_docs: int,
    vocab: VocabMap | None = None,
    chunk: int | None = None,
    selector: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Each document's numerator ``sum_q s_q * dynamic_q * l_q`` (``(n_docs,)``), in chunks of ``chunk``
    positions (whole blocks under D-PACE) whose logits are recomputed in backward instead of kept.
    ``selector``: ``(hidden, logits, predecessor, target argmax) -> loss per position``, the drafter's
    candidate selector's term (``q.predecessor`` given), added to ``l_q`` times ``selector_loss_alpha``."""
    n = q.hidden.shape[0]
    out = q.hidden.new_zeros(n_docs, dtype=torch.float32)
    if n == 0:
        return out + 0.0 * q.hidden.sum()
    dv = vocab.d2t.shape[0] if vocab is not None else None
    size = chunk or chunk_positions(dv or _out_features(head, q.hidden))
    bounds = _chunks(n, size, q.block if recipe.slot_weights == "dpace" else None)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        sl = slice(a, b)
        label = None if q.label is None else q.label[sl]
        state = None if q.target_state is None else q.target_state[sl]
        block = None if q.block is None else q.block[sl]
        pred = None if q.predecessor is None else q.predecessor[sl]

        def part(h, label=label, state=state, block=block, scale=q.scale[sl], doc=q.doc[sl], pred=pred):
            ell, keep = _position_loss(h, head, target_head, recipe, vocab, label, state, selector, pred)
            w = scale * keep
            if recipe.slot_weights == "dpace" and block is not None:
                w = w * dpace_weights(ell.detach(), block, recipe.dpace_alpha)
            return torch.zeros(n_docs, dtype=torch.float32, device=h.device).index_add(0, doc, w * ell)

        h = q.hidden[sl]
        out = out + (checkpoint(part, h, use_reentrant=False) if h.requires_grad else part(h))
    return out


def _out_features(head, hidden: torch.Tensor) -> int:
    w = getattr(head, "weight", None)
    return int(w.shape[0]) if w is not None else int(hidden.shape[-1])


def _chunks(n: int, size: int, block: torch.Tensor | None) -> list[int]:
    """Chunk boundaries ``0 .. n`` of about ``size`` positions; with ``block``, never inside a block."""
    bounds = list(range(0, n, max(1, size))) + [n]
    if block is None:
        return bounds
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = block[1:] != block[:-1]
    first = torch.nonzero(starts).flatten()
    snapped = [int(first[torch.searchsorted(first, torch.tensor(x), right=True) - 1]) for x in bounds[1:-1]]
    return sorted({0, *snapped, n})


def _position_loss(
    h, head, target_head, recipe: Recipe, vocab: VocabMap | None, label, state, selector=None, pred=None
):
    """``(loss per position, 1/0 kept)`` for a chunk of supervised draft positions (plus the candidate
    selector's term where there is one)."""
    logits = head(h).float()
    keep = torch.ones(h.shape[0], dtype=torch.float32, device=h.device)
    if recipe.objective == "data_ce":
        assert label is not None
        if vocab is not None:
            d = vocab.t2d.to(h.device)[label]
            keep = (d >= 0).float()
            label = d.clamp(min=0)
        ell = torch.nn.functional.cross_entropy(logits, label, reduction="none")
        return ell, keep
    assert target_head is not None and state is not None
    with torch.no_grad():
        full = target_head(state).float()
        tgt = full[:, vocab.d2t.to(h.device)] if vocab is not None else full
        if vocab is not None and recipe.out_of_vocab == "drop":
            keep = (vocab.t2d.to(h.device)[full.argmax(-1)] >= 0).float()
    if recipe.objective == "argmax_ce":
        ell = torch.nn.functional.cross_entropy(logits, tgt.argmax(-1), reduction="none")
    elif recipe.objective == "ce_tv":
        ell = _ce_tv(h, logits, tgt, head, recipe)
    else:
        logq = torch.log_softmax(tgt, -1)
        ell = (logq.exp() * (logq - torch.log_softmax(logits, -1))).sum(-1)
    if selector is not None:
        assert pred is not None, "a candidate selector needs each position's predecessor token"
        ell = ell + recipe.selector_loss_alpha * selector(h, logits, pred, tgt.argmax(-1))
    return ell, keep


def _ce_tv(h, logits, tgt, head, recipe: Recipe) -> torch.Tensor:
    """``ce_weight`` x CE on the target's argmax + ``tv_weight`` x ``1 - sum_v min(p_v, q_v)``, plus
    ``confidence_alpha`` x the BCE of the head's ``confidence(h)`` logit (where the head has one: DSpark)
    against the acceptance rate ``1 - TV`` (no gradient through the rate)."""
    ce = torch.nn.functional.cross_entropy(logits, tgt.argmax(-1), reduction="none")
    tv = 1.0 - torch.minimum(torch.softmax(logits, -1), torch.softmax(tgt, -1)).sum(-1)
    ell = recipe.ce_weight * ce + recipe.tv_weight * tv
    confidence = getattr(head, "confidence", None)
    if confidence is not None and recipe.confidence_alpha > 0:
        rate = (1.0 - tv).detach()
        bce = torch.nn.functional.binary_cross_entropy_with_logits(
            confidence(h).float(), rate, reduction="none"
        )
        ell = ell + recipe.confidence_alpha * bce
    return ell


def dpace_weights(ell: torch.Tensor, block: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights of supervised positions grouped by ``block`` (ascending slots): with smoothed confidence
    ``c = (1 - alpha) exp(-l) + alpha`` and ``P_i`` its product over the block's positions up to ``i``,
    position ``i`` weighs ``sum_{j >= i} P_j`` (speculators ``dpace_loss_decay``; unsupervised slots count as
    ``c = 1``).

    >>> w = dpace_weights(torch.zeros(3), torch.tensor([0, 0, 1]), 0.5)
    >>> w.tolist()
    [2.0, 1.0, 1.0]
    """
    n = ell.shape[0]
    if n == 0:
        return ell
    logc = torch.log((1.0 - alpha) * torch.exp(-ell) + alpha)
    starts = torch.ones(n, dtype=torch.bool, device=ell.device)
    starts[1:] = block[1:] != block[:-1]
    seg = torch.cumsum(starts.long(), 0) - 1
    first = torch.nonzero(starts).flatten()
    cs = torch.cumsum(logc, 0)
    before = torch.cat([cs.new_zeros(1), cs])[first][seg]  # cumulative sum before the block's first position
    prefix = torch.exp(cs - before)
    rev = torch.flip(torch.cumsum(torch.flip(prefix, [0]), 0), [0])
    last = torch.cat([first[1:], torch.tensor([n], device=ell.device)]) - 1
    after = torch.cat([rev, rev.new_zeros(1)])[last + 1][seg]
    return rev - after


def with_document_noise(
    hidden: torch.Tensor, contract: Contract, amount: float, *, seed: int, epoch: int
) -> torch.Tensor:
    """``hidden`` (flat ``(1, T, F)``) plus uniform noise ``+-amount``, each document's rows from its own
    generator (:func:`padfree.core.document_rng.document_noise`: seed, epoch, sample id, piece start), so a
    document gets the same noise packed or alone, through padfree's trainer or speculators' fed by
    :mod:`padfree.integrations.feed`; padding rows get none."""
    if amount <= 0:
        return hidden
    out = hidden.clone()
    for d in range(contract.n_docs):
        s = contract.doc_slice(d)
        sid, start = max(0, contract.sample_ids[d]), contract.starts[d]
        noise = document_noise(
            tuple(out[0, s].shape), amount, seed=seed, epoch=epoch, sample_id=sid, start=start
        )
        out[0, s] += torch.from_numpy(noise).to(out)
    return out


__all__ = [
    "LOSS_CHUNK_BYTES",
    "Queries",
    "VocabMap",
    "chunk_positions",
    "document_losses",
    "dpace_weights",
    "loss_scale",
    "with_document_noise",
    "slot_weights_of",
]
