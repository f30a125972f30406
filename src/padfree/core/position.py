"""A sampler's position in an epoch, as saved and read back: epoch, resume history, micro-batches of the
unfinished step, and the balance in force. Pure Python and numpy; the torch sampler stores and loads it.

A state decides the rest of its epoch by itself (format ``padfree.sampler/2``): which items each step holds
depends on the history alone (:mod:`padfree.core.replay`), how a step is given to ranks on the recorded
:class:`~padfree.core.balance.Balance`; so loading it continues exactly, whatever the loading sampler's cost
model, and a state that could not continue exactly is refused in one line that says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from padfree.core.balance import Balance
from padfree.core.config import CostModel
from padfree.core.plan import Plan
from padfree.core.replay import Segment
from padfree.errors import StateError

STATE_FORMAT = "padfree.sampler/2"
FORMAT_V1 = "padfree.sampler/1"  # no balance recorded: accepted only where the cost model cannot matter
_CHUNK = 4_000_000


@dataclass(frozen=True)
class Position:
    epoch: int
    history: list[Segment]
    partial: int
    balance: Balance


def to_state(fingerprint: str, position: Position, mode: str) -> dict:
    """The JSON-serializable state (O(resumes), never O(samples))."""
    return {
        "format": STATE_FORMAT,
        "fingerprint": fingerprint,
        "epoch": position.epoch,
        "history": [_entry(h) for h in position.history],
        "partial": position.partial,
        "mode": mode,
        "balance": position.balance.to_state(),
    }


def from_state(
    state: object, fingerprint: str, world_size: int, grad_accum: int, budget: int | None, cost: CostModel
) -> Position:
    """Read ``state`` back for a sampler of ``world_size`` x ``grad_accum`` (planning budget ``budget``).

    At another shape (a step boundary only) a segment is appended: the rest of the epoch is re-planned over
    the new ranks, the coefficients carry over and the speeds start afresh. ``cost`` is the balance of a
    ``padfree.sampler/1`` state, which recorded none (accepted only where it cannot matter).
    """
    if not isinstance(state, dict) or state.get("format") not in (STATE_FORMAT, FORMAT_V1):
        raise StateError(f"not a padfree sampler state (expected format {STATE_FORMAT!r})")
    if state.get("fingerprint") != fingerprint:
        raise StateError(
            f"sampler state fingerprint {state.get('fingerprint')} does not match this dataset, config "
            f"and seed ({fingerprint}); refusing to resume with a different data order"
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
    if state["format"] == FORMAT_V1:
        if partial or len(history) > 1:
            raise StateError(
                f"a {FORMAT_V1} state records no cost model and re-plans resumed epochs differently: it "
                "can only be continued at a step boundary of an epoch never resumed at another world "
                "size; resume from such a checkpoint or start the epoch again"
            )
        balance = Balance.of(cost)
    else:
        balance = Balance.from_state(state.get("balance"), last.world_size)
    if (last.world_size, last.grad_accum) != (world_size, grad_accum):
        if partial:
            raise StateError(
                f"the state is {partial} micro-batch(es) into a step; it can only resume at world size "
                f"{last.world_size} and grad_accum {last.grad_accum}, not {world_size} and {grad_accum}"
            )
        if last.steps == 0:
            history = history[:-1]
        history.append(Segment(world_size, grad_accum, 0, budget))
        balance = replace(balance, speeds=None)  # other ranks: their speeds are not known yet
    elif partial >= grad_accum:
        raise StateError(f"malformed sampler state: partial {partial} >= grad_accum {grad_accum}")
    return Position(epoch, history, partial, balance)


def _entry(seg: Segment) -> list[int]:
    head = [seg.world_size, seg.grad_accum, seg.steps]
    return head if seg.budget is None else [*head, seg.budget]


def _segment(entry: Sequence[Any]) -> Segment:
    w, g, steps, *rest = entry
    if len(rest) > 1:
        raise ValueError(f"a history entry has 3 or 4 numbers (got {entry!r:.60})")
    budget = rest[0] if rest else None
    return Segment(int(w), int(g), int(steps), None if budget is None else int(budget))


def step_loss_tokens(plan: Plan, lengths: np.ndarray, loss: np.ndarray | None) -> np.ndarray:
    """Loss-bearing tokens of each step of ``plan``: ``length - 1`` per piece, or the sample's ``loss`` count
    (-1 for a step holding a custom count on a truncated or split piece, which cannot be known).

    Summed in chunks of whole micro-batches (~4M pieces): no int64 temporary the size of the epoch.
    """
    k = plan.config.micro_per_step
    m = plan.n_steps * k
    offsets = plan.offsets[: m + 1]
    micro = np.zeros(m, dtype=np.int64)
    nonempty = np.flatnonzero(np.diff(offsets) > 0)
    cuts = np.arange(0, max(int(offsets[-1]), 1), _CHUNK)
    bounds = np.searchsorted(offsets[nonempty], cuts, side="left")
    for lo, hi in zip(bounds, [*bounds[1:], nonempty.shape[0]], strict=True):
        if lo == hi:
            continue
        mb = nonempty[lo:hi]
        a, b = int(offsets[mb[0]]), int(offsets[mb[-1] + 1])
        pieces = plan.lengths[a:b].astype(np.int64)
        if loss is None:
            per = pieces - 1
        else:
            ids = plan.indices[a:b]
            per = np.where(pieces == lengths[ids], loss[ids], -(10**12))
        micro[mb] = np.add.reduceat(per, offsets[mb] - a)
    steps = micro.reshape(plan.n_steps, k).sum(axis=1)
    return np.where(steps < 0, -1, steps)
