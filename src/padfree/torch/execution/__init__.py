"""How a micro-batch runs (the step runner): plain, a long document's chunks together, or a packed row sharded
over a sequence- or context-parallel group; the collectives those need and a loop's data-parallel glue."""

from __future__ import annotations

from typing import TYPE_CHECKING

from padfree.torch._face import lazy_names

if TYPE_CHECKING:
    from padfree.torch.execution.chunked import chunked_backward, run_step, step_documents
    from padfree.torch.execution.collectives import shard_group
    from padfree.torch.execution.context_parallel import shard_cp
    from padfree.torch.execution.distributed import all_reduce_sum, data_parallel, rank_and_world, sync_unless
    from padfree.torch.execution.runner import StepResult, StepRunner
    from padfree.torch.execution.sequence_parallel import check_shardable, shard_sp

_WHERE = {
    "StepResult": "padfree.torch.execution.runner",
    "StepRunner": "padfree.torch.execution.runner",
    "all_reduce_sum": "padfree.torch.execution.distributed",
    "check_shardable": "padfree.torch.execution.sequence_parallel",
    "chunked_backward": "padfree.torch.execution.chunked",
    "data_parallel": "padfree.torch.execution.distributed",
    "rank_and_world": "padfree.torch.execution.distributed",
    "run_step": "padfree.torch.execution.chunked",
    "shard_cp": "padfree.torch.execution.context_parallel",
    "shard_group": "padfree.torch.execution.collectives",
    "shard_sp": "padfree.torch.execution.sequence_parallel",
    "step_documents": "padfree.torch.execution.chunked",
    "sync_unless": "padfree.torch.execution.distributed",
}
"""Where each name of this face is defined: it is imported on first use, so importing one module of
the room does not import the others."""

__all__ = [
    "StepResult",
    "StepRunner",
    "all_reduce_sum",
    "check_shardable",
    "chunked_backward",
    "data_parallel",
    "rank_and_world",
    "run_step",
    "shard_cp",
    "shard_group",
    "shard_sp",
    "step_documents",
    "sync_unless",
]


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
