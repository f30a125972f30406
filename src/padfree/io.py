"""Reading per-sample lengths from files: ``.npy``, ``.txt`` (one integer a line), ``.jsonl`` (a field) and
``.parquet`` (a column). Every problem is an :class:`~padfree.errors.InputError` naming the file, the
sample (line) and the rule."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np

from padfree.errors import InputError
from padfree.lengths import validate_lengths

SUFFIXES = (".npy", ".txt", ".jsonl", ".parquet")


def bundled_seed_mix() -> np.ndarray:
    """The bundled 902K-sample ``seed_mix`` lengths (cl100k tokens; see ``padfree/data/README.md``)."""
    with resources.files("padfree").joinpath("data/seed_mix.npy").open("rb") as f:
        return np.load(f)


def read_lengths(path: str | Path, field: str = "length", column: str = "length") -> np.ndarray:
    """Read and validate a lengths file; returns int64 lengths.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "l.txt")
    >>> _ = open(p, "w").write("3\\n5\\n")
    >>> read_lengths(p).tolist()
    [3, 5]
    """
    p = Path(path)
    name = str(p)
    if not p.exists():
        raise InputError("file not found", path=name)
    if p.is_dir():
        raise InputError("is a directory, not a lengths file", path=name)
    suffix = p.suffix.lower()
    try:
        if suffix == ".npy":
            values = _read_npy(p)
        elif suffix == ".txt":
            values = _read_txt(p)
        elif suffix == ".jsonl":
            values = _read_jsonl(p, field)
        elif suffix == ".parquet":
            values = _read_parquet(p, column)
        else:
            raise InputError(
                f"unknown lengths format {suffix or '(none)'!r}: use one of {', '.join(SUFFIXES)}", path=name
            )
    except InputError as exc:
        if exc.path is None:
            raise InputError(exc.rule, path=name, sample=exc.sample) from None
        raise
    except PermissionError:
        raise InputError("cannot read the file (permission denied)", path=name) from None
    except OSError as exc:
        raise InputError(f"cannot read the file ({exc.strerror or exc})", path=name) from None
    return validate_lengths(values, name)


def _read_npy(p: Path) -> np.ndarray:
    try:
        arr = np.load(p, allow_pickle=False)
    except (ValueError, EOFError, OSError) as exc:
        raise InputError(f"not a readable .npy array ({_short(exc)})") from None
    if isinstance(arr, np.lib.npyio.NpzFile):  # pragma: no cover - np.load returns NpzFile for zip data
        raise InputError("an .npz archive, not a single .npy array")
    return arr


def _read_txt(p: Path) -> np.ndarray:
    out = []
    with p.open("rb") as f:
        for i, raw in enumerate(f):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise InputError("line is not UTF-8 text", sample=i) from None
            if not line:
                raise InputError("empty line (one integer per line expected)", sample=i)
            try:
                out.append(int(line))
            except ValueError:
                raise InputError(f"not an integer: {line[:40]!r}", sample=i) from None
    return _as_array(out)


def _read_jsonl(p: Path, field: str) -> np.ndarray:
    out = []
    with p.open("rb") as f:
        for i, raw in enumerate(f):
            if not raw.strip():
                raise InputError("empty line (one JSON object per line expected)", sample=i)
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise InputError(f"malformed JSON ({_short(exc)})", sample=i) from None
            if not isinstance(rec, dict) or field not in rec:
                raise InputError(f"missing field {field!r}", sample=i)
            v = rec[field]
            if isinstance(v, bool) or not isinstance(v, int):
                raise InputError(f"field {field!r} must be an integer (got {str(v)[:40]!r})", sample=i)
            out.append(v)
    return _as_array(out)


def _read_parquet(p: Path, column: str) -> np.ndarray:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover
        raise InputError("reading .parquet needs pyarrow: pip install 'padfree[io]'") from None
    try:
        table = pq.read_table(p, columns=[column])
    except KeyError:
        raise InputError(f"missing column {column!r}") from None
    except Exception as exc:  # pyarrow raises many types for damaged files
        if "No match for FieldRef" in str(exc) or column in str(exc):
            raise InputError(f"missing column {column!r}") from None
        raise InputError(f"not a readable parquet file ({_short(exc)})") from None
    col = table.column(column)
    if col.null_count:
        arr = col.to_numpy(zero_copy_only=False)
        i = int(np.flatnonzero(np.array([v is None for v in arr]))[0])
        raise InputError(f"column {column!r} has a missing value", sample=i)
    return col.to_numpy()


def _as_array(values: list[int]) -> np.ndarray:
    # Python ints beyond int64 become floats so validation reports them as absurdly large, not as overflow
    if any(abs(v) > 2**62 for v in values):
        return np.array(values, dtype=np.float64)
    return np.array(values, dtype=np.int64)


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
