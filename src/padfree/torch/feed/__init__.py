"""Feeding the loader: this rank's micro-batches of a plan or of a stream (the samplers), the dataset that
hands each its plan info, the collators that make model inputs of them, measured balance, and the
step-normalized loss."""

from __future__ import annotations

from typing import TYPE_CHECKING

from padfree.torch._face import lazy_names

if TYPE_CHECKING:
    from padfree.torch.feed.balance import balance_summary
    from padfree.torch.feed.collate import Batch, PackCollator, PadCollator, packed_layout
    from padfree.torch.feed.dataset import PlannedDataset
    from padfree.torch.feed.loss import global_loss_tokens, source_loss_sums, step_loss, token_loss_sum
    from padfree.torch.feed.sampler import PlanBatchSampler
    from padfree.torch.feed.streamed import Stream, StreamBatchSampler, StreamDataset

_WHERE = {
    "Batch": "padfree.torch.feed.collate",
    "PackCollator": "padfree.torch.feed.collate",
    "PadCollator": "padfree.torch.feed.collate",
    "PlanBatchSampler": "padfree.torch.feed.sampler",
    "PlannedDataset": "padfree.torch.feed.dataset",
    "Stream": "padfree.torch.feed.streamed",
    "StreamBatchSampler": "padfree.torch.feed.streamed",
    "StreamDataset": "padfree.torch.feed.streamed",
    "balance_summary": "padfree.torch.feed.balance",
    "global_loss_tokens": "padfree.torch.feed.loss",
    "packed_layout": "padfree.torch.feed.collate",
    "source_loss_sums": "padfree.torch.feed.loss",
    "step_loss": "padfree.torch.feed.loss",
    "token_loss_sum": "padfree.torch.feed.loss",
}
"""Where each name of this face is defined: it is imported on first use, so importing one module of
the room does not import the others."""

__all__ = [
    "Batch",
    "PackCollator",
    "PadCollator",
    "PlanBatchSampler",
    "PlannedDataset",
    "Stream",
    "StreamBatchSampler",
    "StreamDataset",
    "balance_summary",
    "global_loss_tokens",
    "packed_layout",
    "source_loss_sums",
    "step_loss",
    "token_loss_sum",
]


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
