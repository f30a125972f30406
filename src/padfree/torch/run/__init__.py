"""A training run around the steps: micro-batches grouped into steps, one run id, checkpoints owned by one
run and resumed on every rank, and an end together with the launcher (SIGTERM only at a step boundary)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from padfree.torch._face import lazy_names

# the names for type checkers (``X as X`` re-exports X); at run time each is imported on first use (below)
if TYPE_CHECKING:
    from padfree.torch.run.checkpoint import CheckpointDir as CheckpointDir
    from padfree.torch.run.lifecycle import StopOnSignal as StopOnSignal
    from padfree.torch.run.lifecycle import die_with_parent as die_with_parent
    from padfree.torch.run.lifecycle import launched_by_torchrun as launched_by_torchrun
    from padfree.torch.run.loop import check_resume as check_resume
    from padfree.torch.run.loop import run_id as run_id
    from padfree.torch.run.loop import steps_of as steps_of

__getattr__, __dir__, __all__ = lazy_names(
    __name__,
    {  # module of this room -> the names it defines, imported on first use
        "checkpoint": ("CheckpointDir",),
        "lifecycle": ("StopOnSignal", "die_with_parent", "launched_by_torchrun"),
        "loop": ("check_resume", "run_id", "steps_of"),
    },
)
