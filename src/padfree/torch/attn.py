"""Which attention implementation a strategy should use with a transformers model."""

from __future__ import annotations

import importlib


def attention_implementation(strategy: str) -> str:
    """``"padfree_varlen"`` for packed rows when :mod:`padfree.attention` is available (registering it),
    else ``"sdpa"`` (for packed rows transformers then builds a block mask from the restarting
    ``position_ids``: correct, slower)."""
    if strategy != "packed":
        return "sdpa"
    try:
        module = importlib.import_module("padfree.attention")
    except ImportError:
        return "sdpa"
    register = getattr(module, "register", None)
    if callable(register):
        register()
    attn_for = getattr(module, "attn_for", None)
    return attn_for(strategy) if callable(attn_for) else "padfree_varlen"
