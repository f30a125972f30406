"""Zigzag context parallelism, per document: the exact reference on gloo, and its leaky control.

Under CP every document of a packed row is padded to a multiple of ``2 * cp`` (the plan and
:class:`~padfree.torch.PackCollator` with ``cp`` do it: ``cu_seq_lens_q_padded``), cut into ``2 * cp``
equal pieces, and rank ``r`` holds pieces ``r`` and ``2 * cp - 1 - r`` of *every* document (zigzag, so each
rank gets the same causal work per document): :func:`zigzag_indices`, :func:`shard_cp`.

``padfree_zigzag_cp`` is the REFERENCE, not a bandwidth-optimal ring: the keys and values of the whole row
are all-gathered (an autograd-aware all-gather, :mod:`padfree.torch.execution.collectives`, whose backward
reduce-scatters their gradients), and each local query attends to the keys of its own document only, with
the causal rule taken on the tokens' positions in the unsharded row. It is exact (it computes the same
softmax as unsharded per-document attention), so it is what a ring implementation (K/V passed around,
log-sum-exp merges) is checked against and what proves that the padded THD layout keeps documents apart.

``padfree_zigzag_cp_leaky`` is the leaky control: the same exchange with one causal mask over the whole row
(what accelerate's CP hook and ``torch``'s ``context_parallel`` do to SDPA), so later documents see earlier
ones. It exists only to show that the check catches it; never train with it.

>>> import torch
>>> zigzag_indices(torch.tensor([0, 8, 12]), rank=0, size=2).tolist()  # pieces of 2 and of 1 token
[0, 1, 6, 7, 8, 11]
>>> zigzag_indices(torch.tensor([0, 8, 12]), rank=1, size=2).tolist()
[2, 3, 4, 5, 9, 10]
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np
import torch

from padfree.errors import ConfigError
from padfree.torch.documents import attention as pa
from padfree.torch.documents.boundaries import Boundaries, read_boundaries
from padfree.torch.documents.interface import Call, Forward, interface
from padfree.torch.documents.interface import register as register_attention
from padfree.torch.execution.collectives import all_gather, current
from padfree.torch.execution.sequence_parallel import shard_at, sharded_row

NAME = "padfree_zigzag_cp"
LEAKY = "padfree_zigzag_cp_leaky"


def zigzag_indices(cu_padded, rank: int, size: int) -> np.ndarray:
    """Where rank ``rank`` of ``size`` CP ranks' tokens sit in the unsharded row: pieces ``rank`` and
    ``2 * size - 1 - rank`` of every document (boundaries ``cu_padded``, each span a multiple of
    ``2 * size``), in row order."""
    cu = np.asarray(cu_padded, dtype=np.int64).reshape(-1)
    spans = np.diff(cu)
    if (spans % (2 * size)).any():
        bad = int(spans[spans % (2 * size) != 0][0])
        raise ConfigError(
            f"CP: a document spans {bad} tokens, not a multiple of 2 x cp = {2 * size}: "
            f"plan and collate with cp={size}"
        )
    piece = spans // (2 * size)
    starts = np.stack([cu[:-1] + rank * piece, cu[:-1] + (2 * size - 1 - rank) * piece], axis=1).reshape(-1)
    lens = np.repeat(piece, 2)
    offsets = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(starts, lens) + offsets


def shard_cp(batch: Mapping, rank: int, size: int) -> dict:
    """Rank ``rank``'s zigzag share of a packed row laid out for CP: ``input_ids``, ``position_ids`` (the
    full row's) and ``shift_labels`` at :func:`zigzag_indices`, with the full row's padded boundaries as
    ``cu_seq_lens_q`` / ``_k`` for the attention."""
    ids = torch.as_tensor(batch["input_ids"])
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ConfigError(
            f"context parallelism shards one packed row (input_ids (1, T), got {tuple(ids.shape)})"
        )
    if not size >= 1:
        raise ConfigError(f"CP: size must be an integer >= 1, the CP degree (got {size!r})")
    if not 0 <= rank < size:
        raise ConfigError(f"CP: rank {rank!r} is not in 0..{size - 1} (the ranks of cp={size})")
    bounds = sharded_row(batch)
    if bounds.total != ids.shape[1]:
        raise ConfigError(
            f"CP: the document boundaries cover {bounds.total} tokens, the row has {ids.shape[1]}"
        )
    return shard_at(batch, bounds, torch.from_numpy(zigzag_indices(bounds.cu_seqlens(), rank, size)))


@functools.lru_cache(maxsize=8)
def _layout(
    bounds: Boundaries, rank: int, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(local positions, gathered positions, local documents, gathered documents) of the row ``bounds``, once
    per row (every layer of a forward pass reads the same one); the documents are ``bounds.seq_idx``."""
    everyone = [torch.from_numpy(zigzag_indices(bounds.cu_seqlens(), r, size)) for r in range(size)]
    doc = bounds.seq_idx()[0].to(torch.int64)
    gathered = torch.cat(everyone)
    return everyone[rank], gathered, doc[everyone[rank]], doc[gathered]


def _zigzag(per_document: bool, name: str) -> Forward:
    def forward(call: Call) -> torch.Tensor:
        g = current(name)
        call.one_row(name)
        query = call.query
        if call.softcap is not None or call.sinks is not None:
            raise ConfigError(f"{name}: soft-capped logits and attention sinks are not in the CP reference")
        bounds = read_boundaries(call.kwargs, 1, query.shape[2] * g.size, who=name)  # the whole row's
        if bounds is None:
            raise ConfigError(f"{name}: needs the full row's cu_seq_lens_q: use shard_cp")
        pos, keys_pos, doc, keys_doc = (t.to(query.device) for t in _layout(bounds, g.rank, g.size))
        if pos.shape[0] != query.shape[2]:
            raise ConfigError(
                f"{name}: {query.shape[2]} local tokens, the zigzag layout gives this rank {pos.shape[0]}"
            )
        k, v = all_gather(call.key, 2, g), all_gather(call.value, 2, g)  # (1, Hkv, T, D), in gathered order
        mask = keys_pos[None, :] <= pos[:, None]
        if per_document:
            mask &= keys_doc[None, :] == doc[:, None]
        if call.window is not None:
            mask &= pos[:, None] - keys_pos[None, :] < call.window
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            k,
            v,
            attn_mask=mask,
            dropout_p=call.dropout,
            scale=call.scaling,
            enable_gqa=query.shape[1] != k.shape[1],
        )
        pa._state.path = f"{name} (all-gathered K/V, {g.size} ranks)"
        return out.transpose(1, 2).contiguous()

    doc = f"transformers attention interface for ``{name}`` (see the module doc)."
    return interface(forward, f"{name}_forward", doc)


zigzag_attention_forward = _zigzag(True, NAME)
leaky_attention_forward = _zigzag(False, LEAKY)


def register() -> bool:
    """Register ``padfree_zigzag_cp`` and the leaky control ``padfree_zigzag_cp_leaky`` with transformers
    (idempotent); ``False`` when transformers is not installed."""
    forwards = {NAME: zigzag_attention_forward, LEAKY: leaky_attention_forward}
    return pa.register() and register_attention(forwards, pa.varlen_mask)


register()
