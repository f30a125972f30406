"""Exact chunked training of one long document: each chunk reads its earlier chunks' keys/values, conv state.

A document longer than a micro-batch's budget is cut into consecutive chunks (the ``chunked`` plan strategy
keeps them in order, on one rank, in one step). :func:`chunked_backward` runs ChunkFlow's state-aware
schedule on a transformers causal LM, so the parameter gradients equal training the document whole while
only one chunk's activations are alive at a time::

    forward (no grad)   chunk 0 -> K/V0, chunk 1 (past K/V0) -> K/V1, ..., chunk n-2 -> K/V(n-2)
    backward            chunk n-1 (past K/V0..n-2): forward with grad, backward -> dK/V0..n-2 += ...
                        chunk n-2: recompute, backward with the dK/V later chunks sent -> dK/V0..n-3 += ...
                        ...                                                      chunk 0: recompute, backward

Only the keys and values of earlier chunks (``2 * layers * kv_heads * head_dim`` numbers per token) are kept
for the whole document, and their gradients. ``keep`` chunks' activations may be kept from the forward pass
instead of recomputed (ChunkFlow's K): less compute, more memory.

Hybrids with short convolutions (LFM2, LFM2-MoE: :data:`CARRIED`) carry, per conv layer, the last
``conv_L_cache`` inputs of its convolution instead: chunk ``k`` reads chunk ``k-1``'s conv state (a leaf, like
the keys/values) and its backward sends that state its gradient, which the recomputed chunk ``k-1`` passes on.
Models with any other token mixer (a recurrent or delta-rule state, ALiBi over the row, ...) are refused.

The loss is the document's next-token cross-entropy summed over its labels (logits at ``t`` predict
``labels[t+1]``, across chunk boundaries too), times ``scale`` (the step normalizer of
:func:`padfree.torch.step_loss`), so a step of chunked and packed micro-batches keeps one denominator.

>>> import torch
>>> from padfree.models import build_model
>>> model = build_model("tiny-llama", vocab_size=64, num_hidden_layers=1, hidden_size=32,
...                     intermediate_size=64, num_attention_heads=2, num_key_value_heads=2)
>>> ids = torch.randint(0, 64, (20,))
>>> loss = chunked_backward(model, ids, ids, 8)           # chunks of 8, 8 and 4 tokens
>>> all(p.grad is not None for p in model.parameters()), loss > 0
(True, True)
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from padfree.errors import ConfigError
from padfree.torch.feed.collate import IGNORE

KV = list[tuple[torch.Tensor, ...]]
"""One chunk's state, per layer: ``(key, value)`` of shape ``(1, kv_heads, tokens, head_dim)`` for an
attention layer, ``(conv_state,)`` of shape ``(1, channels, <= kernel)`` (the conv's last inputs) for a
short-conv layer."""

CARRIED = frozenset({"Lfm2ShortConv", "Lfm2MoeShortConv"})
"""The token mixers (:data:`padfree.torch.documents.mixers.MIXERS` keys) whose state chunked training carries
exactly."""


def chunk_lengths(total: int, chunk: int | Sequence[int]) -> list[int]:
    """Chunk sizes of a ``total``-token document: ``chunk`` tokens each, the last one shorter, or the given
    sizes (which must add up to ``total``).

    >>> chunk_lengths(10, 4), chunk_lengths(10, [6, 4])
    ([4, 4, 2], [6, 4])
    """
    if isinstance(chunk, int):
        if chunk < 1:
            raise ConfigError(f"chunk size must be an integer >= 1 (got {chunk})")
        full, rest = divmod(total, chunk)
        return [chunk] * full + ([rest] if rest else [])
    sizes = [int(c) for c in chunk]
    if any(c < 1 for c in sizes) or sum(sizes) != total:
        raise ConfigError(f"chunk sizes {sizes[:8]} must be >= 1 and add up to the document's {total} tokens")
    return sizes


def _cache_class():
    """A transformers ``DynamicCache`` that remembers what each layer adds (this chunk's keys/values, or the
    conv state it leaves) and hands short-conv layers the previous chunk's conv state, in the graph."""
    from transformers import DynamicCache

    class _RecordingCache(DynamicCache):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.added: dict[int, tuple[torch.Tensor, ...]] = {}
            self.conv: dict[int, torch.Tensor] = {}
            self.recording = False
            self.n_past = 0

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if self.recording:
                self.added[layer_idx] = (key_states, value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

        def get_seq_length(self, layer_idx: int = 0) -> int:
            added = [int(t[0].shape[-2]) for t in self.added.values() if len(t) == 2]
            return self.n_past + max(added, default=0)

        def is_recording_past(self, layer_idx: int) -> bool:
            return True  # never the one-token decode path, which updates the conv state in place

        def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
            return bool(self.conv) if layer_idx is None else layer_idx in self.conv

        def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
            if state_idx:
                raise ConfigError(
                    f"chunked training carries one conv state per layer (layer {layer_idx} has more)"
                )
            return self.conv.get(layer_idx)

        def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
            if state_idx or conv_kernel_size is None:
                raise ConfigError(
                    f"chunked training carries short-conv states of known kernel (layer {layer_idx}'s is not)"
                )
            past = self.conv.get(layer_idx)
            full = (
                conv_states if past is None else torch.cat([past.to(conv_states.dtype), conv_states], dim=-1)
            )
            if self.recording:
                self.added[layer_idx] = (full[..., -int(conv_kernel_size) :],)
            return full

        def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
            raise ConfigError(
                f"chunked training carries keys/values and short-conv states; layer {layer_idx} keeps a "
                "recurrent state, which it does not carry"
            )

        update_recurrent_state = get_recurrent_state  # type: ignore[assignment]

    return _RecordingCache


def check_carried(model: torch.nn.Module) -> None:
    """Refuse, in one line, a model with a token mixer whose state chunked training does not carry exactly."""
    from padfree.torch.documents.mixers import mixer_key

    inner: Any = getattr(model, "module", model)
    other = sorted({k for m in inner.modules() if (k := mixer_key(m)) is not None and k not in CARRIED})
    if other:
        from padfree.torch.documents.mixers import MIXERS

        raise ConfigError(
            f"chunked training carries keys/values and short-conv states ({', '.join(sorted(CARRIED))}); "
            f"this model mixes tokens with {', '.join(other)} ({MIXERS[other[0]]}): train it packed or split"
        )


def _takes(model: torch.nn.Module, name: str) -> bool:
    """Whether the model's forward (inside a DDP / FSDP wrapper) takes the keyword ``name``."""
    inner = getattr(model, "module", model)
    return name in inspect.signature(inner.forward).parameters


def _shared_mask(model: torch.nn.Module) -> bool:
    """Whether a chunk's attention over earlier chunks' keys runs block by block with no mask
    (:mod:`padfree.torch.documents.past_attention`): for ``sdpa``, ``eager`` and ``padfree_varlen`` models;
    others read
    the past through the cache, with their own mask."""
    inner: Any = getattr(model, "module", model)
    impl = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    return impl in ("sdpa", "eager", "padfree_varlen")


def _cache_keyword(model: torch.nn.Module) -> str:
    """``cache`` (transformers >= 5.x) or ``past_key_values`` (older), whichever the model's forward takes."""
    return "cache" if _takes(model, "cache") else "past_key_values"


def _check_dropout(model: torch.nn.Module) -> None:
    inner: Any = getattr(model, "module", model)
    cfg = getattr(inner, "config", None)
    rates = [getattr(cfg, n, 0.0) or 0.0 for n in ("attention_dropout", "hidden_dropout", "resid_pdrop")]
    if inner.training and any(float(r) > 0 for r in rates):
        raise ConfigError(
            "chunked training recomputes each chunk's forward and needs it to repeat exactly: set the "
            f"model's dropout to 0 (attention_dropout / hidden_dropout are {rates})"
        )


def _check_recompute(model: torch.nn.Module) -> None:
    """Gradient (activation) checkpointing turns off the key/value cache each chunk hands the next one, and
    chunked training already recomputes each chunk's forward itself: refuse it, naming it as the cause."""
    inner: Any = getattr(model, "module", model)
    if any(getattr(m, "gradient_checkpointing", False) is True for m in inner.modules()):
        raise ConfigError(
            "chunked training cannot run under gradient checkpointing: it recomputes each chunk's forward "
            "itself and needs the key/value cache that checkpointing turns off; turn gradient checkpointing "
            "off (gradient_checkpointing=False in the training arguments, or the model's "
            "activation_checkpointing_disable() or gradient_checkpointing_disable()): chunked training keeps "
            "one chunk's activations alive at a time already (keep / --keep-chunks keeps more)"
        )


class _Chunk:
    """One chunk's forward: its loss and the keys/values it added (graph tensors)."""

    def __init__(self, loss: torch.Tensor, added: KV) -> None:
        self.loss, self.added = loss, added


def _forward(
    model: torch.nn.Module,
    ids: torch.Tensor,
    target: torch.Tensor,
    start: int,
    kv: list[KV],
    keyword: str,
    n_layers: int,
    loss: bool = True,
) -> _Chunk:
    """Run one chunk of ``ids`` at positions ``start ..`` over the keys/values ``kv`` of the chunks before
    it; returns its loss sum (``loss=False``: only its keys/values, the LM head run on one position if the
    model can)."""
    cache = _cache_class()()
    n_past = sum(int(chunk[_kv_layer(chunk)][0].shape[-2]) for chunk in kv) if kv else 0
    cache.n_past = n_past
    blockwise = _shared_mask(model)  # the past read block by block (past_attention), else through the cache
    past: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for layer in range(len(kv[0]) if kv else 0):
        if len(kv[0][layer]) == 1:  # a short-conv layer: the previous chunk's conv state only
            cache.conv[layer] = kv[-1][layer][0]
        elif blockwise:
            past[layer] = [(chunk[layer][0], chunk[layer][1]) for chunk in kv]
        else:
            keys, values = _layer_past(kv, layer)
            cache.update(keys, values, layer)  # the cache keeps its own copy: this one goes now
            del keys, values
    cache.recording = True
    pos = torch.arange(start, start + ids.shape[0], device=ids.device)[None]
    extra: dict[str, Any] = {} if loss or not _takes(model, "logits_to_keep") else {"logits_to_keep": 1}
    with _blockwise(model, past, blockwise) as served:
        out = model(input_ids=ids[None], position_ids=pos, use_cache=True, **{keyword: cache}, **extra)
    attention = {layer for layer, state in cache.added.items() if len(state) == 2}
    if blockwise and served != attention:
        raise ConfigError(
            f"chunked training's attention ran in layers {sorted(served)[:8]}, not in every attention layer "
            f"{sorted(attention)[:8]}: this model's attention does not follow its config's implementation"
        )
    total = out.logits.new_zeros(())
    if loss:
        logits = out.logits[0]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        total = F.cross_entropy(logits, target.to(logits.device), ignore_index=IGNORE, reduction="sum")
    del out
    if len(cache.added) != n_layers:
        raise ConfigError(
            f"chunked training needs a model whose {n_layers} layers all cache keys and values or a conv "
            f"state (got {len(cache.added)}): recurrent or shared-KV layers are not supported"
        )
    added = [cache.added[layer] for layer in range(n_layers)]
    return _Chunk(total, added)


@contextlib.contextmanager
def _blockwise(model: torch.nn.Module, past: dict, on: bool) -> Iterator[set[int]]:
    """Run the model's attention as :mod:`padfree.torch.documents.past_attention` over ``past`` (``on``), its
    own
    implementation restored after; yields the layers it served."""
    if not on:
        yield set()
        return
    from padfree.torch.documents import attention as pa
    from padfree.torch.documents import past_attention

    past_attention.register()
    inner: Any = getattr(model, "module", model)
    cfg = inner.config
    if pa.plan_of(cfg) is None:  # a model built under sdpa / eager: how its layers use the mask, read once
        pa.remember_plan(inner)
    before = cfg._attn_implementation
    cfg._attn_implementation = past_attention.NAME
    try:
        with past_attention.past_blocks(past) as served:
            yield served
    finally:
        cfg._attn_implementation = before


def _kv_layer(chunk: KV) -> int:
    """The first attention layer of a chunk's state (what counts its tokens)."""
    for layer, state in enumerate(chunk):
        if len(state) == 2:
            return layer
    raise ConfigError("chunked training needs at least one attention layer that caches keys and values")


def _layer_past(kv: list[KV], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The earlier chunks' keys and values of one layer, concatenated in the graph: each chunk's own tensors
    are leaves that collect, in their ``.grad``, what every later chunk's backward sends them."""
    if len(kv) == 1:
        return kv[0][layer][0], kv[0][layer][1]
    keys = torch.cat([chunk[layer][0] for chunk in kv], dim=-2)
    return keys, torch.cat([chunk[layer][1] for chunk in kv], dim=-2)


def chunked_backward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    chunk: int | Sequence[int],
    *,
    scale: float = 1.0,
    keep: int = 0,
    sync: Callable[[bool], contextlib.AbstractContextManager] | None = None,
) -> float:
    """Accumulate into the parameters' ``.grad`` the gradient of ``scale * loss_sum`` of one document, chunk
    by chunk, exactly as if it ran whole; returns ``loss_sum`` (a float, for logging).

    Args:
        model: a transformers causal LM (or a DDP wrapper of one) whose layers cache keys and values.
        input_ids, labels: the whole document, 1-D (or ``(1, L)``); labels unshifted, -100 where no loss.
        chunk: the chunk size (the last chunk shorter), or the sizes of the chunks (a plan's pieces).
        scale: what each token's loss is multiplied by (``world_size / step_tokens``).
        keep: how many chunks' activations the forward pass keeps instead of recomputing them in the
            backward pass (0: one chunk's activations alive at a time).
        sync: ``sync(final)`` is the context every forward/backward runs in; ``final`` is True only for the
            last backward (chunk 0's), e.g. ``lambda final: sync_unless(ddp, info.last and final)`` so DDP
            reduces gradients once per step. Default: for a DDP model, one reduction at chunk 0's backward
            (this document is the step); else nothing.
    """
    ids = input_ids.reshape(-1)
    lab = labels.reshape(-1)
    if ids.shape != lab.shape:
        raise ConfigError(f"input_ids ({tuple(ids.shape)}) and labels ({tuple(lab.shape)}) differ in shape")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ConfigError(f"keep must be an integer >= 0 (got {keep!r})")
    _check_dropout(model)
    _check_recompute(model)
    check_carried(model)
    if sync is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        sync = _reduce_once(model)  # one reduction, at chunk 0's backward: never a rank left unsynced
    sizes = chunk_lengths(int(ids.shape[0]), chunk)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    target = F.pad(lab[1:], (0, 1), value=IGNORE)  # logits at t predict labels[t+1], across chunks too
    keyword = _cache_keyword(model)
    inner: Any = getattr(model, "module", model)
    # DDP: only chunk 0's last forward goes through the wrapper (in sync(True) it is the step's reducing
    # one); the others run the module itself, so every rank's DDP forwards, and the collectives DDP runs in
    # them (buffer broadcast, bucket rebuild), are one per document whatever its chunk count
    plain = inner if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    n_layers = int(inner.config.num_hidden_layers)
    ctx = sync if sync is not None else (lambda final: contextlib.nullcontext())
    n = len(sizes)
    lowest_kept = max(n - 1 - keep, 0 if sync is None else 1)

    def piece(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = starts[k], starts[k] + sizes[k]
        return ids[a:b], target[a:b]

    # forward: every chunk but the last, for its keys/values (the kept ones with their graphs)
    kv: list[KV] = []
    kept: dict[int, _Chunk] = {}
    for k in range(n - 1):
        if k >= lowest_kept:
            with ctx(False):
                done = _forward(plain, *piece(k), starts[k], kv[:k], keyword, n_layers)
            kept[k] = done
        else:
            with torch.no_grad():
                done = _forward(plain, *piece(k), starts[k], kv[:k], keyword, n_layers, loss=False)
        kv.append([tuple(t.detach().requires_grad_() for t in state) for state in done.added])
        del done
    # backward, last chunk first: each chunk's loss plus the gradient later chunks sent to its keys/values
    total = 0.0
    for k in range(n - 1, -1, -1):
        with ctx(k == 0):
            done = (
                kept.pop(k)
                if k in kept
                else _forward(model if k == 0 else plain, *piece(k), starts[k], kv[:k], keyword, n_layers)
            )
            outputs: list[torch.Tensor] = [done.loss * scale]
            seeds: list[torch.Tensor | None] = [None]
            own = kv[k] if k < len(kv) else []
            for state, leaves in zip(done.added, own):
                for t, leaf in zip(state, leaves):
                    if leaf.grad is not None:
                        outputs.append(t)
                        seeds.append(leaf.grad)
            torch.autograd.backward(outputs, seeds)
        total += float(done.loss.detach())
        del done, outputs, seeds, own
        if k < len(kv):
            kv[k] = []  # its keys/values and their gradient: no later use
    return total


# ----------------------------------------------------------------------------------------------------------
# one optimizer step of a chunked plan


def _reduce_once(ddp: torch.nn.Module) -> Callable[[bool], contextlib.AbstractContextManager]:
    """``sync(final)`` for a DDP model: ``no_sync`` except for the final backward."""
    from padfree.torch.execution.distributed import sync_unless

    return lambda final: sync_unless(ddp, final)


def step_documents(micro_batches: Sequence[Any]) -> list[list[Any]]:
    """A rank's micro-batches of one step, grouped by document: a micro-batch whose one item is a chunk that
    continues its document (``info.starts[0] > 0``) joins the micro-batch before it; every other micro-batch
    (a packed row, a first chunk) opens a group. The plan keeps a document's chunks consecutive, on one rank,
    inside one step, so a group is one document's chunks in order, or one packed row."""
    groups: list[list[Any]] = []
    for batch in micro_batches:
        info: Any = getattr(batch, "info", None)
        starts = None if info is None else info.starts
        if groups and starts is not None and len(starts) == 1 and starts[0] > 0:
            prev = groups[-1][-1].info
            if prev.indices != info.indices or prev.starts[0] + prev.lengths[0] != starts[0]:
                raise ConfigError(
                    f"sample {info.indices[0]}: a chunk at token {starts[0]} does not follow the micro-batch "
                    "before it; chunked plans are run whole steps at a time, in plan order"
                )
            groups[-1].append(batch)
        else:
            groups.append([batch])
    return groups


def document_backward(
    model: torch.nn.Module,
    chunks: Sequence[Any],
    *,
    scale: float = 1.0,
    keep: int = 0,
    device: torch.device | str | None = None,
    sync: Callable[[bool], contextlib.AbstractContextManager] | None = None,
) -> float:
    """:func:`chunked_backward` of one long document given as its chunks' micro-batches, in order (a group of
    :func:`step_documents`); returns its loss sum."""
    ids = torch.cat([b["input_ids"].reshape(-1) for b in chunks])
    labels = torch.cat([b["labels"].reshape(-1) for b in chunks])
    if device is not None:
        ids, labels = ids.to(device), labels.to(device)
    sizes = [int(b["input_ids"].numel()) for b in chunks]
    return chunked_backward(model, ids, labels, sizes, scale=scale, keep=keep, sync=sync)


def _row_loss(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """A row's summed token losses: the model on ``inputs`` (labels aside) scored against its labels."""
    from padfree.torch.feed.loss import token_loss_sum

    labels = inputs["labels"]
    return token_loss_sum(model(**{k: v for k, v in inputs.items() if k != "labels"}).logits, labels)


def run_step(
    model: torch.nn.Module,
    micro_batches: Sequence[Any],
    scale: float,
    *,
    keep: int = 0,
    device: torch.device | str | None = None,
    sync: Callable[[bool], contextlib.AbstractContextManager] | None = None,
    chunks: bool = True,
    row_loss: Callable[[torch.nn.Module, dict], torch.Tensor] | None = None,
    timed: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None,
) -> tuple[torch.Tensor, int]:
    """Forward and backward of one rank's micro-batches of one optimizer step (collated by
    ``PackCollator(chunked=True)`` for a chunked plan): a packed row as usual, a long document's chunks with
    :func:`chunked_backward`; every token's loss times ``scale`` (:func:`padfree.torch.step_loss`'s
    ``world_size / step_tokens``). Returns ``(loss_sum, tokens)`` (the summed token losses, detached, and the
    real tokens).

    ``sync(final)`` wraps every forward and backward; ``final`` is True for the step's last backward only
    (e.g. ``lambda final: sync_unless(ddp, final)``), so DDP all-reduces once per step, as with any plan.
    Without it a DDP model gets exactly that: reducing at every row's or document's backward would run as
    many all-reduces as this rank has groups, which differs between ranks (a long document is one group,
    four short rows are four), and the ranks' collectives would no longer pair up (a hang).

    ``chunks=False``: every micro-batch is a row of its own (a plan that is not chunked, whose split pieces
    are samples of their own); ``row_loss(model, inputs)``: a row's summed token losses (default: the model
    on the row, :func:`padfree.torch.token_loss_sum`; :class:`padfree.torch.execution.runner.StepRunner` gives
    a shard's); ``timed(model)``: a context around each row's forward and backward (the sampler's timer).
    """
    if sync is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        sync = _reduce_once(model)  # once per row would differ between ranks and hang the collectives
    ctx = sync if sync is not None else (lambda final: contextlib.nullcontext())
    loss_of = row_loss if row_loss is not None else _row_loss
    clock = timed if timed is not None else (lambda m: contextlib.nullcontext())
    groups = step_documents(micro_batches) if chunks else [[b] for b in micro_batches]
    loss_sum: torch.Tensor | None = None
    tokens = 0
    for g, group in enumerate(groups):
        last_group = g == len(groups) - 1
        tokens += sum(int(b.tokens) for b in group)
        if len(group) == 1:
            inputs = {
                k: v.to(device, non_blocking=True) if torch.is_tensor(v) and device is not None else v
                for k, v in group[0].items()
            }
            with ctx(last_group), clock(model):
                token_losses = loss_of(model, inputs)
                (token_losses * scale).backward()
            part = token_losses.detach()
        else:

            def doc_sync(final: bool, last: bool = last_group) -> contextlib.AbstractContextManager:
                return ctx(last and final)

            done = document_backward(model, group, scale=scale, keep=keep, device=device, sync=doc_sync)
            part = torch.tensor(done, device=device if device is not None else group[0]["input_ids"].device)
        loss_sum = part if loss_sum is None else loss_sum + part
    if loss_sum is None:
        loss_sum = torch.zeros((), device=device)
    return loss_sum, tokens
