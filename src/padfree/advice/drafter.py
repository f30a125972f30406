"""The drafter setup ``simulate`` and ``report`` price: :func:`padfree.drafter.setup.drafter_setup` on a
target (its sizes or its folder) with the size of the offline hidden-state cache it needs, as plain values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from padfree.drafter import memory as drafter_memory
from padfree.drafter.setup import DrafterSetup, TargetShape, report
from padfree.errors import ConfigError

REPORT_ORDER = ("method", "recipe", "recipe_line", "title", "uses_anchors", "tokens", "draft_blocks")
"""The keys ``simulate --json``'s ``drafter`` entry leads with, in this order."""


def offline_cache_bytes(tokens: int, layers: int, hidden: int, bytes_per_value: int = 2) -> int:
    """Size of an offline hidden-state cache: ``tokens x layers x hidden x bytes`` (every token's hidden
    states of the drafter's target layers, e.g. bf16: 2 bytes).

    >>> offline_cache_bytes(1_000_000, 3, 4096) / 2**30  # 1M tokens, 3 layers of a 4096-wide target
    22.88818359375
    """
    return int(tokens) * int(layers) * int(hidden) * int(bytes_per_value)


def target_of_folder(folder: Path) -> TargetShape:
    """The sizes of the target in a local transformers folder (its config.json; a multimodal config's decoder
    sizes from its ``text_config``), or one-line :class:`ConfigError` naming what is missing."""
    from padfree.models import read_config_json

    if not folder.is_dir():
        raise ConfigError(f"{folder}: target not found (give a local folder written by save_pretrained)")
    cfg = read_config_json(folder)
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    need = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
    missing = [k for k in need if not isinstance(cfg.get(k), int) or cfg[k] <= 0]
    if missing:
        raise ConfigError(f"{folder / 'config.json'}: no {missing[0]} (a positive integer)")
    heads = cfg["num_attention_heads"]
    return TargetShape(
        hidden=cfg["hidden_size"],
        layers=cfg["num_hidden_layers"],
        vocab=cfg["vocab_size"],
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        intermediate=int(cfg.get("intermediate_size") or 4 * cfg["hidden_size"]),
    )


def priced_setup(
    setup: DrafterSetup,
    lengths: ArrayLike,
    *,
    cache_layers: int | None = None,
    cache_bytes: int = 2,
    target_name: str | None = None,
    loss_counts_name: str | None = None,
) -> dict:
    """The report of a drafter setup (:func:`padfree.drafter.setup.drafter_setup`) on samples of ``lengths``:
    :func:`padfree.drafter.setup.report` with the tokens an epoch trains and the offline cache of
    ``cache_layers`` target layers (default: the recipe's fused layers and the last) at ``cache_bytes`` per
    value; ``target_name`` and ``loss_counts_name`` say where the target and the loss counts came from
    (``None``: sizes given, every token but the first). A sample with more anchors than the setup's
    ``memory_gb`` lets a micro-batch hold is a one-line error."""
    bound = setup.anchor_budget
    if setup.by_memory is not None and (bound is None or bound > setup.by_memory):
        # the memory binds: a sample with more anchors than it allows cannot be planned
        assert setup.memory_gb is not None and setup.anchors is not None
        limit = setup.memory_gb * 2**30
        drafter_memory.check_anchors_fit(setup.by_memory, setup.anchors, limit, setup.config.budget)
    layers = cache_layers if cache_layers is not None else setup.cache_layers
    tokens = int(np.minimum(np.asarray(lengths, dtype=np.int64), setup.config.budget).sum())
    out = {
        **report(setup),
        "tokens": tokens,
        "cache_layers": layers,
        "target": target_name,
        "cache_bytes_per_value": cache_bytes,
        "cache_bytes": offline_cache_bytes(tokens, layers, setup.target.hidden, cache_bytes),
        "loss_counts": loss_counts_name or "every token but the first",
    }
    return {**{k: out[k] for k in REPORT_ORDER}, **out}
