"""Regenerating an epoch's plan from a short resume history, so that a world-size change keeps every sample
exactly once.

A *history* is a list of segments ``(world_size, grad_accum, steps, budget)``: the epoch ran ``steps``
optimizer steps at that shape, planned at that token budget, then resumed at the next shape. The epoch's plan
is rebuilt from the seed alone:

1. plan every item at the first segment's shape (this is the ordinary plan of the epoch);
2. drop the micro-batches of the steps that segment consumed;
3. plan the remaining items again with :func:`padfree.core.plan.plan_items` at the next segment's shape,
   with a seed derived from (seed, epoch, segment number, shape, steps so far); repeat.

The plans are *unassigned* (``assign=False``): a step's micro-batches are in their stratified order, not
yet given to ranks. Which rank runs which micro-batch is decided later, one step at a time, from a cost model
and rank speeds that may change during the epoch; none of that can change which items a step holds, nor the
order in which the rest of the epoch is handed to the next segment. So the rest of an epoch depends on the
history alone (and the configured cost model, fixed for the run, that levels bucketed steps), never on a
fitted cost model or speeds.

The history grows by one segment per *change of shape*, never with the number of samples. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from padfree.core.budget import Budget
from padfree.core.config import PlanConfig
from padfree.core.items import Items
from padfree.core.plan import Plan, plan_items
from padfree.core.stream import plan_stream
from padfree.errors import ConfigError, StateError


@dataclass(frozen=True)
class Segment:
    """``steps`` optimizer steps of one epoch run at ``world_size`` x ``grad_accum``, planned with a token
    budget of ``budget`` per micro-batch (``None``: the config's)."""

    world_size: int
    grad_accum: int
    steps: int
    budget: int | None = None


def derived_seed(
    seed: int,
    epoch: int,
    index: int,
    world_size: int,
    grad_accum: int,
    steps_before: int,
    budget: int | None = None,
) -> int:
    """The seed that re-plans segment ``index`` (> 0) of an epoch: a pure function of the history."""
    words = [seed, epoch, index, world_size, grad_accum, steps_before, 0x9ADF]
    if budget is not None:
        words.append(budget)
    return int(np.random.SeedSequence(words).generate_state(1, np.uint32)[0])


def rest_items(plan: Plan, steps: int, n_samples: int) -> Items:
    """The items of ``plan`` not in its first ``steps`` steps, as plannable :class:`Items`."""
    if steps > plan.n_steps:
        raise StateError(f"state says {steps} steps were consumed but the plan has only {plan.n_steps}")
    cut = int(plan.offsets[steps * plan.config.micro_per_step])
    start = None if plan.starts is None else plan.starts[cut:]
    anchors = None if plan.anchors is None else plan.anchors[cut:]
    return Items(
        length=plan.lengths[cut:],
        sample=plan.indices[cut:],
        start=start,
        n_samples=n_samples,
        anchors=anchors,
    )


def one_per_micro(items: Items, config: PlanConfig, epoch: int) -> Plan:
    """Fallback for an epoch tail too small to give every rank its micro-batches: each item alone, then empty
    micro-batches up to a whole step (the collators turn an empty micro-batch into a row with no loss)."""
    n = len(items)
    k = config.micro_per_step
    m = -(-n // k) * k
    offsets = np.minimum(np.arange(m + 1, dtype=np.int64), n)
    indices = items.sample_ids()[:n].astype(np.int64, copy=False)
    lengths = items.length.astype(np.int64, copy=False)
    return Plan.of(
        config, epoch, indices, offsets, lengths, items.report, starts=items.start, assigned=False,
        anchors=items.anchors,
    )  # fmt: skip


def plan_rest(
    items: Items, config: PlanConfig, epoch: int, window: int | None = None, budget: Budget | None = None
) -> Plan:
    """``plan_items`` on what is left of an epoch (window by window when more than ``window`` items are
    left, over the items' own arrays), or :func:`one_per_micro` when too little is left (a chunked plan
    lays out any rest itself, and says so when its documents no longer fit a rank's micro-batches).
    ``config`` is the segment's and ``budget`` its :class:`~padfree.core.budget.Budget`."""
    if len(items) == 0:
        return one_per_micro(items, config, epoch)
    try:
        if window is not None and len(items) > window:
            return plan_stream(
                items, config, epoch, window=window, assign=False, budget=budget, in_place=True
            )
        return plan_items(items, config, epoch, budget=budget, assign=False)
    except ConfigError:
        if config.spec.layout is not None:  # one item a micro-batch is not the strategy's layout (chunked:
            raise  # it would scatter a document's chunks over ranks)
        return one_per_micro(items, config, epoch)


def replay(
    items: Items | None,
    config: PlanConfig,
    epoch: int,
    history: list[Segment],
    *,
    lengths: np.ndarray | None = None,
    window: int | None = None,
) -> tuple[Plan, int]:
    """The unassigned plan the last segment of ``history`` runs, and how many steps of the epoch came before.

    ``config`` is the run's: each segment brings its own world size and grad-accum, and its planning budget
    when set (its :class:`~padfree.core.budget.Budget`, made once per segment). With ``window`` the epoch is
    planned window by window from ``lengths`` (:func:`padfree.core.stream.plan_stream`, the plan
    ``make_plan`` makes of a huge epoch) and so is a re-planned rest of more than ``window`` items; else the
    ``items`` are planned in memory.

    >>> import numpy as np
    >>> from padfree.core.items import make_items
    >>> items = make_items(np.arange(1, 101), 128, "error")
    >>> cfg = PlanConfig(strategy="packed", budget=128)
    >>> plan, before = replay(items, cfg, 0, [Segment(2, 1, 5), Segment(3, 2, 0)])
    >>> first, _ = replay(items, cfg, 0, [Segment(2, 1, 0)])
    >>> done = first.indices[: first.offsets[10]]
    >>> sorted(np.concatenate([done, plan.indices]).tolist()) == list(range(100)), before
    (True, 5)
    """
    if not history:
        raise StateError("empty resume history")
    cfg, budget = _segment(config, history[0])
    if window is not None:
        if lengths is None:
            raise StateError("a windowed replay needs the lengths")
        plan = plan_stream(lengths, cfg, epoch, window=window, assign=False, budget=budget)
    else:
        if items is None:
            raise StateError("an in-memory replay needs the items")
        plan = plan_items(items, cfg, epoch, budget=budget, assign=False)
    before = 0
    for i in range(1, len(history)):
        prev, seg = history[i - 1], history[i]
        if prev.steps > plan.n_steps:  # named by its place in the state's history
            raise StateError(
                f"malformed sampler state: history[{i - 1}] says {prev.steps} steps were run, but that "
                f"segment's plan has {plan.n_steps}"
            )
        rest = rest_items(plan, prev.steps, plan.n_samples)
        del plan  # the rest is a view; the consumed part goes when the rest is planned
        before += prev.steps
        seed = derived_seed(config.seed, epoch, i, seg.world_size, seg.grad_accum, before, seg.budget)
        cfg, budget = _segment(config, seg)
        plan = plan_rest(rest, cfg.with_(seed=seed), epoch, window, budget)
    return plan, before


def _segment(config: PlanConfig, seg: Segment) -> tuple[PlanConfig, Budget]:
    """The segment's config (``config`` at its world size, grad-accum and planning budget) and budget."""
    budget = Budget.of(config, seg.budget)
    return config.with_(world_size=seg.world_size, grad_accum=seg.grad_accum, budget=budget.plan), budget
