"""Reading per-sample lengths from files: ``.npy``, ``.txt`` (one integer a line), ``.jsonl`` (a field) and
``.parquet`` (a column). Every problem is an :class:`~padfree.errors.InputError` naming the file, the
sample (line) and the rule."""

from __future__ import annotations

import json
import re
import stat
from importlib import resources
from pathlib import Path

import numpy as np

from padfree.core.items import MAX_LENGTH, validate_lengths
from padfree.errors import InputError

SUFFIXES = (".npy", ".txt", ".jsonl", ".parquet")
DATA_HINT = (
    "training records? count their tokens first: padfree lengths DATA --tokenizer TOK --out lengths.npy"
)
_DATA_KEYS = ("messages", "conversations", "instruction", "prompt", "text")


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
    try:
        st = p.stat()
    except FileNotFoundError:
        raise InputError("file not found", path=name) from None
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the file ({_os_reason(exc)})", path=name) from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError("is a directory, not a lengths file", path=name)
    if not stat.S_ISREG(st.st_mode):
        raise InputError("not a regular file (a pipe, socket or device cannot be read)", path=name)
    if st.st_size == 0:
        raise InputError("empty file: no samples", path=name)
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
                f"unknown lengths format {suffix or '(none)'!r}: use one of {', '.join(SUFFIXES)} "
                f"({DATA_HINT})",
                path=name,
            )
    except InputError as exc:
        if exc.path is None:
            raise InputError(exc.rule, path=name, sample=exc.sample) from None
        raise
    except PermissionError:
        raise InputError("cannot read the file (permission denied)", path=name) from None
    except OSError as exc:
        raise InputError(f"cannot read the file ({_os_reason(exc)})", path=name) from None
    except MemoryError:
        raise InputError("too large to load into memory", path=name) from None
    return validate_lengths(values, name)


def assistant_path(lengths: str | Path) -> Path:
    """Where the loss-bearing counts of a lengths file lie (``padfree lengths`` writes them there):
    ``lengths.npy`` -> ``lengths.assistant.npy``.

    >>> assistant_path("data/lengths.npy").name
    'lengths.assistant.npy'
    """
    p = Path(lengths)
    return p.with_name(p.name[: -len(".npy")] + ".assistant.npy")


def read_loss_counts(path: str | Path, lengths: np.ndarray) -> np.ndarray:
    """Loss-bearing tokens per sample (a ``.npy`` beside the lengths, e.g. ``lengths.assistant.npy``), checked
    against ``lengths``: one integer per sample, from 0 to the sample's length. Every problem is one
    :class:`InputError` naming the file, the sample and the rule. Returns int64."""
    p = Path(path)
    try:
        if not stat.S_ISREG(p.stat().st_mode):
            raise InputError("not a regular file (loss counts are a .npy array)", path=str(p))
        raw = _read_npy(p)
    except InputError as exc:
        raise InputError(exc.rule, path=str(p)) from None
    except OSError as exc:
        raise InputError(f"cannot read loss counts ({_os_reason(exc)})", path=str(p)) from None
    if raw.shape[0] != lengths.shape[0]:
        raise InputError(f"{raw.shape[0]} loss counts for {lengths.shape[0]} samples", path=str(p))
    if raw.dtype.kind == "b" or raw.dtype.kind not in "iuf":
        raise InputError(f"loss counts must be integers (got dtype {raw.dtype})", path=str(p))
    vals = raw.astype(np.float64)
    bad = ~np.isfinite(vals) | (vals != np.floor(vals)) | (vals < 0) | (vals > lengths)
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError(
            f"loss count must be an integer from 0 to the sample's length {int(lengths[i])} (got {raw[i]})",
            path=str(p),
            sample=i,
        )
    return vals.astype(np.int64)


def _read_npy(p: Path) -> np.ndarray:
    with p.open("rb") as f:
        magic = f.read(6)
        if magic != b"\x93NUMPY":
            if magic[:2] == b"PK":
                raise InputError("an .npz archive, not a single .npy array")
            raise InputError("not a .npy file (it does not start with the .npy magic bytes)")
        f.seek(0)
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f, max_header_size=2**16)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f, max_header_size=2**16)
            else:  # pragma: no cover - read_magic only returns known versions or raises
                raise ValueError(f"unsupported .npy version {version}")
        except Exception as exc:  # numpy parses the header with tokenize/ast: many error types
            raise InputError(f"not a readable .npy array (bad header: {_short(exc)})") from None
        if dtype.hasobject:
            raise InputError(f"lengths must be integers (got dtype {dtype})")
        if any(d < 0 for d in shape):
            raise InputError(f"not a readable .npy array (bad header: shape {shape})")
        if len(shape) != 1:
            raise InputError(f"lengths must be a 1-D array (got shape {shape})")
        need = int(np.prod(shape, dtype=object)) * dtype.itemsize
        have = p.stat().st_size - f.tell()
        if have < need:
            raise InputError(
                f"truncated .npy: the header promises {need} bytes of data, the file holds {have}"
            )
        try:
            arr = np.fromfile(f, dtype=dtype, count=int(shape[0]))
        except (ValueError, EOFError) as exc:
            raise InputError(f"not a readable .npy array ({_short(exc)})") from None
    return arr


def _read_txt(p: Path) -> np.ndarray:
    out = []
    with p.open("rb") as f:
        for i, raw in enumerate(f):
            try:
                line = raw.decode("utf-8-sig" if i == 0 else "utf-8").strip()
            except UnicodeDecodeError:
                raise InputError("line is not UTF-8 text", sample=i) from None
            if not line:
                raise InputError("empty line (one integer per line expected)", sample=i)
            if not _INT.fullmatch(line):
                raise InputError(f"not an integer: {line[:40]!r}", sample=i)
            if len(line.lstrip("+-").lstrip("0")) > 30:  # beyond int(); any such length is out of range
                sign = "negative" if line.startswith("-") else "absurdly large"
                raise InputError(f"length {line[:20]}... is {sign} (limit {MAX_LENGTH} tokens)", sample=i)
            out.append(int(line))
    return _as_array(out)


def _read_jsonl(p: Path, field: str) -> np.ndarray:
    out = []
    with p.open("rb") as f:
        for i, raw in enumerate(f):
            if not raw.strip():
                raise InputError("empty line (one JSON object per line expected)", sample=i)
            try:
                rec = json.loads(raw.strip())
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, huge ints
                raise InputError(f"malformed JSON ({_short(exc)})", sample=i) from None
            if not isinstance(rec, dict) or field not in rec:
                hint = (
                    f" ({DATA_HINT})" if isinstance(rec, dict) and any(k in rec for k in _DATA_KEYS) else ""
                )
                raise InputError(f"missing field {field!r}{hint}", sample=i)
            v = rec[field]
            if isinstance(v, bool) or not isinstance(v, int):
                raise InputError(f"field {field!r} must be an integer (got {str(v)[:40]!r})", sample=i)
            out.append(v)
    return _as_array(out)


def _read_parquet(p: Path, column: str) -> np.ndarray:
    try:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover
        raise InputError("reading .parquet needs pyarrow: pip install 'padfree[io]'") from None
    import pyarrow as pa

    with p.open("rb") as f:
        try:
            schema = pq.read_schema(f)
        except Exception as exc:  # pyarrow raises many types for damaged files
            raise InputError(f"not a readable parquet file ({_short(exc)})") from None
        names = schema.names
        if column not in names:
            hint = f"; {DATA_HINT}" if any(k in names for k in _DATA_KEYS) else ""
            raise InputError(f"missing column {column!r} (columns: {', '.join(names[:10]) or 'none'}{hint})")
        # the type is checked from the schema, before arrow reads or converts any data
        kind = schema.field(column).type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
            raise InputError(f"column {column!r} must hold integers (got type {schema.field(column).type})")
        f.seek(0)
        try:
            # one thread, no pre-buffering: arrow's thread pools, torn down at interpreter exit while a
            # worker still runs, abort the process (apache/arrow#34314); one column needs no parallelism
            col = pq.read_table(f, columns=[column], use_threads=False, pre_buffer=False).column(column)
        except Exception as exc:
            raise InputError(f"not a readable parquet file ({_short(exc)})") from None
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
        raise InputError(f"column {column!r} must hold integers (got type {col.type})")
    if col.null_count:
        i = int(np.argmax(pc.is_null(col).to_numpy(zero_copy_only=False)))
        raise InputError(f"column {column!r} has a missing value", sample=i)
    try:
        return col.to_numpy()
    except Exception as exc:  # exotic types (dictionary, extension) that do not convert
        raise InputError(
            f"column {column!r} cannot become numbers (type {col.type}: {_short(exc)})"
        ) from None


_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)


def _as_array(values: list[int]) -> np.ndarray:
    # an integer beyond int64 would only fit a float, which rounds it: refuse it here, with its exact digits
    for i, v in enumerate(values):
        if abs(v) > 2**62:
            if v < 0:
                raise InputError(f"length must be a positive integer (got {v})", sample=i)
            raise InputError(f"length {v} is absurdly large (limit {MAX_LENGTH} tokens)", sample=i)
    return np.array(values, dtype=np.int64)


def _os_reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or _short(exc)


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
