"""The transformers attention-interface call, read once: what every padfree attention receives and shares.

transformers calls an attention implementation as ``fn(module, query, key, value, attention_mask,
dropout=..., scaling=..., sliding_window=..., softcap=..., **kwargs)``. :func:`interface` writes that
signature once and hands the body a :class:`Call`; :func:`repeat_heads` gives grouped-query keys/values one
head per query head; :func:`register` puts attention and mask functions in transformers' two registries.

>>> import torch
>>> q, kv = torch.zeros(1, 4, 3, 2), torch.zeros(1, 2, 3, 2)
>>> [t.shape[1] for t in repeat_heads(q, kv, kv)]
[4, 4]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from padfree.errors import ConfigError

Forward = Callable[..., tuple[torch.Tensor, None]]
"""A transformers attention function: ``(module, query, key, value, attention_mask, **kw) -> (out, None)``."""


@dataclasses.dataclass(frozen=True)
class Call:
    """One attention call: ``query`` (B, Hq, T, D), ``key``/``value`` (B, Hkv, S, D), the padded batch's
    ``mask``, and the keywords; ``window`` is the sliding window, ``None`` when absent or not positive."""

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    dropout: float
    scaling: float | None
    window: int | None
    softcap: float | None
    kwargs: dict[str, Any]

    @property
    def sinks(self) -> torch.Tensor | None:
        """Attention-sink logits per query head (``s_aux``, gpt-oss), or ``None``."""
        return self.kwargs.get("s_aux")

    def one_row(self, name: str) -> None:
        """Refuse anything but one packed row without a mask (what a rank of a sharded row holds)."""
        if self.mask is not None and self.query.shape[0] == 1:
            raise ConfigError(
                f"{name}: one packed row per rank, no attention_mask; {type(self.module).__name__} needs one "
                "for its attention pattern (a window or chunk only the mask carries, a mask the model "
                "applies itself, or a padded row): train it unsharded or padded"
            )
        if self.query.shape[0] != 1 or self.mask is not None:
            raise ConfigError(
                f"{name}: one packed row per rank, no attention_mask (got batch {self.query.shape[0]})"
            )


def interface(body: Callable[[Call], torch.Tensor], name: str, doc: str | None = None) -> Forward:
    """The transformers attention function ``name`` that runs ``body`` on the call (doc: ``body``'s)."""

    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        window = sliding_window if sliding_window is not None and sliding_window > 0 else None
        call = Call(module, query, key, value, attention_mask, dropout, scaling, window, softcap, kwargs)
        return body(call), None

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = body.__doc__ if doc is None else doc
    forward.__module__ = body.__module__
    return forward


def repeat_heads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``key``/``value`` (B, Hkv, S, D) with one head per ``query`` head (B, Hq, T, D): each repeated
    ``Hq / Hkv`` times in place (a copy), or as they are when the heads already match."""
    rep = query.shape[1] // key.shape[1]
    if rep == 1:
        return key, value
    return key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)


def register(forwards: Mapping[str, Forward], mask: Callable[..., Any]) -> bool:
    """Register each of ``forwards`` by name with transformers' attention interface and ``mask`` under the
    same name with its mask interface; ``False`` when transformers is not installed."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    for name, fn in forwards.items():
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, mask)
    return True
