"""How a micro-batch runs, decided once per run: plain, whole documents in chunks, or sharded over SP/CP.

:class:`StepRunner` is made once from the plan config and the model (after ``torch.distributed`` is set up)
and is what every training loop asks: :class:`padfree.hf.PadfreeTrainer`, the examples' plain loop
(:func:`padfree.recipes.loop.train_loop`) and ``padfree check-packing --sp/--cp``. Its
:attr:`~StepRunner.mode`:

- ``plain``: each row through the model, its token losses summed (:func:`padfree.torch.token_loss_sum`);
- ``whole_documents`` (the ``chunked`` plan): a long document's chunks run together on its last chunk's turn,
each
  attending to its earlier chunks (:func:`padfree.torch.execution.chunked.document_backward`); packed rows as
  plain;
- ``sharded`` (``sp`` or ``cp`` > 1, packed rows): consecutive ranks ``sp * cp`` at a time form a group that
  shares one data-parallel rank's micro-batches; each runs its shard of the row with Ulysses
  (:mod:`padfree.torch.execution.sequence_parallel`) or zigzag
  (:mod:`padfree.torch.execution.context_parallel`) attention,
  scored against the row's shifted labels. Summed over the group (DDP's all-reduce times the world size, as
  :func:`padfree.torch.step_loss` does), the shards' gradients are the unsharded row's.

The group arithmetic is written here only. Under SP/CP the coordinate that selects data is the
data-parallel one, :attr:`~StepRunner.dp_rank` of :attr:`~StepRunner.dp_size` (every rank of a group is
given the same micro-batches: :attr:`~StepRunner.sampler_ranks` is what
:class:`~padfree.torch.PlanBatchSampler` takes), and the group's first rank (:attr:`~StepRunner.leads`)
counts and logs the shared rows once.

A loop over a plan (under ``torchrun``, wrap the model in ``DistributedDataParallel`` for ``step``)::

    runner = StepRunner(config, model, device=device)       # SP/CP: forms the groups, sets the attention
    sampler = PlanBatchSampler(lengths, config, **runner.sampler_ranks)
    loader = DataLoader(PlannedDataset(data), batch_sampler=sampler, collate_fn=PackCollator(sp=config.sp))
    for micro_batches in steps_of(loader):
        result = runner.step(ddp, micro_batches)              # forward + backward: the step's token mean
        optimizer.step(); optimizer.zero_grad()

>>> from padfree import PlanConfig
>>> from padfree.models import build_model
>>> from padfree.torch import PackCollator, PlanBatchSampler, PlannedDataset
>>> from padfree.torch.run.loop import steps_of
>>> data = [{"input_ids": list(range(1, n + 1))} for n in (5, 9, 3, 7)]
>>> config = PlanConfig(strategy="packed", budget=16, grad_accum=2)
>>> model = build_model("tiny-llama", attn_implementation=StepRunner.attention(config), vocab_size=32,
...                     hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
...                     num_key_value_heads=2)
>>> runner = StepRunner(config, model)
>>> runner.mode, runner.sampler_ranks, runner.reach
('plain', {'dp_rank': 0, 'dp_size': 1}, 16)
>>> sampler = PlanBatchSampler([5, 9, 3, 7], config, **runner.sampler_ranks)
>>> step = [PackCollator()(PlannedDataset(data).__getitems__(mb)) for mb in next(steps_of(sampler))]
>>> result = runner.step(model, step)
>>> result.tokens == sum(b.tokens for b in step), all(p.grad is not None for p in model.parameters())
(True, True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from padfree.core.config import PlanConfig
from padfree.errors import ConfigError
from padfree.torch.execution.chunked import document_backward, run_step, step_documents

Mode = Literal["plain", "whole_documents", "sharded"]
"""How a micro-batch runs: alone, as one of a long document's chunks trained together on its last one, or
sharded over an SP/CP group."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step's forward and backward on this rank gave.

    Attributes:
        loss_sum: the summed token losses of this rank's micro-batches (detached; a shard's, under SP/CP).
        tokens: the real tokens this rank trained; a row an SP/CP group shares is counted by its first rank
            only, so the sum over every rank counts each token once.
    """

    loss_sum: torch.Tensor
    tokens: int


def reach(config: PlanConfig) -> int:
    """The longest sample a plan trains whole: a chunked plan's ``grad_accum`` budgets (a step's chunks), an
    SP/CP row's ``sp * cp`` budgets, else the budget."""
    from padfree.core.budget import Budget

    return Budget.of(config).reach


class StepRunner:
    """How this process runs a micro-batch (see the module doc).

    Args:
        config: the plan config (its ``sp``, ``cp`` and strategy decide the mode).
        model: the model, unwrapped; under SP/CP its attention is switched to the sharded one.
        rank, world: this process's global rank and the number of processes (default: ``torch.distributed``
            when initialized, else 0 and 1).
        device: where rows are moved before they run (default: left where they are).
        keep_chunks: chunked: how many chunks' activations are kept instead of recomputed.
        attention: sharded: the attention the shards run (default padfree's exact one; the checks pass the
            document-blind control).
    """

    def __init__(
        self,
        config: PlanConfig,
        model: Any,
        *,
        rank: int | None = None,
        world: int | None = None,
        device: torch.device | str | None = None,
        keep_chunks: int = 0,
        attention: str | None = None,
    ) -> None:
        import torch.distributed as dist

        live = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if live else 0)
        self.world = world if world is not None else (dist.get_world_size() if live else 1)
        self.config, self.device, self.keep_chunks = config, device, keep_chunks
        self.size = config.sp * config.cp
        """Processes that share each micro-batch (an SP/CP group; 1 without)."""
        self.mode: Mode = "sharded" if self.size > 1 else "whole_documents" if config.chunked else "plain"
        self._group: Any = None
        self._shard: Callable[[Any, int, int], dict] | None = None
        if self.mode == "sharded":
            self._form_groups(model, attention)

    # ----- the group arithmetic ------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        """The data-parallel rank: which share of the plan this process's group runs."""
        return self.rank // self.size

    @property
    def dp_size(self) -> int:
        """The data-parallel size: how many groups share the plan."""
        return self.world // self.size

    @property
    def sampler_ranks(self) -> dict[str, int]:
        """``dp_rank`` and ``dp_size`` for :class:`~padfree.torch.PlanBatchSampler`."""
        return {"dp_rank": self.dp_rank, "dp_size": self.dp_size}

    @property
    def leads(self) -> bool:
        """Whether this process is its group's first: the one that counts and logs the group's rows."""
        return self.rank % self.size == 0

    @property
    def reach(self) -> int:
        """The longest sample this run trains whole (:func:`reach`)."""
        return reach(self.config)

    @staticmethod
    def attention(config: PlanConfig) -> str:
        """The ``attn_implementation`` to build the model with for ``config``'s rows (a sharded run switches
        to its own when the runner is made)."""
        from padfree.torch.documents.attention import attention_implementation

        return attention_implementation(config.strategy)

    def _form_groups(self, model: Any, attention: str | None) -> None:
        """Refuse what SP/CP cannot run, form one process group per data-parallel rank (every process
        creates every group, in the same order), pick the shard function and switch the attention."""
        import torch.distributed as dist

        from padfree.torch.execution import context_parallel as cpm
        from padfree.torch.execution import sequence_parallel as spm

        sp, cp, config = self.config.sp, self.config.cp, self.config
        if sp > 1 and cp > 1:
            raise ConfigError(f"padfree SP and CP together (sp={sp}, cp={cp}) are not supported: use one")
        if not config.packed or config.chunked:
            raise ConfigError(
                "padfree SP/CP: --sp/--cp shard packed rows: use --strategy packed (PlanConfig(strategy="
                f"'packed')), not {config.strategy!r}"
            )
        if self.world % self.size:
            raise ConfigError(
                f"padfree SP/CP: sp x cp = {self.size} processes share each micro-batch, but the world size "
                f"is {self.world}: launch a multiple of {self.size} (torchrun --nproc_per_node ...)"
            )
        spm.check_shardable(model, sp, cp)
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("padfree SP/CP needs torch.distributed (launch with torchrun or accelerate)")
        starts = range(0, self.world, self.size)
        groups = [dist.new_group(list(range(s, s + self.size))) for s in starts]
        self._group = groups[self.dp_rank]
        self._shard = spm.shard_sp if sp > 1 else cpm.shard_cp
        model.set_attn_implementation(attention or (spm.NAME if sp > 1 else cpm.NAME))

    # ----- running ---------------------------------------------------------------------------------------
    def loss_sum(self, model: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """One row through ``model`` (sharded: this process's shard, inside its group): the sum of its token
        losses, the labels they were scored against (a shard's: the row's shifted ones) and the outputs."""
        from padfree.torch.execution import sequence_parallel as spm
        from padfree.torch.execution.collectives import shard_group
        from padfree.torch.feed.loss import token_loss_sum

        if self._shard is None:
            labels = batch["labels"]
            outputs = model(**{k: v for k, v in batch.items() if k != "labels"})
            return token_loss_sum(outputs.logits, labels), labels, outputs
        shard = self._shard(batch, self.rank % self.size, self.size)
        labels = shard.pop("shift_labels")
        with shard_group(self._group):
            outputs = model(**shard, use_cache=False)
        return spm.shard_loss_sum(outputs.logits, labels), labels, outputs

    def documents(self, micro_batches: Sequence[Any]) -> list[list[Any]]:
        """A step's micro-batches as they run: a chunked plan's long document's chunks together
        (:func:`padfree.torch.execution.chunked.step_documents`), every other micro-batch alone."""
        if self.mode == "whole_documents":
            return step_documents(micro_batches)
        return [[b] for b in micro_batches]

    def document(
        self,
        model: Any,
        chunks: Sequence[Any],
        scale: float,
        sync: Callable[[bool], contextlib.AbstractContextManager] | None = None,
    ) -> float:
        """Forward and backward of one long document's chunks (a group of :meth:`documents`), every token's
        loss times ``scale``; ``sync(final)`` as :func:`padfree.torch.execution.chunked.chunked_backward`'s.
        Returns
        its loss sum."""
        return document_backward(
            model, chunks, scale=scale, keep=self.keep_chunks, device=self.device, sync=sync
        )

    def step_tokens(self, micro_batches: Sequence[Any], device: torch.device | str | None = None) -> int:
        """The step's loss-bearing tokens on every rank: the plan's count, else the labels counted on every
        rank and summed (every process must call it; a group's shared rows counted once)."""
        known = micro_batches[0].info.step_tokens
        if known is not None:
            return int(known)
        from padfree.torch.feed.loss import global_loss_tokens

        where = device if device is not None else self.device if self.device is not None else "cpu"
        return global_loss_tokens(list(micro_batches), where, shared=self.size)

    def step(
        self,
        model: Any,
        micro_batches: Sequence[Any],
        step_tokens: int | None = None,
        *,
        timed: Callable[[Any], contextlib.AbstractContextManager] | None = None,
    ) -> StepResult:
        """Forward and backward of this rank's micro-batches of one optimizer step, each token's loss over the
        step's ``step_tokens`` (default :meth:`step_tokens`) times the world size, as
        :func:`padfree.torch.step_loss`; a DDP ``model`` all-reduces once, at the step's last backward.
        ``timed(model)``: the sampler's timer around each row (dynamic balancing; a chunked plan's rows are
        not timed, its ranks being lanes of whole documents)."""
        if step_tokens is None:
            step_tokens = self.step_tokens(micro_batches)
        scale = self.world / step_tokens if step_tokens > 0 else 0.0
        loss_sum, tokens = run_step(
            model,
            micro_batches,
            scale,
            keep=self.keep_chunks,
            device=self.device,
            chunks=self.mode == "whole_documents",
            row_loss=lambda m, inputs: self.loss_sum(m, inputs)[0],
            timed=None if self.mode == "whole_documents" else timed,
        )
        return StepResult(loss_sum, tokens if self.leads else 0)


__all__ = ["Mode", "StepResult", "StepRunner", "reach"]
