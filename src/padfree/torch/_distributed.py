"""The little torch.distributed glue a training loop needs: who am I, skip the gradient all-reduce on all but
the last micro-batch of a step, and sum a number over ranks."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(rank: int | None = None, world_size: int | None = None, default_world: int = 1):
    """``(rank, world_size)``: given values win, then ``torch.distributed`` when initialized, else
    ``(0, default_world)``."""
    if is_distributed():
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    return (0 if rank is None else int(rank)), (default_world if world_size is None else int(world_size))


def sync_unless(model: torch.nn.Module, last: bool):
    """A context for one micro-batch's backward: ``model.no_sync()`` unless ``last`` (or not DDP), so
    gradients are all-reduced once per optimizer step."""
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    ddp: Any = model  # DistributedDataParallel (or anything with no_sync)
    return ddp.no_sync()


def all_reduce_sum(value: float | int | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Sum of ``value`` over all ranks (``value`` itself when not distributed), as a float64 tensor."""
    t = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
