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
from dataclasses import dataclass

import numpy as np

from padfree.core.config import PlanConfig
from padfree.core.fingerprint import fingerprint
from padfree.core.items import make_items, validate_lengths
from padfree.core.plan import Plan
from padfree.core.replay import Segment, replay
from padfree.errors import ConfigError, StateError
from padfree.torch._distributed import rank_and_world

STATE_FORMAT = "padfree.sampler/1"


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
        self._cache: tuple | None = None

    # ----- the plan of the current segment -------------------------------------------------------------
    def _key(self) -> tuple:
        return (self.epoch, tuple(self._history[:-1]), self._history[-1].world_size)

    def _plan(self) -> tuple[Plan, int, np.ndarray]:
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

    def __len__(self) -> int:
        """Micro-batches the next iteration yields on this rank (the rest of the epoch)."""
        plan, _, _ = self._plan()
        return (plan.n_steps - self._history[-1].steps) * self.grad_accum - self._partial

    def __iter__(self) -> Iterator[MicroBatch]:
        plan, before, step_tokens = self._plan()
        g, w, r = self.grad_accum, self.world_size, self.rank
        while self._history[-1].steps < plan.n_steps:
            s = self._history[-1].steps
            j = self._partial
            k = (s * w + r) * g + j
            a, b = int(plan.offsets[k]), int(plan.offsets[k + 1])
            ids = plan.indices[a:b].tolist()
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
                starts=None if plan.starts is None else tuple(plan.starts[a:b].tolist()),
                lengths=tuple(plan.lengths[a:b].tolist()),
                indices=tuple(ids),
            )
            if j == g - 1:
                self._history[-1] = Segment(w, g, s + 1)
                self._partial = 0
            else:
                self._partial = j + 1
            yield MicroBatch(ids, info)

    # ----- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position: epoch, fingerprint and the short resume history (JSON-serializable, O(resumes))."""
        return {
            "format": STATE_FORMAT,
            "fingerprint": self.fingerprint,
            "epoch": self.epoch,
            "history": [[s.world_size, s.grad_accum, s.steps] for s in self._history],
            "partial": self._partial,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at the exact next micro-batch, at this sampler's world size (which may differ: the rest of
        the epoch is then re-planned over the new ranks). Raises :class:`StateError` on a foreign state."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise StateError(f"not a padfree sampler state (expected format {STATE_FORMAT!r})")
        if state.get("fingerprint") != self.fingerprint:
            raise StateError(
                f"sampler state fingerprint {state.get('fingerprint')} does not match this dataset, config "
                f"and seed ({self.fingerprint}); refusing to resume with a different data order"
            )
        try:
            epoch = int(state["epoch"])
            history = [Segment(int(w), int(g), int(s)) for w, g, s in state["history"]]
            partial = int(state["partial"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"malformed sampler state: {exc}") from None
        if not history or epoch < 0 or partial < 0:
            raise StateError("malformed sampler state: empty history or negative position")
        last = history[-1]
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
        elif partial >= self.grad_accum:
            raise StateError(f"malformed sampler state: partial {partial} >= grad_accum {self.grad_accum}")
        self.epoch, self._history, self._partial = epoch, history, partial
        self._cache = None
