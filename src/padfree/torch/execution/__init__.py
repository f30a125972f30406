"""How a micro-batch runs (the step runner): plain, a long document's chunks together, or a packed row sharded
over a sequence- or context-parallel group; the collectives those need and a loop's data-parallel glue."""

from __future__ import annotations

from typing import TYPE_CHECKING

from padfree.torch._face import lazy_names

# the names for type checkers (``X as X`` re-exports X); at run time each is imported on first use (below)
if TYPE_CHECKING:
    from padfree.torch.execution.chunked import chunked_backward as chunked_backward
    from padfree.torch.execution.chunked import run_step as run_step
    from padfree.torch.execution.chunked import step_documents as step_documents
    from padfree.torch.execution.collectives import shard_group as shard_group
    from padfree.torch.execution.context_parallel import shard_cp as shard_cp
    from padfree.torch.execution.distributed import all_reduce_sum as all_reduce_sum
    from padfree.torch.execution.distributed import data_parallel as data_parallel
    from padfree.torch.execution.distributed import rank_and_world as rank_and_world
    from padfree.torch.execution.distributed import sync_unless as sync_unless
    from padfree.torch.execution.runner import StepResult as StepResult
    from padfree.torch.execution.runner import StepRunner as StepRunner
    from padfree.torch.execution.sequence_parallel import check_shardable as check_shardable
    from padfree.torch.execution.sequence_parallel import shard_sp as shard_sp

__getattr__, __dir__, __all__ = lazy_names(
    __name__,
    {  # module of this room -> the names it defines, imported on first use
        "chunked": ("chunked_backward", "run_step", "step_documents"),
        "collectives": ("shard_group",),
        "context_parallel": ("shard_cp",),
        "distributed": ("all_reduce_sum", "data_parallel", "rank_and_world", "sync_unless"),
        "runner": ("StepResult", "StepRunner"),
        "sequence_parallel": ("check_shardable", "shard_sp"),
    },
)
