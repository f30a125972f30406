"""The locked test environment: `make test` and CI install the lock's versions, the lock covers every package
they install, and `make compat` compares the newest releases' family sweep with the lock's."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import tomllib
from conftest import extras_packages

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"


def _compat():
    spec = importlib.util.spec_from_file_location("compat", ROOT / "benchmarks" / "compat.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"Makefile has no {name}"
    return m.group(1).strip()


def test_the_lock_pins_every_package_make_test_installs() -> None:
    pins = _compat().pins(LOCK)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    core = {re.split(r"[<>=!\[ ;]", d, maxsplit=1)[0].lower() for d in deps}
    peers = {p.split("==")[0] for p in _makefile_var("PEERS").split()}
    missing = (core | extras_packages(_makefile_var("EXTRAS_DEV")) | peers) - set(pins)
    assert not missing, f"constraints.txt lacks {sorted(missing)}: run make lock"
    assert pins["torch"] == "2.13.0"  # the CPU wheel on local disk, never another


def test_every_setup_install_goes_through_the_lock() -> None:
    text = (ROOT / "Makefile").read_text()
    setup = text[: text.index("\nlock:")]  # everything before the targets that make or try new locks
    installs = [ln for ln in setup.splitlines() if "pip install" in ln and "--upgrade pip" not in ln]
    assert installs and all("-c $(LOCK)" in ln for ln in installs), installs
    pip_locked = [ln for ln in setup.splitlines() if ln.strip().startswith("$(PIP_LOCKED)")]
    assert len(pip_locked) >= 4  # demo, dev, peers, drafter


def test_the_committed_family_sweep_was_made_on_the_locked_transformers() -> None:
    meta = json.loads((ROOT / "benchmarks/results/families.json").read_text())["meta"]
    assert meta["transformers"] == _compat().pins(LOCK)["transformers"], (
        "benchmarks/results/families.json was made on another transformers than the lock's: re-run "
        "benchmarks/families.py under the lock"
    )


def test_the_trainer_extra_brings_what_transformers_trainer_needs() -> None:
    assert {"accelerate", "torch", "transformers"} <= extras_packages("trainer")
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start: Hugging Face Trainer") :]
    section = section[: section.index("\n## ", 5)]
    named = re.findall(r'pip install -e "\.\[([\w,]+)\]"', section)
    assert named and all("accelerate" in extras_packages(n) for n in named), named


def test_compat_reports_each_family_whose_status_moved(tmp_path) -> None:
    compat = _compat()
    lock = {"a": {"status": "exact"}, "b": {"status": "refused"}, "gone": {"status": "exact"}}
    new = {"a": {"status": "exact"}, "b": {"status": "exact"}, "c": {"status": "refused", "detail": "why"}}
    rows = compat.changes(lock, new)
    assert [(r["family"], r["lock"], r["new"]) for r in rows] == [
        ("b", "refused", "exact"), ("c", "(absent)", "refused"), ("gone", "exact", "(absent)")
    ]  # fmt: skip
    for name, fams, ver in (("lock", lock, "5.25.0"), ("new", new, "5.26.0")):
        rows_ = [{"family": f, **r} for f, r in fams.items()]
        (tmp_path / f"{name}.json").write_text(json.dumps({"meta": {"transformers": ver}, "families": rows_}))
    (tmp_path / "lock.txt").write_text("# lock\nTransformers==5.25.0\ntorch==2.13.0+cpu\nnumpy==2.4.6\n")
    (tmp_path / "new.txt").write_text("transformers==5.26.0\ntorch==2.13.0\nnumpy==2.4.6\nnewpkg==1\n")
    out = tmp_path / "out"
    argv = ["--lock", str(tmp_path / "lock.json"), "--new", str(tmp_path / "new.json"), "--out", str(out)]
    assert compat.main([*argv, "--versions", str(tmp_path / "lock.txt"), str(tmp_path / "new.txt")]) == 0
    md = (out / "compat.md").read_text()
    assert "| b | refused | exact |" in md and "| transformers | 5.25.0 | 5.26.0 |" in md
    assert "| newpkg | - | 1 |" in md and "| torch |" not in md.split("## Packages")[1]
    assert json.loads((out / "compat.json").read_text())["changes"] == rows


def test_compat_refuses_a_file_that_is_not_a_sweep_in_one_line(tmp_path, capsys) -> None:
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    assert _compat().main(["--lock", str(bad), "--new", str(bad), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and "not a family sweep" in err
