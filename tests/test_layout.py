"""The layout holds: no import cycle among padfree's modules (lazy imports included), the planning core
imports nothing but numpy, numba and the standard library, and nothing the tests, examples or package run
reaches outside the repository."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (SRC / "padfree").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    return [n for n in ast.walk(tree) if id(n) not in skip]


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """Every padfree module ``path`` imports at run time, at any depth (function-level imports too)."""
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("padfree"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("padfree"):
            for a in node.names:  # ``from padfree.core import plan`` imports the module padfree.core.plan
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in mods else node.module)
    return {m for m in out if m in mods}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    # a package's __init__ only re-exports; edges into it stand for the submodules it names
    return {m: _imports(p, mods) - packages for m, p in mods.items() if m not in packages}


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(n) :], n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_core_needs_only_numpy_numba_and_the_standard_library() -> None:
    allowed = {"numpy", "numba", "padfree"}
    for path in (SRC / "padfree" / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                ok = top in allowed or top in sys.stdlib_module_names
                ok = ok and (top != "padfree" or name.startswith(("padfree.core", "padfree.errors")))
                assert ok, f"{path.relative_to(ROOT)} imports {name}"


def test_nothing_reaches_outside_the_repository() -> None:
    outside = "shared"  # the workspace folder beside a checkout, which a user's clone does not have
    needles = (f"../{outside}", f'parent / "{outside}"', f'"{outside}" / "data"')
    for folder in ("src", "tests", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            for needle in needles:
                assert needle not in text or path == Path(__file__), f"{path.relative_to(ROOT)}: {needle}"


def test_examples_import_the_library_not_the_commands() -> None:
    """The examples are copyable recipes: they import padfree's library (``padfree.options`` for their
    options, ``padfree.torch.loop`` for the epochs), never the CLI's ``padfree.commands``."""
    bad = []
    for path in sorted((ROOT / "examples").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad += [f"{path.name}: {n}" for n in names if n.startswith("padfree.commands")]
    assert bad == []
