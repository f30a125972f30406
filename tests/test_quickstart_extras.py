"""Issue 19, item 6: `make demo` installs what the README's command-line quick start uses, and every part
of the quick start that needs torch says the one command that installs it, next to it."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _extras(names: str) -> set[str]:
    """The packages the extras ``names`` ("a,b") require, ``padfree[...]`` self-references followed."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pkgs: set[str] = set()
    todo = names.split(",")
    while todo:
        for req in table[todo.pop()]:
            inner = re.fullmatch(r"padfree\[([\w,-]+)\]", req)
            if inner:
                todo += inner.group(1).split(",")
            else:
                pkgs.add(re.split(r"[<>=!\[ ]", req, maxsplit=1)[0])
    return pkgs


def _demo_packages() -> set[str]:
    extras = re.search(r"^EXTRAS_DEMO\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert extras, "Makefile has no EXTRAS_DEMO"
    return _extras(extras.group(1))


def test_make_demo_installs_what_the_command_line_quick_start_imports() -> None:
    # padfree lengths (SentencePiece .model, tokenizer.json, transformers folders, parquet, datasets
    # folders) and padfree report (matplotlib)
    need = {"sentencepiece", "tokenizers", "transformers", "datasets", "pyarrow", "matplotlib"}
    assert need <= _demo_packages()


def test_every_torch_part_of_the_quick_start_says_how_to_install_torch() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    uses_torch = re.compile(
        r"padfree calibrate|padfree check-packing|examples/(train|hf_trainer)\.py|from padfree\.(torch|hf)"
    )
    for i, line in enumerate(lines):
        if uses_torch.search(line) and not line.startswith("|"):
            section = max(j for j in range(i + 1) if lines[j].startswith("## "))
            context = "\n".join(lines[section : i + 3])
            named = re.findall(r"\.\[([\w,]+)\]", context)  # the extras its pip command names
            assert any("torch" in _extras(n) for n in named), (
                f"README line {i + 1} needs torch but its section never says how: {line}"
            )
    assert "torch" not in _demo_packages()  # the demo stays light: torch is the one explicit command
