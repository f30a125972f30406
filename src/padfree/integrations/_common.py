"""What both trainer adapters share: a planned batch of indices that carries its epoch through a DataLoader,
per-document anchors laid out in a row, and the drafter cost model a plan balances ranks with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from padfree.core.anchors import AnchorPolicy, choose_anchors
from padfree.core.config import CostModel
from padfree.drafter import methods
from padfree.drafter.recipes import Recipe
from padfree.errors import ConfigError


@dataclass(frozen=True)
class BatchInfo:
    """Where a planned micro-batch comes from: its epoch, its step (this rank's micro-batch number in the
    epoch) and its sample ids (``indices``), which :class:`padfree.torch.PlannedDataset` hands to the collate
    function beside the items."""

    epoch: int
    step: int
    indices: np.ndarray


class PlannedBatch(list):
    """A micro-batch's sample ids (a list, as a batch sampler yields) that also carries its :class:`BatchInfo`
    through DataLoader workers (pickled with it)."""

    def __init__(self, ids: Sequence[int] | np.ndarray, info: BatchInfo) -> None:
        super().__init__(int(i) for i in ids)
        self.info = info

    def __reduce__(self):
        return (PlannedBatch, (list(self), self.info))


def doc_anchors(
    mask: np.ndarray,
    starts: Sequence[int] | np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    sample_ids: Sequence[int] | np.ndarray,
    *,
    policy: AnchorPolicy,
    seed: int,
    epoch: int,
) -> np.ndarray:
    """The anchors of every document of a flat row (positions in the row), each chosen from the document's own
    loss mask and (seed, epoch, sample id): what the document gets alone."""
    out = [
        choose_anchors(mask[s : s + n], policy, seed=seed, epoch=epoch, sample_id=int(sid)) + s
        for s, n, sid in zip(starts, lengths, sample_ids, strict=True)
    ]
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)


def drafter_cost(recipe: Recipe, **shape: int) -> CostModel:
    """The drafter cost model padfree balances ranks with (:func:`padfree.drafter.methods.cost_model`) for
    ``recipe``'s method, block size and ttt; ``shape``: the target's sizes (``hidden``, ``layers``,
    ``vocab``)."""
    return methods.cost_model(recipe.method, block_size=recipe.block_size, ttt=recipe.ttt, **shape)


def check_rank(rank: int, world_size: int) -> None:
    for name, v, low in (("world size", world_size, 1), ("rank", rank, 0)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < low:
            raise ConfigError(f"{name} must be an integer >= {low} (got {v!r})")
    if rank >= world_size:
        raise ConfigError(f"rank {rank} outside world size {world_size}")
