"""A batch sampler that yields this rank's micro-batches of a padfree plan, resumable in O(1), elastic, and
(``balance="dynamic"``) balanced across ranks from measured micro-batch times.

>>> import numpy as np
>>> from padfree import PlanConfig
>>> s = PlanBatchSampler(np.arange(1, 41), PlanConfig(strategy="packed", budget=64, grad_accum=2), rank=0,
...                      world_size=2)
>>> n = len(s)
>>> mb = next(iter(s))
>>> (mb.info.step, mb.info.micro, mb.info.last, n % 2, len(s) == n - 1)
(0, 0, False, 0, True)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from padfree.core.config import PlanConfig
from padfree.core.cursor import Cursor, EpochSource, MicroBatch, MicroInfo
from padfree.core.plan import Plan
from padfree.errors import ConfigError, StateError
from padfree.torch.execution.distributed import data_parallel
from padfree.torch.feed import dataset as _dataset
from padfree.torch.feed.balance import balance_stats, balancer, check_balance

if TYPE_CHECKING:
    import torch

__all__ = ["MicroBatch", "MicroInfo", "PlanBatchSampler"]


class PlanBatchSampler:
    """Yields this rank's micro-batches in plan order, ``grad_accum`` per optimizer step.

    Use it as ``DataLoader(PlannedDataset(dataset), batch_sampler=sampler, collate_fn=PadCollator())`` (or
    ``torchdata.stateful_dataloader.StatefulDataLoader``). Call :meth:`set_epoch` before each epoch, as with
    ``DistributedSampler``. A second pass over an epoch this sampler has yielded to its end, with no
    :meth:`set_epoch` (or :meth:`load_state_dict`) in between, raises :class:`~padfree.errors.StateError`
    (one line: call ``set_epoch``); silently re-running the same epoch would train on the same micro-batches
    again, and yielding nothing would end training unnoticed. After ``set_epoch`` with the same epoch, an
    epoch that was fully consumed (say, restored at its end) yields nothing until the epoch changes.
    Without a :class:`~padfree.torch.PlannedDataset` around the dataset the collators get no plan info
    (``batch.info`` is None): they warn once.

    Args:
        lengths: tokens of every sample (as the collator will see them, before truncation or splitting).
            With weighted sources (``config.sources``): a mapping of each source's name to its lengths;
            sample ids then count through the sources in the config's order (a ``ConcatDataset`` of them),
            every step holds each source's share (:mod:`padfree.core.sources`), ``MicroInfo.sources`` says
            each sample's source and the state records the sources' counters. Static balance only.
        config: the plan config; its ``world_size`` is replaced by the real one.
        loss_tokens: loss-bearing tokens of every sample: label positions after the first token (with all
            tokens as labels, ``length - 1``; the default); per source (a mapping) with weighted sources.
            Used to give every micro-batch its step's total.
        rank, world_size: the data-parallel rank and size; default to ``torch.distributed`` when initialized,
            else ``0`` and ``config.world_size``.
        dp_rank, dp_size, dp_group: with SP/CP (``config.sp`` / ``config.cp`` > 1) every GPU of a group of
            ``sp * cp`` gets the same micro-batches; these say which data-parallel rank the group is, and how
            many there are (``dp_group``: a process group, or a ``DeviceMesh``, 1-D or with a ``"dp"``
            dimension). Under ``torch.distributed`` with SP/CP one of them is required.
        epoch: the first epoch.
        balance: ``"static"`` (each step given to ranks by ``config.cost``) or ``"dynamic"``: the ranks time
            their micro-batches (:meth:`record_time` or :meth:`timed`), exchange the times every
            ``balance_every`` steps in one small collective, and all refit the same cost coefficients and
            per-rank speeds, which give the coming steps to ranks (steps are also re-cut among ranks:
            per-rank shares that follow the speeds, every micro-batch within the budget). A step's samples
            never change. See :meth:`balance_stats`.
        balance_every: steps between two exchanges (dynamic).
        balance_headroom: dynamic plans fill micro-batches to this share of the budget so that a re-cut can
            give faster ranks more; steps then hold that much fewer tokens (default: room for one rank ~1.4x
            slower, :func:`padfree.core.balance.default_headroom`; 1: no room, assignment only).
        balance_exchange: replaces the ``torch.distributed`` all-gather of the timings (tests, other
            launchers): takes this rank's 1-D float64 payload, returns every rank's, stacked.
        anchors: a drafter plan's draft blocks per sample (:func:`padfree.core.anchors.anchor_counts` of the
            loss masks): micro-batches hold at most ``config.anchor_budget`` of them and the cost model's
            drafter terms price them; resume is unchanged, the fingerprint covers them. Not with ``window``.
        window: plan the epoch window by window, about this many samples each, in bounded memory (as
            ``make_plan`` does). Default: above :data:`padfree.core.planner.STREAM_THRESHOLD` samples,
            windows of :data:`padfree.core.stream.DEFAULT_WINDOW`; else in memory.
    """

    def __init__(
        self,
        lengths: ArrayLike,
        config: PlanConfig,
        *,
        loss_tokens: ArrayLike | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int = 0,
        balance: str = "static",
        balance_every: int = 4,
        balance_headroom: float | None = None,
        balance_exchange: Callable[[np.ndarray], np.ndarray] | None = None,
        window: int | None = None,
        anchors: ArrayLike | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        dp_group: object = None,
    ) -> None:
        check_balance(balance, balance_every)
        src = EpochSource.of(lengths, config, loss_tokens, window, anchors)
        if balance == "dynamic" and config.shard.pads:
            raise ConfigError(
                "balance='dynamic' does not re-cut SP/CP plans yet, nor shapes plans; use balance='static'"
            )
        group = config.shard.group
        rank, world_size = data_parallel(
            rank, world_size, dp_rank=dp_rank, dp_size=dp_size, dp_group=dp_group, group=group,
            default_world=config.world_size,
        )  # fmt: skip
        self.config = config.with_(world_size=world_size)
        self.world_size, self.grad_accum = world_size, config.grad_accum
        self.rank, self.balance, self.balance_every = rank, balance, balance_every
        dynamic = balance == "dynamic"
        # the pure position in the plan this sampler hands out (saved and loaded by itself)
        self.cursor = Cursor(src, self.config, rank, epoch=epoch, dynamic=dynamic, headroom=balance_headroom)
        self.fingerprint, self.identity = self.cursor.fingerprint, self.cursor.identity
        self._lengths = src.lengths
        steps = balance_every if dynamic and world_size > 1 else 0  # 0: no balancer (static or one rank)
        self._dynamic = balancer(world_size, steps, config.grad_accum, config.budget, balance_exchange)
        self._synced: tuple[int, int] | None = None  # (epoch, step) of the last exchange
        self._busy = 0.0  # seconds spent yielding micro-batches (planning included), for balance_stats
        self._busy_first: float | None = None  # ... until the end of the first step
        _dataset.note_sampler()

    # ----- sampler API -----------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    @property
    def plan(self) -> Plan:
        """The plan this sampler hands out in the current epoch (since the last resume: the segment planned
        at this world size), every rank's micro-batches: planned once and kept, so a report of the plan
        (its heaviest micro-batch, its steps) plans nothing twice."""
        return self.cursor.plan

    @property
    def step(self) -> int:
        """Steps of the current epoch consumed so far (whole steps)."""
        return self.cursor.step

    @property
    def steps_in_epoch(self) -> int:
        """Optimizer steps of the current epoch, including steps run before a resume."""
        return self.cursor.steps_in_epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; the current epoch (e.g. just restored) keeps its position."""
        if int(epoch) != self.epoch:
            self._synced = None
        self.cursor.set_epoch(epoch)

    def __len__(self) -> int:
        """Micro-batches the next iteration yields on this rank (the rest of the epoch)."""
        return self.cursor.remaining()

    def __iter__(self) -> Iterator[MicroBatch]:
        if self.cursor.spent:
            raise StateError(
                f"PlanBatchSampler: epoch {self.epoch} was already iterated to its end; call "
                f"sampler.set_epoch({self.epoch + 1}) before the next pass (as with DistributedSampler)"
            )
        cursor, g = self.cursor, self.grad_accum
        while True:
            t0 = time.perf_counter()
            at = cursor.peek()
            if at is None:
                return
            if at[1] == 0:
                self._maybe_sync(at[0])
            nxt = cursor.take()
            assert nxt is not None
            info = nxt.info
            if self._dynamic is not None and nxt.features is not None:
                self._dynamic.yielded((info.epoch, info.step, info.micro), *nxt.features)
            self._busy += time.perf_counter() - t0
            if self._busy_first is None and info.micro == g - 1:
                self._busy_first = self._busy  # planning the epoch and loading the kernels: once
            yield MicroBatch(nxt.ids, info)

    # ----- dynamic balancing -------------------------------------------------------------------------------
    def _maybe_sync(self, step: int) -> None:
        """At every ``balance_every``-th step boundary: exchange the timings and refit (all ranks alike)."""
        where = (self.epoch, step)
        if self._dynamic is None or step == 0 or step % self.balance_every or self._synced == where:
            return
        self._synced = where
        self.cursor.balance = self._dynamic.sync(self.cursor.balance, where)

    def record_time(self, seconds: float, info: MicroInfo | None = None) -> None:
        """Report the compute time of a micro-batch (dynamic balancing; ignored when static).

        Call it once per micro-batch, in the order they were yielded, after its forward and backward and
        *before* anything waits for other ranks: for the last micro-batch of a step, DDP's backward ends in
        the gradient all-reduce, which must not be counted (``timed(model)`` stops the clock when the last
        gradient is ready, just before that wait). Give ``info`` (the micro-batch's :class:`MicroInfo`) to
        pair the time explicitly when some micro-batches go untimed. The times are exchanged at the next
        exchange step; nothing blocks here.
        """
        if self._dynamic is not None:
            self._dynamic.record(seconds, info)

    def timed(self, model: torch.nn.Module | None = None, info: MicroInfo | None = None):
        """A context manager that times one micro-batch and calls :meth:`record_time`::

            for batch in loader:
                with sampler.timed(ddp_model):          # forward + backward of this micro-batch
                    loss = ...; loss.backward()

        With ``model`` the clock stops when its last gradient is ready (before DDP waits for the other ranks),
        on the GPU with CUDA events read later without synchronizing; without it, at the end of the block
        (then keep the all-reduce of the last micro-batch out of the block). A no-op when static.
        """
        if self._dynamic is None:
            return contextlib.nullcontext()
        return self._dynamic.timer(self.record_time, model, info)

    def balance_stats(self) -> dict:
        """The balance in force, how it was learned and the sampler's own time: the keys are
        :func:`padfree.torch.feed.balance.balance_stats`'s."""
        busy = (self._busy, self._busy_first or 0.0)
        budget = self.cursor.history[-1].budget or self.config.budget
        return balance_stats(self.balance, self.cursor.balance, self._dynamic, self.world_size, busy, budget)

    # ----- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position and everything that decides the rest of the epoch: epoch, fingerprint, the short
        resume history, and the balance in force (cost model, rank speeds). JSON-serializable, O(resumes)."""
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume at the exact next micro-batch (a chunked plan: its step's first), at this sampler's world
        size (at another one the rest of the epoch is re-planned over the new ranks). The state's balance
        (cost model, rank speeds) decides the rest of its epoch whatever this sampler's config says (a
        half-done step keeps its ranks' shares); the config's cost model applies again from the next epoch,
        and at another world size the speeds start afresh. A foreign or damaged state, or one that cannot
        be continued exactly, raises :class:`StateError` in one line that says why (checked and restored
        by :meth:`padfree.core.cursor.Cursor.load_state_dict`)."""
        self.cursor.load_state_dict(state)
        self._synced = None
        if self._dynamic is not None:
            self._dynamic.reset()
