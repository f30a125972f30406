"""PyTorch / torch.distributed integration (the ``torch`` extra): a resumable, elastic batch sampler,
collators for padded and packed micro-batches, step-normalized loss helpers, and the step runner that runs
a micro-batch plain, chunked or sharded over an SP/CP group (:mod:`padfree.torch.runner`).

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

from padfree.torch._collate import PackCollator, PadCollator
from padfree.torch._dataset import PlannedDataset
from padfree.torch._distributed import all_reduce_sum, sync_unless
from padfree.torch._loss import global_loss_tokens, source_loss_sums, step_loss, token_loss_sum
from padfree.torch._sampler import PlanBatchSampler
from padfree.torch.runner import StepResult, StepRunner

__all__ = [
    "PackCollator",
    "PadCollator",
    "PlanBatchSampler",
    "PlannedDataset",
    "StepResult",
    "StepRunner",
    "all_reduce_sum",
    "global_loss_tokens",
    "source_loss_sums",
    "step_loss",
    "sync_unless",
    "token_loss_sum",
]
