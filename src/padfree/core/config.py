"""What a plan is asked to do: the strategy, the token budget, the cluster shape and the cost model."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from padfree.core.strategies import REGISTRY, STRATEGIES
from padfree.errors import ConfigError

__all__ = ["DEFAULT_COST", "MAX_BUDGET", "OVERLONG", "STRATEGIES", "CostModel", "PlanConfig"]

OVERLONG = ("error", "truncate", "split", "drop")
MAX_BUDGET = 2**24
"""The largest token budget: packing keeps ~24 bytes per budget token (400 MB at this limit)."""


@dataclass(frozen=True)
class CostModel:
    """Modeled cost of one micro-batch: ``a*slots + b*attention + c``.

    ``slots`` are computed token positions, ``attention`` is the sum of L^2 over padded rows (or of l^2 over
    packed documents). Costs are in token-equivalents: ``a`` is 1 by default.

    >>> CostModel.from_shape(hidden=4096, layers=32, vocab=32000).b > 0
    True
    """

    a: float = 1.0
    b: float = 0.0
    c: float = 0.0
    source: str = "manual"

    @classmethod
    def from_shape(cls, hidden: int = 4096, layers: int = 32, vocab: int = 32000) -> CostModel:
        """FLOP-derived defaults for a decoder: 6*N per token plus causal attention 6*layers*hidden*L^2/1.

        Dense weights N = 12*layers*hidden^2 + vocab*hidden (the LM head); forward+backward of a token costs
        6*N FLOPs. Causal attention (QK^T and AV, half the square) costs 6*layers*hidden per L^2 for forward
        plus backward. Normalized so that ``a == 1``.
        """
        if hidden < 1 or layers < 1 or vocab < 0:
            raise ConfigError(
                f"model shape needs hidden >= 1, layers >= 1, vocab >= 0 (got {hidden}, {layers}, {vocab})"
            )
        n_params = 12 * layers * hidden * hidden + vocab * hidden
        return cls(
            a=1.0, b=(6.0 * layers * hidden) / (6.0 * n_params), c=0.0, source=f"shape h{hidden} l{layers}"
        )

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a cost model written by ``padfree calibrate`` (JSON with keys a, b, c)."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
            return cls(a=float(data["a"]), b=float(data["b"]), c=float(data["c"]), source=str(p))
        except FileNotFoundError:
            raise ConfigError(f"{p}: cost file not found") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{p}: not a cost model (a JSON object with numbers a, b, c): {exc}") from None

    def save(self, path: str | Path, **extra: object) -> None:
        Path(path).write_text(json.dumps({**asdict(self), **extra}, indent=2) + "\n")


DEFAULT_COST = CostModel.from_shape()


@dataclass(frozen=True)
class PlanConfig:
    """Everything that, with the lengths, the seed and the epoch, determines a plan.

    Attributes:
        strategy: ``sorted``, ``random``, ``bucketed`` or ``packed``.
        budget: tokens per micro-batch: count x longest for padded strategies, sum of lengths for packed.
        world_size: ranks (GPUs) that each take ``grad_accum`` micro-batches per optimizer step.
        grad_accum: micro-batches per rank per optimizer step.
        growth: bucketed: each bucket's upper edge is ``growth`` times the previous one.
        buckets: bucketed: if set, use this many buckets with padding-minimizing edges instead of growth.
        mix: bucketed: inside a bucket, samples are cut from a noisy length order whose noise spans
            ``mix`` micro-batches, so two samples share a micro-batch again with probability ~1/mix.
        overlong: what to do with samples longer than the budget: error, truncate, split or drop.
        seed: the seed; with the epoch it fixes every random choice.
        cost: the cost model used to balance ranks and to report compute efficiency.
    """

    strategy: str = "bucketed"
    budget: int = 16384
    world_size: int = 1
    grad_accum: int = 1
    growth: float = 1.25
    buckets: int | None = None
    mix: int = 128
    overlong: str = "error"
    seed: int = 0
    cost: CostModel = field(default_factory=lambda: DEFAULT_COST)

    def __post_init__(self) -> None:
        if self.strategy not in REGISTRY:
            raise ConfigError(f"unknown strategy {self.strategy!r}: choose one of {', '.join(REGISTRY)}")
        for name in ("budget", "world_size", "grad_accum", "mix"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1 (got {value!r})")
        if self.budget > MAX_BUDGET:
            raise ConfigError(
                f"budget must be <= {MAX_BUDGET} tokens per micro-batch (got {self.budget}); the planner's "
                "memory grows with the budget"
            )
        if not (isinstance(self.growth, (int, float)) and self.growth > 1.0 and self.growth < float("inf")):
            raise ConfigError(f"growth must be a number > 1 (got {self.growth!r})")
        if self.buckets is not None and (
            isinstance(self.buckets, bool) or not isinstance(self.buckets, int) or self.buckets < 1
        ):
            raise ConfigError(f"buckets must be an integer >= 1 (got {self.buckets!r})")
        if self.overlong not in OVERLONG:
            raise ConfigError(
                f"unknown overlong policy {self.overlong!r}: choose one of {', '.join(OVERLONG)}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be an integer >= 0 (got {self.seed!r})")

    @property
    def micro_per_step(self) -> int:
        """Micro-batches in one optimizer step: ``world_size * grad_accum``."""
        return self.world_size * self.grad_accum

    @property
    def packed(self) -> bool:
        """Whether micro-batches are packed rows (``sum(lengths) <= budget``) rather than padded ones."""
        return REGISTRY[self.strategy].packed

    def with_(self, **changes: Any) -> PlanConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cost"] = {k: v for k, v in d["cost"].items()}
        return d
