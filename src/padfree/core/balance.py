"""Giving one step's micro-batches to ranks at run time, from a cost model and rank speeds that may change
during an epoch.

A plan fixes which items each optimizer step holds (:func:`padfree.core.replay.replay` plans are
*unassigned*); this module decides, one step at a time, which rank runs which of them. Nothing here can move
an item to another step, so any cost model, any speeds, changed at any step boundary, keep every item of the
epoch exactly once. A step's layout is a pure function of its items and the :class:`Balance` in force.

Two ways to give a step to ranks of different speeds:

- *assignment*: whole micro-batches, the costly ones to the fast ranks (``_ranks.balance_ranks``);
- *re-cut*: the step's items are cut again into ``grad_accum`` micro-batches per rank, each within the
  budget, the heavier share to the faster ranks: packed, best fit into bins (``_ranks.recut_packed``);
  padded, whole rows moved from the slowest rank's micro-batches to similar-length ones of faster ranks
  (``_ranks.recut_padded``).
  Equal-cost micro-batches cannot be balanced by assignment, and a re-cut can only give a fast rank more
  than the average if the average leaves room: a dynamic plan fills its micro-batches to ``headroom *
  budget`` (:func:`dynamic_budget`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from padfree.core import _ranks, capacity, cost, kernels, refit, steps
from padfree.core.budget import Budget
from padfree.core.config import MAX_COST, CostModel, PlanConfig
from padfree.core.cost import Coefficients
from padfree.errors import ConfigError, StateError


@dataclass(frozen=True)
class Balance:
    """What decides how a step is given to ranks.

    Attributes:
        cost: the coefficients of the cost model ``a*slots + b*attention + c`` (a tuple is taken as them).
        speeds: relative speed of each rank, mean 1 (``None``: all equal).
        fitted: ``cost`` was fitted to measured seconds (else it is a configured model, in token units).
        recut: steps are re-cut among ranks (dynamic balancing), not only assigned.
        drafter: a drafter plan's block and reach in token slots (:attr:`CostModel.drafter`), fixed for
            the run: the linear work of a micro-batch is ``slots + drafter[0]*blocks + drafter[1]*reach``
            (:func:`padfree.core.cost.work`) and ``a`` prices it, whether configured or fitted.
    """

    cost: Coefficients
    speeds: tuple[float, ...] | None = None
    fitted: bool = False
    recut: bool = False
    drafter: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        if not isinstance(self.cost, Coefficients):
            object.__setattr__(self, "cost", Coefficients(*self.cost))

    @classmethod
    def of(cls, model: CostModel, recut: bool = False) -> Balance:
        return cls(model.coefficients, recut=recut, drafter=model.drafter)

    def to_state(self) -> dict:
        speeds = None if self.speeds is None else list(self.speeds)
        out = {"cost": list(self.cost), "speeds": speeds, "fitted": self.fitted, "recut": self.recut}
        if any(self.drafter):
            out["drafter"] = list(self.drafter)
        return out

    @classmethod
    def from_state(cls, state: object, world_size: int) -> Balance:
        """Read :meth:`to_state`'s dict back; refuses anything that is not one (one line naming the field):
        ``cost`` 3 numbers from 0 to :data:`~padfree.core.config.MAX_COST`, not all 0; ``speeds`` one number
        per rank, mean 1, the fastest at most :data:`~padfree.core.refit.SPEED_RATIO` times the slowest
        (what a refit can give); ``fitted`` and ``recut`` true or false.

        >>> Balance.from_state({"cost": [1.0, 0.0, 0.0], "speeds": [1e300, 1.0]}, 2)
        Traceback (most recent call last):
        ...
        padfree.errors.StateError: malformed sampler state: balance.speeds [1e+300, 1.0] must be 2 numbers ...
        """
        if not isinstance(state, dict):
            raise StateError(f"malformed sampler state: balance must be an object (got {state!r:.60})")
        coefs, speeds = _numbers(state.get("cost")), _numbers(state.get("speeds"))
        if coefs is None or len(coefs) != 3 or not all(0 <= v <= MAX_COST for v in coefs) or sum(coefs) <= 0:
            raise StateError(
                f"malformed sampler state: balance.cost {_show(state.get('cost'))} must be 3 numbers from 0 "
                f"to {MAX_COST:g}, not all 0"
            )
        if state.get("speeds") is not None and not (
            speeds is not None
            and len(speeds) == world_size
            and min(speeds) > 0
            and max(speeds) <= refit.SPEED_RATIO * (1 + 1e-5) * min(speeds)
            and abs(math.fsum(speeds) / world_size - 1.0) <= SPEED_MEAN_TOLERANCE
        ):
            raise StateError(
                f"malformed sampler state: balance.speeds {_show(state.get('speeds'))} must be {world_size} "
                f"numbers > 0 of mean 1, the largest at most {refit.SPEED_RATIO:g} times the smallest"
            )
        flags = (state.get("fitted", False), state.get("recut", False))
        if not all(isinstance(f, bool) for f in flags):
            raise StateError(
                "malformed sampler state: balance.fitted and balance.recut must be true or false "
                f"(got {flags})"
            )
        drafter = _numbers(state.get("drafter", [0.0, 0.0]))
        if drafter is None or len(drafter) != 2 or not all(0 <= v <= MAX_COST for v in drafter):
            raise StateError(
                f"malformed sampler state: balance.drafter {_show(state.get('drafter'))} must be 2 numbers "
                ">= 0"
            )
        return cls(
            Coefficients(*coefs),
            None if speeds is None else tuple(speeds),
            *flags,
            drafter=(drafter[0], drafter[1]),
        )


SPEED_MEAN_TOLERANCE = 1e-3
"""How far the mean of a state's rank speeds may be from 1 (a refit normalizes it to 1, to 6 digits)."""


def _numbers(values: object) -> list[float] | None:
    """``values`` as floats when it is a list of finite ints or floats (not bools: ``True`` is no
    coefficient), else ``None``."""
    if not isinstance(values, (list, tuple)) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
    ):
        return None
    return [float(v) for v in values]


def _show(value: object) -> str:
    return f"{value!r:.80}"


def dynamic_budget(
    config: PlanConfig, lengths: np.ndarray | None = None, headroom: float | None = None
) -> int | None:
    """The planning budget a dynamically balanced segment records (``None``: the config's): packed bins
    filled to ``sum <= headroom * budget``, padded micro-batches to ``count * longest <= headroom * budget``
    (``headroom`` default :func:`default_headroom` for these lengths at the config's world size).

    >>> dynamic_budget(PlanConfig(strategy="packed", budget=1000, world_size=2), np.array([10, 20]))
    850
    >>> dynamic_budget(PlanConfig(strategy="bucketed", budget=1000), headroom=0.85)
    850
    >>> dynamic_budget(PlanConfig(strategy="bucketed", budget=1000), headroom=1.0) is None
    True
    """
    if config.spec.layout is not None:  # its steps run on the ranks its layout gave them: no re-cut
        return None
    if headroom is None:
        headroom = default_headroom(config.world_size, config, lengths)
    if not (isinstance(headroom, (int, float)) and 0.5 <= headroom <= 1.0):
        raise ConfigError(f"balance headroom must be a number in 0.5 .. 1 (got {headroom!r})")
    if headroom == 1.0:
        return None
    return max(1, int(config.budget * headroom))


def default_headroom(
    world_size: int, config: PlanConfig | None = None, lengths: np.ndarray | None = None
) -> float:
    """Room for one rank ~1.4x slower than the others: ``1 - 0.3 / world_size`` (0.85 at 2 ranks, 0.9625
    at 8), 1 for one rank.

    A padded plan (``config`` not packed) is re-cut by moving whole rows, and an item longer than half the
    planning budget fills a micro-batch alone: where such items hold more than half of the tokens
    (``lengths`` clipped at the budget; long documents), the room would cost more tokens per step than the
    re-cut can win back, and the headroom is 1.

    >>> default_headroom(2), default_headroom(8)
    (0.85, 0.9625)
    >>> cfg = PlanConfig(strategy="bucketed", budget=1000)
    >>> default_headroom(2, cfg, np.array([100] * 9)), default_headroom(2, cfg, np.array([100, 900, 1000]))
    (0.85, 1.0)
    """
    if world_size <= 1:
        return 1.0
    room = 1.0 - 0.3 / world_size
    if config is None or config.packed or lengths is None or np.shape(lengths)[0] == 0:
        return room
    lengths = np.asarray(lengths)
    total = long = 0
    for i in range(0, lengths.shape[0], 1 << 22):  # in chunks: bounded memory at any epoch size
        clipped = np.minimum(lengths[i : i + (1 << 22)], config.budget).astype(np.int64)
        total += int(clipped.sum())
        long += int(clipped[clipped > room * config.budget / 2].sum())
    return room if 2 * long <= total else 1.0


def micro_features(
    lens: np.ndarray,
    offsets: np.ndarray,
    packed: bool,
    anchors: np.ndarray | None = None,
    drafter: tuple[float, float] = (0.0, 0.0),
) -> np.ndarray:
    """``(work, attention)`` of each micro-batch, shape ``(m, 2)`` (zeros for an empty one); ``work`` is the
    slots, plus a drafter plan's blocks and reach weighted by ``drafter`` (:func:`padfree.core.cost.work`)."""
    shapes = cost.micro_shapes(lens, offsets, packed, anchors)
    return np.column_stack([cost.work(shapes, drafter), shapes.attn])


def step_layout(
    lens: np.ndarray,
    offsets: np.ndarray,
    config: PlanConfig,
    balance: Balance,
    budget: Budget | None = None,
    anchors: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One step given to ranks: ``(order, offsets)`` over the step's items, rank after rank, ``grad_accum``
    micro-batches each (rank ``r`` owns micro-batches ``r*grad_accum .. (r+1)*grad_accum-1``).

    ``lens`` are the step's item lengths in plan order and ``offsets`` its ``world_size*grad_accum``
    micro-batches (starting at 0); ``config`` is the segment's and ``budget`` its
    :class:`~padfree.core.budget.Budget` (default ``Budget.of(config)``): a re-cut bin holds up to its
    ``item`` (a drafter plan's, up to its ``cap``, the tokens its item sizes are counted in). With the plan's
    cost model, no speeds and no re-cut this is exactly what :func:`padfree.core.plan.plan_items` gives the
    step: assigned, and, bucketed, its ranks evened out (:func:`padfree.core.steps.even_ranks`).
    ``anchors`` (a drafter plan's, in the order of ``lens``) enter the costs, and a packed re-cut keeps
    every bin within the anchor budget (:mod:`padfree.core.capacity`); padded drafter steps are assigned,
    not re-cut.

    >>> cfg = PlanConfig(strategy="packed", budget=10, world_size=2, grad_accum=1)
    >>> order, off = step_layout(np.array([9, 1, 2]), np.array([0, 1, 3]), cfg, Balance((0.0, 1.0, 0.0)))
    >>> order.tolist(), off.tolist()
    ([0, 1, 2], [0, 1, 3])
    """
    w, g = config.world_size, config.grad_accum
    if offsets.shape[0] - 1 != w * g:
        raise ValueError(f"a step of {offsets.shape[0] - 1} micro-batches for {w} x {g}")
    if config.spec.layout is not None:  # its layout gave the step to ranks (chunked: a document's chunks
        return np.arange(int(offsets[-1]), dtype=np.int64), offsets.astype(np.int64, copy=False)  # on one)
    shapes = cost.micro_shapes(lens, offsets, config.packed, anchors, shard=config.shard)
    costs = cost.micro_costs(shapes, balance.cost, balance.drafter)
    speeds = np.ones(w) if balance.speeds is None else np.asarray(balance.speeds, dtype=np.float64)
    perm = steps.assign_ranks(costs, w, g, speeds=None if balance.speeds is None else speeds)
    ids = np.arange(lens.shape[0], dtype=np.int64)
    order, new_offsets = kernels.gather_segments(ids, offsets.astype(np.int64), perm)
    budget = Budget.of(config) if budget is None else budget
    drafting = anchors is not None or capacity.bounded(config)
    if not balance.recut and balance.speeds is None and steps.evens_ranks(config, drafting) and lens.size:
        if config.packed:
            held = None if anchors is None else anchors[order]
            sizes = capacity.sizes(lens[order], held, config, budget.cap)
            evened = steps.even_ranks(
                lens[order],
                new_offsets,
                config,
                tuple(balance.cost),
                budget.cap,
                sizes,
                held,
                balance.drafter,
            )
        else:
            sized = config.shard.sizes(lens[order], False)  # SP/CP: the padded widths
            evened = steps.even_ranks(sized, new_offsets, config, tuple(balance.cost), budget.cap)
        rows = evened[0]
        return order if rows is None else order[rows], evened[
            1
        ]  # what plan_items gives a step of equal ranks
    if not (balance.recut and w > 1 and lens.size):
        return order, new_offsets
    assigned = (costs[perm].reshape(w, g).sum(axis=1) / speeds).max()
    cap = budget.cap if drafting else budget.item
    if not config.packed:
        if drafting:
            return order, new_offsets
        return _recut_padded(lens, (order, new_offsets), balance.cost, speeds, g, cap, assigned)
    c = balance.cost.c
    # a packed item's share of its bin's cost: its slots and attention (and blocks), the bin's constant once
    alone = cost.micro_shapes(lens, np.arange(lens.shape[0] + 1), True, anchors)  # each item a packed row
    weight = cost.micro_costs(alone, balance.cost._replace(c=0.0), balance.drafter)
    room = lens.astype(np.int64)
    if drafting:
        room = capacity.sizes(room, anchors, config, cap).astype(np.int64)
    bin_of = _ranks.recut_packed(room, weight, float(c), speeds, g, cap)
    if bin_of.size == 0:
        return order, new_offsets
    recut = ((np.bincount(bin_of // g, weights=weight, minlength=w) + g * c) / speeds).max()
    if not recut < assigned:
        return order, new_offsets
    return _by_bin(bin_of, w * g)


def _by_bin(bin_of: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(order, offsets)`` of items labelled with their micro-batch ``bin_of`` (stable inside one)."""
    offsets = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(np.bincount(bin_of, minlength=k), out=offsets[1:])
    return kernels.counting_argsort(bin_of, k).astype(np.int64, copy=False), offsets


def _recut_padded(
    lens: np.ndarray,
    assignment: tuple[np.ndarray, np.ndarray],
    model: Coefficients,
    speeds: np.ndarray,
    accum: int,
    cap: int,
    assigned: float,
) -> tuple[np.ndarray, np.ndarray]:
    """A padded step's ``assignment`` re-cut by moving whole rows from the slowest rank's micro-batches to
    similar-length ones of faster ranks (``_ranks.recut_padded``, ``count * longest <= cap``), kept only
    when it lowers the slowest rank's modeled time below ``assigned``."""
    order, offsets = assignment
    k = offsets.shape[0] - 1
    lens_a = lens[order].astype(np.int64)
    bin_of = _ranks.recut_padded(lens_a, offsets, speeds, accum, cap, np.asarray(model, dtype=np.float64))
    moved, new_offsets = _by_bin(bin_of, k)
    shapes = cost.micro_shapes(lens_a[moved], new_offsets, False)
    per_rank = cost.micro_costs(shapes, model).reshape(-1, accum).sum(axis=1)
    if not (per_rank / speeds).max() < assigned:
        return assignment
    return order[moved], new_offsets
