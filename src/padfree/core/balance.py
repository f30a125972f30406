"""Giving one step's micro-batches to ranks at run time, from a cost model and rank speeds that may change
during an epoch.

A plan fixes which items each optimizer step holds (:func:`padfree.core.replay.replay` plans are
*unassigned*); this module decides, one step at a time, which rank runs which of them. Nothing here can move
an item to another step, so any cost model, any speeds, changed at any step boundary, keep every item of the
epoch exactly once. A step's layout is a pure function of its items and the :class:`Balance` in force.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from padfree.core import _kernels, cost, steps
from padfree.core.config import CostModel, PlanConfig
from padfree.errors import StateError


@dataclass(frozen=True)
class Balance:
    """What decides how a step is given to ranks.

    Attributes:
        cost: ``(a, b, c)`` of the cost model ``a*slots + b*attention + c``.
        speeds: relative speed of each rank (``None``: all equal).
    """

    cost: tuple[float, float, float]
    speeds: tuple[float, ...] | None = None

    @classmethod
    def of(cls, model: CostModel) -> Balance:
        return cls((float(model.a), float(model.b), float(model.c)))

    def to_state(self) -> dict:
        return {
            "cost": list(self.cost),
            "speeds": None if self.speeds is None else list(self.speeds),
        }

    @classmethod
    def from_state(cls, state: object, world_size: int) -> Balance:
        """Read :meth:`to_state`'s dict back; refuses anything that is not one (one line, why)."""
        if not isinstance(state, dict):
            raise StateError(f"malformed sampler state: balance must be an object (got {state!r:.60})")
        try:
            coefs = tuple(float(v) for v in state["cost"])
            speeds = state.get("speeds")
            speeds = None if speeds is None else tuple(float(v) for v in speeds)
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"malformed sampler state: balance {exc!r:.80}") from None
        if len(coefs) != 3 or not all(math.isfinite(v) and v >= 0 for v in coefs) or sum(coefs) <= 0:
            raise StateError(f"malformed sampler state: cost {coefs} must be 3 finite numbers >= 0, not 0")
        if speeds is not None and (
            len(speeds) != world_size or not all(math.isfinite(v) and v > 0 for v in speeds)
        ):
            raise StateError(
                f"malformed sampler state: speeds must be {world_size} finite numbers > 0 (got {speeds})"
            )
        return cls(coefs, speeds)


def micro_costs(lens: np.ndarray, offsets: np.ndarray, config: PlanConfig, balance: Balance) -> np.ndarray:
    """Modeled cost of each micro-batch ``lens[offsets[k]:offsets[k+1]]`` under ``balance`` (an empty one,
    at the tail of an epoch, costs ``c``)."""
    a, b, c = balance.cost
    full = np.flatnonzero(np.diff(offsets) > 0)
    out = np.full(offsets.shape[0] - 1, float(c))
    if full.size:
        shapes = cost.micro_shapes(lens, np.append(offsets[full], offsets[-1]), config.packed)
        out[full] = a * shapes["slots"] + b * shapes["attn"] + c
    return out


def step_layout(
    lens: np.ndarray, offsets: np.ndarray, config: PlanConfig, balance: Balance
) -> tuple[np.ndarray, np.ndarray]:
    """One step given to ranks: ``(order, offsets)`` over the step's items, rank after rank, ``grad_accum``
    micro-batches each (rank ``r`` owns micro-batches ``r*grad_accum .. (r+1)*grad_accum-1``).

    ``lens`` are the step's item lengths in plan order and ``offsets`` its ``world_size*grad_accum``
    micro-batches (starting at 0). With the plan's cost model and no speeds this is exactly what
    :func:`padfree.core.plan.plan_items` assigns.

    >>> cfg = PlanConfig(strategy="packed", budget=10, world_size=2, grad_accum=1)
    >>> order, off = step_layout(np.array([9, 1, 2]), np.array([0, 1, 3]), cfg, Balance((0.0, 1.0, 0.0)))
    >>> order.tolist(), off.tolist()
    ([0, 1, 2], [0, 1, 3])
    """
    w, g = config.world_size, config.grad_accum
    if offsets.shape[0] - 1 != w * g:
        raise ValueError(f"a step of {offsets.shape[0] - 1} micro-batches for {w} x {g}")
    costs = micro_costs(lens, offsets, config, balance)
    perm = steps.assign_ranks(costs, w, g)
    return _kernels.gather_segments(np.arange(lens.shape[0], dtype=np.int64), offsets.astype(np.int64), perm)
