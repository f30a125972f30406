"""A batch sampler that yields this rank's micro-batches of a padfree plan, resumable in O(1) and elastic.

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

from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from padfree.core.balance import Balance, step_layout
from padfree.core.config import PlanConfig
from padfree.core.fingerprint import fingerprint
from padfree.core.items import make_items, validate_lengths
from padfree.core.plan import Plan
from padfree.core.replay import Segment, replay
from padfree.errors import ConfigError, StateError
from padfree.torch._distributed import rank_and_world

STATE_FORMAT = "padfree.sampler/2"
_FORMAT_V1 = "padfree.sampler/1"  # no balance recorded: accepted only where the cost model cannot matter


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
    ) -> None:
        lengths = validate_lengths(lengths)
        rank, world_size = rank_and_world(rank, world_size, config.world_size)
        self.config = config.with_(world_size=world_size)
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} outside world size {world_size}")
        self.rank = rank
        self.fingerprint = fingerprint(lengths, self.config)
        self._items = make_items(lengths, config.budget, config.overlong)
        self._custom = loss_tokens is not None
        if loss_tokens is None:
            self._loss = None
        else:
            loss = np.asarray(loss_tokens, dtype=np.int64)
            if loss.shape != lengths.shape or (loss < 0).any() or (loss >= lengths).any():
                raise ConfigError("loss_tokens must hold one count per sample, each in 0 .. length-1")
            self._loss = loss
        self._lengths = lengths
        self.epoch = int(epoch)
        self._history = [Segment(world_size, config.grad_accum, 0)]
        self._partial = 0  # micro-batches of the current (unfinished) step already yielded
        self._balance = Balance.of(self.config.cost)  # decides how each coming step is given to ranks
        self._cache: tuple | None = None
        self._step_cache: tuple | None = None

    # ----- the plan of the current segment -------------------------------------------------------------
    def _key(self) -> tuple:
        return (self.epoch, tuple(self._history[:-1]), self._history[-1].world_size)

    def _plan(self) -> tuple[Plan, int, np.ndarray]:
        """The current segment's unassigned plan, the steps before it and the loss tokens of each step."""
        if self._cache is None or self._cache[0] != self._key():
            plan, before = replay(self._items, self.config, self.epoch, self._history)
            self._cache = (self._key(), plan, before, self._step_tokens(plan))
        return self._cache[1], self._cache[2], self._cache[3]

    def _step_tokens(self, plan: Plan) -> np.ndarray:
        """Loss-bearing tokens per step (-1 where unknown: a custom count on a truncated or split piece)."""
        k = plan.config.micro_per_step
        m = plan.n_steps * k
        n = int(plan.offsets[m])
        if n == 0:
            return np.zeros(plan.n_steps, dtype=np.int64)
        pieces = plan.lengths[:n]
        if self._loss is None:
            per = pieces - 1
        else:
            whole = pieces == self._lengths[plan.indices[:n]]
            per = np.where(whole, self._loss[plan.indices[:n]], -(10**12))
        micro = np.zeros(m, dtype=np.int64)
        nonempty = np.flatnonzero(np.diff(plan.offsets[: m + 1]) > 0)
        micro[nonempty] = np.add.reduceat(per, plan.offsets[nonempty])
        steps = micro.reshape(plan.n_steps, k).sum(axis=1)
        return np.where(steps < 0, -1, steps)

    def _layout(self, plan: Plan, s: int) -> tuple[int, np.ndarray, np.ndarray]:
        """Step ``s`` of ``plan`` given to ranks under the balance in force: ``(first item, order, offsets)``
        (see :func:`padfree.core.balance.step_layout`)."""
        key = (self._key(), s, self._balance)
        if self._step_cache is None or self._step_cache[0] != key:
            k = self.config.micro_per_step
            offs = plan.offsets[s * k : (s + 1) * k + 1]
            first = int(offs[0])
            lens = plan.lengths[first : int(offs[-1])]
            order, offsets = step_layout(lens, offs - first, plan.config, self._balance)
            self._step_cache = (key, first, order, offsets)
        return self._step_cache[1], self._step_cache[2], self._step_cache[3]

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
            self._history = [Segment(self.world_size, self.grad_accum, 0)]
            self._partial = 0
            self._balance = Balance.of(self.config.cost)

    def __len__(self) -> int:
        """Micro-batches the next iteration yields on this rank (the rest of the epoch)."""
        plan, _, _ = self._plan()
        return (plan.n_steps - self._history[-1].steps) * self.grad_accum - self._partial

    def __iter__(self) -> Iterator[MicroBatch]:
        g, w, r = self.grad_accum, self.world_size, self.rank
        while True:
            plan, before, step_tokens = self._plan()
            s = self._history[-1].steps
            if s >= plan.n_steps:
                return
            j = self._partial
            first, order, offsets = self._layout(plan, s)
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
            yield MicroBatch(ids, info)

    # ----- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position and everything that decides the rest of the epoch: epoch, fingerprint, the short
        resume history, and the balance in force (cost model, rank speeds). JSON-serializable, O(resumes)."""
        return {
            "format": STATE_FORMAT,
            "fingerprint": self.fingerprint,
            "epoch": self.epoch,
            "history": [_entry(h) for h in self._history],
            "partial": self._partial,
            "balance": self._balance.to_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at the exact next micro-batch, at this sampler's world size (which may differ: the rest of
        the epoch is then re-planned over the new ranks).

        The state's balance (cost model, rank speeds) decides the rest of its epoch, whatever this sampler's
        config says: a step half done when the state was saved continues with the same ranks' shares, and
        the epoch ends in the order it would have without the interruption. The config's cost model applies
        again from the next epoch. At another world size the speeds start afresh. Raises
        :class:`StateError` (one line, saying why) on a foreign or damaged state, or on one that cannot be
        continued exactly.
        """
        if not isinstance(state, dict) or state.get("format") not in (STATE_FORMAT, _FORMAT_V1):
            raise StateError(f"not a padfree sampler state (expected format {STATE_FORMAT!r})")
        if state.get("fingerprint") != self.fingerprint:
            raise StateError(
                f"sampler state fingerprint {state.get('fingerprint')} does not match this dataset, config "
                f"and seed ({self.fingerprint}); refusing to resume with a different data order"
            )
        try:
            epoch = int(state["epoch"])
            history = [_segment(h) for h in state["history"]]
            partial = int(state["partial"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"malformed sampler state: {exc}") from None
        if not history or epoch < 0 or partial < 0 or any(h.steps < 0 for h in history):
            raise StateError("malformed sampler state: empty history or negative position")
        last = history[-1]
        if state["format"] == _FORMAT_V1:
            if partial or len(history) > 1:
                raise StateError(
                    f"a {_FORMAT_V1} state records no cost model and re-plans resumed epochs differently: it "
                    "can only be continued at a step boundary of an epoch never resumed at another world "
                    "size; resume from such a checkpoint or start the epoch again"
                )
            balance = Balance.of(self.config.cost)
        else:
            balance = Balance.from_state(state.get("balance"), last.world_size)
        if (last.world_size, last.grad_accum) != (self.world_size, self.grad_accum):
            if partial:
                raise StateError(
                    f"the state is {partial} micro-batch(es) into a step; it can only resume at world size "
                    f"{last.world_size} and grad_accum {last.grad_accum}, not {self.world_size} and "
                    f"{self.grad_accum}"
                )
            if last.steps == 0:
                history = history[:-1]
            history.append(Segment(self.world_size, self.grad_accum, 0))
            balance = replace(balance, speeds=None)  # other ranks: their speeds are not known yet
        elif partial >= self.grad_accum:
            raise StateError(f"malformed sampler state: partial {partial} >= grad_accum {self.grad_accum}")
        self.epoch, self._history, self._partial, self._balance = epoch, history, partial, balance
        self._cache = self._step_cache = None


def _entry(seg: Segment) -> list[int]:
    head = [seg.world_size, seg.grad_accum, seg.steps]
    return head if seg.budget is None else [*head, seg.budget]


def _segment(entry: object) -> Segment:
    w, g, steps, *rest = entry
    if len(rest) > 1:
        raise ValueError(f"a history entry has 3 or 4 numbers (got {entry!r:.60})")
    budget = rest[0] if rest else None
    return Segment(int(w), int(g), int(steps), None if budget is None else int(budget))
