"""What the newest allowed releases change: the family sweep under them, family by family, against the lock's.

``make compat`` installs the newest releases padfree's ranges allow into ``.venv-compat`` (no lock), runs the
family sweep there (``benchmarks/families.py``) and the exactness tests, then this script compares that sweep
with the one committed under the lock (``benchmarks/results/families.json``) and writes what changed:

    python benchmarks/compat.py --lock benchmarks/results/families.json --new build/compat/families.json \
        --out build/compat

Exit 0 either way (a change is news, not a failure); exit 2 on a missing or unreadable sweep file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from padfree.errors import InputError


def load_sweep(path: Path) -> tuple[dict[str, str], dict[str, dict]]:
    """The sweep at ``path`` as its meta (versions) and ``{family: row}``; one line on a bad file."""
    try:
        data = json.loads(path.read_text())
        rows = {r["family"]: r for r in data["families"]}
        return dict(data.get("meta", {})), rows
    except (OSError, ValueError, KeyError, TypeError) as e:
        rule = f"not a family sweep (families.json of benchmarks/families.py): {e}"
        raise InputError(rule, path=str(path)) from None


def changes(lock: dict[str, dict], new: dict[str, dict]) -> list[dict[str, str]]:
    """One row per family whose status differs, appears or disappears between the two sweeps.

    >>> lock = {"a": {"status": "exact"}, "b": {"status": "refused"}}
    >>> new = {"a": {"status": "exact"}, "b": {"status": "exact"}}
    >>> changes(lock, new)
    [{'family': 'b', 'lock': 'refused', 'new': 'exact', 'detail': ''}]
    """
    out = []
    for fam in sorted(set(lock) | set(new)):
        was = lock.get(fam, {}).get("status", "(absent)")
        now = new.get(fam, {}).get("status", "(absent)")
        if was != now:
            out.append({"family": fam, "lock": was, "new": now, "detail": new.get(fam, {}).get("detail", "")})
    return out


def counts(rows: dict[str, dict]) -> dict[str, int]:
    """How many families have each status."""
    out: dict[str, int] = {}
    for r in rows.values():
        out[r["status"]] = out.get(r["status"], 0) + 1
    return dict(sorted(out.items()))


def pins(path: Path) -> dict[str, str]:
    """``{package: version}`` of a ``name==version`` requirements file (a lock, a ``pip freeze``): names
    lower-cased with ``_`` as ``-``, a ``+cpu`` local tag dropped."""
    out = {}
    for line in path.read_text().splitlines():
        name, sep, ver = line.split("#")[0].strip().partition("==")
        if sep:
            out[name.strip().lower().replace("_", "-")] = ver.strip().removesuffix("+cpu")
    return out


def moved(lock: dict[str, str], new: dict[str, str]) -> list[tuple[str, str, str]]:
    """The packages whose version differs between the lock and the newest install."""
    both = sorted(set(lock) | set(new))
    return [(p, lock.get(p, "-"), new.get(p, "-")) for p in both if lock.get(p) != new.get(p)]


def render(
    lock_meta: dict,
    new_meta: dict,
    lock: dict,
    new: dict,
    rows: list[dict[str, str]],
    versions: list[tuple[str, str, str]] | None = None,
) -> str:
    """The markdown report."""
    lines = [
        "# Newest releases vs the lock: the family sweep",
        "",
        "| | lock | newest |",
        "|---|---|---|",
        f"| transformers | {lock_meta.get('transformers', '?')} | {new_meta.get('transformers', '?')} |",
        f"| torch | {lock_meta.get('torch', '?')} | {new_meta.get('torch', '?')} |",
        f"| statuses | {counts(lock)} | {counts(new)} |",
        "",
    ]
    if not rows:
        lines.append("No family changed status.")
    else:
        lines += ["| family | lock | newest | detail |", "|---|---|---|---|"]
        lines += [f"| {r['family']} | {r['lock']} | {r['new']} | {r['detail'][:160]} |" for r in rows]
    if versions is not None:
        lines += ["", "## Packages that moved", ""]
        lines += ["| package | lock | newest |", "|---|---|---|"] if versions else ["None."]
        lines += [f"| {p} | {a} | {b} |" for p, a, b in versions]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--lock", type=Path, default=Path("benchmarks/results/families.json"))
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--versions", type=Path, nargs=2, metavar=("LOCK", "NEW"), help="lock and freeze to diff")
    args = ap.parse_args(argv)
    try:
        lock_meta, lock = load_sweep(args.lock)
        new_meta, new = load_sweep(args.new)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = changes(lock, new)
    versions = moved(pins(args.versions[0]), pins(args.versions[1])) if args.versions else None
    args.out.mkdir(parents=True, exist_ok=True)
    md = render(lock_meta, new_meta, lock, new, rows, versions)
    (args.out / "compat.md").write_text(md)
    report = {"lock": lock_meta, "new": new_meta, "changes": rows, "packages": versions}
    (args.out / "compat.json").write_text(json.dumps(report, indent=1) + "\n")
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
