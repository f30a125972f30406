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
Boundaries come from the outermost model call and from each decoder layer's own keywords, through the one
reader :func:`padfree.torch.documents.boundaries.read_boundaries`; a decoder layer checkpointed by
transformers replays
in the backward pass with the boundaries its forward ran with (bound into its checkpoint, not read from the
thread), so several forwards before a backward, or a backward in another thread, split the same way.
Registering ``padfree_varlen`` (importing :mod:`padfree.torch.documents.attention`) makes every model built or
switched
to it install this by itself (:func:`padfree.torch.documents.attention.keep_apart`); no other model is
touched.

>>> import torch
>>> split_like(torch.zeros(1, 9, 4), 9, 2, 5).shape  # the (B, T, H) slice of tokens 2..4
torch.Size([1, 3, 4])
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from padfree.errors import ConfigError
from padfree.torch.documents.boundaries import Boundaries, read_boundaries

# class name -> what it is (for messages and the sweep's table). Each runs per document when a packed row
# has more than one, unless its kind has fused kernels that take ``cu_seqlens``/``seq_idx`` (KERNELS).
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

_state = threading.local()  # per thread: the stack of boundaries of the calls in progress


def _stack() -> list[Boundaries | None]:
    st = getattr(_state, "stack", None)
    if st is None:
        st = _state.stack = []
    return st


@contextlib.contextmanager
def _bounded(bounds: Boundaries | None) -> Iterator[None]:
    """``bounds`` on this thread's stack for the block (a call, or a checkpointed layer's replay)."""
    st = _stack()
    st.append(bounds)
    try:
        yield
    finally:
        st.pop()


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


def _row_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds", kwargs.get("hidden_states"))
    if x is None and args:
        x = args[0]
    return x if isinstance(x, torch.Tensor) and x.dim() >= 2 else None


def _row_shape(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    x = _row_tensor(args, kwargs)
    return None if x is None else (int(x.shape[0]), int(x.shape[1]))


_REPLAYS: OrderedDict[tuple, Boundaries | None] = OrderedDict()
"""(layer, its input's storage and shape) -> the boundaries it ran with: a layer replayed in the backward pass
by a checkpoint that re-runs its hooks finds them here (its saved input keeps that storage)."""
_REPLAYS_KEPT = 4096
_replays_lock = threading.Lock()


def _input_key(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    x = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
        return None
    return (id(module), x.device, x.data_ptr(), tuple(x.shape), x.dtype)


class _Unknown:
    """Boundaries that cannot be known: a layer replayed in the backward pass by a checkpoint padfree does not
    see, its forward's boundaries gone."""


UNKNOWN = _Unknown()


def _push_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Read this call's boundaries (:func:`padfree.torch.documents.boundaries.read_boundaries`) or inherit its
    caller's, and push them; a model's outermost call also gets positions restarting per document."""
    shape = _row_shape(args, kwargs)
    who = f"padfree: {type(module).__name__}"
    own = None if shape is None else read_boundaries(kwargs, *shape, who=who)
    bounds: Boundaries | _Unknown | None = own if own is not None and own.packed else None
    st = _stack()
    key = _input_key(module, args, kwargs) if getattr(module, "_padfree_layer", False) else None
    replay = not st and _in_backward()
    if bounds is None and st:
        bounds = st[-1]  # an inner model or a decoder layer called without boundaries inherits its caller's
    elif bounds is None and replay and key is not None:  # a layer replayed by a checkpoint that runs hooks
        with _replays_lock:
            bounds = _REPLAYS.get(key, UNKNOWN)
    if key is not None and not replay and not isinstance(bounds, _Unknown):
        with _replays_lock:
            _REPLAYS[key] = bounds
            _REPLAYS.move_to_end(key)
            while len(_REPLAYS) > _REPLAYS_KEPT:
                _REPLAYS.popitem(last=False)
    st.append(bounds)  # type: ignore[arg-type]
    if key is not None:
        _bind_checkpoint(module)
    elif not getattr(module, "_padfree_layer", False) and isinstance(own, Boundaries):
        return _restart_positions(module, args, kwargs, own)
    return None


def _restart_positions(module: torch.nn.Module, args: tuple, kwargs: dict, bounds: Boundaries):
    """A packed call (``cu_seq_lens_q``) to a model that takes ``position_ids``: none given, the positions
    restarting per document are given (each document is then at the positions it has alone); given but
    continuing across a document's start, the call is refused in one line."""
    if not bounds.packed or not bounds.covers(*(_row_shape(args, kwargs) or (0, 0))) or args[1:]:
        return None
    if "position_ids" not in _parameters(module):
        return None
    batch = bounds.rows
    want = bounds.position_ids().reshape(batch, -1)
    pos = kwargs.get("position_ids")
    if pos is None:
        x = _row_tensor(args, kwargs)
        return args, {**kwargs, "position_ids": want.to(None if x is None else x.device)}
    if isinstance(pos, torch.Tensor) and pos.dim() <= 2 and pos.shape[-1] == want.shape[-1]:
        got = pos.expand(batch, -1).reshape(-1).to("cpu", torch.int64)
        starts = torch.tensor(bounds.document_starts(), dtype=torch.int64)
        bad = torch.nonzero(got[starts] != 0).reshape(-1)
        if bad.numel():
            i = int(bad[0])
            raise ConfigError(
                f"padfree: position_ids do not restart at document {i} of cu_seq_lens_q (token "
                f"{int(starts[i])} has position {int(got[starts[i]])}): the model would place it after the "
                "documents before it; pass PackCollator's position_ids (restarting at 0), or none"
            )
    return None


_PARAMETERS: dict[type, frozenset[str]] = {}


def _parameters(module: torch.nn.Module) -> frozenset[str]:
    """The keywords the module's forward takes (per class, read once)."""
    cls = type(module)
    if cls not in _PARAMETERS:
        try:
            _PARAMETERS[cls] = frozenset(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            _PARAMETERS[cls] = frozenset()
    return _PARAMETERS[cls]


def _bind_checkpoint(layer: torch.nn.Module) -> None:
    """transformers checkpoints a decoder layer's ``forward`` inside its hooks, through the layer's
    ``_gradient_checkpointing_func``: wrap it so that the replay in the backward pass (reentrant or not, in
    any thread, after any number of other forwards) runs with the boundaries this forward ran with."""
    func = getattr(layer, "_gradient_checkpointing_func", None)
    if func is None or getattr(func, "_padfree_bounds", False):
        return

    @functools.wraps(func)
    def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        st = _stack()
        bounds = st[-1] if st else None

        def replay(*a: Any, **k: Any) -> Any:
            with _bounded(bounds):
                return function(*a, **k)

        return func(replay, *args, **kwargs)

    checkpoint._padfree_bounds = True  # type: ignore[attr-defined]
    layer._gradient_checkpointing_func = checkpoint  # type: ignore[assignment]


def _pop_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    st = _stack()
    if st:
        st.pop()


def current_boundaries() -> Boundaries | _Unknown | None:
    """The boundaries of the packed call in progress in this thread (a layer replayed in the backward pass
    under gradient checkpointing: those of the forward it replays), ``None`` outside one."""
    st = _stack()
    return st[-1] if st else None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _has_row_kwargs(kwargs: dict) -> bool:
    return kwargs.get("seq_idx") is not None or kwargs.get("cu_seq_lens_q") is not None


def attention_boundaries(
    module: torch.nn.Module, kwargs: dict, batch: int, seq: int, impl: str
) -> Boundaries:
    """The documents a ``padfree_varlen`` attention call keeps apart (the rows themselves when the call
    carries no boundaries), read by the one reader the mixers use. Refused in one line: boundaries that do not
    cover the call, ``position_ids`` of another length, and a packed row reaching a model configured with
    ``padfree_varlen`` by hand (its token mixers and positions were not set up by padfree)."""
    bounds = read_boundaries(kwargs, batch, seq, who=impl)
    pos = kwargs.get("position_ids")
    if bounds is None:
        if isinstance(pos, torch.Tensor) and pos.shape[-1] != seq:
            raise ConfigError(f"{impl}: position_ids cover {pos.shape[-1]} tokens, the row has {seq}")
        return Boundaries.whole_rows(batch, seq)
    if not bounds.covers(batch, seq):
        raise ConfigError(
            f"{impl}: document boundaries cover {bounds.total} tokens, the batch holds {batch}x{seq}"
        )
    if bounds.packed:
        require_prepared(module, impl)
    return bounds


def require_prepared(module: torch.nn.Module, impl: str) -> None:
    """Refuse in one line a packed row reaching ``module`` of a model configured with ``impl`` by hand (its
    config names it, but padfree never kept the model's documents apart: its token mixers and positions)."""
    cfg = getattr(module, "config", None)
    if getattr(cfg, "_attn_implementation", None) == impl and not getattr(module, "_padfree_apart", False):
        raise ConfigError(
            f"{impl}: {type(module).__name__} was not prepared by padfree (its config names {impl} by hand), "
            "so its token mixers and positions would run across the packed documents: build the model with "
            f"attn_implementation='{impl}' or call "
            f"padfree.torch.documents.attention.prepare_for_packing(model)"
        )


KERNELS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "short convolution": ("causal_conv1d",),
        "Mamba-2 SSD": ("causal_conv1d", "mamba_ssm"),
        "gated delta-net": ("causal_conv1d", "fla"),
        "kimi delta attention": ("causal_conv1d", "fla"),
        "gated delta attention": ("causal_conv1d", "fla"),
    }
)
"""Mixer kind (a :data:`MIXERS` value) -> the packages whose fused kernels transformers hands a packed row's
``cu_seqlens`` / ``seq_idx`` (its ``use_kernel_func_from_hub_with_fallback`` functions), so the row runs whole
and exact through them. Every other kind runs per document (a Mamba-1 selective scan takes no boundaries)."""


def fused_kernel(module: torch.nn.Module, device: torch.device | str) -> bool:
    """Whether ``module``'s kind has fused kernels (:data:`KERNELS`) that are installed and run on ``device``
    (CUDA: transformers' own availability checks), so a packed row may run through them whole."""
    key = mixer_key(module)
    packages = KERNELS.get(MIXERS[key], ()) if key is not None else ()
    return torch.device(device).type == "cuda" and bool(packages) and all(_installed(p) for p in packages)


def _installed(package: str) -> bool:
    """Whether transformers finds ``package``'s CUDA kernels installed (its own ``is_*_available``)."""
    from transformers.utils import (
        is_causal_conv1d_available,
        is_flash_linear_attention_available,
        is_mamba_2_ssm_available,
    )

    checks = {
        "causal_conv1d": is_causal_conv1d_available,
        "mamba_ssm": is_mamba_2_ssm_available,
        "fla": is_flash_linear_attention_available,
    }
    return checks[package]()


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
    name = type(module).__name__
    fused = functools.partial(fused_kernel, module)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if getattr(_state, "off", False):
            return original(*args, **kwargs)
        st = _stack()
        bounds = st[-1] if st else None
        if isinstance(bounds, _Unknown) or (not st and _in_backward()):
            raise ConfigError(
                f"padfree: {name} is recomputed in the backward pass without the document boundaries of "
                "its forward (a checkpoint wrapper padfree does not see): enable gradient checkpointing "
                "with model.gradient_checkpointing_enable()"
            )
        x = kwargs.get("hidden_states", kwargs.get("hidden", args[0] if args else None))
        alone = {k: v for k, v in kwargs.items() if k not in _ROW_KWARGS}  # one document per row
        if bounds is None or not bounds.packed or not isinstance(x, torch.Tensor) or x.dim() != 3:
            return original(*args, **alone)
        batch, seq = int(x.shape[0]), int(x.shape[1])
        if not bounds.covers(batch, seq):
            if seq == 1:
                return original(*args, **alone)  # cached decoding
            raise ConfigError(
                f"padfree: {name} runs on {batch}x{seq} tokens of a row whose documents cover "
                f"{bounds.total} (a shard of a sequence- or context-parallel row): a token mixer cannot "
                "keep documents apart on a shard; train this model without sp/cp"
            )
        if _has_row_kwargs(kwargs) and fused(x.device):  # the fused kernels keep the documents apart
            return original(*args, **{**kwargs, **_kernel_kwargs(kwargs, bounds, x.device)})
        return run_per_document(original, bounds.spans, batch, args, kwargs)

    forward._padfree_per_document = True  # type: ignore[attr-defined]
    return forward


def _kernel_kwargs(kwargs: dict, bounds: Boundaries, device: torch.device) -> dict:
    """The row keywords a fused kernel reads, all from ``bounds`` (a THD row's padded spans included)."""
    out: dict[str, Any] = {}
    if "seq_idx" in kwargs:
        out["seq_idx"] = bounds.seq_idx(device)
    for k in ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens"):
        if k in kwargs:
            out[k] = bounds.cu_seqlens(device=device)
    for k in ("max_length_q", "max_length_k"):
        if k in kwargs:
            out[k] = bounds.max_length
    return out


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
        mod._padfree_apart = True  # its attention may take packed rows (attention_boundaries)
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
