"""A map-style dataset wrapper that hands each micro-batch's plan info to the collator.

``DataLoader`` fetches a batch with ``dataset.__getitems__(batch)`` when it exists and passes the result to
``collate_fn``; :class:`PlannedDataset` returns the items as a :class:`Fetched` list that still carries the
:class:`~padfree.torch.feed.sampler.MicroInfo` of the micro-batch.
"""

from __future__ import annotations

import warnings
from typing import Any

_planned = False  # a PlanBatchSampler exists in this process (forked DataLoader workers inherit it)
_warned = False


class Fetched(list):
    """The items of one micro-batch, with its ``.info`` (``None`` outside a plan)."""

    def __init__(self, items: list, info: object = None) -> None:
        super().__init__(items)
        self.info = info

    def __reduce__(self):
        return (Fetched, (list(self), self.info))


class PlannedDataset:
    """Wraps any map-style dataset (``dataset[i]`` -> item) for use with a :class:`PlanBatchSampler`.

    >>> ds = PlannedDataset([{"input_ids": [1, 2]}, {"input_ids": [3]}])
    >>> ds.__getitems__([1, 0])
    [{'input_ids': [3]}, {'input_ids': [1, 2]}]
    """

    def __init__(self, dataset: Any) -> None:  # anything with dataset[i] (and len)
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> Fetched:
        getitems = getattr(self.dataset, "__getitems__", None)
        items = list(getitems(list(indices))) if getitems else [self.dataset[i] for i in indices]
        return Fetched(items, getattr(indices, "info", None))


def note_sampler() -> None:
    """Called by every :class:`~padfree.torch.PlanBatchSampler`: micro-batches of a plan are in use."""
    global _planned
    _planned = True


def warn_if_unplanned(items: object) -> None:
    """Warn once when a collator gets a micro-batch that did not come through a :class:`PlannedDataset`
    while a plan is in use: its ``batch.info`` is None, and a loop that reads ``info.last`` or
    ``info.step_tokens`` would fail later with an unrelated error."""
    global _warned
    if _planned and not _warned and not isinstance(items, Fetched):
        _warned = True
        warnings.warn(
            "padfree: a micro-batch reached the collator without its plan info (batch.info is None): wrap "
            "the dataset as DataLoader(PlannedDataset(dataset), batch_sampler=sampler, ...)",
            stacklevel=3,
        )
