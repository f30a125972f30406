"""Loss normalized by the loss-bearing tokens of the whole optimizer step, so gradient accumulation over
micro-batches of any size, on any number of ranks, gives exactly the full-batch token mean.

Definition: a *loss-bearing token* is a label position ``t >= 1`` of a document whose label is not -100 (the
collators set every document's first label to -100; with all tokens as labels a document of ``L`` tokens has
``L - 1``). For a step with ``T`` such tokens on all ranks, each micro-batch contributes
``sum of its token losses / T``; under DDP, which *averages* gradients over ``W`` ranks, multiply by ``W``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from padfree.torch.execution.distributed import all_reduce_sum
from padfree.torch.feed.collate import IGNORE


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the labels that are not -100 (logits at ``t`` predict
    ``labels[t+1]``), computed in float32 or better. The labels are shifted, not the logits (no copy of
    the largest tensor)."""
    target = F.pad(labels[:, 1:].to(logits.device), (0, 1), value=IGNORE)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


def source_loss_sums(
    logits: torch.Tensor, labels: torch.Tensor, source_ids: torch.Tensor, n_sources: int
) -> torch.Tensor:
    """Per-source sums of next-token cross-entropy and the tokens they count, shape ``(2, n_sources)``: row 0
    the loss sums, row 1 the loss-bearing tokens (a label's source is the source of its position, from the
    collators' ``batch.source_ids``). For logging and DoReMi-style reweighting: computed without gradient
    (one more cross-entropy over the logits), so the training loss is unchanged. Sum over micro-batches and
    ranks, then divide row 0 by row 1 for each source's mean loss.

    >>> logits = torch.zeros(1, 4, 3)
    >>> sums = source_loss_sums(logits, torch.tensor([[-100, 1, -100, 2]]), torch.tensor([[0, 0, 1, 1]]), 2)
    >>> sums[1].tolist(), round(sums[0, 0].item() / sums[1, 0].item(), 4)  # ln 3 each
    ([1.0, 1.0], 1.0986)
    """
    with torch.no_grad():
        target = F.pad(labels[:, 1:].to(logits.device), (0, 1), value=IGNORE).reshape(-1)
        src = F.pad(source_ids[:, 1:].to(logits.device), (0, 1), value=-1).reshape(-1)
        flat = logits.detach().reshape(-1, logits.shape[-1])
        if flat.dtype in (torch.float16, torch.bfloat16):
            flat = flat.float()
        keep = (target != IGNORE) & (src >= 0)
        losses = F.cross_entropy(flat[keep], target[keep], reduction="none").double()
        out = torch.zeros(2, n_sources, dtype=torch.float64, device=logits.device)
        out[0].index_add_(0, src[keep], losses)
        out[1].index_add_(0, src[keep], torch.ones_like(losses))
    return out


def step_loss(loss_sum: torch.Tensor, step_tokens: float, world_size: int = 1) -> torch.Tensor:
    """The micro-batch's share of the step loss: ``loss_sum * world_size / step_tokens`` (``world_size``
    undoes DDP's gradient averaging). ``step_tokens`` is the step's denominator on all ranks: its loss-bearing
    tokens, or what a drafter recipe divides by (a weight sum). A step with none contributes 0."""
    den = float(step_tokens)
    return loss_sum * (world_size / den if den > 0 else 0.0)


def global_loss_tokens(batches: list, device: torch.device | str = "cpu", shared: int = 1) -> int:
    """Fallback when the plan does not know a step's token count: count ``labels != -100`` over this rank's
    micro-batches of the step and all-reduce (every rank must call it, once per step). ``shared``: how many
    ranks hold the same rows (``sp * cp``: the ranks of a sequence- or context-parallel group each hold the
    whole row), whose counts the sum holds that many times."""
    local = sum(int((b["labels"] != IGNORE).sum()) for b in batches)
    return int(all_reduce_sum(local, device).item()) // max(shared, 1)
