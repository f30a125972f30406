"""What a plan is asked to do: the strategy, the token budget, the cluster shape and the cost model."""

from __future__ import annotations

import json
import math
import stat
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from padfree.core.cost import Coefficients
from padfree.core.shard import Shard, check_shapes
from padfree.core.strategies import REGISTRY, STRATEGIES, Strategy
from padfree.errors import ConfigError

__all__ = ["DEFAULT_COST", "MAX_BUDGET", "OVERLONG", "STRATEGIES", "CostModel", "PlanConfig"]

OVERLONG = ("error", "truncate", "split", "drop")
MAX_BUDGET = 2**24
"""The largest token budget: packing keeps ~24 bytes per budget token (400 MB at this limit)."""
MAX_RANKS = 2**20
"""The largest world size, and the most micro-batches per rank per step (grad_accum)."""
MAX_BUCKETS = 1024
"""The most length buckets, whether asked for (``buckets``) or implied by ``growth`` over ``1 .. budget``."""
MAX_MIX = 2**31 - 1
"""The largest bucketed noise window (any value above the micro-batches of a bucket means: shuffle it)."""
MAX_SEED = 2**63 - 1
"""The largest seed (and epoch): they seed numpy's SeedSequence, which takes any int; int64 keeps them
portable to every state format."""
MAX_SHARD = 1024
"""The largest SP or CP degree."""
MAX_COST = 1e30
"""The largest cost coefficient: a, b, c stay finite over any plan (``b * budget**2 * 1e9 micro-batches``)."""


@dataclass(frozen=True)
class CostModel:
    """Modeled cost of one micro-batch: ``a*slots + b*attention + c`` (``+ d*blocks + e*reach``: a drafter).

    ``slots`` are computed token positions, ``attention`` is the sum of L^2 over padded rows (or of l^2 over
    packed documents). Costs are in token-equivalents: ``a`` is 1 by default.

    A drafter step (a frozen target forward, then a drafter trained on the target's hidden states, see
    docs/drafters.md) adds two terms: ``blocks`` are the computed draft blocks (DFlash anchors: each runs
    ``block_size`` query tokens through the drafter and its LM head), ``reach`` the context those blocks
    read (each block of a row reads on average half of its row's length). For a drafter setup ``a`` and
    ``b`` are the target's forward-only costs; each drafter method's FLOP-derived terms are its ``cost`` in
    :mod:`padfree.drafter.methods`.

    >>> CostModel.from_shape(hidden=4096, layers=32, vocab=32000).b > 0
    True
    """

    a: float = 1.0
    b: float = 0.0
    c: float = 0.0
    source: str = "manual"
    d: float = 0.0
    e: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d", "e"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_COST:
                raise ConfigError(
                    f"cost coefficient {name} must be a number from 0 to {MAX_COST:g} (got {v!r}); "
                    "negative, infinite or NaN costs make every balance and throughput meaningless"
                )
        if self.a == self.b == self.c == 0:
            raise ConfigError("cost coefficients a, b, c are all 0: every micro-batch would cost nothing")
        if (self.d or self.e) and not self.a:
            raise ConfigError(
                "drafter cost terms d, e are counted in token slots and need a > 0 "
                f"(got a={self.a!r}, d={self.d!r}, e={self.e!r})"
            )

    @property
    def drafter(self) -> tuple[float, float]:
        """``(d/a, e/a)``: a draft block and a unit of reach in token slots (``(0, 0)`` without drafter
        terms). Balancing folds them into one linear feature, ``slots + d/a*blocks + e/a*reach``."""
        if not (self.d or self.e):
            return (0.0, 0.0)
        return (self.d / self.a, self.e / self.a)

    @property
    def coefficients(self) -> Coefficients:
        """``(a, b, c)`` as floats (what a :class:`~padfree.core.balance.Balance` and the kernels take)."""
        return Coefficients(float(self.a), float(self.b), float(self.c))

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
        data = read_cost_file(p)
        values: list[Any] = [data.get(k) for k in ("a", "b", "c")] + [data.get(k, 0.0) for k in ("d", "e")]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            raise ConfigError(f"{p}: not a cost model (a JSON object with numbers a, b, c; got {values})")
        try:
            a, b, c, d, e = (float(v) for v in values)
            return cls(a=a, b=b, c=c, source=str(p), d=d, e=e)
        except ConfigError as exc:
            raise ConfigError(f"{p}: {exc}") from None

    def save(self, path: str | Path, **extra: object) -> None:
        Path(path).write_text(json.dumps({**asdict(self), **extra}, indent=2) + "\n")


DEFAULT_COST = CostModel.from_shape()

MAX_COST_FILE_BYTES = 2**20


def read_cost_file(path: str | Path) -> dict:
    """The JSON object of a cost file (a regular file of at most 1 MiB); every problem is a one-line
    :class:`ConfigError` naming the file."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(f"{p}: cost file not found") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the cost file ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{p}: not a regular file (a folder, pipe or device cannot be a cost file)")
    if st.st_size > MAX_COST_FILE_BYTES:
        raise ConfigError(f"{p}: {st.st_size} bytes is too large for a cost file (limit 1 MiB)")
    try:
        data = json.loads(p.read_bytes())
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the cost file ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{p}: not a cost model (malformed JSON: {str(exc)[:120]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: not a cost model (a JSON object with numbers a, b, c)")
    return data


@dataclass(frozen=True)
class PlanConfig:
    """Everything that, with the lengths, the seed and the epoch, determines a plan.

    Attributes:
        strategy: ``sorted``, ``random``, ``bucketed``, ``packed`` or ``chunked`` (packed rows of at most
            ``budget`` tokens, documents up to ``grad_accum * budget`` tokens cut into chunks that train
            with their whole context: :mod:`padfree.core.chunked`).
        budget: tokens per micro-batch: count x longest for padded strategies, sum of lengths for packed.
        world_size: ranks (GPUs) that each take ``grad_accum`` micro-batches per optimizer step.
        grad_accum: micro-batches per rank per optimizer step.
        growth: bucketed: each bucket's upper edge is ``growth`` times the previous one.
        buckets: bucketed: if set, use this many buckets with padding-minimizing edges instead of growth.
        mix: bucketed: inside a bucket, samples are cut from a noisy length order whose noise spans
            ``mix`` micro-batches' worth of tokens, so two samples share a micro-batch again with
            probability ~1/mix. ``None`` (default): chosen from the data, the largest value (8 to 128)
            whose estimated padding efficiency is >= 0.96 (see docs/planning.md).
        overlong: what to do with samples longer than the budget: error, truncate, split or drop.
        seed: the seed; with the epoch it fixes every random choice.
        cost: the cost model used to balance ranks and to report compute efficiency.
        anchor_budget: drafter plans (given per-sample ``anchors``): draft blocks per micro-batch at most,
            counted as computed: the sum over a packed row, ``count x most`` over padded rows (the block
            tensor is padded to the row with the most). ``None``: no anchor budget.
        attn_budget: eager EAGLE-3: attention weights one micro-batch may materialise,
            ``L x (L + attn_extra)`` per row (``count x longest x (longest + attn_extra)`` padded,
            ``T x (T + attn_extra)`` for a packed row of ``T`` tokens). ``None``: no bound (varlen or flex
            attention).
        attn_extra: the keys eager attention adds beyond ``L`` (EAGLE-3 with ``ttt`` steps: ``ttt - 1``).
        attn_per_document: a packed row's attention is materialised document by document (padfree's own
            EAGLE-3 drafter): the bound is ``sum l_i x (l_i + attn_extra)`` over the row's documents, each
            document at most the largest ``T`` with ``T x (T + attn_extra) <= attn_budget``, the row still
            ``budget`` tokens. ``False``: one ``T x (T + attn_extra)`` over the whole row (row-wide eager
            attention).
        sp, cp: sequence- and context-parallel degrees (default 1). ``world_size`` then counts
            data-parallel ranks, each a group of ``sp * cp`` GPUs that run the same micro-batch, and
            ``budget`` stays per GPU: a micro-batch holds up to ``sp * cp * budget`` tokens, padding
            included. Packed rows pad each document to a multiple of ``2 * cp`` and the row to a multiple of
            ``sp`` (``cp * lcm(2, sp)`` with CP); padded rows pad their width to that multiple. The padding
            counts in every metric and in the modeled cost that balances ranks (see
            :mod:`padfree.core.shard`).
        shapes: the row lengths a compiler keeps (``torch.compile``, CUDA graphs record a graph per shape):
            ``None`` (default: rows as long as their tokens); a granularity (``512``: every padded width and
            packed row total a multiple of it, with SP/CP of both multiples); or the allowed row lengths
            (``(1024, 2048, 4096)``, :func:`padfree.core.shard.geometric_shapes`), each a multiple of the
            SP/CP row multiple. Rows are padded up to the next shape, that padding counts as padding in
            every metric, and the largest shape within ``sp * cp * budget`` is the row's capacity
            (:meth:`padfree.core.shard.Shard.capacity`): longer samples are overlong.
        sources: weighted sources, ``((name, weight), ...)``: every step holds each source's share
            ``weight / sum(weights)`` of the step, counted in ``unit``, within one document
            (:mod:`padfree.core.sources`; the lengths are then given per source). ``None``: one pool.
        unit: what a source's weight counts: ``documents``, ``tokens`` or ``loss`` (supervised tokens).
        epoch_steps, epoch_tokens: the length of an epoch of sources, in optimizer steps or in tokens
            (rounded up to whole steps); at most one. Default: the tokens of all sources together. Each
            source's repetition (upsampled or capped) follows from it and the weights.
    """

    strategy: str = "bucketed"
    budget: int = 16384
    world_size: int = 1
    grad_accum: int = 1
    growth: float = 1.25
    buckets: int | None = None
    mix: int | None = None
    overlong: str = "error"
    seed: int = 0
    cost: CostModel = field(default_factory=lambda: DEFAULT_COST)
    anchor_budget: int | None = None
    attn_budget: int | None = None
    attn_extra: int = 0
    attn_per_document: bool = False
    sp: int = 1
    cp: int = 1
    shapes: int | tuple[int, ...] | None = None
    # ----- weighted sources (padfree.core.sources): None plans one pool of samples, as before -----------
    sources: tuple[tuple[str, float], ...] | None = None
    unit: str = "tokens"
    epoch_steps: int | None = None
    epoch_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.strategy not in REGISTRY:
            raise ConfigError(f"unknown strategy {self.strategy!r}: choose one of {', '.join(REGISTRY)}")
        for name in ("budget", "world_size", "grad_accum", "mix"):
            value = getattr(self, name)
            if name == "mix" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1 (got {value!r})")
        if self.budget > MAX_BUDGET:
            raise ConfigError(
                f"budget must be <= {MAX_BUDGET} tokens per micro-batch (got {self.budget}); the planner's "
                "memory grows with the budget"
            )
        for name, top in (("world_size", MAX_RANKS), ("grad_accum", MAX_RANKS), ("mix", MAX_MIX)):
            if getattr(self, name) is not None and getattr(self, name) > top:
                raise ConfigError(f"{name} must be <= {top} (got {getattr(self, name)})")
        if not (
            isinstance(self.growth, (int, float))
            and not isinstance(self.growth, bool)
            and self.growth > 1.0
            and self.growth < float("inf")
        ):
            raise ConfigError(f"growth must be a number > 1 (got {self.growth!r})")
        implied = math.log(self.budget) / math.log(self.growth)
        if implied > MAX_BUCKETS:
            least = self.budget ** (1.0 / MAX_BUCKETS)
            raise ConfigError(
                f"growth {self.growth!r} would cut 1 .. {self.budget} tokens into ~{implied:,.0f} buckets "
                f"(at most {MAX_BUCKETS}); use a growth >= {math.ceil(least * 1e6) / 1e6} at this budget"
            )
        if self.buckets is not None and (
            isinstance(self.buckets, bool)
            or not isinstance(self.buckets, int)
            or not 1 <= self.buckets <= MAX_BUCKETS
        ):
            raise ConfigError(f"buckets must be an integer from 1 to {MAX_BUCKETS} (got {self.buckets!r})")
        if self.overlong not in OVERLONG:
            raise ConfigError(
                f"unknown overlong policy {self.overlong!r}: choose one of {', '.join(OVERLONG)}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed must be an integer from 0 to {MAX_SEED} (got {self.seed!r})")
        for name, low in (("anchor_budget", 1), ("attn_budget", 1), ("attn_extra", 0)):
            v = getattr(self, name)
            if v is None and name != "attn_extra":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= 2**62:
                raise ConfigError(f"{name} must be an integer >= {low} (got {v!r})")
        if not isinstance(self.attn_per_document, bool):
            raise ConfigError(f"attn_per_document must be True or False (got {self.attn_per_document!r})")
        if self.attn_budget is not None and self.attn_budget < self.attn_extra + 1:
            raise ConfigError(
                f"attn_budget {self.attn_budget} cannot hold one token's row of 1 + attn_extra "
                f"({self.attn_extra}) weights"
            )
        self._check_shard()
        base = Shard(self.sp, self.cp) if isinstance(self.sp, int) and isinstance(self.cp, int) else Shard()
        shapes = check_shapes(self.shapes, base.row_multiple, base.group * self.budget)
        object.__setattr__(self, "shapes", shapes)  # normalized: a sorted tuple, or an int
        if shapes is not None and self.attn_budget is not None:
            raise ConfigError(
                "shapes with attn_budget are not planned yet (a padded width materialises more attention "
                "than its tokens); plan eager EAGLE-3 without shapes"
            )
        if self.spec.check is not None:  # what the strategy itself does not plan
            self.spec.check(self)
        self._check_sources()

    def _check_sources(self) -> None:
        """Weighted sources: named, unique, weights finite and > 0, a known unit, at most one epoch length
        (:mod:`padfree.core.sources`); without sources the unit and epoch length must stay unset."""
        if isinstance(self.sources, list):  # as JSON gives them back (to_dict writes lists)
            object.__setattr__(
                self, "sources", tuple(tuple(e) if isinstance(e, list) else e for e in self.sources)
            )
        check_source_config(self)

    def _check_shard(self) -> None:
        """``sp`` and ``cp``: integers from 1 to :data:`MAX_SHARD`, their rows within :data:`MAX_BUDGET`."""
        for name in ("sp", "cp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SHARD:
                raise ConfigError(f"{name} must be an integer from 1 to {MAX_SHARD} (got {v!r})")
        if self.sp * self.cp == 1:
            return
        if self.budget * self.sp * self.cp > MAX_BUDGET:
            raise ConfigError(
                f"sp {self.sp} x cp {self.cp} x budget {self.budget} tokens per micro-batch is over "
                f"{MAX_BUDGET}; lower the budget (it is per GPU)"
            )
        if self.anchor_budget is not None or self.attn_budget is not None:
            raise ConfigError("drafter bounds (anchor_budget, attn_budget) are not planned with sp or cp > 1")

    @property
    def shard(self) -> Shard:
        """The SP/CP degrees and the shapes as a :class:`~padfree.core.shard.Shard`."""
        return Shard(self.sp, self.cp, self.shapes)

    @property
    def micro_per_step(self) -> int:
        """Micro-batches in one optimizer step: ``world_size * grad_accum``."""
        return self.world_size * self.grad_accum

    @property
    def spec(self) -> Strategy:
        """The registered :class:`~padfree.core.strategies.Strategy` of ``strategy``: what the layers ask of
        it (its layout, its chunks, whether its rows are packed) rather than its name."""
        return REGISTRY[self.strategy]

    @property
    def chunked(self) -> bool:
        """Whether long documents become chunks trained with their context: ``spec.context`` (the torch
        layer's word for it; :mod:`padfree.core.chunked`)."""
        return self.spec.context

    @property
    def packed(self) -> bool:
        """Whether micro-batches are packed rows (``sum(lengths) <= budget``) rather than padded ones."""
        return self.spec.packed

    def with_(self, **changes: Any) -> PlanConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cost"] = {k: v for k, v in d["cost"].items()}
        for name in ("sp", "cp"):  # present when set, so configs without them read as before
            if d[name] == 1:
                del d[name]
        if d["shapes"] is None:
            del d["shapes"]
        elif isinstance(d["shapes"], tuple):
            d["shapes"] = list(d["shapes"])
        if self.sources is None:  # the same: configs without sources read as before
            for name in ("sources", "unit", "epoch_steps", "epoch_tokens"):
                del d[name]
        else:
            d["sources"] = [list(s) for s in self.sources]
        return d


# ----- weighted sources (padfree.core.sources plans them) ------------------------------------------------
UNITS = ("documents", "tokens", "loss")
"""What a source's weight counts: samples, tokens, or supervised (loss-bearing) tokens."""
MAX_SOURCES = 256
"""The most weighted sources of one plan."""


def check_source_config(config: PlanConfig) -> None:
    """The source fields of ``config`` (see :class:`~padfree.core.config.PlanConfig`), one
    :class:`ConfigError` line naming the source and the rule."""
    if config.sources is None:
        if config.epoch_steps is not None or config.epoch_tokens is not None or config.unit != "tokens":
            raise ConfigError("unit, epoch_steps and epoch_tokens apply to weighted sources only (sources=)")
        return
    if not isinstance(config.sources, tuple) or not 1 <= len(config.sources) <= MAX_SOURCES:
        raise ConfigError(f"sources must be a tuple of 1 to {MAX_SOURCES} (name, weight) pairs")
    seen: set[str] = set()
    for entry in config.sources:
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise ConfigError(f"sources: each entry is a (name, weight) pair (got {entry!r:.60})")
        name, weight = entry
        if not isinstance(name, str) or not name or len(name) > 200 or any(c in name for c in "=:,\n"):
            raise ConfigError(
                f"source {name!r:.60}: a name is a non-empty string of at most 200 characters without "
                "'=', ':', ',' or a newline"
            )
        if name in seen:
            raise ConfigError(f"source {name!r}: named twice (source names must be unique)")
        seen.add(name)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not math.isfinite(weight)
            or weight <= 0
        ):
            raise ConfigError(f"source {name!r}: weight must be a finite number > 0 (got {weight!r})")
    if config.unit not in UNITS:
        raise ConfigError(f"unknown unit {config.unit!r}: a source weight counts {', '.join(UNITS)}")
    for key in ("epoch_steps", "epoch_tokens"):
        v = getattr(config, key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 2**62):
            raise ConfigError(f"{key} must be an integer >= 1 (got {v!r})")
    if config.epoch_steps is not None and config.epoch_tokens is not None:
        raise ConfigError(
            "give the epoch of sources in steps or in tokens, not both (epoch_steps, epoch_tokens)"
        )
    if config.strategy not in ("packed", "bucketed"):
        raise ConfigError(
            f"weighted sources are planned with the packed or bucketed strategy (got {config.strategy!r})"
        )
    if config.overlong not in ("error", "truncate"):
        raise ConfigError(
            f"weighted sources take overlong 'error' or 'truncate' (got {config.overlong!r}): a split or "
            "dropped sample would change what a source's share counts"
        )
    if config.shard.active or config.anchor_budget is not None or config.attn_budget is not None:
        raise ConfigError("weighted sources are not planned with sp/cp > 1 or drafter bounds yet")
    if config.shapes is not None:
        raise ConfigError("weighted sources are not planned with shapes yet: plan them without shapes")
