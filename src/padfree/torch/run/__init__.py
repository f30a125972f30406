"""A training run around the steps: micro-batches grouped into steps, one run id, checkpoints owned by one
run and resumed on every rank, and an end together with the launcher (SIGTERM only at a step boundary)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from padfree.torch._face import lazy_names

if TYPE_CHECKING:
    from padfree.torch.run.checkpoint import CheckpointDir
    from padfree.torch.run.lifecycle import StopOnSignal, die_with_parent, launched_by_torchrun
    from padfree.torch.run.loop import check_resume, run_id, steps_of

_WHERE = {
    "CheckpointDir": "padfree.torch.run.checkpoint",
    "StopOnSignal": "padfree.torch.run.lifecycle",
    "check_resume": "padfree.torch.run.loop",
    "die_with_parent": "padfree.torch.run.lifecycle",
    "launched_by_torchrun": "padfree.torch.run.lifecycle",
    "run_id": "padfree.torch.run.loop",
    "steps_of": "padfree.torch.run.loop",
}
"""Where each name of this face is defined: it is imported on first use, so importing one module of
the room does not import the others."""

__all__ = [
    "CheckpointDir",
    "StopOnSignal",
    "check_resume",
    "die_with_parent",
    "launched_by_torchrun",
    "run_id",
    "steps_of",
]


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
