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
from dataclasses import dataclass, replace

import numpy as np

from padfree.core.balance import Balance, default_headroom, micro_features, plan_budget, step_layout
from padfree.core.config import PlanConfig
from padfree.core.fingerprint import fingerprint_and_identity
from padfree.core.items import make_items, validate_lengths
from padfree.core.plan import Plan
from padfree.core.planner import STREAM_THRESHOLD
from padfree.core.position import Position, from_state, step_loss_tokens, to_state
from padfree.core.replay import Segment, replay
from padfree.core.state_check import segment_budgets
from padfree.core.stream import DEFAULT_WINDOW
from padfree.errors import ConfigError
from padfree.torch._balance import DynamicBalancer
from padfree.torch._distributed import rank_and_world


@dataclass(frozen=True)
class MicroInfo:
    """What the training loop needs to know about one micro-batch.

    Attributes:
        epoch: the epoch.
        step: optimizer step inside the epoch (counting steps run before a resume too).
        micro: accumulation index, ``0 .. grad_accum-1``.
        last: True on the last micro-batch of the step (run backward without ``no_sync`` on this one).
        rank, world_size, grad_accum: the shape this micro-batch was planned for.
        step_tokens: loss-bearing tokens of the whole step on all ranks (see :mod:`padfree.torch._loss`),
            or ``None`` when the plan cannot know it (then count with ``loss.global_loss_tokens``).
        starts: first token of each sample's piece (``None``: every piece starts at 0).
        lengths: tokens of each sample's piece (shorter than the sample when truncated or split).
        indices: the sample ids (as in the :class:`MicroBatch` list), e.g. for a log of consumed samples.
    """

    epoch: int
    step: int
    micro: int
    last: bool
    rank: int
    world_size: int
    grad_accum: int
    step_tokens: int | None
    starts: tuple[int, ...] | None
    lengths: tuple[int, ...]
    indices: tuple[int, ...] = ()


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
    ``DistributedSampler``; an epoch that was fully consumed yields nothing until the epoch changes.

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
        window: plan the epoch window by window, about this many samples each, in bounded memory (as
            ``make_plan`` does; every per-sample array int32). Default: above
            :data:`padfree.core.planner.STREAM_THRESHOLD` samples, windows of
            :data:`padfree.core.stream.DEFAULT_WINDOW`; else in memory.
    """

    def __init__(
        self,
        lengths: object,
        config: PlanConfig,
        *,
        loss_tokens: object | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int = 0,
        balance: str = "static",
        balance_every: int = 4,
        balance_headroom: float | None = None,
        balance_exchange: Callable[[np.ndarray], np.ndarray] | None = None,
        window: int | None = None,
    ) -> None:
        if balance not in ("static", "dynamic"):
            raise ConfigError(f"balance must be 'static' or 'dynamic' (got {balance!r})")
        if isinstance(balance_every, bool) or not isinstance(balance_every, int) or balance_every < 1:
            raise ConfigError(f"balance_every must be an integer >= 1 (got {balance_every!r})")
        n = int(np.shape(lengths)[0]) if np.ndim(lengths) == 1 else 0
        if window is None and n > STREAM_THRESHOLD:
            window = DEFAULT_WINDOW
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ConfigError(f"window must be an integer >= 1 (got {window!r})")
        self._window = window
        # window by window: every per-sample array stays int32 (lengths are validated <= 2**31 - 1)
        lengths = validate_lengths(lengths, compact=window is not None)
        if window is not None:
            lengths = lengths.astype(np.int32, copy=False)
        rank, world_size = rank_and_world(rank, world_size, config.world_size)
        self.config = config.with_(world_size=world_size)
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} outside world size {world_size}")
        self.rank = rank
        self.fingerprint, self.identity = fingerprint_and_identity(lengths, self.config)
        self._items = None if window is not None else make_items(lengths, config.budget, config.overlong)
        self._custom = loss_tokens is not None
        if loss_tokens is None:
            self._loss = None
        else:
            loss = np.asarray(loss_tokens)
            if (
                loss.shape != lengths.shape
                or loss.dtype.kind not in "iu"
                or (loss < 0).any()
                or (loss >= lengths).any()
            ):
                raise ConfigError("loss_tokens must hold one integer count per sample, each in 0 .. length-1")
            self._loss = loss.astype(lengths.dtype, copy=False)
        self._lengths = lengths
        self.epoch = int(epoch)
        self.balance = balance
        self.balance_every = balance_every
        dynamic = balance == "dynamic"
        if balance_headroom is None:
            headroom = default_headroom(world_size, self.config, lengths) if dynamic else 1.0
        else:
            headroom = balance_headroom
        self._budget = plan_budget(self.config, headroom) if dynamic else None  # planning budget
        self._headroom = balance_headroom
        self._dynamic = None
        if dynamic and world_size > 1:
            capacity = 2 * balance_every * config.grad_accum
            scale = (float(config.budget), float(config.budget) ** 2)
            self._dynamic = DynamicBalancer(world_size, capacity, scale, balance_exchange)
        self._history = [Segment(world_size, config.grad_accum, 0, self._budget)]
        self._partial = 0  # micro-batches of the current (unfinished) step already yielded
        self._balance = self._new_balance(None)  # decides how each coming step is given to ranks
        self._synced: tuple | None = None  # (epoch, step) of the last exchange
        self._busy = 0.0  # seconds spent yielding micro-batches (planning included), for balance_stats
        self._busy_first: float | None = None  # ... until the end of the first step
        self._cache: tuple | None = None
        self._step_cache: tuple | None = None

    def _new_balance(self, current: Balance | None) -> Balance:
        """The balance a new epoch starts with: static, the config's; dynamic, what was learned so far."""
        recut = self.balance == "dynamic"
        if self.balance == "static" or current is None:
            return Balance.of(self.config.cost, recut=recut)
        return replace(current, recut=recut)

    # ----- the plan of the current segment -------------------------------------------------------------
    def _key(self, epoch: int | None = None, history: list[Segment] | None = None) -> tuple:
        epoch = self.epoch if epoch is None else epoch
        history = self._history if history is None else history
        last = history[-1]
        return (epoch, tuple(history[:-1]), last.world_size, last.grad_accum, last.budget)

    def _plan(
        self, epoch: int | None = None, history: list[Segment] | None = None
    ) -> tuple[Plan, int, np.ndarray]:
        """The current segment's unassigned plan, the steps before it and the loss tokens of each step (of
        ``epoch`` and ``history`` when given: a state being loaded)."""
        key = self._key(epoch, history)
        if self._cache is None or self._cache[0] != key:
            self._cache = self._step_cache = None  # free the old plan before making the next
            history = self._history if history is None else history
            kw = {"lengths": self._lengths, "window": self._window}
            plan, before = replay(self._items, self.config, key[0], history, **kw)
            self._cache = (key, plan, before, step_loss_tokens(plan, self._lengths, self._loss))
        return self._cache[1], self._cache[2], self._cache[3]

    def _layout(self, plan: Plan, s: int) -> tuple:
        """Step ``s`` of ``plan`` given to ranks under the balance in force: ``(first item, order, offsets,
        features)`` (see :func:`padfree.core.balance.step_layout`; features only when balancing
        dynamically)."""
        key = (self._key(), s, self._balance)
        if self._step_cache is None or self._step_cache[0] != key:
            k = self.config.micro_per_step
            offs = plan.offsets[s * k : (s + 1) * k + 1]
            first = int(offs[0])
            lens = plan.lengths[first : int(offs[-1])]
            order, offsets = step_layout(lens, offs - first, plan.config, self._balance, self.config.budget)
            features = micro_features(lens[order], offsets, plan.config.packed) if self._dynamic else None
            self._step_cache = (key, first, order, offsets, features)
        return self._step_cache[1:]

    # ----- sampler API -----------------------------------------------------------------------------------
    @property
    def grad_accum(self) -> int:
        return self.config.grad_accum

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def step(self) -> int:
        """Steps of the current epoch consumed so far (whole steps)."""
        plan, before, _ = self._plan()
        return before + self._history[-1].steps

    @property
    def steps_in_epoch(self) -> int:
        """Optimizer steps of the current epoch, including steps run before a resume."""
        plan, before, _ = self._plan()
        return before + plan.n_steps

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; the current epoch (e.g. just restored) keeps its position."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._history = [Segment(self.world_size, self.grad_accum, 0, self._budget)]
            self._partial = 0
            self._balance = self._new_balance(self._balance)
            self._synced = None

    def __len__(self) -> int:
        """Micro-batches the next iteration yields on this rank (the rest of the epoch)."""
        plan, _, _ = self._plan()
        return (plan.n_steps - self._history[-1].steps) * self.grad_accum - self._partial

    def __iter__(self) -> Iterator[MicroBatch]:
        g, w, r = self.grad_accum, self.world_size, self.rank
        while True:
            t0 = time.perf_counter()
            plan, before, step_tokens = self._plan()
            s = self._history[-1].steps
            if s >= plan.n_steps:
                return
            j = self._partial
            if j == 0 and self._dynamic is not None:
                self._maybe_sync(before + s)
            first, order, offsets, features = self._layout(plan, s)
            k = r * g + j
            pos = first + order[int(offsets[k]) : int(offsets[k + 1])]
            ids = plan.indices[pos].tolist()
            tokens = int(step_tokens[s])
            info = MicroInfo(
                epoch=self.epoch,
                step=before + s,
                micro=j,
                last=j == g - 1,
                rank=r,
                world_size=w,
                grad_accum=g,
                step_tokens=None if tokens < 0 else tokens,
                starts=None if plan.starts is None else tuple(plan.starts[pos].tolist()),
                lengths=tuple(plan.lengths[pos].tolist()),
                indices=tuple(ids),
            )
            if j == g - 1:
                self._history[-1] = replace(self._history[-1], steps=s + 1)
                self._partial = 0
            else:
                self._partial = j + 1
            if self._dynamic is not None:
                self._dynamic.yielded(
                    (self.epoch, before + s, j), float(features[k, 0]), float(features[k, 1])
                )
            self._busy += time.perf_counter() - t0
            if self._busy_first is None and j == g - 1:
                self._busy_first = self._busy  # planning the epoch and loading the kernels: once
            yield MicroBatch(ids, info)

    # ----- dynamic balancing -------------------------------------------------------------------------------
    def _maybe_sync(self, step: int) -> None:
        """At every ``balance_every``-th step boundary: exchange the timings and refit (all ranks alike)."""
        where = (self.epoch, step)
        if step == 0 or step % self.balance_every or self._synced == where:
            return
        self._synced = where
        self._balance = self._dynamic.sync(self._balance, where)

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

    def timed(self, model: object = None, info: MicroInfo | None = None):
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
        b, d = self._balance, self._dynamic
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
            "plan_budget": self._history[-1].budget or self.config.budget,
        }

    # ----- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position and everything that decides the rest of the epoch: epoch, fingerprint, the short
        resume history, and the balance in force (cost model, rank speeds). JSON-serializable, O(resumes)."""
        position = Position(self.epoch, list(self._history), self._partial, self._balance)
        return to_state(self.fingerprint, position, self.balance, self.identity)

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
        shape = (self.world_size, self.grad_accum, self._budget, self.config.cost)
        budgets = {}

        def allowed(world: int) -> tuple:
            if world not in budgets:
                budgets[world] = segment_budgets(self.config, self._lengths, world, self._headroom)
            return budgets[world]

        def steps(epoch: int, history: list[Segment]) -> int:  # plans the state's epoch (kept for iterating)
            return self._plan(epoch, history)[0].n_steps

        pos = from_state(
            state, self.fingerprint, *shape, budgets=allowed, identity=self.identity, steps=steps
        )
        self.epoch, self._history, self._partial, self._balance = (
            pos.epoch,
            pos.history,
            pos.partial,
            pos.balance,
        )
        self._step_cache = self._synced = None
        if self._dynamic is not None:
            self._dynamic.reset()
