"""A face that loads its names on first use (PEP 562): importing one module of a room runs no other."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``'s face: each name of ``where`` (name -> the module defining
    it) is imported from its module the first time it is asked for, then kept in the package.

    >>> getattr_, dir_ = lazy_names("padfree.torch.run", {"run_id": "padfree.torch.run.loop"})
    >>> getattr_("run_id").__name__, "run_id" in dir_()
    ('run_id', True)
    """

    def getattr_(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(package)
        value = getattr(importlib.import_module(where[name]), name)
        setattr(module, name, value)
        return value

    def dir_() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *where})

    return getattr_, dir_
