"""A sampler's position in an epoch, as saved and read back: epoch, resume history, micro-batches of the
unfinished step, and the balance in force. Pure Python and numpy; the torch sampler stores and loads it.

A state decides the rest of its epoch by itself (format ``padfree.sampler/2``): which items each step holds
depends on the history alone (:mod:`padfree.core.replay`), how a step is given to ranks on the recorded
:class:`~padfree.core.balance.Balance`; so loading it continues exactly, whatever the loading sampler's cost
model, and a state that could not continue exactly is refused in one line that says why.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from padfree.core.balance import Balance
from padfree.core.config import MAX_BUDGET, MAX_RANKS, MAX_SEED, CostModel
from padfree.core.fingerprint import explain
from padfree.core.plan import Plan
from padfree.core.replay import Segment
from padfree.core.state_check import MAX_EPOCH, MAX_SEGMENTS, check_digest, check_history, integer, seal
from padfree.errors import StateError, StateWarning

STATE_FORMAT = "padfree.sampler/2"
FORMAT_V1 = "padfree.sampler/1"  # no balance recorded: accepted only where the cost model cannot matter
_CHUNK = 4_000_000


@dataclass(frozen=True)
class Position:
    epoch: int
    history: list[Segment]
    partial: int
    balance: Balance


def to_state(
    fingerprint: str,
    position: Position,
    mode: str,
    identity: dict | None = None,
    taken: str | None = None,
) -> dict:
    """The JSON-serializable state (O(resumes), never O(samples)), sealed with a digest of its content
    (:func:`padfree.core.state_check.seal`). ``identity`` (the fields the fingerprint hashes) lets a resume
    under another config say which field differs; ``taken`` (mid-step: the digest of the step's micro-batches
    already handed out, :meth:`padfree.core.cursor.Cursor.taken`) lets a load check that the state's balance
    gives the rest of the step to ranks as before (:func:`check_taken`)."""
    state = {
        "format": STATE_FORMAT,
        "fingerprint": fingerprint,
        "epoch": position.epoch,
        "history": [_entry(h) for h in position.history],
        "partial": position.partial,
        "mode": mode,
        "balance": position.balance.to_state(),
    }
    if identity is not None:
        state["identity"] = identity
    if taken is not None:
        state["taken"] = taken
    return seal(state)


def check_taken(state: dict, taken: str | None) -> None:
    """A mid-step state's ``taken`` equals ``taken``, what its balance gives the step's first ``partial``
    micro-batches of every rank now: else the rest of the step would go to ranks differently, and samples
    would be lost and repeated (a balance edited, even within its bounds and re-sealed)."""
    if taken is not None and state.get("taken") != taken:
        raise StateError(
            f"malformed sampler state: taken {str(state.get('taken'))[:12]!r} does not match the "
            f"micro-batches its balance gives the first {state.get('partial')} of the unfinished step "
            f"({taken[:12]}): the "
            "balance or the position was edited mid-step; resume from a checkpoint at a step boundary"
        )


def from_state(
    state: object,
    fingerprint: str,
    world_size: int,
    grad_accum: int,
    budget: int | None,
    cost: CostModel,
    *,
    budgets: Callable[[int], tuple[int | None, ...]] | None = None,
    identity: dict | None = None,
    steps: Callable[[int, list[Segment]], int] | None = None,
) -> Position:
    """Read ``state`` back for a sampler of ``world_size`` x ``grad_accum`` (planning budget ``budget``).

    Every field is checked first (one :class:`StateError` line naming the field): integers are integers in
    range, each segment's budget one of ``budgets(world_size)`` (the budgets the loading config gives, see
    :func:`padfree.core.state_check.segment_budgets`), the balance within its bounds; then the digest (a state
    without one, written before digests, is accepted at a step boundary with a
    :class:`~padfree.errors.StateWarning`, and refused mid-step: it does not record ``taken``). A state of
    another config says which field differs when it records its ``identity`` and ``identity`` is given.

    At another shape (a step boundary only) a segment is appended: the rest of the epoch is re-planned over
    the new ranks, the coefficients carry over and the speeds start afresh. ``cost`` is the balance of a
    ``padfree.sampler/1`` state, which recorded none (accepted only where it cannot matter). ``steps(epoch,
    history)`` gives the steps of the last segment's plan (the caller plans it; the replay checks the earlier
    segments): the position must lie inside it (:func:`check_steps`).
    """
    state = _check_identity(state, fingerprint, identity)
    for key in ("epoch", "history", "partial"):
        if key not in state:
            raise StateError(f"malformed sampler state: no {key!r}")
    epoch = integer(state["epoch"], "epoch", 0, MAX_EPOCH)
    partial = integer(state["partial"], "partial", 0, MAX_RANKS - 1)
    raw = state["history"]
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_SEGMENTS:
        raise StateError(f"malformed sampler state: history must be a list of 1 to {MAX_SEGMENTS} segments")
    history = [_segment(h, i) for i, h in enumerate(raw)]
    idle = next((i for i, seg in enumerate(history[:-1]) if seg.steps == 0), None)
    if idle is not None:  # a resume drops a last segment that ran no step before it appends the next
        raise StateError(
            f"malformed sampler state: history[{idle}] steps must be at least 1 (only the last segment can "
            "have run no step)"
        )
    if state.get("mode", "static") not in ("static", "dynamic"):
        raise StateError(
            f"malformed sampler state: mode must be 'static' or 'dynamic' (got {state['mode']!r:.40})"
        )
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
    if budgets is not None:
        check_history(history, budgets)
    if (last.world_size, last.grad_accum) == (world_size, grad_accum) and partial >= grad_accum:
        raise StateError(f"malformed sampler state: partial {partial} >= grad_accum {grad_accum}")
    if partial >= last.grad_accum:
        raise StateError(
            f"malformed sampler state: partial {partial} >= the state's grad_accum {last.grad_accum}"
        )
    if steps is not None:
        check_steps(Position(epoch, history, partial, balance), steps(epoch, history))
    _check_sealed(state, partial)
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
    return Position(epoch, history, partial, balance)


def _check_identity(state: object, fingerprint: str, identity: dict | None) -> dict:
    """``state`` if it is a sampler state of this dataset, config and seed; else a :class:`StateError`."""
    if not isinstance(state, dict) or state.get("format") not in (STATE_FORMAT, FORMAT_V1):
        raise StateError(f"not a padfree sampler state (expected format {STATE_FORMAT!r})")
    if state.get("fingerprint") != fingerprint:
        why = None
        if identity is not None:
            why = explain(state.get("identity"), identity, "in the state", sampler=True)
        if why is not None:
            raise StateError(
                f"the sampler state belongs to another configuration ({why}); resume with the config and "
                "data it was saved with, or start a new run without it (another checkpoint directory)"
            )
        raise StateError(
            f"sampler state fingerprint {str(state.get('fingerprint'))[:40]} does not match this dataset, "
            f"config and seed ({fingerprint}); refusing to resume with a different data order"
        )
    return state


def _check_sealed(state: dict, partial: int) -> None:
    """A state without a digest (written before digests) only at a step boundary, and with a warning."""
    sealed = check_digest(state)
    if partial and not sealed and "taken" not in state:  # written before digests and `taken` (issue 20)
        raise StateError(
            "a sampler state saved mid-step by an earlier padfree (no record of the step's micro-batches "
            "already handed out, no digest) cannot be continued exactly: resume from a checkpoint at a step "
            "boundary or start the epoch again"
        )
    if not sealed:
        warnings.warn(
            "the sampler state has no digest (it was written before sampler states carried one): its "
            "fields were checked, but an edit that keeps them plausible cannot be detected",
            StateWarning,
            stacklevel=4,
        )


def check_steps(position: Position, n_steps: int) -> None:
    """The position lies inside the plan of its last segment (``n_steps`` steps): its steps at most
    ``n_steps``, and a partial step one that exists (earlier segments are checked by the replay)."""
    last = position.history[-1]
    if last.steps + (position.partial > 0) > n_steps:
        raise StateError(
            f"malformed sampler state: history[{len(position.history) - 1}] says {last.steps} steps"
            f"{' and a partial one' if position.partial else ''} were run, but that segment's plan has "
            f"{n_steps}"
        )


def _entry(seg: Segment) -> list[int]:
    head = [seg.world_size, seg.grad_accum, seg.steps]
    return head if seg.budget is None else [*head, seg.budget]


def _segment(entry: object, i: int) -> Segment:
    if not isinstance(entry, (list, tuple)) or len(entry) not in (3, 4):
        raise StateError(
            f"malformed sampler state: history[{i}] must hold 3 or 4 integers (got {entry!r:.60})"
        )
    w = integer(entry[0], f"history[{i}] world size", 1, MAX_RANKS)
    g = integer(entry[1], f"history[{i}] grad_accum", 1, MAX_RANKS)
    steps = integer(entry[2], f"history[{i}] steps", 0, MAX_SEED)
    budget = None if len(entry) == 3 else integer(entry[3], f"history[{i}] budget", 1, MAX_BUDGET)
    return Segment(w, g, steps, budget)


def step_loss_tokens(plan: Plan, lengths: np.ndarray, loss: np.ndarray | None) -> np.ndarray:
    """Loss-bearing tokens of each step of ``plan``: ``length - 1`` per piece, or the sample's ``loss`` count
    (-1 for a step holding a custom count on a truncated or split piece, which cannot be known). A chunked
    plan's document counts once, over all its chunks (``length - 1``, or ``loss`` when it is whole).

    Summed in chunks of whole micro-batches (~4M pieces): no int64 temporary the size of the epoch.
    """
    k = plan.config.micro_per_step
    m = plan.n_steps * k
    chunked = plan.config.chunked
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
        if chunked and plan.starts is not None:  # a chunk after the first predicts its first token too
            first = plan.starts[a:b] == 0
            if loss is None:
                per = pieces - first
            else:  # the document's count on its first chunk; unknown when it was truncated
                ids = plan.indices[a:b]
                doc = np.maximum(np.cumsum(first) - 1, 0)  # a window may open mid-document
                whole = np.bincount(doc, weights=pieces)[doc] == lengths[ids]
                per = np.where(first, np.where(whole, loss[ids], -(10**12)), 0)
        elif loss is None:
            per = pieces - 1
        else:
            ids = plan.indices[a:b]
            per = np.where(pieces == lengths[ids], loss[ids], -(10**12))
        micro[mb] = np.add.reduceat(per, offsets[mb] - a)
    steps = micro.reshape(plan.n_steps, k).sum(axis=1)
    return np.where(steps < 0, -1, steps)
