"""PyTorch / torch.distributed integration (the ``torch`` extra), in four rooms, each with its face:

- :mod:`padfree.torch.feed`: feeding the loader: the resumable, elastic samplers of a plan and of a stream,
  the dataset that hands each micro-batch its plan info, collators for padded and packed micro-batches,
  measured balance and the step-normalized loss;
- :mod:`padfree.torch.documents`: keeping packed documents apart inside the model: the one boundary
  reader, per-document attention and token mixers, the leak probe;
- :mod:`padfree.torch.execution`: how a micro-batch runs: the step runner (plain, a long document's chunks
  together, or sharded over an SP/CP group), the collectives and the data-parallel glue;
- :mod:`padfree.torch.run`: the run around the steps: checkpoints, run ids, how a process ends.

This face names what a training loop calls from them.

The training loop (see ``examples/train.py`` for the whole thing)::

    sampler = PlanBatchSampler(lengths, PlanConfig(strategy="packed", budget=8192, grad_accum=4),
                               loss_tokens=loss_tokens,          # rank/world from torch.distributed
                               balance="dynamic")                # optional: balance from measured times
    loader = DataLoader(PlannedDataset(dataset), batch_sampler=sampler, collate_fn=PackCollator())
    sampler.load_state_dict(saved)                               # optional: any world size, O(1)
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            info = batch.info                                    # step, micro, last, step_tokens ...
            labels = batch.pop("labels")
            with sync_unless(ddp_model, info.last), sampler.timed(ddp_model):   # compute time, no wait
                loss = token_loss_sum(ddp_model(**batch).logits, labels)
                step_loss(loss, info.step_tokens, world_size).backward()
            if info.last:
                optimizer.step(); optimizer.zero_grad()
                saved = sampler.state_dict()                     # JSON-able, O(number of resumes)

>>> import numpy as np
>>> from padfree import PlanConfig
>>> from padfree.torch import PackCollator, PlanBatchSampler, PlannedDataset
>>> data = [{"input_ids": list(range(1, n + 1))} for n in (5, 9, 3, 7, 2, 8, 4, 6)]
>>> sampler = PlanBatchSampler([len(d["input_ids"]) for d in data], PlanConfig(strategy="packed", budget=16))
>>> batch = PackCollator()(PlannedDataset(data).__getitems__(next(iter(sampler))))
>>> batch.loss_tokens == (batch["labels"] != -100).sum().item()
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from padfree.torch._face import lazy_names
from padfree.torch.execution.distributed import all_reduce_sum, sync_unless
from padfree.torch.execution.runner import StepResult, StepRunner
from padfree.torch.feed.collate import PackCollator, PadCollator
from padfree.torch.feed.dataset import PlannedDataset
from padfree.torch.feed.loss import global_loss_tokens, source_loss_sums, step_loss, token_loss_sum
from padfree.torch.feed.sampler import PlanBatchSampler

if TYPE_CHECKING:
    from padfree.torch.documents.attention import attention_implementation, prepare_for_packing
    from padfree.torch.feed.streamed import Stream, StreamBatchSampler, StreamDataset
    from padfree.torch.run.checkpoint import CheckpointDir

_LAZY = {
    "documents.attention": ("attention_implementation", "prepare_for_packing"),
    "feed.streamed": ("Stream", "StreamBatchSampler", "StreamDataset"),
    "run.checkpoint": ("CheckpointDir",),
}
"""Names loaded on first use: the attention registers with transformers when it is imported, which a loop
that never builds a transformers model should not pay for."""

__all__ = [
    "CheckpointDir",
    "PackCollator",
    "PadCollator",
    "PlanBatchSampler",
    "PlannedDataset",
    "StepResult",
    "StepRunner",
    "Stream",
    "StreamBatchSampler",
    "StreamDataset",
    "all_reduce_sum",
    "attention_implementation",
    "global_loss_tokens",
    "prepare_for_packing",
    "source_loss_sums",
    "step_loss",
    "sync_unless",
    "token_loss_sum",
]


__getattr__, __dir__, _ = lazy_names(__name__, _LAZY)  # __all__ above: these and the eager names
