"""The epoch plan and how one in-memory epoch is planned.

``plan_items`` is where the pieces meet: items (:mod:`~padfree.core.items`) and the strategy's layout
(:mod:`~padfree.core.strategies`): its own, or the default :func:`form_steps_ranks`, micro-batches (the
strategy's ``form``), then steps and ranks (:mod:`~padfree.core.steps`). A :class:`Plan`
holds flat arrays so that millions of samples stay cheap. :func:`padfree.core.planner.make_plan` decides
between this in-memory path and the windowed one (:mod:`padfree.core.stream`, which builds on this one).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from padfree.core import capacity, cost, kernels, steps
from padfree.core.budget import Budget
from padfree.core.config import DEFAULT_COST, PlanConfig
from padfree.core.items import Items, Report, make_items, validate_lengths
from padfree.core.strategies import REGISTRY
from padfree.errors import ConfigError


def epoch_rng(seed: int, epoch: int, strategy: str, *tag: int) -> np.random.Generator:
    """The generator behind every random choice of one epoch: PCG64 seeded by (seed, epoch, the strategy's
    stream id, and ``tag``: the windowed planner's sub-streams).

    The same inputs give the same stream on every machine and in every process.
    """
    words = [int(seed), int(epoch), REGISTRY[strategy].stream_id, *map(int, tag)]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))


def check_epoch(epoch: object) -> int:
    """The epoch as an ``int``, or a :class:`ConfigError` unless it is an integer >= 0."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ConfigError(f"epoch must be an integer >= 0 (got {epoch!r})")
    return int(epoch)


def check_fills_step(n_items: int, config: PlanConfig) -> None:
    """Every rank needs ``grad_accum`` micro-batches of at least one sample in a step."""
    k = config.micro_per_step
    if n_items < k:
        raise ConfigError(
            f"{n_items} samples cannot fill one step of {k} micro-batches "
            f"(world_size {config.world_size} x grad_accum {config.grad_accum})"
        )


@dataclass(frozen=True)
class Plan:
    r"""Micro-batches, in plan order, of one epoch.

    Micro-batch ``k`` holds samples ``indices[offsets[k]:offsets[k+1]]``; it belongs to step
    ``k // (world_size*grad_accum)``, rank ``(k % (world_size*grad_accum)) // grad_accum`` and is that rank's
    accumulation micro-batch ``k % grad_accum``. With ``world_size=2, grad_accum=3``::

        micro-batch k:   0   1   2   3   4   5 | 6   7   8   9  10  11 | 12 ...
        step:            0   0   0   0   0   0 | 1   1   1   1   1   1 |  2
        rank:            0   0   0   1   1   1 | 0   0   0   1   1   1 |  0
        accumulation:    0   1   2   0   1   2 | 0   1   2   0   1   2 |  0
                        [ rank 0  ] [ rank 1  ]
                        [ one optimizer step  ]

        rank 0 runs 0, 1, 2 (no_sync, no_sync, sync) then 6, 7, 8 ...  (``micro_ids(0)``)
        indices: [ 17 4 | 9 | 23 40 2 | ... ]    offsets: [0, 2, 3, 6, ...]

    The plan balances each step's two ranks by modeled cost; the step's samples mix the dataset's lengths.

    Attributes:
        config, epoch: what made it.
        indices: sample ids, micro-batch after micro-batch.
        offsets: micro-batch boundaries into ``indices`` (``n_micro + 1`` entries).
        lengths: tokens of each entry of ``indices`` (after truncation or splitting).
        starts: first token of each entry inside its sample (``None`` unless ``overlong='split'``).
        edges: the bucket upper edges used this epoch, after sparse buckets merged (bucketed only).
        n_samples, truncated, split, dropped: the overlong policy's report.
        plan_seconds: wall time to make the plan.
        assigned: each step's micro-batches are given to ranks (``False``: still in their stratified order,
            as :func:`padfree.core.replay.replay` leaves them; then :meth:`micro_ids` and :meth:`records`
            refuse, since no rank owns a micro-batch yet).
        anchors: drafter plans: draft blocks (anchors) of each entry of ``indices`` (else ``None``).

    Build one with :meth:`of`.
    """

    config: PlanConfig
    epoch: int
    indices: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray | None = None
    edges: np.ndarray | None = None
    n_samples: int = 0
    truncated: int = 0
    split: int = 0
    dropped: int = 0
    plan_seconds: float = 0.0
    assigned: bool = True
    _cache: dict = field(default_factory=dict, repr=False, compare=False)  # "shapes": cost.Shapes
    anchors: np.ndarray | None = None

    @classmethod
    def of(
        cls,
        config: PlanConfig,
        epoch: int,
        indices: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        report: Report,
        *,
        starts: np.ndarray | None = None,
        edges: np.ndarray | None = None,
        t0: float | None = None,
        assigned: bool = True,
        shapes: cost.Shapes | None = None,
        anchors: np.ndarray | None = None,
    ) -> Plan:
        """The one way a plan is built: its arrays, the overlong ``report`` of its items, ``plan_seconds``
        since ``t0`` (``None``: 0), and ``shapes`` already computed for these micro-batches (or none)."""
        seconds = 0.0 if t0 is None else time.perf_counter() - t0
        cache = {} if shapes is None else {"shapes": shapes}
        return cls(
            config,
            epoch,
            indices,
            offsets,
            lengths,
            starts,
            edges,
            *report,
            seconds,
            assigned,
            cache,
            anchors,
        )

    @property
    def n_micro(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def n_steps(self) -> int:
        return self.n_micro // self.config.micro_per_step

    def micro(self, k: int) -> np.ndarray:
        """Sample ids of micro-batch ``k``."""
        return self.indices[self.offsets[k] : self.offsets[k + 1]]

    def micro_batches(self) -> list[np.ndarray]:
        """All micro-batches as a list of arrays (convenient for small plans)."""
        return np.split(self.indices, self.offsets[1:-1])

    def micro_ids(self, rank: int) -> np.ndarray:
        """The micro-batch numbers rank ``rank`` runs, in order (``grad_accum`` per step)."""
        self._check_assigned()
        c = self.config
        if not 0 <= rank < c.world_size:
            raise ConfigError(f"rank {rank} outside world size {c.world_size}")
        k = c.micro_per_step
        base = np.arange(self.n_steps, dtype=np.int64)[:, None] * k + rank * c.grad_accum
        return (base + np.arange(c.grad_accum, dtype=np.int64)[None, :]).ravel()

    def _check_assigned(self) -> None:
        if not self.assigned and self.config.world_size > 1:
            raise ConfigError(
                "this plan's steps are not given to ranks yet (an unassigned replay plan): no rank owns a "
                "micro-batch; see padfree.core.balance.step_layout"
            )

    def shapes(self) -> cost.Shapes:
        """Per micro-batch counts, real tokens, slots and attention (see ``cost.micro_shapes``)."""
        if "shapes" not in self._cache:
            context = self.starts if self.config.spec.context else None  # a chunk's keys of its earlier ones
            computed = cost.micro_shapes(
                self.lengths,
                self.offsets,
                self.config.packed,
                self.anchors,
                context=context,
                shard=self.config.shard,
            )
            self._cache["shapes"] = computed
        shapes: cost.Shapes = self._cache["shapes"]
        return shapes

    def forget_shapes(self) -> None:
        """Drop the cached per-micro-batch arrays (a measured piece of a long epoch)."""
        self._cache.clear()

    def costs(self) -> np.ndarray:
        """Modeled cost of each micro-batch under the plan's cost model."""
        return cost.micro_costs(self.shapes(), self.config.cost)

    def rank_costs(self) -> np.ndarray:
        """Modeled cost per (step, rank), shape ``(n_steps, world_size)``."""
        return cost.rank_costs(self.costs(), self.config.world_size, self.config.grad_accum)

    def records(self) -> Iterator[dict]:
        """One dict per micro-batch: ``{"epoch", "step", "rank", "micro", "indices"}`` (plus token ``starts``
        and ``lengths`` when samples were split)."""
        self._check_assigned()
        c = self.config
        k = c.micro_per_step
        for j in range(self.n_micro):
            a, b = int(self.offsets[j]), int(self.offsets[j + 1])
            rec = {
                "epoch": self.epoch,
                "step": j // k,
                "rank": (j % k) // c.grad_accum,
                "micro": j % c.grad_accum,
                "indices": self.indices[a:b].tolist(),
            }
            if self.starts is not None:
                rec["starts"] = self.starts[a:b].tolist()
                rec["lengths"] = self.lengths[a:b].tolist()
            yield rec


def plan_in_memory(
    lengths: ArrayLike,
    config: PlanConfig,
    epoch: int,
    *,
    path: str | None = None,
    t0: float | None = None,
    assign: bool = True,
    anchors: ArrayLike | None = None,
) -> Plan:
    """Plan one epoch with every sample in memory: validate, apply the overlong policy (at the budget's
    ``item``, :class:`~padfree.core.budget.Budget`), plan the items (``assign``: see :func:`plan_items`;
    ``anchors``: per-sample draft blocks of a drafter plan, see :func:`validate_anchors`)."""
    t0 = time.perf_counter() if t0 is None else t0
    lengths = validate_lengths(lengths, path)
    budget = Budget.of(config)
    counts = None if anchors is None else validate_anchors(anchors, lengths, path)
    items = make_items(lengths, budget.item, config.overlong, path, anchors=counts, chunks=budget.chunks)
    return plan_items(items, config, epoch, budget=budget, t0=t0, assign=assign)


def validate_anchors(anchors: object, lengths: np.ndarray, path: str | None = None) -> np.ndarray:
    """Per-sample anchor counts (draft blocks) as int64: one integer >= 0 per sample, at most its length
    (:func:`padfree.core.anchors.anchor_counts` computes them from loss masks)."""
    a = np.asarray(anchors)
    if a.shape != lengths.shape or a.dtype.kind not in "iu":
        raise ConfigError(
            f"anchors must hold one integer count per sample ({lengths.shape[0]} samples; got shape "
            f"{a.shape}, dtype {a.dtype})" + (f" for {path}" if path else "")
        )
    bad = (a < 0) | (a > lengths)
    if bad.any():
        i = int(np.argmax(bad))
        raise ConfigError(
            f"sample {i}: {int(a[i])} anchors for {int(lengths[i])} tokens (must be 0 .. length)"
            + (f" in {path}" if path else "")
        )
    return a.astype(np.int64, copy=False)


def plan_items(
    items: Items,
    config: PlanConfig,
    epoch: int,
    *,
    budget: Budget | None = None,
    t0: float | None = None,
    rng: np.random.Generator | None = None,
    assign: bool = True,
) -> Plan:
    """Plan one epoch of already prepared items (see :func:`padfree.core.items.make_items`).

    ``config`` is the segment's (its budget is what micro-batches are filled to) and ``budget`` its
    :class:`~padfree.core.budget.Budget` (default: ``Budget.of(config)``). ``rng`` replaces the epoch's
    generator (:func:`epoch_rng`); the stream planner gives each window its own.
    ``assign=False`` leaves each step's micro-batches in their stratified order, not yet given to ranks: the
    same steps (the same micro-batches in each) whatever cost model assigns them (bucketed steps are levelled
    under the default cost model, never the configured one, which a resume may change:
    :func:`padfree.core.steps.level_steps`), which the sampler then assigns one
    step at a time (:func:`padfree.core.balance.step_layout` on one step gives what ``assign=True`` gives).
    """
    t0 = time.perf_counter() if t0 is None else t0
    rng = epoch_rng(config.seed, epoch, config.strategy) if rng is None else rng
    budget = Budget.of(config) if budget is None else budget
    layout = config.spec.layout
    if layout is not None:  # the strategy lays out its own epoch: the same plan assigned or not
        laid = layout(items, config, budget, rng)
        return Plan.of(
            config, epoch, laid.sample, laid.offsets, laid.lengths, items.report, starts=laid.starts, t0=t0,
            assigned=assign,
        )  # fmt: skip
    return form_steps_ranks(items, config, epoch, budget, rng, t0, assign)


def form_steps_ranks(
    items: Items,
    config: PlanConfig,
    epoch: int,
    budget: Budget,
    rng: np.random.Generator,
    t0: float,
    assign: bool,
) -> Plan:
    """The default layout (:func:`plan_items` says what the arguments are): the strategy's ``form`` makes
    micro-batches of the items' sizes within the budget's ``cap``, strata are mixed into steps, the last step
    completed, and (``assign``) each step's micro-batches given to ranks by modeled cost and evened out."""
    check_fills_step(len(items), config)
    k = config.micro_per_step
    length = items.length
    cap = budget.cap
    # every capacity folded into one size per item (the lengths themselves without drafter bounds or SP/CP
    # padding), and micro-batches formed within cap
    size = capacity.sizes(length, items.anchors, config, cap)
    at_cap = config if cap == config.budget else config.with_(budget=cap, sp=1, cp=1)  # sizes are padded
    form = config.spec.form
    assert form is not None  # a strategy without a layout of its own has a form
    order, offsets, strata, edges = form(size, at_cap, rng)
    if strata is not None:
        ranks = None  # steps levelled for the ranks, assigned or not, under a cost model the epoch keeps: the
        # configured one is not in the fingerprint and may change at a resume, the epoch's steps may not
        if steps.levels_steps(config, items.anchors is not None or capacity.bounded(config)):
            ranks = (config.world_size, config.grad_accum, tuple(DEFAULT_COST.coefficients))
        composed = steps.quantile_steps(order, offsets, size, k, cap, rng, ranks)
        if composed is None:  # the tail cannot be cut into whole steps: strata spread by token mass
            tokens = np.add.reduceat(length[order].astype(np.float64), offsets[:-1])
            perm = steps.stratified_order(strata, tokens, rng)
            composed = kernels.gather_segments(order, offsets, perm)
        order, offsets = composed
    order, offsets = steps.complete_last_step(order, offsets, size, k, cap, config.packed)
    lens = length[order]
    anchors = None if items.anchors is None else items.anchors[order]
    shapes = cost.micro_shapes(lens, offsets, config.packed, anchors, shard=config.shard)
    cached: cost.Shapes | None = shapes  # the plan's shapes, unless the assignment reorders them
    if assign and config.world_size > 1:
        costs = cost.micro_costs(shapes, config.cost)
        perm = steps.assign_ranks(costs, config.world_size, config.grad_accum)
        order, offsets = kernels.gather_segments(order, offsets, perm)
        lens = length[order]
        if steps.evens_ranks(config, items.anchors is not None or capacity.bounded(config)):
            coefs = config.cost.coefficients
            if config.packed:
                rows, offsets = steps.even_ranks(
                    lens,
                    offsets,
                    config,
                    coefs,
                    cap,
                    size,
                    items.anchors,
                    config.cost.drafter,
                    costs[perm],
                    order,
                )
            else:
                rows, offsets = steps.even_ranks(size[order], offsets, config, coefs, cap)
            if rows is not None:
                order, lens = order[rows], lens[rows]
        anchors = None if items.anchors is None else items.anchors[order]
        cached = None
    sample_ids = order if items.sample is None else items.sample[order]
    starts = None if items.start is None else items.start[order]
    return Plan.of(
        config, epoch, sample_ids, offsets, lens, items.report, starts=starts, edges=edges, t0=t0,
        assigned=assign, shapes=cached, anchors=anchors,
    )  # fmt: skip
