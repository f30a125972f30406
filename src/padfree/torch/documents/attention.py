"""Padding-free attention for packed rows: attention that skips the work a block-diagonal mask would hide.

A packed row holds several documents back to back (``position_ids`` restart at 0 for each one). transformers'
``sdpa`` and ``eager`` paths turn that into a dense ``T x T`` block-diagonal mask and still pay for every
masked score. ``padfree_varlen`` computes attention document by document instead:

- GPU: ``flash_attn_varlen_func`` when ``flash_attn`` is installed, else PyTorch's own
  ``torch.nn.attention.varlen.varlen_attn`` (fp16/bf16; called with the keywords the installed torch has, and
  probed once: if it fails, per-document SDPA runs and :func:`last_path` says why), else per-document SDPA.
  Under ``torch.autocast`` q/k/v are taken in the autocast dtype, as autocast does for SDPA;
- CPU: per-document SDPA (the row is split at document boundaries with ``split``, each piece runs causal
  SDPA, the outputs are concatenated), grouped-query heads, sliding windows, ``scaling``, logit
  soft-capping and attention sinks (``s_aux``, gpt-oss) honoured.

Document boundaries come from the ``cu_seq_lens_q`` keyword (what transformers'
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` and padfree's ``PackCollator`` emit) or else
from ``position_ids`` resets (``cu_seq_lens_q_padded`` first when a row is laid out for SP/CP: each document's
pads sit inside its span, after its real tokens); they are computed once per forward pass and reused by every
layer. Sharded rows: :mod:`padfree.torch.execution.sequence_parallel`,
:mod:`padfree.torch.execution.context_parallel`. Padded
batches (an ``attention_mask`` is present) and cached decoding keep the model's normal ``sdpa`` path.

The model's attention pattern is kept, never assumed: :func:`varlen_mask` reads what transformers' mask
function asks for (:func:`mask_pattern`: causal, window, chunk, other) and how the model's layers use the
mask (:func:`plan_model`, read once per model when it is built). Only where the layers hand the mask to this
function unchanged, and pass their window as ``sliding_window``, is no mask built; elsewhere (a mask the
model applies in its own code: Bloom, XGLM, GPT-NeoX-Japanese, Doge; a window or chunk only the mask carries:
Qwen2-MoE, PhiMoE, Llama-4; overlays) the model gets transformers' own mask, restricted to the row's
documents. A term the model hands its attention that padfree does not apply (:data:`UNAPPLIED`: a learned
position bias, foreign sinks, sparse indices) is refused in one line, never dropped.

Importing this module registers the implementation with transformers (:func:`register`, idempotent), so any
model whose attention goes through ``ALL_ATTENTION_FUNCTIONS`` (Llama, Mistral, Qwen2, Gemma, ...) can use it
by name. What registering patches, and nothing more: the two new names in transformers' attention and mask
registries, and a step after ``PreTrainedModel``'s ``post_init``, ``set_attn_implementation``,
``set_use_kernels`` and ``reset_kernels`` that gives a model whose config names a padfree attention what
:func:`prepare_for_packing` states (:func:`keep_apart`); a model built with any other attention gets nothing
(no hook, no attribute, the same dispatch):

>>> import padfree.torch.documents.attention as pa
>>> pa.attn_for("packed"), pa.attn_for("sorted")
('padfree_varlen', 'sdpa')
>>> from padfree.models import build_model
>>> model = build_model("tiny-llama", attn_implementation=pa.NAME, vocab_size=64, num_hidden_layers=1)
>>> model.config._attn_implementation
'padfree_varlen'
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from padfree.core.strategies import REGISTRY
from padfree.errors import ConfigError
from padfree.torch.documents import interface as common
from padfree.torch.documents.boundaries import Boundaries, read_boundaries, row_keywords
from padfree.torch.documents.interface import Call
from padfree.torch.documents.mixers import attention_boundaries, require_prepared

NAME = "padfree_varlen"
LEAKY = "padfree_leaky"

_state = threading.local()
_registered = False


def attn_for(strategy: str) -> str:
    """The ``attn_implementation`` a plan strategy needs: ``"padfree_varlen"`` for packed rows (one row,
    several documents), ``"sdpa"`` for padded strategies (sorted, random, bucketed)."""
    spec = REGISTRY.get(strategy)
    return NAME if spec is not None and spec.packed else "sdpa"


def attention_for_rows(packed: bool) -> str:
    """:func:`attention_implementation` for packed rows (``packed``) or padded ones, whatever made them (a
    plan strategy or a peer's batching)."""
    return NAME if packed and register() else "sdpa"


def last_path() -> str | None:
    """Which kernel the last ``padfree_varlen`` call in this thread used (for reports), or ``None``."""
    return getattr(_state, "path", None)


def reset_path() -> None:
    """Forget the last path, so that :func:`last_path` says ``None`` until padfree's attention runs again
    (e.g. before a forward pass of a model that might use transformers' own attention instead)."""
    _state.path = None


def prepare_for_packing(model: torch.nn.Module, attn_implementation: str = NAME) -> torch.nn.Module:
    """Switch ``model`` to ``attn_implementation``, turn ``use_cache`` off and :func:`keep_apart` its
    documents, in place; returns the model.

    With ``use_cache=True`` (the ``LlamaConfig`` default) transformers skips packed-sequence detection and the
    documents of a packed row attend to each other under ``sdpa``/``eager`` while training still "works".
    """
    register()
    hf: Any = model  # a transformers PreTrainedModel
    hf.config.use_cache = False
    if getattr(hf.config, "_attn_implementation", None) != attn_implementation:
        hf.set_attn_implementation(attn_implementation)
    keep_apart(model, attn_implementation)
    return model


def keep_apart(model: torch.nn.Module, attn_implementation: str | None = None) -> None:
    """What a model under a padfree attention gets (``attn_implementation``, default its config's), in place
    and idempotent: the boundary keywords of its calls watched (:func:`watch_rows`), how its layers use the
    mask read (:func:`remember_plan`) and, under ``padfree_varlen``, its token mixers run per document
    (:func:`padfree.torch.documents.mixers.keep_documents_apart`). Under any other attention: nothing."""
    from padfree.torch.documents.mixers import keep_documents_apart

    name = attn_implementation or getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not str(name).startswith("padfree_"):
        return
    remember_plan(model)
    watch_rows(model)
    if name == NAME:
        keep_documents_apart(model)


# ----------------------------------------------------------------------------------------------------------
# kernels: q, k, v are (1, H, T, D) with documents back to back along T; each returns (T, H, D).
# 4-D on purpose: PyTorch's fused CPU kernel (flash) only takes 4-D inputs; 3-D falls back to the math path.


def _doc_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float | None,
    dropout: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one document (1, H, L, D) -> (1, H, L, D); ``sinks`` (H,) are attention-sink
    logits (gpt-oss): one more softmax column per head that takes probability mass and gives no value."""
    n = q.shape[2]
    gqa = q.shape[1] != k.shape[1]
    mask = None
    if window is not None and n > window:
        i = torch.arange(n, device=q.device)
        diff = i[:, None] - i[None, :]
        mask = (diff >= 0) & (diff < window)
    if softcap is None and sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=gqa
        )
    # soft-capped logits and sinks are not SDPA features: explicit scores, one document at a time
    if gqa:
        k, v = common.repeat_heads(q, k, v)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(1, scores.shape[1], n, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = torch.nn.functional.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


def _per_document(q, k, v, lengths, scaling, dropout, window, softcap, sinks=None) -> torch.Tensor:
    if len(lengths) == 1:
        return _doc_attention(q, k, v, scaling, dropout, window, softcap, sinks)[0].transpose(0, 1)
    outs = [
        _doc_attention(qi, ki, vi, scaling, dropout, window, softcap, sinks)[0].transpose(0, 1)
        for qi, ki, vi in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True)
    ]
    return torch.cat(outs, dim=0)


def _flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=8)
def _param_names(fn) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a readable signature
        return frozenset()


def varlen_call(fn, scaling: float | None, window: int | None, gqa: bool) -> tuple[dict, bool] | None:
    """How to ask ``fn`` (PyTorch's ``varlen_attn``) for causal attention, as its signature allows:
    ``(keyword arguments, repeat_kv)``, or ``None`` when this version cannot express the call.

    The keywords moved between releases: torch 2.10 took ``is_causal``, 2.11 takes ``window_size`` (causal
    is ``(-1, 0)``) and ``scale`` but no ``enable_gqa``, later ones add ``enable_gqa``. Without it,
    grouped-query heads are repeated (``repeat_kv``) so that every query head has its own key/value head.

    >>> def torch_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None,
    ...                window_size=(-1, -1)):
    ...     pass
    >>> varlen_call(torch_2_11, None, None, gqa=True)
    ({'window_size': (-1, 0)}, True)
    >>> def torch_2_10(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, is_causal=False, scale=None):
    ...     pass
    >>> varlen_call(torch_2_10, 0.125, None, gqa=False)
    ({'scale': 0.125, 'is_causal': True}, False)
    >>> varlen_call(torch_2_10, None, 4096, gqa=False) is None  # no sliding window there
    True
    """
    names = _param_names(fn)
    kwargs: dict = {}
    if scaling is not None:
        if "scale" not in names:
            return None
        kwargs["scale"] = scaling
    if "window_size" in names:
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    elif "is_causal" in names and window is None:
        kwargs["is_causal"] = True
    else:
        return None
    repeat_kv = False
    if gqa:
        if "enable_gqa" in names:
            kwargs["enable_gqa"] = True
        else:
            repeat_kv = True
    return kwargs, repeat_kv


def _varlen_ok(
    fn, kwargs: dict, repeat_kv: bool, like: torch.Tensor, heads: int, kv_heads: int
) -> str | None:
    """``None`` when ``fn(**kwargs)`` runs forward and backward on this device and dtype and matches
    per-document SDPA on a small packed row; else why not. Checked once per setup (cached in ``_probed``)."""
    key = (
        str(like.device),
        like.dtype,
        heads,
        kv_heads,
        like.shape[-1],
        repr(sorted(kwargs.items())),
        repeat_kv,
    )
    if key in _probed:
        return _probed[key]
    why = None
    try:
        with torch.inference_mode(False), torch.enable_grad():
            gen = torch.Generator(device=like.device).manual_seed(0)
            lengths = [5, 11]
            shape = (1, heads, sum(lengths), like.shape[-1])
            kv_shape = (1, kv_heads, sum(lengths), like.shape[-1])
            q = torch.randn(shape, generator=gen, device=like.device, dtype=like.dtype).requires_grad_()
            k = torch.randn(kv_shape, generator=gen, device=like.device, dtype=like.dtype).requires_grad_()
            v = torch.randn(kv_shape, generator=gen, device=like.device, dtype=like.dtype).requires_grad_()
            cu = torch.tensor([0, 5, 16], dtype=torch.int32, device=like.device)
            out = _call_varlen(fn, kwargs, repeat_kv, q, k, v, cu, max(lengths))
            out.float().sum().backward()
            if q.grad is None or k.grad is None or not torch.isfinite(q.grad).all():
                why = "no usable gradient"
            else:
                scale = kwargs.get("scale")
                window = kwargs.get("window_size", (-1, 0))[0]
                ref = _per_document(
                    q.detach(),
                    k.detach(),
                    v.detach(),
                    lengths,
                    scale,
                    0.0,
                    None if window < 0 else window + 1,
                    None,
                )
                err = (out.detach().float() - ref.float()).abs().max().item()
                if not err <= 5e-2:
                    why = f"differs from per-document SDPA by {err:.3g}"
    except Exception as exc:  # an unsupported GPU, dtype or head size: fall back, say why
        why = _reason(exc)
    _probed[key] = why
    return why


def _call_varlen(fn, kwargs: dict, repeat_kv: bool, q, k, v, cu: torch.Tensor, max_len: int) -> torch.Tensor:
    """q (1, Hq, T, D), k/v (1, Hkv, T, D) -> (T, Hq, D) through torch's varlen_attn."""
    if repeat_kv:
        k, v = common.repeat_heads(q, k, v)
    qt, kt, vt = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))  # (T, H, D)
    return fn(qt, kt, vt, cu, cu, max_len, max_len, **kwargs)


_probed: dict[tuple, str | None] = {}


def _reason(exc: Exception) -> str:
    first = str(exc).strip().splitlines()[:1]
    return f"{type(exc).__name__}: {first[0][:120]}" if first else type(exc).__name__


def _gpu_varlen(
    q, k, v, bounds: Boundaries, scaling, dropout, window, softcap
) -> tuple[torch.Tensor | None, str]:
    """(T, H, D) output from a fused varlen kernel and the path taken, or ``(None, why not)`` when none
    applies to these inputs (the caller then runs per-document SDPA). Never raises for a kernel that this
    torch or GPU lacks: torch's ``varlen_attn`` is probed once per setup (forward, backward and a comparison
    with per-document SDPA) and skipped, with the reason, when the probe fails."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return None, f"fused varlen kernels need fp16/bf16, q is {str(q.dtype).removeprefix('torch.')}"
    cu, max_len = bounds.cu_seqlens(device=q.device), bounds.max_length
    left = -1 if window is None else window - 1
    if _flash_attn_available():
        from flash_attn import flash_attn_varlen_func

        qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))  # (T, H, D)
        out = flash_attn_varlen_func(
            qt,
            kt,
            vt,
            cu,
            cu,
            max_len,
            max_len,
            dropout_p=dropout,
            softmax_scale=scaling,
            causal=True,
            window_size=(left, 0),
            softcap=0.0 if softcap is None else softcap,
        )
        return out, "flash_attn varlen (GPU)"
    fn = _torch_varlen()
    if fn is None:
        return None, "torch has no torch.nn.attention.varlen"
    if softcap is not None or dropout > 0:
        return None, "torch varlen_attn has no soft-capping or dropout"
    call = varlen_call(fn, scaling, window, q.shape[1] != k.shape[1])
    if call is None:
        return None, "torch varlen_attn of this version cannot express the call"
    why = _varlen_ok(fn, call[0], call[1], q, q.shape[1], k.shape[1])
    if why is not None:
        return None, f"torch varlen_attn unusable: {why}"
    try:
        out = _call_varlen(fn, call[0], call[1], q, k, v, cu, max_len)
    except Exception as exc:  # e.g. an input size the kernel rejects: fall back for this call
        return None, f"torch varlen_attn failed: {_reason(exc)}"
    return out, "torch varlen_attn (GPU)"


# ----------------------------------------------------------------------------------------------------------
# the transformers entry points


def varlen_attention(call: Call) -> torch.Tensor:
    """``padfree_varlen`` on a call: ``query`` (B, Hq, T, D), ``key``/``value`` (B, Hkv, T, D) -> output
    (B, T, Hq, D) (``(output, None)`` from :data:`varlen_attention_forward`, the transformers attention
    interface). Documents never see each other; padded batches go to ``sdpa``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    query, key, value, kwargs = call.query, call.key, call.value, call.kwargs
    batch, _, q_len, _ = query.shape
    unread = sorted(k for k, v in kwargs.items() if k in UNAPPLIED and v is not None)
    if unread:
        names = ", ".join(f"`{k}`" for k in unread)
        raise ConfigError(
            f"padfree_varlen: {type(call.module).__name__} passes {names} to its attention, which padfree's "
            "attention does not apply (a bias, sinks or scores of the model's own): train this model with "
            "--strategy bucketed"
        )
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(call.module, "is_causal", True) if is_causal is None else is_causal
    if call.mask is not None or not is_causal or key.shape[2] != q_len:
        row = read_boundaries(kwargs, batch, q_len, who=NAME)
        packed = row is not None and row.packed
        if packed:
            require_prepared(call.module, NAME)
        if key.shape[2] != q_len and packed:
            raise ConfigError(
                f"padfree_varlen: a packed row (cu_seq_lens_q / restarting position_ids) cannot use cached "
                f"keys ({key.shape[2]} keys for {q_len} queries: cached, compressed or another sequence's); "
                "call the model with use_cache=False for packed training, or train this model padded"
            )
        _state.path = (
            "sdpa with the model's own mask, kept to each document (its pattern needs one)"
            if call.mask is not None and key.shape[2] == q_len and packed
            else "sdpa (padded batch or cached decoding)"
        )
        sdpa_args = (call.module, query, key, value, call.mask, call.dropout, call.scaling)
        return sdpa_attention_forward(*sdpa_args, softcap=call.softcap, **kwargs)[0]
    sinks, softcap, window = call.sinks, call.softcap, call.window
    if kwargs.get("output_attentions"):
        raise ConfigError(
            "padfree_varlen: output_attentions is not supported; use attn_implementation='eager'"
        )

    bounds = attention_boundaries(call.module, kwargs, batch, q_len, NAME)
    query, key, value = _autocast_inputs(query, key, value)
    if batch == 1:
        q, k, v = query, key, value
    else:  # documents never cross rows: flatten rows into one long row
        q, k, v = (x.transpose(0, 1).reshape(1, x.shape[1], -1, x.shape[3]) for x in (query, key, value))
    out, why = None, None
    if q.is_cuda and sinks is None:
        out, path = _gpu_varlen(q, k, v, bounds, call.scaling, call.dropout, window, softcap)
        if out is None:
            why = path
        else:
            _state.path = path
    if out is None:
        device = "GPU" if q.is_cuda else "CPU"
        kind = (
            "eager soft-capped"
            if softcap is not None
            else "eager with sinks"
            if sinks is not None
            else "SDPA"
        )
        _state.path = f"per-document {kind} ({device}" + (f"; {why})" if why else ")")
        out = _per_document(q, k, v, list(bounds.spans), call.scaling, call.dropout, window, softcap, sinks)
    return out.reshape(batch, q_len, *out.shape[1:])


varlen_attention_forward = common.interface(varlen_attention, "varlen_attention_forward")

UNAPPLIED = frozenset(
    {"position_bias", "sinks", "indices", "topk_indices", "attention_bias", "attn_bias", "alibi", "score_mod"}
)
"""Keywords of an attention call that carry a term of the model's own attention which padfree's attention
does not apply (a learned position bias, Inkling's ``sinks``, a sparse indexer's ``indices``...): refused,
never dropped. (``s_aux`` sinks, windows and soft-capping are applied. Other keywords reach attention only in
passing, e.g. ``num_items_in_batch``; the sweep's comparison with the model's own attention catches a term
this list misses.)"""


def _autocast_inputs(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under ``torch.autocast``, q/k/v in the autocast dtype, as autocast itself treats SDPA. Needed because
    they arrive mixed: rotary embeddings multiply the bf16 projections by float32 cos/sin (the residual stream
    stays float32), so q and k come back float32 while v is bf16, and a fused kernel would be skipped."""
    dev = xs[0].device.type
    if not torch.is_autocast_enabled(dev):
        return xs
    dtype = torch.get_autocast_dtype(dev)
    return tuple(x if x.dtype == dtype else x.to(dtype) for x in xs)


def varlen_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers mask interface for ``padfree_varlen``: no dense mask for an unpadded row whose pattern
    padfree's attention keeps itself (causal, or a sliding window the layer passes as ``sliding_window``; the
    attention function finds document boundaries itself); else the ``sdpa`` mask, which is the model's own
    pattern exactly (block-diagonal over the row's documents, windows, chunks, overlays), handed to ``sdpa``:
    padded batches, cached decoding, chunked attention (Llama-4), windows only the mask carries (Qwen2-MoE,
    PhiMoE), overlays (image tokens, bidirectional blocks), and models that apply the mask in their own code
    instead of calling the attention function unchanged with it (Bloom, XGLM, GPT-NeoX-Japanese, Doge): there
    no mask would mean attention to future tokens."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    plain = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == 0 and kv_offset == 0
    plan = plan_of(kwargs.get("config"))
    if attention_mask is None and q_length == kv_length and plain:
        fn = kwargs.get("mask_function")
        kwargs["mask_function"] = _with_documents(fn, batch_size, q_length, kwargs.get("device", "cpu"))
    if plan is None or not plan.plain:  # the model's own code reads the mask: its eager form, always there
        return eager_mask(
            batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask, **kwargs
        )
    if attention_mask is None and q_length == kv_length and plain:
        if plan.keeps(mask_pattern(kwargs.get("mask_function"))[0]):
            return None
        kwargs["allow_is_causal_skip"] = False  # a pattern only the mask carries: it must exist
    return sdpa_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask, **kwargs
    )


def _with_documents(fn: Any, batch: int, length: int, device: Any = "cpu") -> Any:
    """``fn`` restricted to the documents of the packed row in progress (:func:`watch_rows`) when it does not
    keep them apart itself (a model that builds its mask without ``position_ids``), positions counted from
    each document's start as transformers does for packed rows; ``fn`` otherwise."""
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        packed_sequence_mask_function,
        remap_positions_for_packed_sequence,
    )

    fn = causal_mask_function if fn is None else fn
    rows = getattr(_state, "rows", None)
    source = rows[-1] if rows else None
    if not source or _read_mask(fn)[2]:
        return fn
    bounds = read_boundaries(source, batch, length, who=NAME)
    if bounds is None or not bounds.packed or not bounds.covers(batch, length):
        return fn
    doc = bounds.seq_idx(device).reshape(batch, length)
    pos = bounds.position_ids(device).reshape(batch, length)
    return and_masks(remap_positions_for_packed_sequence(fn, pos), packed_sequence_mask_function(doc))


def watch_rows(model: torch.nn.Module) -> None:
    """Keep the boundary keywords of ``model``'s call in progress
    (:func:`padfree.torch.documents.boundaries.row_keywords`, read by the one reader only when a dense mask
    needs them)
    for :func:`varlen_mask`, in place and idempotent."""
    if getattr(model, "_padfree_rows", False):
        return

    def enter(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        rows = getattr(_state, "rows", None)
        if rows is None:
            rows = _state.rows = []
        source = row_keywords(kwargs)  # kept as they came: read only where a mask needs them
        rows.append(source if source else (rows[-1] if rows else None))

    def leave(module: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        rows = getattr(_state, "rows", None)
        if rows:
            rows.pop()

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)
    model._padfree_rows = True  # type: ignore[assignment]


def mask_pattern(fn: Any) -> tuple[str, int | None]:
    """What a transformers mask function asks for, read from its closures: ``("causal", None)``,
    ``("window", w)``, ``("chunk", c)`` (each restricted to the row's documents when packed), or
    ``("other", None)`` for anything padfree does not read (bidirectional, overlays, an unknown function).

    >>> from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    >>> mask_pattern(causal_mask_function), mask_pattern(sliding_window_causal_mask_function(8))
    (('causal', None), ('window', 8))
    >>> mask_pattern(lambda b, h, q, kv: q >= kv)
    ('other', None)
    """
    kind, size, _ = _read_mask(fn)
    return kind, size


def _read_mask(fn: Any) -> tuple[str, int | None, bool]:
    """:func:`mask_pattern` and whether the function already keeps the row's documents apart (transformers
    detected the packed row from ``position_ids``)."""
    if fn is None:
        return "causal", None, False
    causal, window, chunk, docs, todo = False, None, None, False, [fn]
    while todo:
        f = todo.pop()
        code = getattr(f, "__code__", None)
        name = getattr(f, "__qualname__", "")
        cells = (
            dict(zip(code.co_freevars, (c.cell_contents for c in f.__closure__ or ()), strict=True))
            if code
            else {}
        )
        if name == "causal_mask_function":
            causal = True
        elif name.startswith("sliding_window_overlay."):
            window = int(cells["sliding_window"])
        elif name.startswith("chunked_overlay."):
            chunk = int(cells["chunk_size"])
        elif name.startswith("packed_sequence_mask_function."):
            docs = True
        elif name.startswith("remap_positions_for_packed_sequence."):
            todo.append(cells["mask_function"])
        elif name.startswith("and_masks."):
            todo.extend(cells["mask_functions"])
        else:
            return "other", None, docs
    if not causal or (window is not None and chunk is not None):
        return "other", None, docs
    if chunk is not None:
        return "chunk", chunk, docs
    return ("window", window, docs) if window is not None else ("causal", None, docs)


@dataclass(frozen=True)
class MaskPlan:
    """How a model's attention layers use the mask transformers builds for them: ``plain``: every attention
    layer hands the mask it receives, unchanged, to the registered attention function (so ``None`` is safe:
    padfree's attention keeps causality and documents itself); ``windows``: those layers also pass
    ``sliding_window`` to it (so a window mask may be left out too)."""

    plain: bool
    windows: bool
    why: str = ""

    def keeps(self, kind: str) -> bool:
        """Whether padfree's attention reproduces a mask of ``kind`` without it."""
        return self.plain and (kind == "causal" or (kind == "window" and self.windows))


_plans: dict[int, tuple[weakref.ref, MaskPlan]] = {}

SELF_MASKING = frozenset({"BloomAttention", "XGLMAttention", "GPTNeoXJapaneseAttention", "DogeAttention"})
"""Attention classes that apply the model's mask in their own code (or derive another one from it)."""


def plan_of(config: Any) -> MaskPlan | None:
    """The :class:`MaskPlan` of the model built with ``config`` (``None``: a model padfree never saw)."""
    hit = _plans.get(id(config))
    return hit[1] if hit is not None and hit[0]() is config else None


@functools.lru_cache(maxsize=1024)
def _forward_source(cls: Any) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (TypeError, OSError, AttributeError):
        return ""


_CALL = re.compile(r"attention_interface\((?P<args>[^()]*(?:\([^()]*\)[^()]*)*)\)", re.S)


# ``attention_mask = <something else>`` in a forward (a keyword argument line ``attention_mask=...,`` is not;
# nor is cross-attention's ``attention_mask = encoder_attention_mask``)
_REASSIGNED = re.compile(r"^\s*attention_mask\s*=(?!=)(?!\s*encoder_attention_mask\s*$)(?!.*,\s*$)", re.M)


def plan_model(model: torch.nn.Module) -> MaskPlan:
    """Read ``model``'s attention classes (their source) for :class:`MaskPlan`: conservative, so that
    anything unsure keeps the dense mask (exact, slower)."""
    dispatch, windows = 0, True
    classes: set[Any] = {type(m) for m in model.modules()}
    for cls in classes:
        if cls.__name__ in SELF_MASKING:
            return MaskPlan(False, False, f"{cls.__name__} applies the mask itself")
        src = _forward_source(cls)
        calls = list(_CALL.finditer(src))
        if not calls:
            continue
        for c in calls:
            args = c.group("args")
            passes = re.search(r"(^|,)\s*attention_mask\s*(,|$)", args) or re.search(
                r"attention_mask\s*=\s*attention_mask\b", args
            )
            if not passes or _REASSIGNED.search(src):
                return MaskPlan(False, False, f"{cls.__name__} hands the attention function another mask")
            windows = windows and "sliding_window" in args
        dispatch += 1
    if not dispatch:
        return MaskPlan(False, False, "no layer calls the registered attention function")
    return MaskPlan(True, windows)


def needs_mask(model: torch.nn.Module) -> str | None:
    """Why ``model``'s packed rows need a dense mask under padfree's attention (a mask it applies itself, a
    window or chunk only the mask carries), in words; ``None`` when per-document attention keeps its pattern
    with no mask (what sharded attention, SP and CP, requires)."""
    cfg: Any = getattr(model, "config", None)
    plan = plan_of(cfg)
    if plan is None:
        return "padfree never saw the model built, so it cannot tell how its layers use the mask"
    if not plan.plain:
        return plan.why
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    kinds = set(getattr(text, "layer_types", None) or ())
    if "chunked_attention" in kinds or getattr(text, "attention_chunk_size", None):
        return "chunked attention, which only the mask carries"
    window = getattr(text, "sliding_window", None)
    sliding = any("sliding" in str(k) for k in kinds) or (
        window and not kinds and getattr(text, "use_sliding_window", True) is not False
    )
    if sliding and not plan.windows:
        return "a sliding window its layers do not pass to the attention function (only the mask carries it)"
    return None


def remember_plan(model: Any) -> None:
    """Record :func:`plan_model` for ``model``'s config (and each inner model's), for :func:`varlen_mask` and
    chunked training's mask function."""
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is None or not hasattr(mod, "post_init"):
            continue
        _plans[id(cfg)] = (weakref.ref(cfg, functools.partial(_forget, id(cfg))), plan_model(mod))


def _forget(key: int, _ref: object) -> None:
    _plans.pop(key, None)


def leaky_attention(call: Call) -> torch.Tensor:
    """A deliberately WRONG implementation (``padfree_leaky``) for testing leak detectors such as
    ``padfree check-packing``: plain causal attention over the whole row (the leaky control), so
    every document of a packed row sees the ones before it. Never train with it."""
    query, key = call.query, call.key
    gqa = query.shape[1] != key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, call.value, dropout_p=call.dropout, is_causal=True, scale=call.scaling, enable_gqa=gqa
    )
    _state.path = "causal SDPA over the whole row (deliberately leaky)"
    return out.transpose(1, 2)


leaky_attention_forward = common.interface(leaky_attention, "leaky_attention_forward")


def register() -> bool:
    """Register ``padfree_varlen`` (and the test-only ``padfree_leaky``) with transformers' attention and mask
    interfaces, and :func:`keep_apart` every model built with a padfree attention (idempotent; what is
    patched: the module doc). Returns ``False`` when transformers is not installed."""
    global _registered
    if _registered:
        return True
    if not common.register({NAME: varlen_attention_forward, LEAKY: leaky_attention_forward}, varlen_mask):
        return False
    _install_on_build()
    _registered = True
    return True


_BUILD_STEPS = ("post_init", "set_attn_implementation", "set_use_kernels", "reset_kernels")
"""The ``PreTrainedModel`` methods after which a model may newly run under a padfree attention (built, loaded,
switched) or have its mixers' forward put back by the ``kernels`` library (``kernelize()`` on every
``train()`` / ``eval()`` switch of a loaded model)."""


def _install_on_build() -> None:
    """After each of :data:`_BUILD_STEPS`, :func:`keep_apart` the model: one built, loaded or switched to a
    padfree attention is exact on PackCollator's batch with nothing more to call; any other is left as it
    is."""
    from transformers import PreTrainedModel

    for name in _BUILD_STEPS:
        method = getattr(PreTrainedModel, name, None)
        if method is not None and not getattr(method, "_padfree_then_apart", False):
            setattr(PreTrainedModel, name, _then_apart(method))


def _then_apart(method: Any) -> Any:
    @functools.wraps(method)
    def then_apart(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        keep_apart(self)
        return out

    then_apart._padfree_then_apart = True  # type: ignore[attr-defined]
    return then_apart


def attention_implementation(strategy: str) -> str:
    """The ``attn_implementation`` to build a transformers model with for ``strategy``: ``"padfree_varlen"``
    for packed rows (registered on the way), ``"sdpa"`` for padded strategies, and ``"sdpa"`` for packed rows
    too when transformers cannot take a custom attention (it then builds a block mask from the restarting
    ``position_ids``: correct, slower)."""
    return attention_for_rows(attn_for(strategy) == NAME)


register()
