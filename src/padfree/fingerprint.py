"""A short, stable identity of (lengths, config, seed): stored in sampler states and checked on resume, so a
state from another dataset, config or seed is refused instead of silently changing the data order."""

from __future__ import annotations

import hashlib
import json

import numpy as np

from padfree.config import PlanConfig


def fingerprint(lengths: np.ndarray, config: PlanConfig) -> str:
    """Hex digest of the lengths (as little-endian int64) and every config field that shapes the plan.

    World size and grad-accum are left out on purpose: an elastic resume changes them.

    >>> from padfree import PlanConfig
    >>> a = fingerprint(np.array([3, 4]), PlanConfig(seed=1))
    >>> a == fingerprint(np.array([3, 4]), PlanConfig(seed=1, world_size=4))
    True
    >>> a == fingerprint(np.array([3, 4]), PlanConfig(seed=2))
    False
    """
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(np.asarray(lengths), dtype="<i8").tobytes())
    fields = {
        "strategy": config.strategy,
        "budget": config.budget,
        "growth": config.growth,
        "buckets": config.buckets,
        "mix": config.mix,
        "overlong": config.overlong,
        "seed": config.seed,
    }
    h.update(json.dumps(fields, sort_keys=True).encode())
    return h.hexdigest()[:32]
