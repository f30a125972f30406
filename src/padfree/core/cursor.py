"""One rank's way through an epoch: from the lengths, the config, the resume history and the position in the
unfinished step to this rank's next micro-batch and its facts. Pure numpy: the torch sampler hands out what
it yields, and the Hugging Face Trainer runs on that sampler.

::

    lengths --EpochSource--> items (in memory) or windows
                  |
    history --replay--> the segment's unassigned plan --step_layout(balance)--> this rank's micro-batch
                  |                                                                  |
    position (epoch, history, partial, balance) <---------- advance ----------------+

A :class:`Cursor` keeps one plan (the current segment's, with its :class:`~padfree.core.budget.Budget`) and
one step's layout in memory; everything it yields is a pure function of its
:class:`~padfree.core.position.Position` and the source, so the state it saves (:meth:`Cursor.state_dict`,
:mod:`padfree.core.position`) continues it exactly when loaded (:meth:`Cursor.load_state_dict`).

>>> import numpy as np
>>> cfg = PlanConfig(strategy="packed", budget=64, world_size=2, grad_accum=2)
>>> cur = Cursor(EpochSource.of(np.arange(1, 41), cfg), cfg, rank=1)
>>> nxt = cur.take()
>>> (nxt.info.step, nxt.info.micro, nxt.info.last, nxt.info.rank, cur.partial, cur.peek())
(0, 0, False, 1, 1, (0, 1))
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from padfree.core.balance import Balance, dynamic_budget, micro_features, step_layout
from padfree.core.budget import Budget
from padfree.core.capacity import bounded
from padfree.core.config import PlanConfig
from padfree.core.fingerprint import fingerprint_and_identity
from padfree.core.items import Items, make_items, validate_lengths
from padfree.core.plan import Plan, validate_anchors
from padfree.core.planner import planning_window
from padfree.core.position import Position, check_taken, from_state, step_loss_tokens, to_state
from padfree.core.replay import Segment, replay
from padfree.core.sources import Counters, SourceData, replay_sources, source_data
from padfree.core.state_check import DIGEST, seal, segment_budgets
from padfree.errors import ConfigError, StateError


@dataclass(frozen=True)
class MicroInfo:
    """What the training loop needs to know about one micro-batch.

    Attributes:
        epoch: the epoch.
        step: optimizer step inside the epoch (counting steps run before a resume too).
        micro: accumulation index, ``0 .. grad_accum-1``.
        last: True on the last micro-batch of the step (run backward without ``no_sync`` on this one).
        rank, world_size, grad_accum: the shape this micro-batch was planned for.
        step_tokens: loss-bearing tokens of the whole step on all ranks (see :mod:`padfree.torch.feed.loss`),
            or ``None`` when the plan cannot know it (then count with ``loss.global_loss_tokens``).
        starts: first token of each sample's piece (``None``: every piece starts at 0).
        lengths: tokens of each sample's piece (shorter than the sample when truncated or split).
        indices: the sample ids (as in the ``MicroBatch`` list), e.g. for a log of consumed samples.
        anchors: a drafter plan's draft blocks (anchors) of each sample (``None`` without anchors).
        sources: a plan of weighted sources: each sample's source (its index in ``config.sources``).
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
    anchors: tuple[int, ...] | None = None
    sources: tuple[int, ...] | None = None


class MicroBatch(list):
    """A list of sample ids (plain ints, so any map-style dataset can index them) with its :class:`MicroInfo`
    in ``.info``: what a sampler yields for one micro-batch the cursor takes."""

    def __init__(self, ids: list[int], info: MicroInfo) -> None:
        super().__init__(ids)
        self.info = info

    def __reduce__(self):  # keep .info when sent to DataLoader workers
        return (MicroBatch, (list(self), self.info))


class Next(NamedTuple):
    """One micro-batch as the cursor yields it: sample ids, facts, and ``(slots, attention)`` when the
    cursor measures features for a dynamic balancer (else ``None``)."""

    ids: list[int]
    info: MicroInfo
    features: tuple[float, float] | None


@dataclass(frozen=True, slots=True)
class EpochSource:
    """What every epoch is planned from: the validated lengths, their items (in memory) or the window size
    (window by window: every per-sample array int32), and the loss-bearing tokens per sample (``None``:
    ``length - 1``), and a drafter plan's anchors per sample (``None``: not a drafter plan); with weighted
    sources, their :class:`~padfree.core.sources.SourceData` (``lengths`` and ``loss`` are then every
    source's, in the config's order)."""

    lengths: np.ndarray
    items: Items | None
    window: int | None
    loss: np.ndarray | None
    anchors: np.ndarray | None = None
    mixture: SourceData | None = None

    @classmethod
    def of(
        cls,
        lengths: ArrayLike,
        config: PlanConfig,
        loss_tokens: ArrayLike | None = None,
        window: int | None = None,
        anchors: ArrayLike | None = None,
    ) -> EpochSource:
        """Validate ``lengths`` and ``loss_tokens`` (one count per sample, each in ``0 .. length-1``) for
        planning window by window, ``window`` samples each, or when it is ``None`` as
        :func:`padfree.core.planner.planning_window` decides by size (in memory up to its threshold).
        With ``config.sources``, ``lengths`` (and ``loss_tokens``) map each source's name to its own."""
        if config.sources is not None:
            if window is not None or anchors is not None:
                raise ConfigError("weighted sources are planned in memory, without anchors (no window)")
            data = source_data(lengths, config, loss_tokens)  # type: ignore[arg-type]
            return cls(data.lengths, None, None, data.loss, None, data)
        window = planning_window(lengths, True if window is not None else None, window)
        arr = validate_lengths(lengths, compact=window is not None)
        if window is not None:  # lengths are validated <= 2**31 - 1
            arr = arr.astype(np.int32, copy=False)
        if config.spec.layout is not None and window is not None:
            raise ConfigError(f"{config.strategy} plans are planned in memory: no window")
        if (anchors is not None or bounded(config)) and window is not None:
            raise ConfigError(
                "drafter plans (anchors, anchor_budget, attn_budget) are planned in memory: no window"
            )
        counts = None if anchors is None else validate_anchors(anchors, arr)
        items = None
        if window is None:
            at = Budget.of(config)
            items = make_items(arr, at.item, config.overlong, anchors=counts, chunks=at.chunks)
        loss = None
        if loss_tokens is not None:
            loss = np.asarray(loss_tokens)
            if (
                loss.shape != arr.shape
                or loss.dtype.kind not in "iu"
                or (loss < 0).any()
                or (loss >= arr).any()
            ):
                raise ConfigError("loss_tokens must hold one integer count per sample, each in 0 .. length-1")
            loss = loss.astype(arr.dtype, copy=False)
        return cls(arr, items, window, loss, counts)


class _PlanCache(NamedTuple):
    key: tuple
    plan: Plan
    budget: Budget  # the segment's
    before: int  # steps of the epoch before the plan's segment
    step_tokens: np.ndarray  # loss tokens of each step of the plan (-1: unknown)
    trace: list[Counters] | None = None  # weighted sources: the counters after each step of the plan


class _StepCache(NamedTuple):
    key: tuple
    first: int  # the step's first entry in the plan
    order: np.ndarray  # the step's entries, rank after rank (see step_layout)
    offsets: np.ndarray
    features: np.ndarray | None  # (slots, attention) per micro-batch of the step


class Cursor:
    """This rank's position in an epoch and the micro-batches that follow it; it saves and loads itself
    (:meth:`state_dict`, :meth:`load_state_dict`).

    Args:
        source: the lengths (see :meth:`EpochSource.of`).
        config: the plan config at the running world size.
        rank: this rank.
        epoch: the first epoch.
        dynamic: the balance is learned at run time: steps are re-cut among ranks, a new epoch keeps the
            learned balance, and each micro-batch comes with its ``(slots, attention)`` (several ranks).
            New segments are planned with headroom for the re-cuts
            (:func:`padfree.core.balance.dynamic_budget` at ``headroom``, default the rule for these lengths).
        headroom: see ``dynamic``; a loaded state's segments may also have been planned at it.
    """

    def __init__(
        self,
        source: EpochSource,
        config: PlanConfig,
        rank: int,
        *,
        epoch: int = 0,
        dynamic: bool = False,
        headroom: float | None = None,
    ) -> None:
        if not 0 <= rank < config.world_size:
            raise ConfigError(f"rank {rank} outside world size {config.world_size}")
        if dynamic and config.shard.pads:  # its re-cuts fill rows past the group's padded row
            raise ConfigError(
                "balance='dynamic' does not re-cut SP/CP plans yet, nor shapes plans (its re-cuts do not "
                "pad documents and rows for the shard or the shapes); use balance='static'"
            )
        self.source = source
        self.config = config
        self.rank = rank
        self.dynamic = dynamic
        self.headroom = headroom
        # the planning budget new segments record (None: the config's)
        self.budget = dynamic_budget(config, source.lengths, headroom) if dynamic else None
        self.features = dynamic and config.world_size > 1
        if source.mixture is not None and dynamic:
            raise ConfigError("weighted sources are balanced statically for now; use balance='static'")
        self.fingerprint, self.identity = fingerprint_and_identity(source.lengths, config, source.anchors)
        if source.mixture is not None:  # the sources' names, weights, sizes, unit and epoch decide the plan
            self.fingerprint, self.identity = _with_sources(self.fingerprint, self.identity, source, config)
        self.epoch = int(epoch)
        self.history = [self._fresh()]
        self.partial = 0  # micro-batches of the current (unfinished) step already taken
        self.balance = self._new_balance(None)  # decides how each coming step is given to ranks
        self.spent = False  # the epoch's last micro-batch was taken, no set_epoch or load since
        self._plan_cache: _PlanCache | None = None
        self._step_cache: _StepCache | None = None

    def _fresh(self) -> Segment:
        return Segment(self.config.world_size, self.config.grad_accum, 0, self.budget)

    def _new_balance(self, current: Balance | None) -> Balance:
        """The balance an epoch starts with: static, the config's; dynamic, what was learned so far."""
        if not self.dynamic or current is None:
            return Balance.of(self.config.cost, recut=self.dynamic)
        return replace(current, recut=True)

    # ----- position and state ----------------------------------------------------------------------------
    @property
    def position(self) -> Position:
        return Position(self.epoch, list(self.history), self.partial, self.balance)

    def restore(self, position: Position) -> None:
        """Continue from ``position`` (read by :func:`padfree.core.position.from_state` for this shape)."""
        self.epoch, self.history = position.epoch, list(position.history)
        self.partial, self.balance = position.partial, position.balance
        self._step_cache = None
        if self._plan_cache is not None and self._plan_cache.key != _key(self.epoch, self.history):
            self._plan_cache = None  # kept when plan_steps just planned this very position

    def state_dict(self) -> dict:
        """The position and everything that decides the rest of the epoch
        (:func:`padfree.core.position.to_state`): epoch, fingerprint, the short resume history, the balance
        in force and, mid-step, the digest of the step's micro-batches already handed out.
        JSON-serializable, O(resumes)."""
        mode = "dynamic" if self.dynamic else "static"
        state = to_state(self.fingerprint, self.position, mode, self.identity, self.taken())
        if self.source.mixture is None:
            return state
        body = {k: v for k, v in state.items() if k != DIGEST}
        return seal({**body, "sources": self.counters().to_state()})

    def counters(self) -> Counters:
        """Weighted sources: the counters (samples drawn and units per source, the epoch's units and
        tokens) at the current step boundary; their deficits decide the coming steps."""
        cache = self._plan()
        if cache.trace is None:
            raise ConfigError("counters belong to a plan of weighted sources")
        return cache.trace[self.history[-1].steps]

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` at this cursor's shape (at another world size the rest of the epoch is
        re-planned over the new ranks). Every field is checked (:func:`padfree.core.position.from_state`):
        segment budgets against the ones this config plans at, the position against the state's own plan,
        and a mid-step state's handed-out micro-batches against what its balance gives them now
        (:func:`padfree.core.position.check_taken`). A refused state raises :class:`StateError` (one line)
        and leaves the cursor where it was. A chunked plan's mid-step state resumes at its step's first
        micro-batch: such a step trains whole, once all of it is handed out
        (:func:`padfree.torch.execution.chunked.run_step`, the Trainer), so nothing of it was trained, and a
        long
        document's later chunk cannot train without its first (every rank rewinds alike)."""
        budgets: dict[int, tuple[int | None, ...]] = {}

        def allowed(world: int) -> tuple[int | None, ...]:  # the budgets a segment at ``world`` may record
            if world not in budgets:
                budgets[world] = segment_budgets(self.config, self.source.lengths, world, self.headroom)
            return budgets[world]

        c = self.config
        pos = from_state(
            state, self.fingerprint, c.world_size, c.grad_accum, self.budget, c.cost, budgets=allowed,
            identity=self.identity, steps=self.plan_steps,  # the state's epoch planned (and kept) first
        )  # fmt: skip
        before = self.position
        self.restore(pos)
        try:
            check_taken(state, self.taken())  # mid-step: the step's handed-out part is unchanged
            if self.source.mixture is not None:
                _check_counters(state, self.counters())
        except StateError:
            self.restore(before)
            raise
        if self.config.spec.context:  # a step of chunks runs whole: none of it was trained, a chunk needs
            # its first
            self.partial = 0
        self.spent = False

    def plan_steps(self, epoch: int, history: list[Segment]) -> int:
        """Steps of the plan the last segment of ``history`` runs in ``epoch`` (a state being checked before
        it is restored; the plan is kept for it)."""
        return self._plan(int(epoch), history).plan.n_steps

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; the current epoch keeps its position."""
        self.spent = False
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.history = [self._fresh()]
            self.partial = 0
            self.balance = self._new_balance(self.balance)

    # ----- the plan of the current segment ---------------------------------------------------------------
    def _replay(self, epoch: int, history: list[Segment]) -> tuple[Plan, int]:
        return self._replay_traced(epoch, history)[:2]

    def _replay_traced(self, epoch: int, history: list[Segment]) -> tuple[Plan, int, list[Counters] | None]:
        src = self.source
        if src.mixture is not None:
            return replay_sources(src.mixture, self.config, epoch, history)
        plan, before = replay(src.items, self.config, epoch, history, lengths=src.lengths, window=src.window)
        return plan, before, None

    def _plan(self, epoch: int | None = None, history: list[Segment] | None = None) -> _PlanCache:
        """The unassigned plan of the last segment of ``history`` in ``epoch`` (default: the current
        segment), with the segment's budget, the steps before it and the loss tokens of each step."""
        if epoch is None or history is None:
            epoch, history = self.epoch, self.history
        key = _key(epoch, history)
        if self._plan_cache is None or self._plan_cache.key != key:
            self._plan_cache = self._step_cache = None  # free the old plan before making the next
            plan, before, trace = self._replay_traced(epoch, history)
            tokens = step_loss_tokens(plan, self.source.lengths, self.source.loss)
            budget = Budget.of(self.config, history[-1].budget)
            self._plan_cache = _PlanCache(key, plan, budget, before, tokens, trace)
        return self._plan_cache

    def _layout(self, cache: _PlanCache, s: int) -> _StepCache:
        """Step ``s`` of the segment's plan given to ranks under the balance in force (see
        :func:`padfree.core.balance.step_layout`)."""
        key = (_key(self.epoch, self.history), s, self.balance)
        if self._step_cache is None or self._step_cache.key != key:
            plan = cache.plan
            k = self.config.micro_per_step
            offs = plan.offsets[s * k : (s + 1) * k + 1]
            first = int(offs[0])
            lens = plan.lengths[first : int(offs[-1])]
            anchors = None if plan.anchors is None else plan.anchors[first : int(offs[-1])]
            bal = self.balance
            order, offsets = step_layout(lens, offs - first, plan.config, bal, cache.budget, anchors)
            features = None
            if self.features:
                a_order = None if anchors is None else anchors[order]
                features = micro_features(lens[order], offsets, plan.config.packed, a_order, bal.drafter)
            self._step_cache = _StepCache(key, first, order, offsets, features)
        return self._step_cache

    @property
    def plan(self) -> Plan:
        """The plan of the current segment of the epoch (every rank's micro-batches, before they are given to
        ranks): the one this cursor hands out, planned once and kept."""
        return self._plan().plan

    @property
    def step(self) -> int:
        """Whole steps of the current epoch consumed so far."""
        return self._plan().before + self.history[-1].steps

    @property
    def steps_in_epoch(self) -> int:
        """Optimizer steps of the current epoch, including steps run before a resume."""
        cache = self._plan()
        return cache.before + cache.plan.n_steps

    def epoch_steps(self, epoch: int) -> int:
        """Optimizer steps of ``epoch`` run from its beginning at this shape (the current plan stays)."""
        plan, before = self._replay(int(epoch), [self._fresh()])
        return before + plan.n_steps

    def remaining(self) -> int:
        """Micro-batches this rank has left in the current epoch."""
        plan = self._plan().plan
        return (plan.n_steps - self.history[-1].steps) * self.config.grad_accum - self.partial

    def taken(self) -> str | None:
        """Digest of the micro-batches of the unfinished step already handed out (every rank's first
        ``partial``), ``None`` at a step boundary. Stored in a mid-step state: a state whose balance would
        give that step to ranks differently (the rest of the step would lose and repeat samples) is refused
        when it is loaded, however it was sealed."""
        if self.partial == 0:
            return None
        cache = self._plan()
        plan, g = cache.plan, self.config.grad_accum
        lay = self._layout(cache, self.history[-1].steps)
        h = hashlib.sha256()
        for r in range(self.config.world_size):
            for j in range(self.partial):
                k = r * g + j
                ids = plan.indices[lay.first + lay.order[int(lay.offsets[k]) : int(lay.offsets[k + 1])]]
                h.update(np.int64(ids.shape[0]).tobytes())
                h.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
        return h.hexdigest()[:32]

    # ----- moving ----------------------------------------------------------------------------------------
    def peek(self) -> tuple[int, int] | None:
        """``(step, micro)`` of the next micro-batch, or ``None`` at the end of the epoch."""
        cache = self._plan()
        s = self.history[-1].steps
        return None if s >= cache.plan.n_steps else (cache.before + s, self.partial)

    def take(self) -> Next | None:
        """This rank's next micro-batch (the cursor moves past it), or ``None`` at the end of the epoch."""
        cache = self._plan()
        plan, s, j = cache.plan, self.history[-1].steps, self.partial
        if s >= plan.n_steps:
            return None
        g, w, r = self.config.grad_accum, self.config.world_size, self.rank
        lay = self._layout(cache, s)
        k = r * g + j
        pos = lay.first + lay.order[int(lay.offsets[k]) : int(lay.offsets[k + 1])]
        ids = plan.indices[pos].tolist()
        tokens = int(cache.step_tokens[s])
        info = MicroInfo(
            epoch=self.epoch,
            step=cache.before + s,
            micro=j,
            last=j == g - 1,
            rank=r,
            world_size=w,
            grad_accum=g,
            step_tokens=None if tokens < 0 else tokens,
            starts=None if plan.starts is None else tuple(plan.starts[pos].tolist()),
            lengths=tuple(plan.lengths[pos].tolist()),
            indices=tuple(ids),
            anchors=None if plan.anchors is None else tuple(plan.anchors[pos].tolist()),
            sources=None
            if self.source.mixture is None
            else tuple(self.source.mixture.source_of(ids).tolist()),
        )
        if j == g - 1:
            self.history[-1] = replace(self.history[-1], steps=s + 1)
            self.partial = 0
        else:
            self.partial = j + 1
        self.spent = j == g - 1 and s + 1 == plan.n_steps
        feats = None if lay.features is None else (float(lay.features[k, 0]), float(lay.features[k, 1]))
        return Next(ids, info, feats)


def _key(epoch: int, history: list[Segment]) -> tuple:
    """What decides the plan of the last segment of ``history`` (its steps run so far do not)."""
    last = history[-1]
    return (epoch, tuple(history[:-1]), last.world_size, last.grad_accum, last.budget)


def _with_sources(
    fingerprint: str, identity: dict, source: EpochSource, config: PlanConfig
) -> tuple[str, dict]:
    """The fingerprint and identity of a plan of weighted sources: the plain ones with the sources' names,
    weights and sizes, the unit and the epoch length folded in."""
    assert source.mixture is not None
    extra = {
        "sources": [[n, float(w)] for n, w in config.sources or ()],
        "source_sizes": source.mixture.sizes.tolist(),
        "unit": config.unit,
        "epoch_steps": config.epoch_steps,
        "epoch_tokens": config.epoch_tokens,
    }
    h = hashlib.sha256(fingerprint.encode())
    h.update(json.dumps(extra, sort_keys=True).encode())
    return h.hexdigest()[:32], {**identity, **extra}


def _check_counters(state: dict, counters: Counters) -> None:
    """A state of weighted sources records the counters its history gives (samples drawn and units per
    source): else its deficits were edited, or it belongs to another planner."""
    if state.get("sources") != counters.to_state():
        raise StateError(
            "malformed sampler state: its source counters (samples drawn and deficits per source) do not "
            "match what its history replays to; resume from an unedited checkpoint"
        )
