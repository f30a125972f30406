"""The little torch.distributed glue a training loop needs: who am I, skip the gradient all-reduce on all but
the last micro-batch of a step, and sum a number over ranks."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from padfree.errors import ConfigError


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(rank: int | None = None, world_size: int | None = None, default_world: int = 1):
    """``(rank, world_size)``: given values win, then ``torch.distributed`` when initialized, else
    ``(0, default_world)``."""
    if is_distributed():
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    return (0 if rank is None else int(rank)), (default_world if world_size is None else int(world_size))


def data_parallel(
    rank: int | None,
    world_size: int | None,
    *,
    dp_rank: int | None = None,
    dp_size: int | None = None,
    dp_group: Any = None,
    group: int = 1,
    default_world: int = 1,
) -> tuple[int, int]:
    """``(rank, world_size)`` of the data-parallel ranks a plan's micro-batches go to, when each is a group of
    ``group`` GPUs (SP x CP) that all run the same micro-batch.

    Said explicitly by ``dp_rank`` / ``dp_size``, or ``dp_group``: a process group (the rank in it and its
    size) or a ``DeviceMesh`` (a 1-D one, or the ``"dp"`` dimension of a named one); ``rank`` /
    ``world_size`` are data-parallel too (the one meaning they have). Without them: ``torch.distributed`` when
    ``group`` is 1; with SP/CP groups a global rank does not say its group, and that is a one-line
    :class:`ConfigError`. Not distributed: ``(0, default_world)``.

    >>> data_parallel(None, None, dp_rank=1, dp_size=4, group=2)
    (1, 4)
    """
    if (rank is not None and dp_rank not in (None, rank)) or (
        world_size is not None and dp_size not in (None, world_size)
    ):
        raise ConfigError(
            f"rank/world_size ({rank}, {world_size}) and dp_rank/dp_size ({dp_rank}, {dp_size}) differ"
        )
    rank = dp_rank if dp_rank is not None else rank
    world_size = dp_size if dp_size is not None else world_size
    if dp_group is not None:
        if rank is not None or world_size is not None:
            raise ConfigError("give either dp_group or dp_rank/dp_size (rank/world_size), not both")
        rank, world_size = _group_rank(dp_group)
    elif group > 1 and is_distributed() and (rank is None or world_size is None):
        raise ConfigError(
            f"with sp x cp = {group} GPUs per micro-batch, say this rank's data-parallel place: dp_rank= and "
            "dp_size=, or dp_group= (a process group or a DeviceMesh with a 'dp' dimension)"
        )
    return rank_and_world(rank, world_size, default_world)


def _group_rank(dp_group: Any) -> tuple[int, int]:
    """``(rank, size)`` in a process group or a DeviceMesh's data-parallel dimension."""
    if hasattr(dp_group, "get_local_rank") and hasattr(dp_group, "size"):  # a DeviceMesh
        names = getattr(dp_group, "mesh_dim_names", None) or ()
        if getattr(dp_group, "ndim", 1) == 1:
            return int(dp_group.get_local_rank()), int(dp_group.size())
        if "dp" not in names:
            raise ConfigError(f"dp_group: a {dp_group.ndim}-D DeviceMesh without a 'dp' dimension ({names})")
        return int(dp_group.get_local_rank("dp")), int(dp_group.size(names.index("dp")))
    if not is_distributed():
        raise ConfigError("dp_group is a process group but torch.distributed is not initialized")
    return int(dist.get_rank(dp_group)), int(dist.get_world_size(dp_group))


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
