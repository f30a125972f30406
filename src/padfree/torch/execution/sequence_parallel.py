"""Ulysses sequence parallelism around padfree's per-document attention: a shard of a packed row per rank.

Each of the ``sp`` ranks of a sequence-parallel group holds a contiguous ``1/sp`` of one packed row
(:func:`shard_sp`; the plan makes the row's length a multiple of ``sp``, :class:`padfree.core.shard.Shard`).
Everything but attention is per token and runs on the shard. Around attention an all-to-all turns
``[seq/sp, heads]`` into ``[seq, heads/sp]``,
:func:`padfree.torch.documents.attention.varlen_attention_forward`
runs over the whole row with the whole row's document boundaries (every rank has them: ``cu_seq_lens_q`` of
the full row), and a second all-to-all turns it back. Both exchanges carry gradients
(:mod:`padfree.torch.execution.collectives`), so a backward through the shards gives the unsharded row's
gradients once the SP ranks' parameter gradients are summed (what DDP / FSDP over the SP x DP mesh does).

Registered with transformers as ``padfree_ulysses`` (and ``padfree_ulysses_leaky``: the same exchange around
:func:`padfree.torch.documents.attention.leaky_attention`, the leaky control for leak checks). The forward
pass runs
inside :func:`padfree.torch.execution.collectives.shard_group` (the SP group). Query heads, and key/value
heads unless
they are repeated, must divide by ``sp``. Models with convolutions or recurrences (hybrids) are not sharded
here: those mixers would see only their shard.

>>> import padfree.torch.execution.sequence_parallel as sp
>>> from padfree.torch import PackCollator
>>> row = PackCollator(sp=2)([{"input_ids": [5, 6]}, {"input_ids": [7, 8, 9]}])  # 5 tokens, padded to 6
>>> shard = sp.shard_sp(row, rank=1, size=2)
>>> shard["input_ids"].tolist(), shard["position_ids"].tolist(), shard["cu_seq_lens_q"].tolist()
([[8, 9, 0]], [[1, 2, 3]], [0, 2, 6])
>>> sp.shard_sp(row, rank=0, size=2)["shift_labels"].tolist()  # next tokens; -100 at a document's end
[[6, -100, 8]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from padfree.errors import ConfigError
from padfree.torch.documents import attention as pa
from padfree.torch.documents.boundaries import Boundaries, read_boundaries
from padfree.torch.documents.interface import Call, Forward, interface, repeat_heads
from padfree.torch.documents.interface import register as register_attention
from padfree.torch.execution.collectives import all_to_all, current

NAME = "padfree_ulysses"
LEAKY = "padfree_ulysses_leaky"
IGNORE = -100


def check_shardable(model: torch.nn.Module, sp: int = 1, cp: int = 1) -> None:
    """Refuse, in one :class:`ConfigError` line naming the cause, a model that padfree's SP (``sp`` > 1) or
    CP (``cp`` > 1) cannot shard exactly: convolutions or recurrences (a hybrid or recurrent model: each
    would see only its shard), under CP soft-capped attention scores or attention sinks (not in the CP
    reference), under SP query heads that do not split over the ranks. The one check the Trainer and
    ``padfree check-packing --sp/--cp`` make before any work."""
    from padfree.torch.documents.mixers import mixers_of

    if sp <= 1 and cp <= 1:
        return
    what = f"padfree SP (sp={sp})" if sp > 1 else f"padfree CP (cp={cp})"
    mixers = sorted(set(mixers_of(model).values()))
    if mixers:
        raise ConfigError(
            f"{what}: this model has convolutions or recurrences ({', '.join(mixers[:4])}: a hybrid or "
            "recurrent model), which would see only their shard; train it without SP/CP"
        )
    if cp > 1:
        for name, module in model.named_modules():
            cap = getattr(module, "attn_logit_softcapping", None)
            sinks = getattr(module, "sinks", None)
            if cap is not None or isinstance(sinks, torch.Tensor):
                feature = (
                    f"soft-caps its scores (attn_logit_softcapping={cap:g})"
                    if cap is not None
                    else "has sinks (a learned logit per head)"
                )
                raise ConfigError(
                    f"{what}: this model's attention {feature} in {name or 'the model'}, which padfree's CP "
                    "attention does not compute; train it without CP (padfree's SP computes it)"
                )
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if sp > 1 and isinstance(heads, int) and heads % sp:
        raise ConfigError(f"{what}: the model's {heads} attention heads do not split over {sp} ranks")


def row_boundaries(batch: Mapping) -> torch.Tensor:
    """The document boundaries a sharded row's attention uses (int32, empty documents dropped):
    :func:`sharded_row`'s ``cu_seqlens``."""
    return sharded_row(batch).cu_seqlens()


def sharded_row(batch: Mapping) -> Boundaries:
    """The documents of a packed row to shard, read by
    :func:`padfree.torch.documents.boundaries.read_boundaries` (the
    one reader, attention's too): the padded spans (``cu_seq_lens_q_padded`` of a
    :class:`~padfree.torch.PackCollator` with ``sp``/``cp``; each document's pads after its real tokens, so
    they change none of its real tokens), else ``cu_seq_lens_q``."""
    if batch.get("cu_seq_lens_q_padded") is None and batch.get("cu_seq_lens_q") is None:
        raise ConfigError("a sharded row needs its document boundaries (cu_seq_lens_q): use PackCollator")
    row = {k: torch.as_tensor(v) for k, v in batch.items() if k.startswith("cu_seq_lens_") and v is not None}
    ids = torch.as_tensor(batch["input_ids"])
    bounds = read_boundaries(row, 1, int(ids.shape[-1]), who="SP/CP")
    assert bounds is not None
    return bounds


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The row's targets: ``labels`` shifted one left (-100 at the end), so that a shard's logits at ``t``
    are scored against ``shift_labels[t]`` without the next shard's first label (transformers'
    ``shift_labels``)."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE)


def shard_sp(batch: Mapping, rank: int, size: int) -> dict:
    """Rank ``rank``'s contiguous ``1/size`` of a packed row (one row, length a multiple of ``size``):
    ``input_ids``, ``position_ids`` (from the full row, so rotary positions are those of the unsharded
    row), ``shift_labels`` (the full row's, cut; score with :func:`shard_loss_sum`), and the full row's
    ``cu_seq_lens_q`` / ``_k`` (:func:`sharded_row`) and ``max_length_q`` / ``_k`` for the attention."""
    ids = torch.as_tensor(batch["input_ids"])
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ConfigError(
            f"sequence parallelism shards one packed row (input_ids of shape (1, T), got {tuple(ids.shape)})"
        )
    total = ids.shape[1]
    if not size >= 1:
        raise ConfigError(f"SP: size must be an integer >= 1, the SP degree (got {size!r})")
    if not 0 <= rank < size:
        raise ConfigError(f"SP: rank {rank!r} is not in 0..{size - 1} (the ranks of sp={size})")
    if total % size:
        raise ConfigError(
            f"SP: a row of {total} tokens does not split into {size} equal shards "
            f"(plan and collate with sp={size})"
        )
    bounds = sharded_row(batch)
    if bounds.total != total:
        raise ConfigError(f"SP: the document boundaries cover {bounds.total} tokens, the row has {total}")
    n = total // size
    return shard_at(batch, bounds, slice(rank * n, (rank + 1) * n))


def shard_at(batch: Mapping, bounds: Boundaries, at: slice | torch.Tensor) -> dict:
    """A rank's share of a packed row: ``input_ids``, ``position_ids`` and ``shift_labels`` (the full row's,
    :func:`shift_labels`) at ``at`` (a slice or an index tensor along the row), and the full row's documents
    ``bounds`` as ``cu_seq_lens_q`` / ``_k`` with its longest span as ``max_length_q`` / ``_k``."""
    out: dict[str, Any] = {
        "input_ids": torch.as_tensor(batch["input_ids"])[:, at],
        "position_ids": torch.as_tensor(batch["position_ids"])[:, at],
    }
    if batch.get("labels") is not None:
        out["shift_labels"] = shift_labels(torch.as_tensor(batch["labels"]))[:, at]
    cu, longest = bounds.cu_seqlens(), bounds.max_length
    out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=longest, max_length_k=longest)
    return out


def shard_loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropies of a shard's logits against its ``shift_labels`` (-100 ignored), float32 or
    better: summed over the shards, the row's :func:`padfree.torch.token_loss_sum`."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE,
        reduction="sum",
    )


def _ulysses(inner: Callable[[Call], torch.Tensor], name: str) -> Forward:
    def forward(call: Call) -> torch.Tensor:
        g = current(name)
        call.one_row(name)
        query, key, value = call.query, call.key, call.value
        heads, kv_heads = query.shape[1], key.shape[1]
        if heads % g.size:
            raise ConfigError(f"{name}: {heads} query heads do not split over sp={g.size} ranks")
        if kv_heads % g.size:  # fewer key/value heads than ranks: every query head gets its own copy
            key, value = repeat_heads(query, key, value)
        q, k, v = (all_to_all(x, 1, 2, g) for x in (query, key, value))  # (1, H/sp, T, D)
        extra = {}
        sinks = call.sinks
        if sinks is not None:
            per = heads // g.size
            extra["s_aux"] = sinks[g.rank * per : (g.rank + 1) * per]
        for k_ in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal"):
            if call.kwargs.get(k_) is not None:
                extra[k_] = call.kwargs[k_]
        row = read_boundaries(extra, 1, q.shape[2], who=name)  # what the attention below reads
        if row is None or not row.covers(1, q.shape[2]):
            have = "none" if row is None else f"{row.total} tokens"
            raise ConfigError(
                f"{name}: needs the full row's cu_seq_lens_q ({q.shape[2]} tokens; got {have}): use shard_sp"
            )
        out = inner(dataclasses.replace(call, query=q, key=k, value=v, kwargs=extra))
        back = all_to_all(out.transpose(1, 2), 2, 1, g)  # (1, H, T/sp, D)
        return back.transpose(1, 2).contiguous()

    doc = f"transformers attention interface for ``{name}`` (see the module doc)."
    return interface(forward, f"{name}_forward", doc)


ulysses_attention_forward = _ulysses(pa.varlen_attention, NAME)
ulysses_leaky_attention_forward = _ulysses(pa.leaky_attention, LEAKY)


def register() -> bool:
    """Register ``padfree_ulysses`` and ``padfree_ulysses_leaky`` with transformers (idempotent); ``False``
    when transformers is not installed."""
    forwards = {NAME: ulysses_attention_forward, LEAKY: ulysses_leaky_attention_forward}
    return pa.register() and register_attention(forwards, pa.varlen_mask)


register()
