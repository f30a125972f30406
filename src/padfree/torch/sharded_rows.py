"""padfree's own SP / CP in a training loop: each rank of a group runs its shard of the group's packed row.

One class serves both :class:`padfree.hf.PadfreeTrainer` and the plain loop (``examples/train.py
--sp/--cp``): consecutive ranks ``sp * cp`` at a time form a group that shares one data-parallel rank's
micro-batches (:class:`~padfree.torch.PlanBatchSampler` with ``dp_rank`` / ``dp_size``); each runs its
shard of the row (Ulysses :mod:`padfree.torch.sequence_parallel` or zigzag
:mod:`padfree.torch.context_parallel` attention) and scores it against the row's shifted labels. Summed
over the group (DDP's all-reduce times the world size, as :func:`padfree.torch.step_loss` does), the shards'
gradients are the unsharded row's.
"""

from __future__ import annotations

from typing import Any

import torch

from padfree.core.config import PlanConfig
from padfree.errors import ConfigError


class ShardedRows:
    """The group of this rank and how it shards a row (see the module doc). Builds one process group per
    data-parallel rank (every rank creates every group, in the same order) and switches ``model`` to the
    sharded attention."""

    def __init__(self, model: Any, plan_config: PlanConfig, rank: int, world: int) -> None:
        import torch.distributed as dist

        from padfree.torch import context_parallel as cpm
        from padfree.torch import sequence_parallel as spm

        sp, cp = plan_config.sp, plan_config.cp
        if sp > 1 and cp > 1:
            raise ConfigError(f"padfree SP and CP together (sp={sp}, cp={cp}) are not supported: use one")
        if not plan_config.packed or plan_config.chunked:
            raise ConfigError(
                f"padfree SP/CP shards packed rows: use strategy 'packed' (got {plan_config.strategy!r})"
            )
        spm.check_shardable(model, sp, cp)
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("padfree SP/CP needs torch.distributed (launch with torchrun or accelerate)")
        self.size = sp * cp
        if world % self.size:
            raise ConfigError(
                f"padfree SP/CP: sp x cp = {self.size} processes share each micro-batch, but the world size "
                f"is {world}: launch a multiple of {self.size} (torchrun --nproc_per_node ...)"
            )
        self.rank = rank % self.size
        self.dp_rank, self.dp_size = rank // self.size, world // self.size
        groups = [dist.new_group(list(range(s, s + self.size))) for s in range(0, world, self.size)]
        self.group = groups[rank // self.size]
        self.shard = spm.shard_sp if sp > 1 else cpm.shard_cp
        self.loss_of = spm.shard_loss_sum
        model.set_attn_implementation(spm.NAME if sp > 1 else cpm.NAME)

    def loss_sum(self, model: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Run this rank's shard of the packed row ``batch`` through ``model`` (inside the group): the sum of
        its token losses, its labels (the row's shifted ones, -100: none) and the model's outputs."""
        from padfree.torch.collectives import shard_group

        shard = self.shard(batch, self.rank, self.size)
        labels = shard.pop("shift_labels")
        with shard_group(self.group):
            outputs = model(**shard, use_cache=False)
        return self.loss_of(outputs.logits, labels), labels, outputs

    def loss(self, model: Any, inputs: Any, num_items_in_batch: Any) -> tuple[torch.Tensor, Any]:
        """The Trainer's loss of this rank's shard: its token losses over ``num_items_in_batch`` (the step's
        loss tokens; else this shard's own)."""
        total, labels, outputs = self.loss_sum(model, inputs)
        den = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum().clamp(min=1)
        return total / den, outputs


__all__ = ["ShardedRows"]
