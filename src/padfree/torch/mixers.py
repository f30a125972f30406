"""Per-document token mixers: convolutions, recurrences, linear attention that never cross a packed boundary.

``padfree_varlen`` keeps *attention* inside each document of a packed row. Hybrid and recurrent models mix
tokens elsewhere too: LFM2's short convolutions, Mamba / Mamba-2 mixers (Jamba, Bamba, Nemotron-H, Falcon-H1,
Granite-4), gated delta-nets (Qwen3.5, Qwen3-Next, Kimi-Linear), MiniMax's lightning attention, RWKV's
time and channel mixing, RecurrentGemma's RG-LRU. Run over a whole packed row, each of them carries the end of
one document into the start of the next, silently. Here every such module runs once per document instead::

    packed row      [ a a a a | b b | c c c ]        position_ids 0 1 2 3 0 1 0 1 2
    mixer input     (1, 9, H) ──split──> (1,4,H) (1,2,H) (1,3,H)
    mixer output    (1, 9, H) <──concat── each piece mixed alone (its state starts at zero)

Which modules mix is a table (:data:`MIXERS`: class names, or ``family.Class`` where a name is too plain),
filled from ``padfree check-packing --all-families``, which localises a leak to the module that causes it.
Boundaries come from the outermost model call (``cu_seq_lens_q`` or restarting ``position_ids``) and from
each decoder layer's own keywords, so a layer recomputed under gradient checkpointing splits the same way.
Importing :mod:`padfree.torch.attention`
makes every model built or switched to ``attn_implementation="padfree_varlen"`` install this by itself.

>>> import torch
>>> split_like(torch.zeros(1, 9, 4), 9, 2, 5).shape  # the (B, T, H) slice of tokens 2..4
torch.Size([1, 3, 4])
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from padfree.errors import ConfigError
from padfree.torch.boundaries import lengths_from_cu, lengths_from_position_ids

# class name -> what it is (for messages and the sweep's table). Each runs per document when a packed row
# has more than one; a fast kernel that takes ``cu_seqlens``/``seq_idx`` itself is listed in KERNELS.
MIXERS: dict[str, str] = {
    "Lfm2ShortConv": "short convolution",
    "Lfm2MoeShortConv": "short convolution",
    "Lfm3ShortConv": "short convolution",
    "MambaMixer": "Mamba selective scan",
    "FalconMambaMixer": "Mamba selective scan",
    "JambaMambaMixer": "Mamba selective scan",
    "Mamba2Mixer": "Mamba-2 SSD",
    "BambaMixer": "Mamba-2 SSD",
    "NemotronHMamba2Mixer": "Mamba-2 SSD",
    "GraniteMoeHybridMambaLayer": "Mamba-2 SSD",
    "FalconH1Mixer": "Mamba-2 SSD",
    "ZambaMambaMixer": "Mamba selective scan",
    "Zamba2MambaMixer": "Mamba-2 SSD",
    "Qwen3NextGatedDeltaNet": "gated delta-net",
    "Qwen3_5GatedDeltaNet": "gated delta-net",
    "Qwen3_5MoeGatedDeltaNet": "gated delta-net",
    "OlmoHybridGatedDeltaNet": "gated delta-net",
    "LaraMiniGatedDeltaNet": "gated delta-net",
    "KimiLinearDeltaAttention": "kimi delta attention",
    "BailingHybridDeltaAttention": "gated delta attention",
    "InklingShortConvolution": "short convolution",
    "Inkling2ShortConvolution": "short convolution",
    "Inkling2DynamicShortConvolution": "short convolution",
    "ZayaCCAProjection": "convolved attention projections",
    "MiniMaxLightningAttention": "lightning attention",
    "RwkvSelfAttention": "RWKV time mixing",
    "RwkvFeedForward": "RWKV channel mixing (token shift)",
    "RecurrentGemmaRecurrentBlock": "RG-LRU recurrence",
    "xLSTMBlock": "mLSTM recurrence",
    "BloomAttention": "ALiBi attention over the row's causal mask",
    "openai.Attention": "attention over the row's causal mask",  # openai-gpt's class is plainly "Attention"
    "GPTNeoXJapaneseAttention": "attention over the row's causal mask",
    "XGLMAttention": "attention over the row's causal mask",
    "DogeAttention": "dynamic-mask attention over the row",
    "CpmAntAttention": "position-bias attention over the row",
}

_state = threading.local()


def _stack() -> list[list[int] | None]:
    s = getattr(_state, "stack", None)
    if s is None:
        s = _state.stack = []
    return s


def split_like(x: Any, total: int, start: int, end: int, batch: int = 1, row: int = 0) -> Any:
    """The tokens ``start:end`` of ``x`` when ``x`` is laid out along a packed row of ``total`` tokens
    (hidden states ``(B, T, ...)``, ids ``(B, T)``, a ``(B, 1, T, T)`` mask, an ALiBi ``(B*H, 1, T)`` bias, a
    ``(T,)`` cache position), recursing into tuples and lists; anything else is returned as it is."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            return x
        rows = slice(row, row + 1) if batch > 1 and x.shape[0] == batch else slice(None)
        if x.dim() == 1:
            return x[start:end] if x.shape[0] == total else x
        if x.dim() == 4 and x.shape[-2:] == (total, total):
            return x[rows, :, start:end, start:end]
        if x.dim() == 3 and x.shape[1] == 1 and x.shape[-1] == total and x.shape[0] != batch:
            return x[:, :, start:end]  # ALiBi (B*H, 1, T): one row at a time only (checked by the caller)
        if x.shape[1] == total:
            return x[rows, start:end]
        return x[rows] if rows != slice(None) else x
    if isinstance(x, tuple | list):
        return type(x)(split_like(v, total, start, end, batch, row) for v in x)
    return x


def _cat(parts: Sequence[Any], lengths: Sequence[int]) -> Any:
    """The per-document outputs joined back along the row: tensors whose dim 1 is each document's length are
    concatenated, anything else (a bias, attention weights, ``None``) is the first document's."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        along_row = all(
            isinstance(p, torch.Tensor) and p.dim() >= 2 and p.shape[1] == n
            for p, n in zip(parts, lengths, strict=True)
        )
        return torch.cat(list(parts), dim=1) if along_row else first
    if isinstance(first, tuple | list):
        return type(first)(_cat([p[i] for p in parts], lengths) for i in range(len(first)))
    return first


# keywords that describe the whole packed row: a document alone gets its own, or none
_ROW_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens")


def run_per_document(
    forward: Callable[..., Any], lengths: Sequence[int], batch: int, args: tuple, kwargs: dict
) -> Any:
    """``forward(*args, **kwargs)`` once per document of a packed row (documents back to back along dim 1,
    ``lengths`` over the ``batch`` rows flattened), outputs concatenated back in order."""
    total = sum(lengths) // batch
    kwargs = {k: v for k, v in kwargs.items() if k not in _ROW_KWARGS}
    pieces, row, pos = [], 0, 0
    outs_by_row: list[list[Any]] = [[] for _ in range(batch)]
    lens_by_row: list[list[int]] = [[] for _ in range(batch)]
    for n in lengths:
        if pos + n > total:
            raise ConfigError(f"padfree: a document of {n} tokens crosses a row end at {pos} of {total}")
        a = tuple(split_like(v, total, pos, pos + n, batch, row) for v in args)
        kw = {k: split_like(v, total, pos, pos + n, batch, row) for k, v in kwargs.items()}
        if "position_ids" in kw and isinstance(kw["position_ids"], torch.Tensor):
            kw["position_ids"] = kw["position_ids"] - kw["position_ids"].reshape(-1)[0]
        outs_by_row[row].append(forward(*a, **kw))
        lens_by_row[row].append(n)
        pos += n
        if pos == total:
            row, pos = row + 1, 0
    for outs, lens in zip(outs_by_row, lens_by_row, strict=True):
        pieces.append(_cat(outs, lens) if len(outs) > 1 else outs[0])
    if batch == 1:
        return pieces[0]
    first = pieces[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(pieces, dim=0)
    return type(first)(
        torch.cat([p[i] for p in pieces], dim=0) if isinstance(p0, torch.Tensor) else p0
        for i, p0 in enumerate(first)
    )


def lengths_of(kwargs: dict, batch: int, seq: int) -> list[int] | None:
    """Document lengths of a packed call (``cu_seq_lens_q``, else restarting ``position_ids``), or ``None``
    when the call carries neither (one document per row)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        lengths = lengths_from_cu(cu)
    else:
        pos = kwargs.get("position_ids")
        if not isinstance(pos, torch.Tensor) or pos.shape[-1] != seq or pos.dim() > 2:
            return None
        lengths = lengths_from_position_ids(pos.expand(batch, -1) if pos.dim() == 2 else pos)
    if len(lengths) <= batch or sum(lengths) != batch * seq:
        return None
    return lengths


def _row_shape(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds", kwargs.get("hidden_states"))
    if x is None and args:
        x = args[0]
    if isinstance(x, torch.Tensor) and x.dim() >= 2:
        return int(x.shape[0]), int(x.shape[1])
    return None


def _push_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    shape = _row_shape(args, kwargs)
    lengths = None if shape is None else lengths_of(kwargs, *shape)
    stack = _stack()
    outer = stack[-1] if stack else None
    if lengths is None and outer is not None and (shape is None or sum(outer) == shape[0] * shape[1]):
        lengths = outer  # an inner model or a decoder layer called without boundaries inherits its caller's
    if not stack:
        _state.last = lengths  # kept after the pass: a checkpointed layer recomputed in backward finds it
    stack.append(lengths)


def _pop_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    stack = _stack()
    if stack:
        stack.pop()


def current_lengths() -> list[int] | None:
    """The document lengths of the packed call in progress (or, in the backward pass, of the last one: a layer
    recomputed under gradient checkpointing), ``None`` outside one."""
    stack = _stack()
    if stack:
        return stack[-1]
    return getattr(_state, "last", None) if _in_backward() else None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _has_row_kwargs(kwargs: dict) -> bool:
    return kwargs.get("seq_idx") is not None or kwargs.get("cu_seq_lens_q") is not None


KERNEL_PATH: dict[str, bool] = {}
"""Mixer class -> whether transformers' fused kernel took the packed row whole on the GPU (``True``: exact
through the kernel, as the leak probe checks on the device; ``False``: no kernel here, per document)."""


@contextlib.contextmanager
def per_document_mixers(on: bool = True) -> Iterator[None]:
    """Within the block, token mixers run per document (``on``, the default everywhere) or over the whole
    packed row as transformers runs them (``on=False``: to measure what the per-document path costs or closes,
    never to train)."""
    before = getattr(_state, "off", False)
    _state.off = not on
    try:
        yield
    finally:
        _state.off = before


def _per_document_forward(module: torch.nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if getattr(_state, "off", False):
            return original(*args, **kwargs)
        lengths = current_lengths()
        x = kwargs.get("hidden_states", kwargs.get("hidden", args[0] if args else None))
        alone = {k: v for k, v in kwargs.items() if k not in _ROW_KWARGS}  # one document per row
        if lengths is None or not isinstance(x, torch.Tensor) or x.dim() != 3:
            return original(*args, **alone)
        batch, seq = int(x.shape[0]), int(x.shape[1])
        if sum(lengths) != batch * seq:
            if seq == 1 or not _in_backward():
                return original(*args, **alone)  # cached decoding, or another model's call
            raise ConfigError(
                f"padfree: {type(module).__name__} recomputed on a row of {batch}x{seq} tokens while the "
                f"packed boundaries cover {sum(lengths)}: run each forward's backward before the next forward"
            )
        if len(lengths) == batch:
            return original(*args, **alone)
        if x.is_cuda and KERNEL_PATH.get(type(module).__name__) is not False and _has_row_kwargs(kwargs):
            try:  # transformers' own fused kernel keeps documents apart from cu_seqlens / seq_idx
                out = original(*args, **kwargs)
                KERNEL_PATH[type(module).__name__] = True
                return out
            except ValueError as exc:  # "can't keep packed sequences apart without <kernel>"
                if "packed sequences apart" not in str(exc):
                    raise
                KERNEL_PATH[type(module).__name__] = False
        return run_per_document(original, lengths, batch, args, kwargs)

    forward._padfree_per_document = True  # type: ignore[attr-defined]
    return forward


def keep_documents_apart(model: torch.nn.Module, names: Sequence[str] | None = None) -> list[str]:
    """Make every token mixer of ``model`` (the classes in :data:`MIXERS`, or ``names``) run once per document
    of a packed row, in place and idempotent; returns the qualified names of the modules it wraps.

    Boundaries are read at the outermost module call and at each decoder layer
    (``GradientCheckpointingLayer``) from ``cu_seq_lens_q`` or restarting ``position_ids``, PackCollator's
    layout."""
    wanted = set(MIXERS if names is None else names)
    wrapped: list[str] = []
    if not getattr(model, "_padfree_bounds", False):
        model.register_forward_pre_hook(_push_hook, with_kwargs=True)
        model.register_forward_hook(_pop_hook, with_kwargs=True, always_call=True)
        model._padfree_bounds = True  # type: ignore[assignment]
    for qname, mod in model.named_modules():
        if mixer_key(mod) in wanted or type(mod).__name__ in wanted:
            if not getattr(mod.forward, "_padfree_per_document", False):  # also after `kernels` reset it
                mod.forward = _per_document_forward(mod, mod.forward)
                mod._padfree_per_document = True
            wrapped.append(qname)
        elif _is_layer(mod) and not getattr(mod, "_padfree_bounds", False):
            mod._padfree_layer = True
            mod.register_forward_pre_hook(_push_hook, with_kwargs=True)
            mod.register_forward_hook(_pop_hook, with_kwargs=True, always_call=True)
            mod._padfree_bounds = True
    return wrapped


def mixer_key(mod: torch.nn.Module) -> str | None:
    """The :data:`MIXERS` key of ``mod`` (``family.Class`` first, then the bare class name), or ``None``."""
    cls = type(mod).__name__
    family = type(mod).__module__.rsplit(".", 1)[-1].removeprefix("modeling_")
    for key in (f"{family}.{cls}", cls):
        if key in MIXERS:
            return key
    return None


def _is_layer(mod: torch.nn.Module) -> bool:
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(mod).__mro__)


def mixers_of(model: torch.nn.Module) -> dict[str, str]:
    """The token mixers of ``model`` that run per document: qualified module name -> what it is."""
    keys = {q: mixer_key(m) for q, m in model.named_modules()}
    return {q: MIXERS[k] for q, k in keys.items() if k is not None}
