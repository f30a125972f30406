"""Fuzzing the lengths readers: every file is either read correctly or refused with one line; nothing else.

Each test compares a successful read with an independent oracle, so a reader that accepts garbage or reads
the wrong values fails, not only one that crashes.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from padfree.cli import main
from padfree.core.items import MAX_LENGTH
from padfree.data.length_files import read_lengths
from padfree.errors import PadfreeError

# PADFREE_FUZZ_EXAMPLES=5000 runs a longer campaign (the test suite uses the profile's default)
FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    **(
        {"max_examples": int(os.environ["PADFREE_FUZZ_EXAMPLES"])}
        if "PADFREE_FUZZ_EXAMPLES" in os.environ
        else {}
    ),
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _read(path: Path, **kw) -> np.ndarray | None:
    """The reader's answer: the values, or None after checking the refusal is a one-line PadfreeError."""
    try:
        got = read_lengths(path, **kw)
    except PadfreeError as exc:
        msg = str(exc)
        assert "\n" not in msg and msg.startswith(str(path) + ": "), msg
        return None
    assert got.dtype == np.int64 and got.ndim == 1 and got.size > 0
    assert int(got.min()) >= 1 and int(got.max()) <= MAX_LENGTH
    return got


def _valid(values: list) -> bool:
    return len(values) > 0 and all(1 <= v <= MAX_LENGTH for v in values)


# --- random bytes under every suffix ------------------------------------------------------------------------


@FUZZ
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".npy", ".txt", ".jsonl", ".parquet"]))
def test_random_bytes(folder: Path, data: bytes, suffix: str):
    p = folder / f"rand{suffix}"
    p.write_bytes(data)
    got = _read(p)
    if got is not None and suffix == ".txt":
        assert got.tolist() == _txt_oracle(data)
    if got is not None and suffix == ".jsonl":
        assert got.tolist() == _jsonl_oracle(data)


# --- near-valid .npy ---------------------------------------------------------------------------------------

DESCRS = [
    "<i8",
    "<i4",
    ">i4",
    "<u2",
    "|u1",
    "<f8",
    "<f2",
    "|b1",
    "|O",
    "<U3",
    "|V8",
    "<c8",
    "<M8[s]",
    "<i3",
    "x",
]


@st.composite
def npy_files(draw) -> tuple[bytes, dict]:
    descr = draw(st.sampled_from(DESCRS))
    shape = draw(
        st.one_of(
            st.tuples(st.integers(-2, 40)),
            st.tuples(st.integers(0, 4), st.integers(0, 4)),
            st.just(()),
            st.tuples(st.integers(2**40, 2**62)),
        )
    )
    fortran = draw(st.booleans())
    header = {"descr": descr, "fortran_order": fortran, "shape": shape}
    text = repr(header) if draw(st.integers(0, 9)) else draw(st.text(max_size=60))
    text = text + " " * ((-(len(text) + 11)) % 64) + "\n"
    version = draw(st.sampled_from([b"\x01\x00", b"\x02\x00", b"\x03\x00", b"\x09\x00"]))
    hlen = len(text.encode("utf-8", "replace"))
    length = hlen.to_bytes(2, "little") if version == b"\x01\x00" else hlen.to_bytes(4, "little")
    head = b"\x93NUMPY" + version + length + text.encode("utf-8", "replace")
    try:
        itemsize = np.dtype(descr).itemsize
    except TypeError:
        itemsize = 1
    n = shape[0] if len(shape) == 1 and 0 <= shape[0] <= 40 else 4
    size = max(0, n * itemsize)
    body = draw(
        st.binary(min_size=size, max_size=size + 9) if draw(st.booleans()) else st.binary(max_size=size + 9)
    )
    cut = draw(st.integers(0, len(head) + len(body)))
    full = head + body
    if draw(st.integers(0, 4)) == 0:
        full = full[:cut]
    return full, header


@FUZZ
@given(spec=npy_files())
def test_near_valid_npy(folder: Path, spec: tuple[bytes, dict]):
    data, header = spec
    p = folder / "near.npy"
    p.write_bytes(data)
    got = _read(p)
    if got is not None:  # the oracle: numpy's own loader on the same bytes, then the documented rules
        arr = np.load(io.BytesIO(data), allow_pickle=False)
        assert arr.ndim == 1 and arr.dtype.kind in "iuf"
        assert np.array_equal(arr.astype(np.float64), got.astype(np.float64))


def test_npy_headers_found_by_fuzzing(folder: Path):
    """Headers that once escaped as TokenError / MemoryError instead of one line."""
    p = folder / "found.npy"
    for text in [")", "{'descr': '<i4', 'fortran_order': False, 'shape': (1000000000000,), }"]:
        text = text + " " * ((-(len(text) + 11)) % 64) + "\n"
        p.write_bytes(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode() + b"\x00" * 8)
        with pytest.raises(PadfreeError, match=r"bad header|truncated"):
            read_lengths(p)


def test_valid_npy_dtypes_round_trip(folder: Path):
    for dt in ["<i8", "<i4", ">i4", "<u2", "|u1", "<f8", "<f4", "<f2", ">u8"]:
        want = np.array([1, 7, 200, 3], dtype=dt)
        p = folder / "ok.npy"
        np.save(p, want)
        assert read_lengths(p).tolist() == [1, 7, 200, 3], dt


# --- .txt --------------------------------------------------------------------------------------------------

_ASCII_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)


def _txt_oracle(data: bytes) -> list[int] | None:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines = lines[:-1]
    out = []
    for i, raw in enumerate(lines):
        raw = raw + b"\n"
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if i == 0 and s.startswith("\ufeff"):
            s = s[1:]
        s = s.strip()
        if not _ASCII_INT.fullmatch(s) or len(s.lstrip("+-").lstrip("0")) > 30:
            return None
        out.append(int(s))
    return out if _valid(out) else None


TXT_LINE = st.one_of(
    st.integers(-5, 3 * 10**9).map(str),
    st.integers(1, 10**6).map(lambda v: f"  {v}\t"),
    st.integers(1, 10**6).map(lambda v: f"+{v}"),
    st.integers(1, 10**6).map(lambda v: f"{v}.0"),
    st.just(""),
    st.text(max_size=8),
    st.just("9" * 60),
)


@FUZZ
@given(lines=st.lists(TXT_LINE, max_size=12), crlf=st.booleans(), final=st.booleans(), bom=st.booleans())
def test_txt_lines(folder: Path, lines: list[str], crlf: bool, final: bool, bom: bool):
    sep = "\r\n" if crlf else "\n"
    text = ("\ufeff" if bom else "") + sep.join(lines) + (sep if final and lines else "")
    data = text.encode("utf-8", "surrogatepass")
    p = folder / "l.txt"
    p.write_bytes(data)
    got = _read(p)
    want = _txt_oracle(data) if data else None
    assert (None if got is None else got.tolist()) == want


# --- .jsonl ------------------------------------------------------------------------------------------------


def _jsonl_oracle(data: bytes) -> list[int] | None:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines = lines[:-1]
    out = []
    for raw in lines:
        if not raw.strip():
            return None
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):
            return None
        v = rec.get("length") if isinstance(rec, dict) else None
        if type(v) is not int:
            return None
        out.append(v)
    return out if _valid(out) else None


JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
JSON_LINE = st.one_of(
    st.integers(1, 10**6).map(lambda v: json.dumps({"length": v, "id": "x"})),
    st.integers(1, 10**6).map(lambda v: json.dumps({"length": v}) + "  "),
    JSON_VALUE.map(lambda v: json.dumps({"length": v})),
    JSON_VALUE.map(json.dumps),
    st.text(max_size=10),
    st.just(""),
    st.just('{"length": NaN}'),
)


@FUZZ
@given(lines=st.lists(JSON_LINE, max_size=8), final=st.booleans())
def test_jsonl_lines(folder: Path, lines: list[str], final: bool):
    data = ("\n".join(lines) + ("\n" if final and lines else "")).encode("utf-8", "surrogatepass")
    p = folder / "l.jsonl"
    p.write_bytes(data)
    got = _read(p)
    want = _jsonl_oracle(data) if data else None
    assert (None if got is None else got.tolist()) == want


# --- .parquet ----------------------------------------------------------------------------------------------

PA_TYPES = [pa.int8(), pa.int32(), pa.int64(), pa.uint16(), pa.uint64(), pa.float32(), pa.float64()]


@st.composite
def parquet_tables(draw) -> tuple[pa.Table, list | None]:
    n = draw(st.integers(0, 12))
    name = draw(st.sampled_from(["length", "length", "len"]))
    kind = draw(st.sampled_from(["num", "num", "num", "str", "bool", "list"]))
    if kind == "num":
        typ = draw(st.sampled_from(PA_TYPES))
        if pa.types.is_floating(typ):
            elem = st.one_of(st.integers(-3, 5000).map(float), st.floats(allow_nan=True, width=32))
        else:
            info = np.iinfo(typ.to_pandas_dtype())
            elem = st.integers(max(int(info.min), -5), min(int(info.max), 3 * 10**9))
        vals = draw(
            st.lists(st.one_of(elem, st.none()) if draw(st.booleans()) else elem, min_size=n, max_size=n)
        )
        col = pa.array(vals, type=typ)
    elif kind == "str":
        vals = draw(st.lists(st.integers(1, 9).map(str), min_size=n, max_size=n))
        col = pa.array(vals)
    elif kind == "bool":
        vals = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        col = pa.array(vals)
    else:
        vals = draw(st.lists(st.lists(st.integers(1, 9), max_size=2), min_size=n, max_size=n))
        col = pa.array(vals)
    table = pa.table({name: col, "other": pa.array(range(n))})
    ok = (
        name == "length"
        and kind == "num"
        and n > 0
        and all(v is not None and v == v and float(v).is_integer() and 1 <= v <= MAX_LENGTH for v in vals)
    )
    return table, ([int(v) for v in vals] if ok else None)


@FUZZ
@given(spec=parquet_tables())
def test_parquet_tables(folder: Path, spec: tuple[pa.Table, list | None]):
    table, want = spec
    p = folder / "l.parquet"
    pq.write_table(table, p)
    got = _read(p)
    assert (None if got is None else got.tolist()) == want


# --- the CLI on random files -------------------------------------------------------------------------------


@settings(FUZZ, max_examples=max(15, FUZZ.max_examples // 10))
@given(data=st.binary(max_size=80), suffix=st.sampled_from([".npy", ".txt", ".jsonl"]))
def test_cli_on_random_files(folder: Path, capsys: pytest.CaptureFixture, data: bytes, suffix: str):
    p = folder / f"cli{suffix}"
    p.write_bytes(data)
    out = folder / "plan.jsonl"
    code = main(["plan", str(p), "--world-size=1", "--grad-accum=1", f"--out={out}"])
    err = capsys.readouterr().err
    assert code in (0, 2)
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    if code == 2:
        assert err.startswith(f"padfree: error: {p}: ")
    else:
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        ids = sorted(i for r in rows for i in r["indices"])
        assert ids == list(range(read_lengths(p).shape[0]))
