"""Drafter attention masks (DFlash blocks, EAGLE-3 test-time training) as one predicate each, materialised
as a dense boolean mask (CPU training with SDPA/eager, forward and backward) or as a flex-attention
``BlockMask`` (GPU): the same function decides both, so they cannot disagree.

All positions are *flat* (a contract's rows concatenated, see :mod:`padfree.drafter.contract`);
``document_ids`` is ``-1`` on padding.

**DFlash.** ``n`` anchors open ``n`` blocks of ``B`` query tokens. Keys are the ``T`` context positions
(projected target hidden states) followed by the ``n * B`` block tokens. Block ``j`` (anchor ``a``, document
``d``) sees the context of ``d`` strictly before ``a`` and its own block (both directions), nothing else::

    context  0 1 2 3 4 5 | 6 7 8 9      blocks (B = 2): anchors 2 (doc 0) and 7 (doc 1)
    doc      0 0 0 0 0 0 | 1 1 1 1
                            context keys                block keys
                          0 1 2 3 4 5 6 7 8 9      b0 b0 b1 b1
    block 0 slot 0 (a=2)  x x . . . . . . . .      x  x  .  .
    block 0 slot 1        x x . . . . . . . .      x  x  .  .
    block 1 slot 0 (a=7)  . . . . . . x . . .      .  .  x  x
    block 1 slot 1        . . . . . . x . . .      .  .  x  x

**EAGLE-3** at test-time-training step ``k``: queries are the ``T`` positions; keys are step 0's ``T``
positions then one more ``T`` per earlier step. A query sees step 0's keys causally inside its own document,
and at every step its own position (the diagonal)::

    doc      0 0 0 | 1 1        step 0 keys      step 1 keys
                                0 1 2 3 4        0 1 2 3 4
    q 0                         x . . . .        x . . . .
    q 1                         x x . . .        . x . . .
    q 2                         x x x . .        . . x . .
    q 3                         . . . x .        . . . x .
    q 4                         . . . x x        . . . . x

>>> doc = torch.tensor([0, 0, 0, 1, 1])
>>> eagle3_dense_mask(doc, step=0).int().tolist()[4]
[0, 0, 0, 1, 1]
>>> m = DFlashMask(doc, torch.tensor([1, 3]), block_size=2).dense()
>>> m.shape, m.int().tolist()[2]
(torch.Size([4, 9]), [0, 0, 0, 0, 0, 0, 0, 1, 1])
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class DFlashMask:
    """The DFlash mask of one flat row, decided by one predicate (:meth:`visible`) and materialised dense or
    as a flex-attention ``BlockMask``. ``document_ids``: the ``T`` context positions' documents; ``anchors``:
    the ``n`` blocks' anchor positions; ``window``: the context is only the ``window`` positions before the
    anchor; ``causal``: a slot sees only its block's earlier slots and itself (speculators' sliding-window
    layers)."""

    document_ids: torch.Tensor
    anchors: torch.Tensor
    block_size: int
    window: int | None = None
    causal: bool = False

    @cached_property
    def _query_anchor(self) -> torch.Tensor:
        return self.anchors.to(self.document_ids.device).repeat_interleave(self.block_size)

    def visible(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Whether query ``q`` sees key ``kv``, on index tensors of any (broadcastable) shape."""
        doc, b = self.document_ids, self.block_size
        n_ctx = doc.shape[0]
        a = self._query_anchor[q]
        d = doc[a]
        is_ctx = kv < n_ctx
        ctx = doc[torch.remainder(kv, max(n_ctx, 1))]
        sees_ctx = is_ctx & (ctx == d) & (d >= 0) & (kv < a)
        if self.window is not None:
            sees_ctx = sees_ctx & (kv >= a - self.window)
        sees_block = ~is_ctx & (torch.div(kv - n_ctx, b, rounding_mode="floor") == q // b)
        if self.causal:
            sees_block = sees_block & (kv - n_ctx <= q)
        return sees_ctx | sees_block

    @property
    def shape(self) -> tuple[int, int]:
        """``(n * B, T + n * B)``: queries, then context and block keys."""
        n_q = self.anchors.shape[0] * self.block_size
        return n_q, self.document_ids.shape[0] + n_q

    def dense(self) -> torch.Tensor:
        """The dense boolean mask of :attr:`shape` (True: attend)."""
        n_q, n_kv = self.shape
        dev = self.document_ids.device
        return self.visible(torch.arange(n_q, device=dev)[:, None], torch.arange(n_kv, device=dev)[None, :])

    def block_mask(self):
        """The same mask as a flex-attention ``BlockMask``."""
        _ = self._query_anchor  # derived here, once, not inside flex's vmap of the predicate
        return _block_mask(self.visible, *self.shape, self.document_ids.device)


def eagle3_predicate(document_ids: torch.Tensor):
    """``visible(q, kv)`` of the EAGLE-3 mask at any step (keys of step ``s`` are ``s * T .. (s+1) * T``)."""
    n = document_ids.shape[0]

    def visible(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        step = torch.div(kv, n, rounding_mode="floor")
        j = torch.remainder(kv, n)
        dq = document_ids[q]
        causal_doc = (step == 0) & (dq >= 0) & (document_ids[j] == dq) & (j <= q)
        return causal_doc | (j == q)

    return visible


def dflash_context_mask(
    document_ids: torch.Tensor, anchors: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """The context part of the DFlash mask per anchor, ``(n, T)``: what each block sees before its anchor (its
    slots all see the same context). The block part is each block's own ``B x B``."""
    dev = document_ids.device
    a = anchors.to(dev)[:, None]
    kv = torch.arange(document_ids.shape[0], device=dev)[None, :]
    d = document_ids[a]
    m = (document_ids[kv] == d) & (d >= 0) & (kv < a)
    return m & (kv >= a - window) if window is not None else m


def eagle3_dense_mask(document_ids: torch.Tensor, step: int) -> torch.Tensor:
    """Dense boolean EAGLE-3 mask at test-time-training step ``step``: ``(T, (step + 1) * T)``."""
    n = document_ids.shape[0]
    dev = document_ids.device
    q = torch.arange(n, device=dev)[:, None]
    kv = torch.arange((step + 1) * n, device=dev)[None, :]
    return eagle3_predicate(document_ids)(q, kv)


def _block_mask(visible, q_len: int, kv_len: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(q_idx, kv_idx)

    return create_block_mask(mask_mod, None, None, q_len, kv_len, device=device)


def eagle3_block_mask(document_ids: torch.Tensor, step: int):
    """The EAGLE-3 mask at ``step`` as a flex-attention ``BlockMask`` (same predicate as the dense one)."""
    n = document_ids.shape[0]
    return _block_mask(eagle3_predicate(document_ids), n, (step + 1) * n, document_ids.device)


def cross_document_pairs(mask: torch.Tensor, q_doc: torch.Tensor, kv_doc: torch.Tensor) -> int:
    """How many attended ``(query, key)`` pairs join two different documents (or a document and padding)."""
    return int((mask & (q_doc[:, None] != kv_doc[None, :])).sum())


PAIRS_CHUNK = 1 << 22
"""(query, key) pairs a crossing count evaluates at once (a few hundred MB of index tensors at most)."""


def count_cross_pairs(
    visible,
    q_doc: torch.Tensor,
    kv_doc: torch.Tensor,
    keys: int | None = None,
    own_block: int | None = None,
) -> int:
    """:func:`cross_document_pairs` of the mask ``visible`` (a predicate of this module) without building
    it: queries in chunks of :data:`PAIRS_CHUNK` pairs, so memory stays bounded whatever the row. Keys: all
    ``len(kv_doc)``, or (DFlash, ``own_block`` its block size ``B``) the first ``keys`` (the context) and the
    query's own block, the only keys a DFlash query's attention scores
    (:func:`padfree.drafter.methods.dflash.model.block_attend`; another block's keys are never computed
    with)."""
    n_q, dev = q_doc.shape[0], q_doc.device
    n_kv = kv_doc.shape[0] if keys is None else keys
    width = n_kv + (own_block or 0)
    step = max(1, PAIRS_CHUNK // max(width, 1))
    ctx = torch.arange(n_kv, device=dev)[None, :]
    total = 0
    for q0 in range(0, n_q, step):
        q = torch.arange(q0, min(q0 + step, n_q), device=dev)[:, None]
        kv = ctx.expand(q.shape[0], -1)
        if own_block:
            first = n_kv + torch.div(q, own_block, rounding_mode="floor") * own_block
            kv = torch.cat([kv, first + torch.arange(own_block, device=dev)[None, :]], 1)
        total += int((visible(q, kv) & (q_doc[q] != kv_doc[kv])).sum())
    return total
