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

from padfree.core.balance import dynamic_budget
from padfree.core.config import PlanConfig
from padfree.core.cursor import Cursor, EpochSource, MicroInfo
from padfree.core.fingerprint import fingerprint_and_identity
from padfree.core.planner import planning_window
from padfree.core.position import check_taken, from_state, to_state
from padfree.core.state_check import segment_budgets
from padfree.errors import ConfigError, StateError
from padfree.torch import _dataset
from padfree.torch._balance import DynamicBalancer
from padfree.torch._distributed import rank_and_world

if TYPE_CHECKING:
    import torch

__all__ = ["MicroBatch", "MicroInfo", "PlanBatchSampler"]


class MicroBatch(list):
    """A list of sample ids (plain ints, so any map-style dataset can index them) with its :class:`MicroInfo`
    in ``.info``."""

    def __init__(self, ids: list[int], info: MicroInfo) -> None:
        super().__init__(ids)
        self.info = info

    def __reduce__(self):  # keep .info when sent to DataLoader workers
        return (MicroBatch, (list(self), self.info))


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
        config: the plan config; its ``world_size`` is replaced by the real one.
        loss_tokens: loss-bearing tokens of every sample: label positions after the first token (with all
            tokens as labels, ``length - 1``; the default). Used to give every micro-batch its step's total.
        rank, world_size: default to ``torch.distributed`` when initialized, else ``0`` and
            ``config.world_size``.
        epoch: the first epoch.
        balance: ``"static"`` (each step given to ranks by ``config.cost``) or ``"dynamic"``: the ranks time
            their micro-batches (:meth:`record_time` or :meth:`timed`), exchange the times every
            ``balance_every`` steps in one small collective, and all refit the same cost coefficients and
            per-rank speeds, which give the coming steps to ranks (steps are also re-cut among ranks:
            per-rank shares that follow the speeds, every micro-batch within the budget). A step's samples
            never change. See :meth:`balance_stats`.
        balance_every: steps between two exchanges (dynamic).
        balance_headroom: dynamic plans fill micro-batches to this share of the budget so that a re-cut can
            give faster ranks more (default ``1 - 0.3/world_size``: room for one rank ~1.4x slower, and 1
            for a padded plan whose tokens are mostly in items over half the budget, see
            :func:`padfree.core.balance.default_headroom`; 1: no room, assignment only). Steps then hold
            that much fewer tokens.
        balance_exchange: replaces the ``torch.distributed`` all-gather of the timings (tests, other
            launchers): takes this rank's 1-D float64 payload, returns every rank's, stacked.
        anchors: a drafter plan's draft blocks (anchors) per sample, e.g.
            :func:`padfree.core.anchors.anchor_counts` of the loss masks: micro-batches hold at most
            ``config.anchor_budget`` of them, and the cost model's drafter terms price them. They depend on
            the data only, so resume (exact and elastic) is unchanged; the state's fingerprint covers them.
            In memory only (not with ``window``).
        window: plan the epoch window by window, about this many samples each, in bounded memory (as
            ``make_plan`` does; every per-sample array int32). Default: above
            :data:`padfree.core.planner.STREAM_THRESHOLD` samples, windows of
            :data:`padfree.core.stream.DEFAULT_WINDOW`; else in memory.
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
    ) -> None:
        if balance not in ("static", "dynamic"):
            raise ConfigError(f"balance must be 'static' or 'dynamic' (got {balance!r})")
        if isinstance(balance_every, bool) or not isinstance(balance_every, int) or balance_every < 1:
            raise ConfigError(f"balance_every must be an integer >= 1 (got {balance_every!r})")
        window = planning_window(lengths, True if window is not None else None, window)
        source = EpochSource.of(lengths, config, loss_tokens, window, anchors)
        rank, world_size = rank_and_world(rank, world_size, config.world_size)
        self.config = config.with_(world_size=world_size)
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} outside world size {world_size}")
        self.rank = rank
        self.fingerprint, self.identity = fingerprint_and_identity(
            source.lengths, self.config, source.anchors
        )
        self.balance = balance
        self.balance_every = balance_every
        dynamic = balance == "dynamic"
        # the planning budget: a dynamic plan leaves headroom for re-cuts
        budget = dynamic_budget(self.config, source.lengths, balance_headroom) if dynamic else None
        self._cursor = Cursor(source, self.config, rank, epoch=epoch, budget=budget, dynamic=dynamic)
        self._lengths = source.lengths
        self._headroom = balance_headroom
        self._dynamic = None
        if dynamic and world_size > 1:
            capacity = 2 * balance_every * config.grad_accum
            scale = (float(config.budget), float(config.budget) ** 2)
            self._dynamic = DynamicBalancer(world_size, capacity, scale, balance_exchange)
        self._synced: tuple[int, int] | None = None  # (epoch, step) of the last exchange
        self._busy = 0.0  # seconds spent yielding micro-batches (planning included), for balance_stats
        self._busy_first: float | None = None  # ... until the end of the first step
        self._spent = False  # this sampler yielded the epoch's last micro-batch; no set_epoch since
        _dataset.note_sampler()

    # ----- sampler API -----------------------------------------------------------------------------------
    @property
    def cursor(self) -> Cursor:
        """The pure position in the plan (:class:`padfree.core.cursor.Cursor`) this sampler hands out."""
        return self._cursor

    @property
    def epoch(self) -> int:
        return self._cursor.epoch

    @property
    def grad_accum(self) -> int:
        return self.config.grad_accum

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def step(self) -> int:
        """Steps of the current epoch consumed so far (whole steps)."""
        return self._cursor.step

    @property
    def steps_in_epoch(self) -> int:
        """Optimizer steps of the current epoch, including steps run before a resume."""
        return self._cursor.steps_in_epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; the current epoch (e.g. just restored) keeps its position."""
        self._spent = False
        if int(epoch) != self.epoch:
            self._cursor.set_epoch(epoch)
            self._synced = None

    def __len__(self) -> int:
        """Micro-batches the next iteration yields on this rank (the rest of the epoch)."""
        return self._cursor.remaining()

    def __iter__(self) -> Iterator[MicroBatch]:
        if self._spent:
            raise StateError(
                f"PlanBatchSampler: epoch {self.epoch} was already iterated to its end; call "
                f"sampler.set_epoch({self.epoch + 1}) before the next pass (as with DistributedSampler)"
            )
        cursor, g = self._cursor, self.grad_accum
        while True:
            t0 = time.perf_counter()
            at = cursor.peek()
            if at is None:
                return
            if at[1] == 0 and self._dynamic is not None:
                self._maybe_sync(at[0])
            nxt = cursor.take()
            assert nxt is not None
            info = nxt.info
            self._spent = info.last and info.step + 1 == cursor.steps_in_epoch
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
        self._cursor.balance = self._dynamic.sync(self._cursor.balance, where)

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
        """The balance in force and how it was learned: ``mode``, ``cost`` (a, b, c: seconds per slot, per
        attention unit and per micro-batch once fitted, else the configured token units), ``fitted``,
        ``speeds`` (per rank, mean 1), ``heldout_rel_error`` (the previous fit's mean relative error on the
        micro-batches of the last exchange, which it had not seen), ``exchanges``, ``records`` (timed
        micro-batches received, all ranks), ``dropped_times`` (this rank's times screened out: non-finite,
        <= 0, absurd or far off the median of its recent times, see :func:`padfree.core.refit.screen`),
        ``sync_seconds`` (this rank's time in exchanges and refits) and
        ``sampler_seconds`` (all of its time yielding micro-batches: planning, layouts, exchanges), of which
        ``sampler_first_step_seconds`` until its first step was out (planning, loading compiled kernels)."""
        b, d = self._cursor.balance, self._dynamic
        return {
            "mode": self.balance,
            "cost": b.cost,
            "fitted": b.fitted,
            "speeds": b.speeds or (1.0,) * self.world_size,
            "recut": b.recut,
            "heldout_rel_error": None if d is None else d.heldout_error,
            "exchanges": 0 if d is None else d.exchanges,
            "records": 0 if d is None else d.records,
            "dropped_times": 0 if d is None else d.dropped,
            "sync_seconds": 0.0 if d is None else d.sync_seconds,
            "sampler_seconds": self._busy,
            "sampler_first_step_seconds": self._busy_first or 0.0,
            "plan_budget": self._cursor.history[-1].budget or self.config.budget,
        }

    # ----- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position and everything that decides the rest of the epoch: epoch, fingerprint, the short
        resume history, and the balance in force (cost model, rank speeds). JSON-serializable, O(resumes)."""
        cur = self._cursor
        return to_state(self.fingerprint, cur.position, self.balance, self.identity, cur.taken())

    def load_state_dict(self, state: dict) -> None:
        """Resume at the exact next micro-batch, at this sampler's world size (which may differ: the rest of
        the epoch is then re-planned over the new ranks).

        The state's balance (cost model, rank speeds) decides the rest of its epoch, whatever this sampler's
        config says: a step half done when the state was saved continues with the same ranks' shares, and
        the epoch ends in the order it would have without the interruption. The config's cost model applies
        again from the next epoch. At another world size the speeds start afresh. Raises
        :class:`StateError` (one line, saying why) on a foreign or damaged state, or on one that cannot be
        continued exactly (see :mod:`padfree.core.position`).
        """
        shape = (self.world_size, self.grad_accum, self._cursor.budget, self.config.cost)
        budgets: dict[int, tuple] = {}

        def allowed(world: int) -> tuple:  # the budgets a segment at ``world`` can have been planned at
            if world not in budgets:
                budgets[world] = segment_budgets(self.config, self._lengths, world, self._headroom)
            return budgets[world]

        steps = self._cursor.plan_steps  # the state's epoch planned (and kept) before it is believed
        pos = from_state(
            state, self.fingerprint, *shape, budgets=allowed, identity=self.identity, steps=steps
        )
        before = self._cursor.position
        self._cursor.restore(pos)
        try:
            check_taken(state, self._cursor.taken())  # mid-step: the step's handed-out part is unchanged
        except StateError:
            self._cursor.restore(before)
            raise
        self._synced = None
        self._spent = False
        if self._dynamic is not None:
            self._dynamic.reset()
