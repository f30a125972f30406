"""Checking a saved sampler state before it is believed: its digest, every field's type and range, budgets.

Each field is checked against the sampler that loads it (segment budgets: one the loading config gives);
anything else is one StateError line naming the field.

A state is sealed when written (:func:`seal`: ``digest`` = sha256 of the canonical JSON of every other field),
so an edited or damaged state is refused even where each field alone is plausible (a balance changed in the
middle of a step would give the step's remaining micro-batches to ranks differently and lose samples).

>>> state = seal({"epoch": 1, "history": [[2, 1, 5]]})
>>> check_digest(state)
True
>>> check_digest(state | {"epoch": 2})
Traceback (most recent call last):
...
padfree.errors.StateError: sampler state digest ... does not match its content: it was edited or damaged ...
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import numpy as np

from padfree.core.balance import dynamic_budget
from padfree.core.config import MAX_SEED, PlanConfig
from padfree.errors import StateError

DIGEST = "digest"
MAX_SEGMENTS = 65_536
"""The most segments a state's history may hold (one per change of world size within an epoch)."""
MAX_EPOCH = MAX_SEED
"""The largest epoch a state may be at (as the seed: int64)."""


def digest(state: dict) -> str:
    """sha256 (32 hex digits) of the canonical JSON of ``state`` without its ``digest``."""
    body = {k: v for k, v in state.items() if k != DIGEST}
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False, default=_plain)
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
        raise StateError(f"malformed sampler state: not plain JSON data ({str(exc)[:80]})") from None
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _plain(value: object) -> object:
    """A numpy scalar as the Python number it holds (what JSON and a checkpoint keep of it)."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON data")


def seal(state: dict) -> dict:
    """``state`` with its :func:`digest` added."""
    return {**state, DIGEST: digest(state)}


def check_digest(state: dict) -> bool:
    """True when ``state`` carries a digest that matches its content; False when it carries none (a state
    written before digests); raises :class:`StateError` when the digest does not match."""
    saved = state.get(DIGEST)
    if saved is None:
        return False
    if not isinstance(saved, str) or saved != digest(state):
        raise StateError(
            f"sampler state digest {str(saved)[:12]!r} does not match its content: it was edited or damaged "
            "after it was written; resume from another checkpoint or start the epoch again"
        )
    return True


def integer(value: object, field: str, lo: int, hi: int) -> int:
    """``value`` when it is an integer (not a bool, not a float) from ``lo`` to ``hi``, else one line."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise StateError(
            f"malformed sampler state: {field} must be an integer from {lo} to {hi} (got {value!r:.40})"
        )
    return int(value)


def segment_budgets(
    config: PlanConfig, lengths: np.ndarray, world_size: int, headroom: float | None
) -> tuple[int | None, ...]:
    """The planning budgets a segment at ``world_size`` can have been planned at under ``config``: ``None``
    (the config's budget: static balance, or no headroom), the default dynamic headroom's and, when the
    sampler was given one, ``headroom``'s (:func:`padfree.core.balance.dynamic_budget`).

    >>> cfg = PlanConfig(strategy="packed", budget=1000)
    >>> segment_budgets(cfg, np.array([10, 20]), 2, None), segment_budgets(cfg, np.array([10]), 1, 0.7)
    ((None, 850), (None, 700))
    """
    at = config.with_(world_size=world_size)
    out: list[int | None] = [None]
    for h in (None, headroom) if headroom is not None else (None,):
        if (b := dynamic_budget(at, lengths, h)) not in out:
            out.append(b)
    return tuple(out)


def check_history(history: list, budgets: Callable[[int], tuple[int | None, ...]]) -> None:
    """Every segment's planning budget is one the loading config gives at its world size (``budgets``, e.g.
    :func:`segment_budgets`): a budget its steps were not planned at would replay other steps, and samples
    would be lost or repeated."""
    for i, seg in enumerate(history):
        allowed = budgets(seg.world_size)
        if seg.budget not in allowed:
            shown = " or ".join("the config's" if b is None else str(b) for b in allowed)
            raise StateError(
                f"sampler state history[{i}] budget {seg.budget} (world size {seg.world_size}) is not one "
                f"this sampler plans at ({shown}): resume with the config, balance mode and balance_headroom "
                "the state was saved with"
            )
