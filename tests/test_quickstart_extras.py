"""Issue 19, item 6: `make demo` installs what the README's command-line quick start uses, and every part
of the quick start that needs torch says the one command that installs it, next to it."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import extras_packages

ROOT = Path(__file__).resolve().parents[1]


def _demo_packages() -> set[str]:
    extras = re.search(r"^EXTRAS_DEMO\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert extras, "Makefile has no EXTRAS_DEMO"
    return extras_packages(extras.group(1))


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
            assert any("torch" in extras_packages(n) for n in named), (
                f"README line {i + 1} needs torch but its section never says how: {line}"
            )
    assert "torch" not in _demo_packages()  # the demo stays light: torch is the one explicit command
