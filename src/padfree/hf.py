"""padfree plans inside ``transformers.Trainer`` and TRL's ``SFTTrainer`` (the ``hf`` / ``trl`` extras).

:class:`PadfreeTrainer` is a ``Trainer`` whose training data loader is
``DataLoader(PlannedDataset(train_dataset), batch_sampler=<the plan>, collate_fn=PadCollator|PackCollator)``;
:func:`padfree_sft_trainer` builds the same on top of ``trl.SFTTrainer``. What they change:

- **data**: this rank's micro-batches of the plan, ``grad_accum`` per optimizer step, over the epochs of the
  run (each plan epoch with its own ``set_epoch``). ``TrainingArguments.gradient_accumulation_steps`` must
  equal the plan's ``grad_accum``. Plan epochs may hold different numbers of steps, which the Trainer's fixed
  "steps per epoch" cannot express, so the Trainer sees one long epoch covering all plan epochs
  (``num_train_epochs`` plan epochs, or endless until ``max_steps``); ``len(dataloader)`` is exact. The
  logged ``epoch`` is the plan's progress (``epoch + (step + 1) / steps in that epoch``), also after a
  resume.
- **loss normalization**: ``num_items_in_batch`` is the plan's count of loss-bearing tokens of the whole step
  (all ranks, all accumulation micro-batches; ``MicroInfo.step_tokens``), not a recount, and needs no
  collective. The model's loss is then ``sum of token losses / step tokens``; ``Trainer.compute_loss``
  multiplies it by the number of processes (``average_tokens_across_devices=True``, the default) which undoes
  DDP's gradient averaging, exactly as ``padfree.torch.step_loss`` does. With
  ``average_tokens_across_devices=False`` the count handed over is ``step tokens / world size`` instead,
  which gives the same gradient. When the plan cannot know the count (a custom loss-token count on truncated
  or split samples) the step's ``labels != -100`` are counted and summed over the ranks once per step
  (:func:`padfree.torch.global_loss_tokens`; the ranks of an SP/CP group hold the same rows and count once),
  and handed over the same way.
- **packed rows** (strategy ``packed``): :class:`~padfree.torch.PackCollator` returns ``input_ids``,
  ``labels``, ``position_ids``, ``cu_seq_lens_q/k`` and ``max_length_q/k``; the loader bypasses the Trainer's
  column removal, so all of them reach ``model(**batch)``. Load the model with
  ``attn_implementation=padfree.torch.attention_implementation("packed")`` (padfree's varlen attention when
  available, else sdpa with transformers' packed-sequence mask).
- **dynamic balancing** (``balance="dynamic"``): each ``training_step`` is timed and the ranks are
  balanced from measured times (see :class:`~padfree.torch.PlanBatchSampler`); the learned coefficients
  and speeds travel in the sampler state.
- **resume**: every checkpoint folder gets ``padfree_sampler.json`` (the sampler state after the last
  optimizer step); ``trainer.train(resume_from_checkpoint=...)`` restores it instead of letting the Trainer
  skip batches, so the next micro-batch is exactly the one after the checkpoint. At the same world size the
  run continues as if never stopped. At another world size the sampler re-plans the rest of the epoch over
  the new ranks (every sample still once per epoch); the Trainer's ``max_steps`` keeps counting optimizer
  steps, with an epoch-based schedule training ends when the plan's epochs run out (the progress bar's total
  may then be off). A checkpoint without the file (not written by this class) is refused.

- **sequence / context parallelism**: padfree's own (``PlanConfig(sp=N)`` or ``cp=N``, packed, launched
  with ``torchrun``): consecutive ranks ``N`` at a time share a data-parallel rank's micro-batches and each
  runs its shard of the row with ``padfree_ulysses`` / ``padfree_zigzag_cp`` attention
  (:class:`~padfree.torch.execution.runner.StepRunner`, the same code as ``examples/train.py --sp/--cp``).
  accelerate's ``ParallelismConfig(cp_size)`` (one causal mask over the packed row) and ``sp_size``
  (DeepSpeed ALST, CUDA only) are refused in one line naming the fix (:func:`refuse_parallelism`).

Not supported (refused with :class:`~padfree.errors.ConfigError`): ``DataParallel`` (several GPUs in one
process), tensor parallelism, accelerate's context/sequence parallelism, fractional ``num_train_epochs``, and
models whose forward takes no loss kwargs (then ``num_items_in_batch`` would be ignored and every micro-batch
averaged on its own).

Example (single process, a tiny random Llama)::

    import numpy as np
    from transformers import TrainingArguments
    from padfree import PlanConfig
    from padfree.hf import PadfreeTrainer
    from padfree.models import build_model
    from padfree.torch.documents.attention import attention_implementation

    data = [{"input_ids": np.arange(1, n + 1)} for n in (50, 90, 30, 70, 20, 80, 40, 60)]
    config = PlanConfig(strategy="packed", budget=128, grad_accum=2, seed=0)
    model = build_model("tiny-llama", attn_implementation=attention_implementation("packed"),
                        hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128)
    args = TrainingArguments("out", gradient_accumulation_steps=config.grad_accum, max_steps=2,
                             remove_unused_columns=False, report_to=[], use_cpu=True)
    trainer = PadfreeTrainer(model=model, args=args, train_dataset=data,
                             lengths=[len(d["input_ids"]) for d in data], plan_config=config)
    trainer.train()                     # later: trainer.train(resume_from_checkpoint=True)

Items are dicts with ``input_ids`` and ``labels`` (-100: no loss) or ``loss_mask`` (1: loss), as for the
collators; pass ``loss_tokens`` (per sample: loss positions after the first token) when not every token is a
label, so the plan's step counts match what the collator produces.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import transformers
from numpy.typing import ArrayLike
from torch.utils.data import DataLoader, Dataset

from padfree.core.config import PlanConfig
from padfree.core.cursor import MicroInfo
from padfree.errors import ConfigError, StateError
from padfree.models import require_packable
from padfree.torch.execution.runner import StepRunner
from padfree.torch.feed.collate import PackCollator, PadCollator
from padfree.torch.feed.dataset import PlannedDataset
from padfree.torch.feed.sampler import MicroBatch, PlanBatchSampler

STATE_FILE = "padfree_sampler.json"

SAMPLER_OPTIONS = tuple(
    name
    for name, p in inspect.signature(PlanBatchSampler).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name not in ("loss_tokens", "rank", "world_size", "epoch")
)
"""The :class:`~padfree.torch.PlanBatchSampler` options a :class:`PadfreeTrainerMixin` passes through:
all of its keyword options but those the Trainer decides (rank, world size, epochs) or takes itself."""


class EpochChain:
    """A batch sampler that runs a :class:`PlanBatchSampler` through plan epochs ``sampler.epoch ..
    epochs-1`` (``epochs=None``: endless) and remembers the sampler state right after each micro-batch, so the
    state of what was *consumed* is known even when the ``DataLoader`` prefetches ahead.

    ``length`` (micro-batches) is what ``len()`` reports: by default the rest of the chained epochs.
    """

    def __init__(self, sampler: PlanBatchSampler, epochs: int | None, length: int | None = None) -> None:
        if epochs is None and length is None:
            raise ConfigError("an endless epoch chain needs an explicit length")
        self.sampler = sampler
        self.epochs = epochs
        self._length = length
        self._states: OrderedDict[tuple[int, int, int], dict] = OrderedDict()
        self.steps_in_epoch: dict[int, int] = {}
        """Optimizer steps of each plan epoch iterated so far (including steps run before a resume)."""

    def __len__(self) -> int:
        if self._length is not None:
            return self._length
        assert self.epochs is not None  # an endless chain has an explicit length
        cursor = self.sampler.cursor
        total = cursor.remaining()
        for epoch in range(cursor.epoch + 1, self.epochs):
            total += cursor.epoch_steps(epoch) * cursor.config.grad_accum
        return total

    def __iter__(self) -> Iterator[MicroBatch]:
        epoch = self.sampler.epoch
        while self.epochs is None or epoch < self.epochs:
            self.sampler.set_epoch(epoch)
            self.steps_in_epoch[epoch] = self.sampler.steps_in_epoch
            for micro in self.sampler:
                info = micro.info
                self._states[(info.epoch, info.step, info.micro)] = self.sampler.state_dict()
                while len(self._states) > 4096:  # far more than any prefetch depth
                    self._states.popitem(last=False)
                yield micro
            epoch += 1

    def state_after(self, info: MicroInfo) -> dict:
        """The sampler state right after the micro-batch ``info`` was yielded."""
        key = (info.epoch, info.step, info.micro)
        if key not in self._states:
            raise StateError(f"no sampler state recorded for epoch {info.epoch} step {info.step}")
        return self._states[key]


class _PlanEpoch(transformers.TrainerCallback):
    """Sets ``state.epoch`` to the plan's epoch progress after every optimizer step, before other callbacks
    and the log see it: ``epoch + (step + 1) / steps_in_epoch`` of the step's last micro-batch. The
    Trainer's own count assumes one epoch spanning the run and restarts from 0 at a resume."""

    def __init__(self, trainer: PadfreeTrainerMixin) -> None:
        self._trainer = weakref.proxy(trainer)

    def on_step_end(self, args, state, control, **kwargs):
        epoch = self._trainer.padfree_epoch()
        if epoch is not None:
            state.epoch = epoch


if TYPE_CHECKING:  # the mixin goes in front of a Trainer: type-check it as one
    _TrainerBase = transformers.Trainer
else:
    _TrainerBase = object


class PadfreeTrainerMixin(_TrainerBase):
    """The padfree behaviour, to put in front of ``transformers.Trainer`` or a subclass (see the module doc).

    Keyword args (besides the Trainer's): ``lengths`` (tokens per sample of ``train_dataset``),
    ``plan_config`` (:class:`~padfree.PlanConfig`; its world size is replaced by the real one),
    ``loss_tokens`` (loss-bearing tokens per sample, default ``length - 1``), ``collator`` (default
    :class:`~padfree.torch.PackCollator` for ``packed``, else :class:`~padfree.torch.PadCollator` padding to a
    multiple of 8), and every option of :class:`~padfree.torch.PlanBatchSampler` but the ones the Trainer
    decides (:data:`SAMPLER_OPTIONS`: ``balance``, ``balance_every``, ``balance_headroom``,
    ``balance_exchange``, ``window``; with ``balance="dynamic"`` every ``training_step`` is timed, up to the
    model's last gradient, and the ranks are balanced from those times). Rank and world size come from
    ``TrainingArguments``; plan epochs from ``num_train_epochs`` (from 0, or from the checkpoint resumed).
    ``stream`` (a :class:`padfree.torch.feed.streamed.Stream`) replaces ``lengths`` and ``train_dataset``: a
    streamed plan whose lengths are learned as read (it needs ``max_steps``;
    :mod:`padfree.torch.feed.streamed`).
    """

    def __init__(
        self,
        *args: Any,
        lengths: ArrayLike | None = None,
        plan_config: PlanConfig,
        loss_tokens: ArrayLike | None = None,
        collator: Callable[[list], Any] | None = None,
        keep_chunks: int = 0,
        stream: Any = None,
        **kwargs: Any,
    ) -> None:
        options = {k: kwargs.pop(k) for k in SAMPLER_OPTIONS if k in kwargs}  # the rest is the Trainer's
        targs_given = kwargs.get("args", args[1] if len(args) > 1 else None)
        refuse_parallelism(getattr(targs_given, "parallelism_config", None), plan_config)
        if collator is None:
            shapes = plan_config.shapes
            packed = PackCollator(
                chunked=plan_config.chunked, sp=plan_config.sp, cp=plan_config.cp, shapes=shapes
            )
            collator = (
                packed
                if plan_config.packed
                else PadCollator(pad_to_multiple_of=None if shapes else 8, shapes=shapes)
            )
        kwargs.setdefault("data_collator", collator)
        super().__init__(*args, **kwargs)
        targs = self.args
        if targs.gradient_accumulation_steps != plan_config.grad_accum:
            raise ConfigError(
                f"TrainingArguments.gradient_accumulation_steps={targs.gradient_accumulation_steps} but the "
                f"plan has grad_accum={plan_config.grad_accum}: they must be equal"
            )
        if targs.n_gpu > 1:
            raise ConfigError("DataParallel (several GPUs, one process) is unsupported: one process per GPU")
        if self.get_tp_size() != 1:
            raise ConfigError("tensor parallelism is not supported with padfree plans")
        refuse_parallelism(getattr(self.accelerator, "parallelism_config", None), plan_config)
        if targs.max_steps <= 0 and float(targs.num_train_epochs) != int(targs.num_train_epochs):
            raise ConfigError(
                f"num_train_epochs must be a whole number (got {targs.num_train_epochs}); or use max_steps"
            )
        if not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            raise ConfigError(
                "the model's forward takes no loss kwargs (num_items_in_batch): the step's token "
                "normalization cannot be applied; pass compute_loss_func"
            )
        if plan_config.packed and isinstance(self.model, torch.nn.Module):
            require_packable(self.model, f"{type(self).__name__} with a packed plan")
        self.padfree_runner = StepRunner(
            plan_config, self.model, rank=targs.process_index, world=targs.world_size, device=targs.device,
            keep_chunks=keep_chunks,
        )  # fmt: skip
        if (
            self.padfree_runner.mode == "whole_documents"
            and getattr(self.accelerator, "scaler", None) is not None
        ):
            raise ConfigError("chunked plans run their own backward passes: use bf16 or float32, not fp16")
        self.padfree_collator = collator
        self.padfree_stream = stream
        if stream is not None:  # a streamed plan (padfree.torch.feed.streamed.Stream): steps known as read
            self.padfree_sampler = _stream_sampler(stream, plan_config, lengths, options, targs)
        else:
            self.padfree_sampler = self._plan_sampler(lengths, plan_config, loss_tokens, options)
        self._padfree_chain: EpochChain | None = None
        self._padfree_state: dict | None = None
        self._padfree_info: MicroInfo | None = None
        self._padfree_tokens = 0  # the plan's tokens this process fetched in this train() call
        self._padfree_sources: torch.Tensor | None = None  # the micro-batch's per-token sources
        self._padfree_by_source: torch.Tensor | None = None  # per-source loss sums and tokens since a log
        self.callback_handler.callbacks.insert(0, _PlanEpoch(self))

    def _plan_sampler(self, lengths, plan_config, loss_tokens, options) -> PlanBatchSampler:
        if lengths is None:
            raise ConfigError(
                "PadfreeTrainer needs lengths (tokens per sample) or stream=Stream(source, window)"
            )
        return PlanBatchSampler(
            lengths,
            plan_config,
            loss_tokens=loss_tokens,
            **{**options, **self.padfree_runner.sampler_ranks},  # the data-parallel coordinate: the runner's
        )

    # ----- data --------------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        if self.padfree_stream is not None:
            from padfree.torch.feed.streamed import StreamDataset

            chain = EpochChain(
                self.padfree_sampler, None, length=self.args.max_steps * self.padfree_sampler.grad_accum
            )
            self._padfree_chain = chain
            return DataLoader(
                cast(Dataset, StreamDataset()), batch_sampler=chain, collate_fn=self.padfree_collator
            )
        if self.train_dataset is None:
            raise ConfigError("training needs a train_dataset")
        sampler, targs = self.padfree_sampler, self.args
        if targs.max_steps > 0:
            chain = EpochChain(sampler, None, length=targs.max_steps * sampler.grad_accum)
        else:
            chain = EpochChain(sampler, int(targs.num_train_epochs))
        self._padfree_chain = chain
        workers = targs.dataloader_num_workers
        extra: dict[str, Any] = {}
        if workers > 0:
            extra = {
                "persistent_workers": targs.dataloader_persistent_workers,
                "prefetch_factor": targs.dataloader_prefetch_factor,
            }
        return DataLoader(
            cast(Dataset, PlannedDataset(self.train_dataset)),
            batch_sampler=chain,
            collate_fn=self.padfree_collator,
            num_workers=workers,
            pin_memory=targs.dataloader_pin_memory and torch.cuda.is_available(),
            **extra,
        )

    def set_initial_training_values(self, args, dataloader):
        """One Trainer epoch spans all plan epochs: its length is the exact number of micro-batches."""
        values = list(super().set_initial_training_values(args, dataloader))
        steps = len(dataloader) // self.padfree_sampler.grad_accum
        # (num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples,
        #  total_train_batch_size, steps_in_epoch, max_steps)
        values[0], values[1], values[5], values[6] = 1, max(steps, 1), len(dataloader), steps
        return tuple(values)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step, timed for dynamic balancing (forward and backward up to the last gradient; a
        no-op when static). A chunked plan's long document runs on its last chunk's micro-batch, all its
        chunks at once (:func:`padfree.torch.execution.chunked.chunked_backward`); its earlier chunks' steps
        do
        nothing (:meth:`padfree.torch.StepRunner.document`)."""
        group = getattr(inputs, "padfree_chunks", None)
        if group is not None:
            return self._chunked_step(model, group, num_items_in_batch)
        self._padfree_sources = getattr(inputs, "source_ids", None)  # the Trainer's copy drops attributes
        with self.padfree_sampler.timed(model, getattr(inputs, "info", None)):
            return super().training_step(model, inputs, num_items_in_batch)

    def _chunked_step(self, model, group: list, num_items_in_batch) -> torch.Tensor:
        device = self.args.device
        if not group:  # an earlier chunk: its document runs with its last chunk
            return torch.zeros((), device=device)
        model.train()
        den = float(num_items_in_batch) if num_items_in_batch is not None else 1.0
        scale = (self.accelerator.num_processes if self.args.average_tokens_across_devices else 1) / den
        ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None

        def sync(final: bool):  # the Trainer's own context holds the document's last backward
            return contextlib.nullcontext() if final or ddp is None else ddp.no_sync()

        with self.compute_loss_context_manager():
            total = self.padfree_runner.document(model, group, scale, sync)
        return torch.tensor(total * scale, device=device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The Trainer's loss; with padfree SP/CP (``plan_config.sp`` / ``cp`` > 1) this rank's shard of the
        packed row runs inside its group (:meth:`padfree.torch.StepRunner.loss_sum`), scored against the
        row's shifted labels, over ``num_items_in_batch`` (the step's loss tokens; else the shard's own)."""
        sources, self._padfree_sources = self._padfree_sources, None
        sharded = self.padfree_runner.mode == "sharded"
        if not sharded and sources is not None and "labels" in inputs:
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            self._padfree_note_sources(outputs, inputs["labels"], sources)
            return (loss, outputs) if return_outputs else loss
        if not sharded:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        total, labels, outputs = self.padfree_runner.loss_sum(model, inputs)
        den = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum().clamp(min=1)
        loss = total / den
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # undoes DDP's average over every rank, as Trainer
        return (loss, outputs) if return_outputs else loss

    # ----- weighted sources ------------------------------------------------------------------------------
    def _padfree_note_sources(self, outputs: Any, labels: torch.Tensor, sources: torch.Tensor) -> None:
        """Add this micro-batch's per-source loss sums and tokens (:func:`padfree.torch.source_loss_sums`)."""
        from padfree.torch.feed.loss import source_loss_sums

        logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
        n = len(self.padfree_sampler.config.sources or ())
        sums = source_loss_sums(logits, labels, sources, n)
        self._padfree_by_source = sums if self._padfree_by_source is None else self._padfree_by_source + sums

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, plus with weighted sources ``loss_<name>``: each source's mean token loss since
        the last log, over all ranks; and in the end-of-training metrics ``train_tokens_per_second``: the
        plan's tokens (padding excluded) of every data-parallel rank over ``train_runtime`` (under a token
        budget samples per second mean little). Every process logs, so summing over processes is safe."""
        if "train_runtime" in logs:
            from padfree.torch.execution.distributed import all_reduce_sum

            mine = torch.tensor(float(self._padfree_tokens), dtype=torch.float64)
            tokens = float(all_reduce_sum(mine, self.args.device).item()) / self.padfree_runner.size
            logs["train_tokens_per_second"] = round(tokens / max(float(logs["train_runtime"]), 1e-9), 3)
        if "loss" in logs and self._padfree_by_source is not None:
            from padfree.torch.execution.distributed import all_reduce_sum

            sums = all_reduce_sum(self._padfree_by_source, self._padfree_by_source.device).cpu()
            self._padfree_by_source = None
            for j, (name, _) in enumerate(self.padfree_sampler.config.sources or ()):
                if sums[1, j] > 0:
                    logs[f"loss_{name}"] = round(float(sums[0, j] / sums[1, j]), 4)
        super().log(logs, *args, **kwargs)

    # ----- loss normalization ------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        for group in self.padfree_runner.documents(batches):  # a long document's chunks: on its last one
            if len(group) > 1:
                for b in group[:-1]:
                    b.padfree_chunks = []
                group[-1].padfree_chunks = group
        self._padfree_tokens += sum(sum(b.info.lengths) for b in batches if hasattr(b, "info"))
        info = getattr(batches[-1], "info", None) if batches else None
        if info is not None and self._padfree_chain is not None:
            self._padfree_state = self._padfree_chain.state_after(info)
            self._padfree_info = info
        return batches, num_items

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._padfree_tokens = 0
        return super().train(*args, **kwargs)

    def padfree_epoch(self) -> float | None:
        """Plan epochs done, as a fraction, after the last step fetched (None before the first): what the
        Trainer logs as ``epoch``. A resumed run logs what the unbroken run logged."""
        info, chain = self._padfree_info, self._padfree_chain
        if info is None or chain is None or not chain.steps_in_epoch.get(info.epoch):
            return None
        return info.epoch + (info.step + 1) / chain.steps_in_epoch[info.epoch]

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        infos: list[MicroInfo] = [getattr(b, "info", None) for b in batch_samples]  # type: ignore[misc]
        if not infos or any(i is None for i in infos) or "labels" not in batch_samples[0]:
            return super()._get_num_items_in_batch(batch_samples, device)
        first = infos[0]
        one_step = all((i.epoch, i.step) == (first.epoch, first.step) for i in infos)
        if len(infos) != first.grad_accum or not one_step:
            raise StateError(
                f"the Trainer grouped {len(infos)} micro-batches across plan steps "
                f"{sorted({(i.epoch, i.step) for i in infos})}; expected {first.grad_accum} of one step"
            )
        # the plan's count, else (a cut sample with a custom loss count) the labels counted on every rank
        tokens = max(self.padfree_runner.step_tokens(batch_samples, device), 1)
        ranks = self.padfree_runner.world  # every process
        if self.args.average_tokens_across_devices or ranks == 1:
            return torch.tensor(tokens, device=device)  # compute_loss multiplies by the number of processes
        return torch.tensor(tokens / ranks, dtype=torch.float64, device=device)

    # ----- checkpoints -------------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if not self.args.should_save:
            return
        folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        state = self._padfree_state if self._padfree_state is not None else self.padfree_sampler.state_dict()
        tmp = folder / f".{STATE_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, folder / STATE_FILE)

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        epochs_trained, skip = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if resume_from_checkpoint is not None:
            path = Path(resume_from_checkpoint) / STATE_FILE
            if not path.is_file():
                raise StateError(f"{path}: no padfree sampler state in this checkpoint; cannot resume")
            try:
                state = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise StateError(f"{path}: unreadable sampler state ({exc})") from None
            self.padfree_sampler.load_state_dict(state)
            self._padfree_state = state
            skip = 0  # the sampler itself continues after the checkpoint: nothing to skip
        return epochs_trained, skip


def _stream_sampler(stream: Any, plan_config: PlanConfig, lengths: Any, options: dict, targs: Any) -> Any:
    """The sampler of ``stream=`` (:class:`padfree.torch.feed.streamed.Stream`), or one line naming a rule."""
    from padfree.torch.feed.streamed import Stream, StreamBatchSampler

    if not isinstance(stream, Stream):
        raise ConfigError(
            f"stream= takes padfree.torch.feed.streamed.Stream(source, window) (got {type(stream).__name__})"
        )
    if lengths is not None or options or plan_config.sp * plan_config.cp > 1:
        raise ConfigError("a streamed plan learns its lengths as read: no lengths=, sampler options or sp/cp")
    if targs.max_steps <= 0:
        raise ConfigError(
            "a streamed plan needs TrainingArguments.max_steps > 0: its steps are known only as read"
        )
    return StreamBatchSampler(stream.source, plan_config, stream.window, length_of=stream.length_of,
                              rank=targs.process_index, world_size=targs.world_size)  # fmt: skip


def refuse_parallelism(pc: Any, plan_config: PlanConfig) -> None:
    """One-line :class:`ConfigError` for the accelerate / transformers ``ParallelismConfig`` settings that
    padfree plans cannot run with here, naming the way out (``pc``: the config, or ``None``)."""
    if pc is None:
        return
    cp, sp = int(getattr(pc, "cp_size", 1) or 1), int(getattr(pc, "sp_size", 1) or 1)
    if cp > 1 and plan_config.packed:
        raise ConfigError(
            f"ParallelismConfig(cp_size={cp}): accelerate's CP hook forces one causal mask over the packed "
            "row, so its documents would attend to each other; use padfree's CP attention (PlanConfig(cp=N), "
            "padfree.torch.execution.context_parallel) or disable packing (a padded strategy)"
        )
    if cp > 1:
        raise ConfigError(
            f"ParallelismConfig(cp_size={cp}) with padded rows is a GPU check (benchmarks/gpu/run.sh), not "
            "accepted here; use padfree's CP on packed rows: PlanConfig(strategy='packed', cp=N)"
        )
    if sp > 1:
        raise ConfigError(
            f"ParallelismConfig(sp_size={sp}) runs DeepSpeed ALST (DeepSpeed on CUDA: a GPU check in "
            "benchmarks/gpu/run.sh), not accepted here; use padfree's Ulysses SP: "
            "PlanConfig(strategy='packed', sp=N) with PadfreeTrainer"
        )
    if int(getattr(pc, "tp_size", 1) or 1) > 1:
        raise ConfigError("tensor parallelism is not supported with padfree plans")


class PadfreeTrainer(PadfreeTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` fed by a padfree plan; see :mod:`padfree.hf` for a worked example."""


def padfree_sft_trainer():
    """The class ``PadfreeSFTTrainer(PadfreeTrainerMixin, trl.SFTTrainer)`` (needs the ``trl`` extra).

    Give it a tokenized ``datasets.Dataset`` (``input_ids`` and ``labels`` columns) and
    ``SFTConfig(dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False, ...)`` so TRL
    neither re-tokenizes nor packs it (the plan does the batching)::

        SFT = padfree_sft_trainer()
        trainer = SFT(model=model, args=sft_config, train_dataset=ds, processing_class=tok,
                      lengths=lengths, plan_config=config)
    """
    import trl

    doc = {"__doc__": padfree_sft_trainer.__doc__}
    return type("PadfreeSFTTrainer", (PadfreeTrainerMixin, trl.SFTTrainer), doc)


__all__ = [
    "SAMPLER_OPTIONS",
    "STATE_FILE",
    "EpochChain",
    "PadfreeTrainer",
    "PadfreeTrainerMixin",
    "padfree_sft_trainer",
]
