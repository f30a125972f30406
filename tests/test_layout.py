"""The layout holds: no import cycle among padfree's modules (lazy imports included), the planning core
imports nothing but numpy, numba and the standard library, and nothing the tests, examples or package run
reaches outside the repository."""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

from conftest import HANG_S

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
    """At run time: an ``if TYPE_CHECKING:`` import (annotations only) is for the type checker."""
    allowed = {"numpy", "numba", "padfree"}
    for path in (SRC / "padfree" / "core").rglob("*.py"):
        for node in _runtime_nodes(ast.parse(path.read_text())):
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


def test_core_plans_with_every_other_package_blocked() -> None:
    """What the import scan above reads, run: a fresh interpreter where only numpy, numba and the standard
    library can be imported plans and streams an epoch."""
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'typing_extensions', 'matplotlib', 'pyarrow'):\n"
        "    sys.modules[name] = None\n"
        "import numpy as np\n"
        "from padfree.core.config import PlanConfig\n"
        "from padfree.core.planner import make_plan, plan_pieces\n"
        "cfg = PlanConfig(strategy='bucketed', budget=64, world_size=2, grad_accum=2, seed=1)\n"
        "lengths = np.arange(1, 201) % 60 + 1\n"
        "whole = make_plan(lengths, cfg, 0, stream=True, window=50)\n"
        "pieces = list(plan_pieces(lengths, cfg, 0, stream=True, window=50))\n"
        "assert np.array_equal(np.concatenate([p.indices for p in pieces]), whole.indices)\n"
        "print(sorted(whole.indices.tolist()) == list(range(200)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_nothing_reaches_outside_the_repository() -> None:
    outside = "shared"  # the workspace folder beside a checkout, which a user's clone does not have
    needles = (f"../{outside}", f'parent / "{outside}"', f'"{outside}" / "data"')
    for folder in ("src", "tests", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            for needle in needles:
                assert needle not in text or path == Path(__file__), f"{path.relative_to(ROOT)}: {needle}"


# ----- layers: what each layer may import (lazy imports included, ``if TYPE_CHECKING:`` not) ----------------
LOWER = ("padfree.core", "padfree.torch", "padfree.data", "padfree.hf")
"""The planning, torch, data and Trainer layers: the drafter wing builds on them, never the other way."""
UPPER = ("padfree.drafter", "padfree.integrations")


def _method_specs() -> tuple[str, ...]:
    """Every method folder (``padfree/drafter/methods/<name>/``) and its spec, found rather than listed: a
    new method's spec is held to the rule without a line here."""
    home = SRC / "padfree" / "drafter" / "methods"
    found = sorted(
        m for m, p in _modules().items() if p.parent.parent == home and p.stem in ("__init__", "spec")
    )
    assert len(found) >= 8, found  # dflash, eagle3, mtp and peagle at least, each a folder and a spec
    return tuple(found)


TORCH_FREE_DRAFTER = (
    "padfree.drafter",
    "padfree.drafter.memory",
    "padfree.drafter.methods",
    "padfree.drafter.methods.base",
    *_method_specs(),
    "padfree.drafter.proc",
    "padfree.drafter.recipes",
    "padfree.drafter.sizes",
)
"""The drafter modules that run without torch (``padfree simulate``, ``report`` and the planner read them):
the package, its recipes, memory model, sizes and ``/proc`` probes, the method registry and every method's
folder and spec; every other drafter module (a method's ``model``) imports torch."""
TORCH = ("torch", "torchdata")


def _in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@functools.cache
def _edges() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, mods) for m, p in mods.items()}


def _reach(start: str) -> set[str]:
    """Every padfree module importing ``start`` runs, at any depth: what it imports (lazily too) and the
    packages above each (importing ``padfree.drafter.recipes`` runs ``padfree/drafter/__init__.py``)."""
    mods, edges = _modules(), _edges()
    seen: set[str] = set()
    todo = [start]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parents = [".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)]
        todo.extend([*edges.get(m, ()), *(p for p in parents if p in mods)])
    return seen


def _imports_any(path: Path) -> set[str]:
    """Every module ``path`` imports at run time, with ``from a import b`` also as ``a.b``."""
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_lower_layers_import_neither_the_drafter_nor_the_integrations() -> None:
    mods = _modules()
    lower = sorted(m for m in mods if _in(m, LOWER))
    assert "padfree.core.planner" in lower and "padfree.torch.feed.sampler" in lower and "padfree.hf" in lower
    assert "padfree.drafter.collate" in _reach("padfree.integrations.speculators")  # the walk sees through
    for m in lower:
        bad = sorted(n for n in _reach(m) if _in(n, UPPER))
        assert not bad, f"{m} imports {', '.join(bad)} (the drafter wing builds on the lower layers)"


def test_torch_imports_neither_the_option_kit_nor_the_test_helpers() -> None:
    """``padfree.torch`` is a library layer: no module under it reaches the command line's option kit
    (``padfree.options``) or the test helpers (``padfree.testing``), lazily neither; the argparse loop lives
    above it, in ``padfree.recipes``."""
    mods = _modules()
    torch_mods = sorted(m for m in mods if _in(m, ("padfree.torch",)))
    assert "padfree.torch.execution.runner" in torch_mods and "padfree.torch.run.loop" in torch_mods
    upper = ("padfree.options", "padfree.testing")
    assert any(_in(n, upper) for n in _reach("padfree.recipes.loop"))  # the walk sees them where they are
    for m in torch_mods:
        bad = sorted(n for n in _reach(m) if _in(n, upper))
        assert not bad, f"{m} imports {', '.join(bad)} (move what needs them up to padfree.recipes)"


def test_core_and_the_torch_free_drafter_modules_import_no_torch() -> None:
    mods = _modules()
    assert set(TORCH_FREE_DRAFTER) <= set(mods), "a listed torch-free drafter module is gone: update the list"
    starts = [m for m in mods if _in(m, ("padfree.core",))] + list(TORCH_FREE_DRAFTER)
    # the check sees torch where it is: the drafter's trainer reaches it through the modules it imports
    assert any(_in(n, TORCH) for m in _reach("padfree.drafter.train") for n in _imports_any(mods[m]))
    for start in starts:
        for m in sorted(_reach(start)):
            torch = sorted(n for n in _imports_any(mods[m]) if _in(n, TORCH))
            assert not torch, f"{start} imports torch through {m} ({', '.join(torch)})"


def test_torch_free_modules_load_without_torch() -> None:
    """The same at run time, in a fresh interpreter: what third-party packages they import pull no torch."""
    code = (
        "import sys; import " + ", ".join(("padfree.core.planner", *TORCH_FREE_DRAFTER)) + "; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchdata', 'transformers')))"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=HANG_S
    )
    assert out.returncode == 0, out.stderr[-500:]
    assert out.stdout.strip() == "[]", f"importing them loaded {out.stdout.strip()[:300]}"


def test_examples_import_the_library_not_the_commands() -> None:
    """The examples are copyable recipes: they import padfree's library, never ``padfree.commands`` (the
    command line's own modules)."""
    examples = sorted((ROOT / "examples").glob("*.py"))
    assert examples
    for path in examples:
        bad = sorted(n for n in _imports_any(path) if _in(n, ("padfree.commands", "padfree.cli")))
        assert not bad, f"{path.relative_to(ROOT)} imports {', '.join(bad)}"


_SHARED = "padfree.commands.common"
"""What the commands share: their common options and output checks."""


def test_each_command_imports_no_other_command_and_the_library_no_command() -> None:
    """A command is a thin shell: it imports the library and what the commands share
    (``padfree.commands.common``), never another command; no library module imports a command."""
    mods = _modules()
    commands = sorted(m for m in mods if _in(m, ("padfree.commands",)) and m != "padfree.commands")
    assert "padfree.commands.simulate" in commands and "padfree.commands.report" in commands
    for m in commands:
        names = _imports_any(mods[m])
        bad = sorted(n for n in names if n.startswith("padfree.commands.") and not _in(n, (_SHARED,)))
        assert not bad, f"{m} imports {', '.join(bad)} (move what both need into the library or common)"
    library = sorted(m for m in mods if not _in(m, ("padfree.commands", "padfree.cli", "padfree.__main__")))
    for m in library:
        bad = sorted(n for n in _imports_any(mods[m]) if _in(n, ("padfree.commands", "padfree.cli")))
        assert not bad, f"{m} imports {', '.join(bad)} (the library never reaches up into the command line)"


def test_examples_import_no_other_example() -> None:
    """Each example is one copyable file: what examples share lives in the library (``padfree.options``,
    ``padfree.data``, ``padfree.recipes``), never in a module beside them."""
    examples = sorted((ROOT / "examples").glob("*.py"))
    local = {p.stem for p in examples} | {p.name for p in (ROOT / "examples").iterdir() if p.is_dir()}
    assert {"train", "train_drafter", "hf_trainer"} <= local
    for path in examples:
        bad = sorted(n for n in _imports_any(path) if n.split(".")[0] in local)
        assert not bad, f"{path.relative_to(ROOT)} imports {', '.join(bad)} (move it into the library)"


# ----- a mode owns its layout: no layer asks a strategy's name ---------------------------------------------
MODE = "chunked"
MODE_HOMES = ("padfree/core/strategies.py", "padfree/core/chunked.py")
"""Where the ``chunked`` strategy is registered and laid out: the only modules that may compare its name."""


def _name_compared(tree: ast.AST, name: str) -> list[int]:
    """Lines where the string ``name`` is compared: ``==``, ``!=``, ``is``, or ``in`` a literal tuple, list or
    set (a membership test of a dict's keys, e.g. a metric named like it, is no comparison of the name)."""

    def is_name(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value == name

    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands, operands[1:], strict=False):
            if isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)):
                hit = is_name(left) or is_name(right)
            elif isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
                hit = any(is_name(e) for e in right.elts)
            else:
                hit = False
            if hit:
                lines.append(node.lineno)
    return lines


def test_the_chunked_strategy_is_named_only_where_it_is_registered_and_laid_out() -> None:
    """Every layer asks the strategy (``config.spec``: its layout, its chunks, its context), never its name:
    ``"chunked"`` is compared nowhere in ``src/padfree`` outside its two modules, nor in the examples."""
    sample = 'a = s == "chunked"\nb = "chunked" != s\nc = s in ("packed", "chunked")\nd = "chunked" in m\n'
    assert _name_compared(ast.parse(sample), MODE) == [1, 2, 3]  # the check sees each form, not a dict key
    seen = 0
    for path in sorted([*(SRC / "padfree").rglob("*.py"), *(ROOT / "examples").glob("*.py")]):
        rel = path.relative_to(SRC if path.is_relative_to(SRC) else ROOT).as_posix()
        if rel in MODE_HOMES:
            continue
        seen += 1
        lines = _name_compared(ast.parse(path.read_text()), MODE)
        assert not lines, f"{rel}:{lines[0]} compares the strategy name {MODE!r}: ask config.spec instead"
    assert seen > 100


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_another_packages_private_module_or_name() -> None:
    """A package's ``_name`` modules and names are its own: another package reaches them through a public
    module (its face), so a package can change its insides without breaking its neighbours."""
    mods = _modules()
    bad = []
    for m, path in mods.items():
        home = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                if not t.startswith("padfree."):
                    continue
                parts = t.split(".")
                at = next((i for i, p in enumerate(parts) if _private(p)), None)
                if at is None:
                    continue
                owner = ".".join(parts[:at])  # the package (or module) the private thing is in ...
                if owner in mods and mods[owner].name != "__init__.py":
                    owner = owner.rpartition(".")[0]  # ... a module's private name belongs to its package
                if owner != home and not home.startswith(owner + "."):  # its own subpackages may
                    bad.append(f"{m} imports {t}")
    assert not bad, "; ".join(sorted(bad))


FUNCTION_LINES = 100
"""The longest a function in src may be: past it, a reader cannot hold it, and it is two ideas."""


def test_no_function_in_src_is_over_100_lines() -> None:
    long = []
    for path in (SRC / "padfree").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "; ".join(sorted(long))
