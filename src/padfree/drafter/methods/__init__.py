"""The drafter methods padfree trains, registered by name: each method is one folder here, and this registry
collects them (no torch here).

A method's folder, ``methods/<name>/``, holds:

* ``spec.py`` (no torch): its cost and memory terms, its recipe line, how a memory bound limits it (by
  draft blocks or by attention), whether it opens its work at anchors, and the :class:`Method` record that
  says all of it, built by keyword as ``METHOD``;
* ``model.py`` (torch): its fields of a micro-batch, its drafter (``Config``, ``Drafter``, ``build``), the
  pairs a leak check counts and its export format's writer (:class:`~padfree.drafter.methods.base.
  MethodModule`; :meth:`Method.load` finds it beside the spec);
* ``__init__.py``: one docstring naming the method.

Which target layers a drafter fuses is a recipe's choice (:mod:`padfree.drafter.recipes`, where each method's
presets are), by one of the :data:`LAYER_RULES` here. Everything outside the method's folder asks the
registry instead of comparing names, so a third method is its folder, one line in :data:`SPECS` and its
presets (the peers' trainers that have a model of it add an adapter in :mod:`padfree.integrations`).

>>> sorted(METHODS)
['dflash', 'dflash2', 'dspark', 'eagle3', 'mtp', 'peagle']
>>> get("dflash").uses_anchors, get("eagle3").uses_anchors
(True, False)
>>> LAYER_RULES["spread"](36, 5), LAYER_RULES["low_mid_high"](36, 3)
((1, 9, 17, 25, 33), (1, 17, 32))
>>> get("medusa")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
padfree.errors.ConfigError: unknown drafter method 'medusa': choose dflash or eagle3 or ...
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from padfree.core.config import CostModel
from padfree.drafter.methods.base import Method, MethodModule
from padfree.drafter.methods.dflash import spec as dflash
from padfree.drafter.methods.dflash2 import spec as dflash2
from padfree.drafter.methods.dspark import spec as dspark
from padfree.drafter.methods.eagle3 import spec as eagle3
from padfree.drafter.methods.mtp import spec as mtp
from padfree.drafter.methods.peagle import spec as peagle
from padfree.drafter.sizes import Sizes
from padfree.errors import ConfigError

if TYPE_CHECKING:  # mypy checks each method's torch module against the contract
    from padfree.drafter.methods.dflash import model as _dflash
    from padfree.drafter.methods.dflash2 import model as _dflash2
    from padfree.drafter.methods.dspark import model as _dspark
    from padfree.drafter.methods.eagle3 import model as _eagle3
    from padfree.drafter.methods.mtp import model as _mtp
    from padfree.drafter.methods.peagle import model as _peagle

    _MODELS: tuple[MethodModule, ...] = (_dflash, _eagle3, _mtp, _peagle, _dspark, _dflash2)

SPECS: tuple[ModuleType, ...] = (dflash, eagle3, mtp, peagle, dspark, dflash2)
"""Every method's spec module, in the order the CLI lists them."""

LAYER_RULES: dict[str, Callable[[int, int], tuple[int, ...]]] = {
    "spread": dflash.spread_layers,
    "low_mid_high": eagle3.low_mid_high,
    "last": mtp.last_layer,
}
"""Target-layer rules by name: ``(target layers, fused layers) -> layer ids`` (decoder layer outputs, from
0)."""

METHODS: dict[str, Method] = {}
"""Every drafter method by name (the CLI's ``--method`` / ``--drafter`` choices are its keys)."""


def register(spec: ModuleType | Method) -> Method:
    """Add a method to :data:`METHODS`: its spec module (whose ``METHOD`` it reads) or the record itself."""
    method = spec if isinstance(spec, Method) else spec.METHOD
    if method.name in METHODS and METHODS[method.name] is not method:
        raise ConfigError(f"drafter method {method.name!r} is registered already")
    holder = next((m for m in METHODS.values() if m.export_format == method.export_format), method)
    if holder.name != method.name:
        raise ConfigError(f"export format {method.export_format!r} holds {holder.name} drafters already")
    METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a method registered by :func:`register` (tests)."""
    METHODS.pop(name, None)


for _spec in SPECS:
    register(_spec)


def get(name: str) -> Method:
    """The method registered as ``name``; anything else is a one-line :class:`ConfigError`."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown drafter method {name!r}: choose {' or '.join(METHODS)}") from None


def cost_model(method: str, *, block_size: int = 16, ttt: int = 7, **sizes: int) -> CostModel:
    """The FLOP-derived cost model of ``method`` for a target (and drafter) of ``sizes``
    (:class:`~padfree.drafter.sizes.Sizes`' fields).

    >>> cost_model("dflash", hidden=64, layers=2, vocab=100).d > 0
    True
    """
    return get(method).cost(Sizes(**sizes), block_size, ttt)


__all__ = [
    "LAYER_RULES",
    "METHODS",
    "Method",
    "MethodModule",
    "Sizes",
    "cost_model",
    "get",
    "register",
    "unregister",
]
