"""The drafter trainers' own packages (z-lab ``dflash``, vllm ``speculators``, ``specforge``), imported for
tests and benchmarks that run their real code beside padfree's.

Their releases pin other versions of padfree's dependencies (transformers, datasets, torch), so they are never
padfree dependencies: ``make drafter`` (a user's) and ``make setup-dev`` install their wheels without
dependencies (``PEERS`` below, plus the libraries their model modules import, the ``peers`` extra: loguru,
httpx, openai, hs-connectors). What imports then, on torch 2.13 / transformers 5.24, CPU:

- ``dflash``: ``dflash.model`` (``DFlashDraftModel``, ``dflash_generate``) and ``dflash.benchmark``.
- ``speculators``: the package, ``models.dflash``, ``models.eagle3``, ``train.data``,
  ``train.distributed_batch_sampler``, ``train.trainer``, ``convert``; its data-generation clients import
  ``openai`` and ``hs_connectors`` at module level (``models.eagle3`` imports one of them), which no model,
  sampler or collate function calls: the ``peers`` extra installs them; :func:`import_peer` stubs them only
  where they are absent.
- ``specforge``: the package, ``algorithms.common.dflash_family_model``, ``data``, ``training``, ``modeling``;
  ``algorithms.eagle3.model`` imports ``triton`` (GPU only) and does not import here.

>>> from support.peers import PEERS
>>> sorted(PEERS)
['dflash', 'specforge', 'speculators']
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from unittest import mock

PEERS = {"dflash": "0.1.0", "speculators": "0.9.0", "specforge": "0.2.0"}
"""Each peer package and the version padfree's tests and benchmarks are checked against."""

_STUBBED = {
    "speculators": (
        "openai",
        "openai.types",
        "openai.types.chat",
        "openai.types.completion",
        "hs_connectors",
    ),
}


def peer_missing(name: str) -> str:
    """Why ``name`` cannot be imported here (an empty string when it can): one line for a skip reason."""
    try:
        import_peer(name)
    except ImportError as err:
        return (
            f"{name} {PEERS.get(name, '')} is not importable ({err}); `make setup-dev` installs it "
            "(pip install --no-deps)"
        )
    return ""


def import_peer(name: str, module: str = "") -> ModuleType:
    """Import peer ``name`` (or its submodule ``module``, e.g. ``models.dflash.core``), stubbing the clients
    it imports but never calls in training code. Raises ImportError when it is not installed."""
    if name not in PEERS:
        raise ImportError(f"unknown peer package {name!r} (one of {', '.join(sorted(PEERS))})")
    for stub in _STUBBED.get(name, ()):
        try:
            importlib.import_module(stub)
        except ImportError:
            sys.modules[stub] = mock.MagicMock(name=stub)
    return importlib.import_module(f"{name}.{module}" if module else name)
