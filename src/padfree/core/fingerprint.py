"""A short, stable identity of (lengths, config, seed): stored in sampler states and checked on resume, so a
state from another dataset, config or seed is refused instead of silently changing the data order."""

from __future__ import annotations

import hashlib
import json

import numpy as np

from padfree.core.config import PlanConfig
from padfree.errors import StateError

_CHUNK = 4_000_000


def fingerprint(lengths: np.ndarray, config: PlanConfig, anchors: np.ndarray | None = None) -> str:
    """Hex digest of the lengths (as little-endian int64) and every config field that shapes the plan (and a
    drafter plan's per-sample ``anchors`` and capacities, when given: without them the digest is unchanged).

    World size and grad-accum are left out on purpose: an elastic resume changes them.

    >>> from padfree import PlanConfig
    >>> a = fingerprint(np.array([3, 4]), PlanConfig(seed=1))
    >>> a == fingerprint(np.array([3, 4]), PlanConfig(seed=1, world_size=4))
    True
    >>> a == fingerprint(np.array([3, 4]), PlanConfig(seed=2))
    False
    """
    return fingerprint_and_identity(lengths, config, anchors)[0]


def fingerprint_and_identity(
    lengths: np.ndarray, config: PlanConfig, anchors: np.ndarray | None = None
) -> tuple[str, dict]:
    """:func:`fingerprint` and the readable fields it hashes (``samples``, a ``lengths`` digest, strategy,
    budget, growth, buckets, mix, overlong, seed; a drafter plan's ``anchors`` digest and bounds; ``sp`` and
    ``cp`` when not 1), so that a
    mismatch can say which field differs (:func:`explain`). One pass over the lengths."""
    h = hashlib.sha256()
    lengths = np.asarray(lengths)
    for a in range(0, lengths.shape[0], _CHUNK):  # chunks: the same digest without an int64 copy of it all
        h.update(np.ascontiguousarray(lengths[a : a + _CHUNK], dtype="<i8").tobytes())
    of_lengths = h.copy().hexdigest()[:16]
    fields = {
        "strategy": config.strategy,
        "budget": config.budget,
        "growth": config.growth,
        "buckets": config.buckets,
        "mix": config.mix,
        "overlong": config.overlong,
        "seed": config.seed,
    }
    for name in ("anchor_budget", "attn_budget"):
        if getattr(config, name) is not None:
            fields[name] = getattr(config, name)
    for name in ("sp", "cp"):  # only when set: the fingerprints of plans without them stay what they were
        if getattr(config, name) != 1:
            fields[name] = getattr(config, name)
    if config.shapes is not None:  # only when set, as sp and cp
        fields["shapes"] = config.shapes if isinstance(config.shapes, int) else list(config.shapes)
    if config.attn_budget is not None:
        fields["attn_extra"] = config.attn_extra
        if config.attn_per_document:
            fields["attn_per_document"] = True
    identity: dict = {"samples": int(lengths.shape[0]), "lengths": of_lengths}
    if anchors is not None:
        h.update(b"anchors")
        counts = np.asarray(anchors)
        a_hash = hashlib.sha256()
        for i in range(0, counts.shape[0], _CHUNK):
            chunk = np.ascontiguousarray(counts[i : i + _CHUNK], dtype="<i8").tobytes()
            h.update(chunk)
            a_hash.update(chunk)
        identity["anchors"] = a_hash.hexdigest()[:16]
    h.update(json.dumps(fields, sort_keys=True).encode())
    return h.hexdigest()[:32], {**identity, **fields}


def explain(
    saved: object, now: dict, where: str = "in the checkpoint", *, sampler: bool = False
) -> str | None:
    """Which fields of a saved identity (:func:`fingerprint_and_identity`) differ from ``now``, e.g.
    ``budget 256 in the checkpoint, 512 now``; ``None`` when ``saved`` is not an identity or nothing differs.
    ``sampler``: both are sampler identities, whose optional fields (``anchor_budget``, ``attn_budget``...)
    are written only when set, so a field in one and not the other differs (``none`` on the side without
    it); otherwise only the fields both hold are compared.

    >>> explain({"budget": 256, "seed": 0}, {"budget": 512, "seed": 0})
    'budget 256 in the checkpoint, 512 now'
    >>> explain({"budget": 256}, {"budget": 256, "attn_budget": 9000}, sampler=True)
    'attn_budget none in the checkpoint, 9000 now'
    """
    if not isinstance(saved, dict):
        return None
    parts = []
    keys = list(dict.fromkeys([*now, *saved])) if sampler else [k for k in now if k in saved]
    for key in keys:
        old, new = saved.get(key), now.get(key)
        if old != new:
            if key == "lengths":
                parts.append("the token counts differ (another dataset, or samples added or changed)")
            elif key == "anchors":
                parts.append("the anchor counts differ (other loss masks or another anchor policy)")
            else:
                shown = ["none" if v is None else f"{v!r:.40}".replace("'", "") for v in (old, new)]
                parts.append(f"{key} {shown[0]} {where}, {shown[1]} now")
    return "; ".join(parts) or None


def check_state(
    state_fingerprint: object, lengths: np.ndarray, config: PlanConfig, what: str = "sampler state"
) -> None:
    """Refuse a saved state that was made for other lengths, another config or another seed.

    ``state_fingerprint`` is the value :func:`fingerprint` gave when the state was saved. Raises
    :class:`~padfree.errors.StateError` with a one-line message that says what to do.

    >>> from padfree import PlanConfig
    >>> cfg = PlanConfig(seed=1)
    >>> check_state(fingerprint(np.array([3, 4]), cfg), np.array([3, 4]), cfg)
    >>> check_state(fingerprint(np.array([3, 4]), cfg), np.array([3, 5]), cfg)
    Traceback (most recent call last):
    ...
    padfree.errors.StateError: sampler state belongs to other lengths, config or seed ...
    """
    if not isinstance(state_fingerprint, str) or not state_fingerprint:
        raise StateError(
            f"{what} has no fingerprint (got {str(state_fingerprint)[:40]!r}): it was not saved by padfree "
            "or is damaged; start without it"
        )
    expected = fingerprint(lengths, config)
    if state_fingerprint != expected:
        raise StateError(
            f"{what} belongs to other lengths, config or seed (state fingerprint {state_fingerprint[:12]}, "
            f"this run {expected[:12]}: {np.asarray(lengths).shape[0]} samples, strategy {config.strategy}, "
            f"budget {config.budget}, overlong {config.overlong}, seed {config.seed}); resume with the "
            "lengths, config and seed it was saved with, or start without it"
        )
