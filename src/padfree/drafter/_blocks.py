"""Building blocks the reference drafters share: RMSNorm, rotary embeddings, SwiGLU MLP, masked attention
(dense boolean mask through SDPA on any device, or a flex-attention BlockMask on GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class DrafterConfig:
    """The config fields every reference drafter has, as its checkpoints keep them, filled from the run's
    :class:`~padfree.drafter.sizes.Sizes` (:meth:`~padfree.drafter.sizes.Sizes.drafter_config`;
    ``hidden_size`` is the target's; ``head_size`` the width of one attention head, None: ``hidden_size //
    num_heads``); each method's config adds its own (DFlash: layers, block size, target layers; EAGLE-3:
    test-time-training steps)."""

    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-6
    head_size: int | None = None

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (Llama / Qwen3 style), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class QKNormAttention(nn.Module):
    """A module holding a Qwen3 decoder layer's attention weights (DFlash's layers, MTP's layer)."""

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    q_norm: RMSNorm
    k_norm: RMSNorm

    def add_attention(self, cfg: DrafterConfig) -> None:
        """Create the attention of ``cfg``'s sizes, in this order: ``q_proj``, ``k_proj``, ``v_proj``,
        ``o_proj`` (no bias) and the per-head ``q_norm``, ``k_norm``."""
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.eps)
        self.k_norm = RMSNorm(d, cfg.eps)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x`` ``(H, N, D)`` at integer ``positions`` ``(N,)`` (rotate-half convention)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    half = d // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """``q`` ``(Hq, Nq, D)``, ``k``/``v`` ``(Hkv, Nk, D)`` -> ``(Nq, Hq * D)``. ``mask``: a dense boolean
    ``(Nq, Nk)`` (True: attend; SDPA, forward and backward on CPU) or a flex-attention ``BlockMask``."""
    if q.shape[1] == 0:  # no draft query (e.g. a document without a valid anchor)
        return q.new_zeros(0, q.shape[0] * q.shape[2])
    if isinstance(mask, torch.Tensor):
        out = nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask[None, None], enable_gqa=q.shape[0] != k.shape[0]
        )[0]
    else:
        gqa = q.shape[0] != k.shape[0]
        out = _flex(q.device)(q[None], k[None], v[None], block_mask=mask, enable_gqa=gqa)[0]
    return out.transpose(0, 1).reshape(q.shape[1], -1)


_COMPILED: dict[str, object] = {}


def _flex(device: torch.device):
    """flex attention: compiled once per process on a GPU (its fused kernel; eager flex attention there
    materialises every score), eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _COMPILED:
        _COMPILED["cuda"] = torch.compile(flex_attention, dynamic=True)
    return _COMPILED["cuda"]
