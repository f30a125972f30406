"""A chunk's exact attention over earlier chunks' keys/values, block by block: no mask, no copy of the past.

Chunked training (:mod:`padfree.torch.execution.chunked`) runs a chunk of ``T`` queries over the keys and
values of the
``P`` tokens before it and its own. Handing them to ``sdpa`` costs, besides the keys/values themselves, a
``T x (P + T)`` mask, a concatenated copy of the past that attention saves for its backward, and that copy's
gradient: memory that grows with the document. Here the past stays as it is kept, one block per earlier
chunk, and the softmax is merged across blocks online (flash-attention's log-sum-exp rule); the backward
recomputes each block's scores from the saved log-sum-exp, so what attention keeps for its backward is the
chunk's queries, output and log-sum-exp, and at any moment one ``T x block`` score matrix per head::

    out = sum_j softmax-weights(q K_j^T) V_j      blocks j: earlier chunks (all visible), then the chunk's own
                                                  (causal); m, l: running max and sum of exp per query

During a chunked forward, :func:`past_blocks` says which blocks each layer reads, and the model runs with
``attn_implementation`` :data:`NAME` (registered with transformers by :func:`register`; its mask function
builds no mask).

>>> import torch
>>> q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
>>> out = block_attention(q, [(k[:, :, :2], v[:, :, :2]), (k[:, :, 2:], v[:, :, 2:])], 0.5)
>>> ref = torch.nn.functional.scaled_dot_product_attention(
...     q, k.expand(1, 2, 5, 4), v.expand(1, 2, 5, 4), torch.ones(3, 5).tril(2).bool(), scale=0.5)
>>> torch.allclose(out, ref, atol=1e-6)
True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from padfree.errors import ConfigError
from padfree.torch.documents.interface import Call, interface, repeat_heads
from padfree.torch.documents.interface import register as register_attention

NAME = "padfree_chunk"
"""The attention implementation a chunked forward runs under (only inside :func:`past_blocks`)."""

Block = tuple[torch.Tensor, torch.Tensor]
"""One block's ``(key, value)``, each ``(1, kv_heads, tokens, head_dim)``."""

_state = threading.local()


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, t: int, causal: bool) -> torch.Tensor:
    """``(Hkv, G*T, n)`` scores of grouped queries ``(Hkv, G*T, D)`` (query ``t`` of every group head at rows
    ``t, T+t, ...``) over keys ``(Hkv, n, D)``; the last block (``causal``) masks keys after each query (its
    ``n`` keys end where the queries end)."""
    s = torch.matmul(q, k.to(q.dtype).transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        after = torch.ones(t, n, dtype=torch.bool, device=s.device).triu_(n - t + 1)
        s = s.masked_fill(after.repeat(s.shape[1] // t, 1), float("-inf"))
    return s


def _wide(dtype: torch.dtype) -> torch.dtype:
    """What the softmax accumulates in: float32, or float64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, scale: float, *flat: torch.Tensor) -> torch.Tensor:
        hkv = flat[0].shape[1]
        _, hq, t, d = q.shape
        qg = q.to(_wide(q.dtype)).reshape(hkv, hq // hkv * t, d)
        m = qg.new_full((*qg.shape[:-1], 1), float("-inf"))
        total = qg.new_zeros(m.shape)
        acc = torch.zeros_like(qg)
        n_blocks = len(flat) // 2
        for j in range(n_blocks):
            k, v = flat[2 * j][0], flat[2 * j + 1][0]
            s = _scores(qg, k, scale, t, causal=j == n_blocks - 1)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            alpha = torch.exp(m - m_new)
            total = total * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, v.to(p.dtype))
            m = m_new
            del s, p
        out = acc / total
        lse = m + torch.log(total)
        ctx.scale, ctx.t = scale, t
        ctx.save_for_backward(q, out, lse, *flat)
        return out.reshape(1, hq, t, d).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, out, lse, *flat = ctx.saved_tensors
        scale, t = ctx.scale, ctx.t
        qg = q.to(out.dtype).reshape(out.shape)
        dout = grad_out.to(out.dtype).reshape(out.shape)
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qg)
        grads: list[torch.Tensor | None] = []
        n_blocks = len(flat) // 2
        for j in range(n_blocks):
            k, v = flat[2 * j], flat[2 * j + 1]
            p = torch.exp(_scores(qg, k[0], scale, t, causal=j == n_blocks - 1) - lse)
            dv = torch.matmul(p.transpose(-1, -2), dout)  # the group's heads summed by the product
            ds = p * (torch.matmul(dout, v[0].to(p.dtype).transpose(-1, -2)) - delta)
            del p
            dq += torch.matmul(ds, k[0].to(ds.dtype)) * scale
            dk = torch.matmul(ds.transpose(-1, -2), qg) * scale
            del ds
            grads += [dk[None].to(k.dtype), dv[None].to(v.dtype)]
        return (dq.reshape(q.shape).to(q.dtype), None, *grads)


class _FusedBlockAttention(torch.autograd.Function):
    """The same on CPU with torch's fused flash-attention kernel per block: the blocks' outputs merged by
    their log-sum-exp, and each block's backward given the merged output and log-sum-exp (exact: the
    probabilities it recomputes are the whole row's)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, scale: float, *flat: torch.Tensor) -> torch.Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        n_blocks = len(flat) // 2
        out: torch.Tensor | None = None
        lse = torch.empty(0)
        for j in range(n_blocks):
            k, v = repeat_heads(q, flat[2 * j], flat[2 * j + 1])  # a block-sized copy for grouped heads
            o, l_j = flash(q, k, v, 0.0, j == n_blocks - 1, scale=scale)
            if out is None:
                out, lse = o.to(_wide(q.dtype)), l_j
                continue
            merged = torch.logaddexp(lse, l_j)
            out = out * torch.exp(lse - merged)[..., None] + o * torch.exp(l_j - merged)[..., None]
            lse = merged
        assert out is not None
        out = out.to(q.dtype).contiguous()
        ctx.scale = scale
        ctx.save_for_backward(q, out, lse, *flat)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, out, lse, *flat = ctx.saved_tensors
        groups = q.shape[1] // flat[0].shape[1]
        n_blocks = len(flat) // 2
        dq = torch.zeros_like(q)
        grads: list[torch.Tensor | None] = []
        dout = grad_out.contiguous()
        for j in range(n_blocks):
            k, v = repeat_heads(q, flat[2 * j], flat[2 * j + 1])
            dq_j, dk, dv = backward(dout, q, k, v, out, lse, 0.0, j == n_blocks - 1, scale=ctx.scale)
            dq += dq_j
            if groups > 1:
                dk = dk.unflatten(1, (-1, groups)).sum(2)
                dv = dv.unflatten(1, (-1, groups)).sum(2)
            grads += [dk, dv]
        return (dq, None, *grads)


def block_attention(
    query: torch.Tensor, blocks: Sequence[Block], scale: float, fused: bool = True
) -> torch.Tensor:
    """Exact softmax attention of ``query`` ``(1, Hq, T, D)`` over ``blocks`` in order, the last one the
    queries' own (causal, its ``T`` keys ending with the queries), every earlier one wholly visible;
    returns ``(1, Hq, T, D)``. Grouped-query heads: ``Hq`` a multiple of the blocks' ``Hkv``. On CPU each
    block runs torch's fused flash kernel (``fused``), elsewhere the blocks' matrix products."""
    if query.shape[0] != 1 or not blocks or query.shape[1] % blocks[0][0].shape[1]:
        raise ConfigError(
            f"block attention takes one row, heads a multiple of the key heads (query {tuple(query.shape)})"
        )
    flat = [t for block in blocks for t in block]
    fn = _FusedBlockAttention if fused and query.device.type == "cpu" else _BlockAttention
    out: torch.Tensor = fn.apply(query, float(scale), *flat)
    return out


@contextlib.contextmanager
def past_blocks(past: Mapping[int, Sequence[Block]]) -> Iterator[set[int]]:
    """Inside: a layer whose attention runs under :data:`NAME` reads ``past[layer_idx]`` (earlier chunks'
    keys/values, oldest first) before its own; yields the set of layers that did."""
    before = getattr(_state, "past", None)
    served: set[int] = set()
    _state.past, _state.served = past, served
    try:
        yield served
    finally:
        _state.past = before


def chunk_attention(call: Call) -> torch.Tensor:
    """:data:`NAME` on a call: ``query`` (1, Hq, T, D) over the layer's earlier blocks and its own
    ``key``/``value`` (1, Hkv, T, D) -> output (1, T, Hq, D) (``(output, None)`` from
    :data:`chunk_attention_forward`, the transformers attention interface)."""
    past = getattr(_state, "past", None)
    layer = getattr(call.module, "layer_idx", None)
    if past is None or layer is None:
        raise ConfigError(f"{NAME} attention runs only inside padfree's chunked training")
    if call.dropout or call.mask is not None or call.sinks is not None or call.softcap:
        raise ConfigError(
            f"chunked training's attention takes no dropout, mask, sinks or softcap (layer {layer})"
        )
    if call.window is not None:
        raise ConfigError(f"chunked training attends to the whole past: layer {layer} has a sliding window")
    query, key = call.query, call.key
    if key.shape[2] != query.shape[2]:
        raise ConfigError(f"layer {layer}: {key.shape[2]} own keys for {query.shape[2]} queries")
    scale = call.scaling if call.scaling is not None else query.shape[-1] ** -0.5
    out = block_attention(query, [*past.get(layer, ()), (key, call.value)], scale)
    _state.served.add(layer)
    return out.transpose(1, 2).contiguous()


chunk_attention_forward = interface(chunk_attention, "chunk_attention_forward")


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of :data:`NAME`: none (every earlier block is visible, the own block causal), for a
    model whose mask is plain causal and whose layers hand it to the attention function unchanged; a window or
    chunk only the mask carries (Qwen2-MoE, PhiMoE, Llama-4), or attention that applies the mask in its own
    code (Bloom, XGLM...), is refused in one line: with no mask it would see the whole past or its future."""
    from padfree.torch.documents import attention as pa

    kind, size = pa.mask_pattern(kwargs.get("mask_function"))
    if kind != "causal":
        what = f"a {kind} of {size}" if size is not None else "a pattern padfree does not read"
        raise ConfigError(
            f"chunked training attends to the whole past: the model's mask carries {what}; train it unchunked"
        )
    plan = pa.plan_of(kwargs.get("config"))
    if plan is not None and not plan.plain:
        raise ConfigError(
            f"chunked training needs a mask this model would apply itself ({plan.why}); train it unchunked"
        )
    return None


def register() -> bool:
    """Register :data:`NAME` with transformers' attention and mask interfaces (idempotent); ``False`` when
    transformers is not installed."""
    return register_attention({NAME: chunk_attention_forward}, _no_mask)
