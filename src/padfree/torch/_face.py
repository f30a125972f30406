"""A face that loads its names on first use (PEP 562): importing one module of a room runs no other."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_names(
    package: str, where: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``'s face from one table ``where`` (a module of the
    package, named relative to it -> the names it defines): each name is imported from its module the first
    time it is asked for, then kept in the package; ``__all__`` lists them all, sorted.

    >>> getattr_, dir_, all_ = lazy_names("padfree.torch.run", {"loop": ("run_id", "steps_of")})
    >>> getattr_("run_id").__name__, "run_id" in dir_(), all_
    ('run_id', True, ['run_id', 'steps_of'])
    """
    module_of = {name: f"{package}.{module}" for module, names in where.items() for name in names}

    def getattr_(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_of[name]), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def dir_() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *module_of})

    return getattr_, dir_, sorted(module_of)
