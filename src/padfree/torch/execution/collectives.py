"""Autograd-aware all-to-all and all-gather for sharded attention, and the group a sharded forward uses.

Sequence and context parallel attention (:mod:`padfree.torch.execution.sequence_parallel`,
:mod:`padfree.torch.execution.context_parallel`) exchange activations between the ranks of one SP/CP group
inside the
model's forward pass, so the exchange must carry gradients back: the backward of an all-to-all is the reverse
all-to-all, the backward of an all-gather a reduce-scatter (done here as an all-to-all and a sum, which gloo
has). Both run on gloo (CPU) as on NCCL. The group is set around the forward pass with :func:`shard_group`,
which is how the attention functions, called by transformers with no room for a group argument, find it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from padfree.errors import ConfigError

_state = threading.local()


@dataclass(frozen=True)
class Group:
    """The ranks that share one micro-batch's row: ``group`` (``None``: the default group), this rank's
    place ``rank`` in it and its ``size``."""

    group: Any
    rank: int
    size: int


@contextlib.contextmanager
def shard_group(group: Any = None) -> Iterator[Group]:
    """Within the block, sharded attention exchanges with the ranks of ``group`` (a
    ``torch.distributed`` process group; ``None``: the default one). Needs an initialized process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("sharded attention needs torch.distributed initialized (init_process_group)")
    g = Group(group, dist.get_rank(group), dist.get_world_size(group))
    before = getattr(_state, "group", None)
    _state.group = g
    try:
        yield g
    finally:
        _state.group = before


def current(who: str) -> Group:
    """The group set by :func:`shard_group`, or a :class:`ConfigError` saying that ``who`` needs one."""
    g = getattr(_state, "group", None)
    if g is None:
        raise ConfigError(
            f"{who}: run the forward pass inside padfree.torch.execution.collectives.shard_group(group)"
        )
    return g


def _exchange(chunks: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """Chunk ``j`` goes to rank ``j``; returns what every rank sent here, in rank order."""
    chunks = [c.contiguous() for c in chunks]
    out = [torch.empty_like(c) for c in chunks]
    dist.all_to_all(out, chunks, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, split_dim: int, cat_dim: int, group: Any, size: int) -> torch.Tensor:
        ctx.dims, ctx.group, ctx.size = (split_dim, cat_dim), group, size
        return torch.cat(_exchange(list(x.chunk(size, split_dim)), group), dim=cat_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split_dim, cat_dim = ctx.dims
        back = torch.cat(_exchange(list(grad.chunk(ctx.size, cat_dim)), ctx.group), dim=split_dim)
        return back, None, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Any, size: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.size = dim, group, size
        out = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.cat(out, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # reduce-scatter: every rank's gradient for this rank's piece, summed
        pieces = _exchange(list(grad.chunk(ctx.size, ctx.dim)), ctx.group)
        return torch.stack(pieces).sum(0), None, None, None


def all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, g: Group) -> torch.Tensor:
    """``x`` cut into ``g.size`` equal pieces along ``split_dim``, piece ``j`` sent to rank ``j``, the pieces
    received concatenated along ``cat_dim`` in rank order; differentiable (the backward is the reverse)."""
    if x.shape[split_dim] % g.size:
        raise ConfigError(
            f"all_to_all: dimension {split_dim} of size {x.shape[split_dim]} is not a multiple of {g.size}"
        )
    if g.size == 1:
        return x
    return _AllToAll.apply(x, split_dim, cat_dim, g.group, g.size)


def all_gather(x: torch.Tensor, dim: int, g: Group) -> torch.Tensor:
    """Every rank's ``x`` (equal shapes) concatenated along ``dim`` in rank order; differentiable (each
    rank's gradient for its piece is the sum of every rank's)."""
    if g.size == 1:
        return x
    return _AllGather.apply(x, dim, g.group, g.size)
