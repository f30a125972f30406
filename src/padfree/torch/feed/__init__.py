"""Feeding the loader: this rank's micro-batches of a plan or of a stream (the samplers), the dataset that
hands each its plan info, the collators that make model inputs of them, measured balance, and the
step-normalized loss."""

from __future__ import annotations

from typing import TYPE_CHECKING

from padfree.torch._face import lazy_names

# the names for type checkers (``X as X`` re-exports X); at run time each is imported on first use (below)
if TYPE_CHECKING:
    from padfree.torch.feed.balance import balance_summary as balance_summary
    from padfree.torch.feed.collate import Batch as Batch
    from padfree.torch.feed.collate import PackCollator as PackCollator
    from padfree.torch.feed.collate import PadCollator as PadCollator
    from padfree.torch.feed.collate import packed_layout as packed_layout
    from padfree.torch.feed.dataset import PlannedDataset as PlannedDataset
    from padfree.torch.feed.loss import global_loss_tokens as global_loss_tokens
    from padfree.torch.feed.loss import source_loss_sums as source_loss_sums
    from padfree.torch.feed.loss import step_loss as step_loss
    from padfree.torch.feed.loss import token_loss_sum as token_loss_sum
    from padfree.torch.feed.sampler import PlanBatchSampler as PlanBatchSampler
    from padfree.torch.feed.streamed import Stream as Stream
    from padfree.torch.feed.streamed import StreamBatchSampler as StreamBatchSampler
    from padfree.torch.feed.streamed import StreamDataset as StreamDataset

__getattr__, __dir__, __all__ = lazy_names(
    __name__,
    {  # module of this room -> the names it defines, imported on first use
        "balance": ("balance_summary",),
        "collate": ("Batch", "PackCollator", "PadCollator", "packed_layout"),
        "dataset": ("PlannedDataset",),
        "loss": ("global_loss_tokens", "source_loss_sums", "step_loss", "token_loss_sum"),
        "sampler": ("PlanBatchSampler",),
        "streamed": ("Stream", "StreamBatchSampler", "StreamDataset"),
    },
)
