"""Every argument parser of the command line, the examples and the benchmarks reads only whole option names:
an abbreviation (``--sp`` for ``--split``) is a usage error, never silently another option."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from padfree.cli import build_parser, main
from padfree.options import OneLineParser, example_parser

ROOT = Path(__file__).resolve().parents[1]
PLACES = ("src/padfree", "examples", "benchmarks")


def _name(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _parsers_without_allow_abbrev_false() -> tuple[list[str], int]:
    """``(file:line of each ArgumentParser(...) call lacking allow_abbrev=False, calls seen)``; a subclass of
    ArgumentParser other than :class:`OneLineParser` (which forces it) counts as lacking it too."""
    bad, seen = [], 0
    for place in PLACES:
        for path in sorted((ROOT / place).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                subclass = isinstance(node, ast.ClassDef) and node.name != "OneLineParser"
                if subclass and any(_name(b) == "ArgumentParser" for b in node.bases):
                    bad.append(where)
                if not (isinstance(node, ast.Call) and _name(node.func) == "ArgumentParser"):
                    continue
                seen += 1
                flag = next((k.value for k in node.keywords if k.arg == "allow_abbrev"), None)
                if not (isinstance(flag, ast.Constant) and flag.value is False):
                    bad.append(where)
    return bad, seen


def test_every_argument_parser_sets_allow_abbrev_false() -> None:
    bad, seen = _parsers_without_allow_abbrev_false()
    assert seen >= 30  # the benchmarks' parsers and examples/hf_trainer.py's were all found
    assert not bad, f"ArgumentParser without allow_abbrev=False (use padfree.options.OneLineParser): {bad}"


def test_the_one_line_parser_and_every_command_refuse_abbreviations(capsys: pytest.CaptureFixture) -> None:
    assert OneLineParser(allow_abbrev=True).allow_abbrev is False
    assert example_parser("doc").allow_abbrev is False
    sub = next(a for a in build_parser()._actions if a.choices and "plan" in a.choices)
    assert all(p.allow_abbrev is False for p in sub.choices.values())
    assert main(["plan", "--budg", "512"]) == 2  # was read as --budget
    assert "unrecognized arguments: --budg" in capsys.readouterr().err
    assert main(["check-packing", "--fam", "llama"]) == 2  # was read as --families
    assert "unrecognized arguments: --fam" in capsys.readouterr().err


def test_an_example_does_not_read_an_abbreviation_as_another_option(capsys: pytest.CaptureFixture) -> None:
    """``examples/train.py --spl 2`` used to train on split ``2`` (``--split``)."""
    spec = importlib.util.spec_from_file_location("train_example", ROOT / "examples" / "train.py")
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    with pytest.raises(SystemExit) as stop:
        train.parse_args(["--spl", "2"])
    assert stop.value.code == 2 and "unrecognized arguments: --spl 2" in capsys.readouterr().err


def test_every_scripts_device_is_checked_when_its_options_are_parsed() -> None:
    """A benchmark's ``--device bogus`` (or ``cuda`` without CUDA) is a usage error, not a failure deep in a
    run: ``type=device_option`` (the commands and examples call ``check_device`` before any work)."""
    import argparse

    from padfree.options import device_option

    bad, seen = [], 0
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            call = isinstance(node, ast.Call) and _name(node.func) == "add_argument" and node.args
            if not (call and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--device"):
                continue
            seen += 1
            kind = next((k.value for k in node.keywords if k.arg == "type"), None)
            if not (isinstance(kind, ast.Name) and kind.id == "device_option"):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert seen >= 3 and not bad, bad
    assert device_option("cpu") == "cpu"
    with pytest.raises(argparse.ArgumentTypeError, match="'bogus': not a device name"):
        device_option("bogus")
