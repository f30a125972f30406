"""Which format each data source is in, and its records in order: shared by ``padfree lengths`` and training.

>>> rs = readings(["fixtures/samples/gsm8k.jsonl.gz"])  # run from the repository root
>>> rs[0].fmt
'messages'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from padfree.data import formats, records
from padfree.data.tokenization import raise_record_error
from padfree.errors import ConfigError, InputError

MODES = ("auto", *formats.FORMATS)
_MAIN_FIELD = {
    "messages": "messages",
    "sharegpt": "conversations",
    "alpaca": "instruction",
    "prompt_completion": "prompt",
    "text": "text",
}


@dataclass(frozen=True)
class Reading:
    """One source, the format its records are read in and (columnar sources) the columns read."""

    source: records.Source
    fmt: str
    columns: list[str] | None

    @property
    def jsonl(self) -> bool:
        return self.source.kind == "jsonl"


def field_map(mode: str, field: str | None, fields: Mapping[str, str] | None) -> dict[str, str]:
    """The field names for ``mode``; ``field`` renames the mode's main field (``--field``/``--messages``)."""
    if mode not in MODES:
        raise ConfigError(f"unknown format {mode!r}: choose one of {', '.join(MODES)}")
    over = dict(fields or {})
    if field:
        if mode == "auto":
            raise ConfigError("a field name needs a format (--format, --field or --messages)")
        over[_MAIN_FIELD[mode]] = field
    return formats.field_names(over)


def readings(
    data: str | Path | Sequence[str | Path],
    mode: str = "auto",
    fields: Mapping[str, str] | None = None,
    split: str | None = None,
) -> list[Reading]:
    """Resolve files, globs and folders and decide each source's format (``mode``, or auto-detected from the
    first record / the column names). ``fields``: fields read under other names (:func:`field_map`)."""
    names = field_map(mode, None, fields)
    out = []
    for src in records.resolve_sources(data, split):
        cols = records.columns_of(src)
        if cols is None:
            fmt = mode if mode != "auto" else _detect_jsonl(src, names)
            out.append(Reading(src, fmt, None))
            continue
        found = mode if mode != "auto" else formats.detect(cols, names)
        if found is None:
            raise InputError(
                f"no column of a known format (columns: {', '.join(cols[:12])}): expected one of "
                f"{_expected(names)}; use --format or --field-map",
                path=src.name,
            )
        need = formats.needed_columns(found, names, cols)
        missing = [c for c in need if c not in cols]
        if missing:
            raise InputError(
                f"missing column {missing[0]!r} (columns: {', '.join(cols[:12])})", path=src.name
            )
        out.append(Reading(src, found, need))
    return out


def _detect_jsonl(src: records.Source, names: Mapping[str, str]) -> str:
    try:
        first = records.first_record(src)
    except formats.RecordError as exc:
        raise_record_error(str(src.path), True, 0, exc.rule)
    if first is None:
        return "text"  # no records: any format reads nothing
    if not isinstance(first, dict):
        raise_record_error(str(src.path), True, 0, f"a JSON {type(first).__name__}, not an object")
    fmt = formats.detect(first, names)
    if fmt is None:
        keys = ", ".join(list(first)[:12]) or "none"
        raise_record_error(
            str(src.path),
            True,
            0,
            f"the record matches no format (keys: {keys}): expected one of {_expected(names)}; "
            "use --format or --field-map",
        )
    return fmt


def _expected(names: Mapping[str, str]) -> str:
    return ", ".join(repr(names[k]) for _, k in formats.DETECT)
