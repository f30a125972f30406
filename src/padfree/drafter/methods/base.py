"""What a drafter method is made of: the :class:`Method` record its torch-free spec builds (by keyword), the
:class:`MethodModule` its torch module provides, and the FLOP terms every method's cost starts from. No torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from padfree.core.anchors import AnchorPolicy
from padfree.core.config import CostModel, PlanConfig
from padfree.drafter.memory import MemoryModel, bound_attention
from padfree.drafter.sizes import Sizes
from padfree.errors import ConfigError

if TYPE_CHECKING:
    from padfree.drafter.recipes import Recipe

Bound = Callable[
    ["Recipe", PlanConfig, MemoryModel, "float | None", "int | None"], tuple[PlanConfig, "int | None"]
]
"""``(recipe, config, memory model, memory bytes, anchor budget) -> (config, draft blocks the memory
allows or None)``: how a memory bound limits the method's micro-batches
(:func:`padfree.drafter.memory.bound_blocks`, :func:`padfree.drafter.memory.bound_attention`)."""


@dataclass(frozen=True)
class BuildArgs:
    """What a run hands every method's ``build(recipe, sizes, args)`` beside the recipe and the target's
    sizes. A method refuses in one line what it cannot use.

    Attributes:
        n_fused: target layers fused into the drafter's input. draft_layers: the drafter's layers
            (:meth:`Method.layers`). weights: the target's ``(embedding, LM head)`` weight tensors.
        vocab: a draft vocabulary (:class:`~padfree.drafter.objective.VocabMap`) or None (the full one).
    """

    n_fused: int
    draft_layers: int
    weights: tuple[Any, Any]
    vocab: Any = None


class MethodModule(Protocol):
    """What a method's torch module (``methods/<name>/model.py``) provides (mypy checks the modules against
    it in :mod:`padfree.drafter.train`): its draft queries of a micro-batch, its drafter built from a recipe
    and the run's :class:`~padfree.drafter.sizes.Sizes`, the pairs a leak check counts, and its export
    format's writer (:mod:`padfree.drafter.export` dispatches to it): ``export_files(state, meta) -> (config,
    tensors)`` and ``check_export(meta, verifier_option=...)``, which refuses in one line what the format
    cannot hold."""

    @property
    def Fields(self) -> type: ...  # noqa: N802 (the module's class)

    def fields(self, contract: Any, options: Any, *, epoch: int, leaky: bool = False) -> Any: ...

    def build(self, recipe: Recipe, sizes: Sizes, args: BuildArgs) -> Any: ...

    def crossings(self, batch: Any) -> tuple[int, Any, Any]: ...

    def field_padding(self, batch: Any, mask_token_id: int = 1) -> Any: ...

    def export_files(self, state: dict, meta: dict) -> tuple[dict, dict]: ...

    def check_export(self, meta: dict, *, verifier_option: str | None = ...) -> None: ...


@dataclass(frozen=True, kw_only=True)
class Method:
    """One drafter method, as its spec (``methods/<name>/spec.py``) declares it.

    Attributes:
        name: registry key and CLI choice. title: how prose names it.
        spec: the spec module itself; its folder's ``model`` module is the method's torch side
            (:class:`MethodModule`, loaded by :meth:`load`).
        cost: ``(sizes, block_size, ttt) -> CostModel``: FLOP-derived, in target-forward token units.
        memory: ``(sizes, recipe) -> MemoryModel``: the activation memory of a micro-batch.
        recipe_line: ``recipe -> str``: the recipe's values that set this method's work and loss, one line.
        anchors: ``recipe -> AnchorPolicy``: the rule that opens its draft work at anchors chosen per
            document (:mod:`padfree.core.anchors`), which plans count, budget and balance; None: none.
        export_format: the served format a checkpoint of this method exports to (its model module writes
            it); one method per format.
        unit: what one unit of the method's draft work is called in reports.
        knob: the method's own size option (``block_size`` or ``ttt``), printed beside its name.
        bound: how a memory bound limits its micro-batches (:data:`Bound`): by attention (the default) or
            by draft blocks.
        draft_layers: the drafter's layers where the method fixes them (EAGLE-3: one decoder layer); None:
            the caller's choice (``--draft-layers``).
        crossing: what of the drafter's labels (and fed inputs) can cross a document end, as
            ``check-drafter`` names them.
        shifted_inputs: the drafter is fed inputs shifted along the row (EAGLE-3's next tokens), which can
            come from another document (``check-drafter`` counts them).
    """

    name: str
    title: str
    spec: ModuleType
    cost: Callable[[Sizes, int, int], CostModel]
    memory: Callable[[Sizes, Recipe], MemoryModel]
    recipe_line: Callable[[Recipe], str]
    export_format: str
    unit: str = "draft positions"
    knob: str = "ttt"
    bound: Bound = bound_attention
    anchors: Callable[[Recipe], AnchorPolicy] | None = None
    draft_layers: int | None = None
    crossing: str = "labels"
    shifted_inputs: bool = False

    @property
    def uses_anchors(self) -> bool:
        """Whether its draft work opens at anchors (a description for reports; behaviour follows
        :attr:`anchors` and :attr:`bound`)."""
        return self.anchors is not None

    def load(self) -> ModuleType:
        """The method's torch module, ``model`` beside its spec (needs torch; it provides
        :class:`MethodModule`)."""
        return importlib.import_module(".model", self.spec.__package__)

    def layers(self, draft_layers: int) -> int:
        """The drafter's layers when ``draft_layers`` are asked for: the method's own where it fixes them."""
        return draft_layers if self.draft_layers is None else self.draft_layers

    def describe(self, block_size: int, ttt: int) -> str:
        """The method with its own size: ``"dflash (block 16)"``, ``"eagle3 (ttt 7)"``."""
        return (
            f"{self.name} (block {block_size})" if self.knob == "block_size" else f"{self.name} (ttt {ttt})"
        )


def line(recipe: Recipe, *terms: str) -> str:
    """A method's recipe line (:attr:`Method.recipe_line`): the recipe's name, the method's ``terms`` and
    the recipe's normalization."""
    return f"recipe {recipe.name}: {', '.join(terms)}, {recipe.normalization} mean"


def flops(s: Sizes) -> tuple[float, float, float, float, int]:
    """``(target per token, target attention per l^2, drafter per query, drafter attention per pair, dh)``:
    the target runs forward only (``2 * N`` a token, ``N = 12 * layers * h^2 + vocab * h``), the drafter
    forward and backward (``6 * Nd`` a query, its LM head of :attr:`~Sizes.head_vocab` rows included)."""
    dh = s.hidden
    target = 2.0 * (12 * s.layers * s.hidden * s.hidden + s.vocab * s.hidden)
    draft = 6.0 * (12 * s.draft_layers * dh * dh + s.head_vocab * dh)
    return target, 2.0 * s.layers * s.hidden, draft, 6.0 * s.draft_layers * dh, dh


def check_steps(ttt: int) -> None:
    """A method drafting ``ttt`` steps needs at least one: one line otherwise."""
    if ttt < 1:
        raise ConfigError(f"drafter shape: ttt must be >= 1 (got {ttt})")
