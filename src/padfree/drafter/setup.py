"""The one drafter decision: for a recipe on a target, with the data's lengths and loss counts and a memory
bound, the plan config, anchor counts, cost model, memory model and the expected peak of a plan. No torch.

Everything that plans drafter work (``examples/train_drafter.py``, ``simulate``/``report``, the integrations,
the drafter benchmarks) builds a :class:`DrafterSetup` with :func:`drafter_setup` instead of assembling the
pieces itself.

>>> import numpy as np
>>> from padfree import PlanConfig
>>> from padfree.drafter import recipes
>>> s = drafter_setup(recipes.get("specforge", "dflash"), PlanConfig(strategy="packed", budget=256),
...                   target=TargetShape(hidden=64, layers=6, vocab=100, heads=4, kv_heads=2,
...                                      intermediate=128),
...                   lengths=np.array([100, 200, 50]), loss_counts=np.array([60, 150, 10]), memory_gb=0.5)
>>> s.anchors.tolist(), s.config.anchor_budget, s.config.cost.source
([59, 149, 9], 827, 'drafter dflash h64 l6 dh64')
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from padfree.core.anchors import anchor_counts, anchor_quota
from padfree.core.budget import Budget
from padfree.core.config import CostModel, PlanConfig
from padfree.core.cost import micro_shapes
from padfree.core.items import make_items
from padfree.core.plan import Plan
from padfree.drafter import methods
from padfree.drafter.memory import MemoryModel
from padfree.drafter.recipes import Recipe, check_drafts
from padfree.drafter.sizes import Sizes
from padfree.errors import ConfigError

TargetShape = Sizes
"""The target's sizes a setup reads (:class:`~padfree.drafter.sizes.Sizes`, the one sizes record: the
drafter's fields keep their defaults until :func:`drafter_setup` fills them)."""


DEFAULT_TARGET = TargetShape.common(hidden=4096, layers=32, vocab=32000)
"""The target a setup assumes when none is given: 4096 wide, 32 layers, 32000 tokens (a Llama-2-7B shape)."""


@dataclass(frozen=True)
class DrafterSetup:
    """What a drafter run plans with (built by :func:`drafter_setup`).

    Attributes:
        method, recipe, target: the method, its recipe and the target's sizes (:class:`Sizes`).
        config: the plan config: the drafter's cost model, and its micro-batches bounded by the anchor budget
            (DFlash) or attention budget (EAGLE-3) the memory bound and ``anchor_budget`` allow.
        anchors: draft blocks per sample the planner counts (``None``: the method counts none).
        cost: the FLOP-derived cost model (also ``config.cost`` unless the caller gave its own).
        memory: the activation memory model of the drafter on this target.
        memory_gb: the memory bound (GiB of activations per micro-batch; ``None``: none).
        anchor_budget: the user's bound on draft blocks per micro-batch (``None``: none).
        by_memory: the draft blocks per micro-batch the memory bound allows (DFlash; else ``None``).
    """

    method: methods.Method
    recipe: Recipe
    target: TargetShape
    config: PlanConfig
    anchors: np.ndarray | None
    cost: CostModel
    memory: MemoryModel
    memory_gb: float | None = None
    anchor_budget: int | None = None
    by_memory: int | None = None

    @property
    def cut(self) -> int:
        """Where the plan cuts a sample: the budget, or less where the memory bound limits attention."""
        return Budget.of(self.config).item

    def limit_line(self) -> str | None:
        """Why samples are cut below the budget (the memory bound), or ``None`` when they are not."""
        if self.cut >= self.config.budget:
            return None
        return (
            f"{self.cut} tokens, the longest document whose attention fits --memory-gb {self.memory_gb:g} "
            f"({self.memory.source}; a row still holds up to --budget {self.config.budget} tokens)"
        )

    def check_fit(self, lengths: ArrayLike) -> None:
        """Refuse, in one line naming the options that fix it, samples the plan cannot hold: longer than the
        memory bound's cut under ``--overlong error``, or with more draft blocks (as the plan cuts them) than
        a micro-batch may open."""
        lens = np.asarray(lengths, dtype=np.int64)
        cut, overlong, limit = self.cut, self.config.overlong, self.limit_line()
        if limit is not None and overlong == "error" and len(lens) and int(lens.max()) > cut:
            raise ConfigError(
                f"--memory-gb {self.memory_gb:g}: {int((lens > cut).sum())} of {len(lens)} samples are "
                f"longer than {limit}; raise --memory-gb, or choose --overlong truncate, split or drop"
            )
        n = self.config.anchor_budget
        if self.anchors is None or n is None or not len(lens):
            return
        pieces = make_items(lens, cut, overlong, anchors=self.anchors)
        assert pieces.anchors is not None
        if not len(pieces.anchors) or int(pieces.anchors.max()) <= n:
            return
        k = int(np.argmax(pieces.anchors))
        by = f"--anchor-budget {self.anchor_budget}; raise it, or lower --max-anchors"
        if self.anchor_budget is None or n < self.anchor_budget:
            gb = f"{self.memory_gb:g}"
            by = (
                f"the {n} --memory-gb {gb} leaves room for ({self.memory.source}); --memory-gb {gb} allows "
                f"{n} draft blocks per micro-batch of --budget {self.config.budget} tokens: pass "
                f"--max-anchors {n}, raise --memory-gb or lower --budget"
            )
        raise ConfigError(
            f"sample {int(pieces.sample_ids()[k])} has {int(pieces.anchors[k])} draft blocks (anchors) in "
            f"its first {cut} tokens, more than a micro-batch may hold: {by}"
        )

    def heaviest_bytes(self, plan: Plan) -> float:
        """Activation bytes of the heaviest micro-batch of ``plan`` by :attr:`memory`."""
        shapes = micro_shapes(plan.lengths, plan.offsets, plan.config.packed, plan.anchors)
        bytes_ = self.memory.micro_bytes(shapes)
        return float(bytes_.max()) if len(bytes_) else 0.0

    def peak_line(self, plan: Plan, resident: float) -> str:
        """The expected peak of a process holding ``resident`` bytes that runs ``plan``, as one line."""
        heaviest = self.heaviest_bytes(plan)
        return (
            f"expected peak memory {(resident + heaviest) / 2**30:.2f} GiB: this process "
            f"{resident / 2**30:.2f} GiB + its heaviest micro-batch {heaviest / 2**30:.2f} GiB "
            f"({self.memory.source})"
        )

    @property
    def cache_layers(self) -> int:
        """Target layers an offline hidden-state cache keeps per token: the recipe's fused layers and the
        last (the target's logits), the last counted once where the drafter reads it itself (MTP)."""
        n = self.target.layers
        fused = methods.LAYER_RULES[self.recipe.layer_rule](n, self.recipe.fused_layers)
        return self.recipe.fused_layers + (0 if n - 1 in fused else 1)

    def describe(self) -> str:
        """One line: the method with its own size and the recipe."""
        return f"{self.method.describe(self.recipe.block_size, self.recipe.ttt)}, {self.recipe.describe()}"


def fused_layers(recipe: Recipe, n_layers: int) -> int:
    """How many target layers the recipe's drafter fuses on a target of ``n_layers`` (a small target fuses
    what it has)."""
    return len(methods.LAYER_RULES[recipe.layer_rule](n_layers, recipe.fused_layers))


def draft_vocab_size(recipe: Recipe, vocab: int) -> int | None:
    """The recipe's draft vocabulary on a target of ``vocab`` tokens (``None``: the full one)."""
    size = recipe.draft_vocab
    return None if size is None or size >= vocab else int(size)


def estimated_valid(loss: np.ndarray, tokens: np.ndarray, recipe: Recipe) -> np.ndarray:
    """Valid anchor positions per sample from counts alone (no masks): its supervised tokens, less the one a
    ``pair`` rule needs after the anchor (a supervised run's last token), within the tokens the plan keeps and
    the recipe's end margin. Exact for one supervised run per sample (an answer after its prompt); each
    further run costs one more position."""
    tail = np.minimum(loss, np.maximum(tokens - recipe.anchor_margin, 0))
    return np.maximum(tail - (1 if recipe.anchor_eligibility == "pair" else 0), 0)


def sample_anchors(recipe: Recipe, lengths: ArrayLike, loss_mask: ArrayLike) -> np.ndarray | None:
    """Draft blocks per sample that the planner counts for ``recipe`` (its anchor rule on each sample's loss
    mask; ``loss_mask``: the samples' masks, concatenated); ``None`` for a method without anchors."""
    rule = methods.get(recipe.method).anchors
    if rule is None:
        return None
    offsets = np.concatenate(([0], np.cumsum(np.asarray(lengths, dtype=np.int64))))
    return anchor_counts(np.asarray(loss_mask, dtype=bool), offsets, rule(recipe))


def drafter_setup(
    recipe: Recipe,
    config: PlanConfig,
    *,
    lengths: ArrayLike,
    target: TargetShape = DEFAULT_TARGET,
    loss_counts: ArrayLike | None = None,
    loss_mask: ArrayLike | None = None,
    memory_gb: float | None = None,
    anchor_budget: int | None = None,
    draft_layers: int = 1,
    cost: CostModel | None = None,
    memory: MemoryModel | None = None,
) -> DrafterSetup:
    """The drafter setup of ``recipe`` on ``target`` for samples of ``lengths``.

    Args:
        target: the target's sizes (default :data:`DEFAULT_TARGET`).
        config: the plan config before the drafter (strategy, budget, overlong...); its cost is replaced by
            the drafter's unless ``cost`` is given (a measured one).
        loss_mask: the samples' loss masks, concatenated: exact anchor counts per sample. Else
            ``loss_counts`` (loss-bearing tokens per sample; default every token but the first) estimate
            them (:func:`estimated_valid`).
        memory_gb: bound the activations of every micro-batch (GiB): the draft blocks (DFlash) or the
            attention (EAGLE-3) a micro-batch holds.
        anchor_budget: draft blocks per micro-batch at most (DFlash).
        draft_layers: the drafter's layers (where the method leaves them to the caller: DFlash).
        memory: the memory model (default: the method's analytic one for these sizes).
    """
    method = methods.get(recipe.method)
    lens = np.asarray(lengths, dtype=np.int64)
    anchors = None
    supervised = None
    if loss_mask is not None:
        mask = np.asarray(loss_mask, dtype=bool)
        supervised = int(mask.sum())
        anchors = sample_anchors(recipe, lens, mask)
    elif method.anchors is not None:
        loss = np.maximum(lens - 1, 0) if loss_counts is None else np.asarray(loss_counts, dtype=np.int64)
        valid = estimated_valid(loss, np.minimum(lens, config.budget), recipe)
        anchors = anchor_quota(valid, method.anchors(recipe))
    if loss_mask is not None:
        check_drafts(recipe, anchors, lens, supervised)  # a run that drafts nothing trains zeros
    sizes = target.with_(
        draft_layers=method.layers(draft_layers),
        fused_layers=fused_layers(recipe, target.layers),
        draft_vocab=draft_vocab_size(recipe, target.vocab),
    )
    flops = method.cost(sizes, recipe.block_size, recipe.ttt)
    if memory is None:
        memory = method.memory(sizes, recipe)
    limit = None if memory_gb is None else memory_gb * 2**30
    cfg, by_memory = method.bound(
        recipe, config.with_(cost=flops if cost is None else cost), memory, limit, anchor_budget
    )
    return DrafterSetup(
        method, recipe, target, cfg, anchors, flops, memory, memory_gb, anchor_budget, by_memory
    )


def report(setup: DrafterSetup) -> dict:
    """The setup as plain values (``simulate --json``'s ``drafter`` entry reads these)."""
    return {
        "method": setup.method.name,
        "recipe": setup.recipe.name,
        "recipe_line": setup.recipe.describe(),
        "title": setup.method.title,
        "uses_anchors": setup.method.uses_anchors,
        "draft_blocks": int(setup.anchors.sum()) if setup.anchors is not None else 0,
        "anchors_per_sample": float(setup.anchors.mean()) if setup.anchors is not None else 0.0,
        "hidden": setup.target.hidden,
        "memory_model": dataclasses.asdict(setup.memory),
        "memory_gb": setup.memory_gb,
    }


__all__ = [
    "DEFAULT_TARGET",
    "DrafterSetup",
    "TargetShape",
    "drafter_setup",
    "estimated_valid",
    "fused_layers",
    "report",
    "sample_anchors",
]
