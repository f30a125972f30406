"""The one record of a drafter run's sizes, the target's and the drafter's, that the cost model, the memory
model and the reference drafters' configs all read. No torch.

>>> s = Sizes.common(hidden=512, layers=8, vocab=1000)
>>> s.heads, s.kv_heads, s.intermediate, s.head_vocab, s.head_dim
(4, 1, 1536, 1000, 128)
>>> Sizes(hidden=64, heads=4, draft_vocab=32).head_vocab
32
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from padfree.errors import ConfigError


@dataclass(frozen=True)
class Sizes:
    """A target's sizes and its drafter's (defaults: a Llama-2-7B shape with one draft layer).

    Attributes:
        hidden, layers, vocab: the target's width, decoder layers and vocabulary.
        heads, kv_heads, intermediate: its attention heads, key-value heads and MLP width (the reference
            drafters copy them).
        head_size: the width of one attention head (None: ``hidden // heads``). eps, rope_theta: its
            RMSNorm epsilon and rotary base (the drafters copy them; a rotary scaling is not carried).
        draft_layers: the drafter's layers. fused_layers: the target layers it fuses.
        draft_vocab: the drafter's LM-head vocabulary (None: the target's).
    """

    hidden: int = 4096
    layers: int = 32
    vocab: int = 32000
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 3 * 4096
    head_size: int | None = None
    eps: float = 1e-6
    rope_theta: float = 10000.0
    draft_layers: int = 1
    fused_layers: int = 3
    draft_vocab: int | None = None

    def __post_init__(self) -> None:
        if min(self.hidden, self.layers, self.draft_layers) < 1 or min(self.vocab, self.head_vocab) < 0:
            raise ConfigError("drafter shape: sizes must be >= 1 and vocabularies >= 0")

    @property
    def head_vocab(self) -> int:
        """The drafter's LM-head rows: its draft vocabulary, or the target's."""
        return self.vocab if self.draft_vocab is None else self.draft_vocab

    @property
    def head_dim(self) -> int:
        """The width of one attention head."""
        return self.head_size or self.hidden // self.heads

    def with_(self, **changes: Any) -> Sizes:
        """These sizes with ``changes`` (fields by name)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def common(cls, hidden: int, layers: int, vocab: int) -> Sizes:
        """A target of these sizes with the common shapes: heads of 128 dimensions, a quarter as many
        key-value heads, an MLP 3x the hidden size."""
        heads = max(1, hidden // 128)
        return cls(hidden, layers, vocab, heads, max(1, heads // 4), 3 * hidden)

    @classmethod
    def of_config(cls, cfg: Any) -> Sizes:
        """The sizes of a transformers config (a loaded target's ``model.config``)."""
        heads = int(cfg.num_attention_heads)
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        return cls(
            int(cfg.hidden_size),
            int(cfg.num_hidden_layers),
            int(cfg.vocab_size),
            heads,
            int(getattr(cfg, "num_key_value_heads", None) or heads),
            int(cfg.intermediate_size),
            head_size=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            eps=float(getattr(cfg, "rms_norm_eps", None) or 1e-6),
            rope_theta=float(theta or getattr(cfg, "rope_theta", None) or 10000.0),
        )

    def drafter_config(self) -> dict[str, Any]:
        """The fields every reference drafter's config has (:class:`padfree.drafter._blocks.DrafterConfig`,
        the names its checkpoints keep): width, heads, key-value heads, MLP width, head width, epsilon and
        rotary base."""
        return {
            "hidden_size": self.hidden,
            "num_heads": self.heads,
            "num_kv_heads": self.kv_heads,
            "intermediate_size": self.intermediate,
            "head_size": self.head_dim,
            "eps": self.eps,
            "rope_theta": self.rope_theta,
        }


__all__ = ["Sizes"]
