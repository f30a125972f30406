"""From a dataset and a tokenizer to per-sample lengths: parallel, with a progress bar and a content cache.

The cache key is the sha256 of the data's bytes, of the tokenizer's bytes and of every option that changes
a count (mode, field, chat template, counting-rule version), so a second run on the same inputs only hashes
the files and reads the stored counts, and any change to the data or the tokenizer misses.

Example (library)::

    res = count_lengths("data.jsonl.gz", "tokenizer.json", workers=4)
    res.lengths, res.loss_tokens, res.cache_hit
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from padfree.data import records
from padfree.data.tokenization import (
    RULE_VERSION,
    TokenCounter,
    count_values,
    raise_record_error,
    tokenizer_kind,
)
from padfree.errors import ConfigError, InputError

MODES = ("auto", "text", "messages")


@dataclass(frozen=True)
class LengthsResult:
    """Token counts of one dataset.

    Attributes:
        lengths: tokens per sample (int64).
        loss_tokens: loss-bearing tokens per sample: assistant turns of a chat, every token of a document.
        cache_hit: whether the counts came from the cache.
        cache_file: where they are (or were) stored; ``None`` when caching is off.
        seconds: wall time of the call.
    """

    lengths: np.ndarray
    loss_tokens: np.ndarray
    cache_hit: bool
    cache_file: Path | None
    seconds: float


def default_cache_dir() -> Path:
    """``$PADFREE_CACHE_DIR``, else ``~/.cache/padfree``."""
    env = os.environ.get("PADFREE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "padfree"


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def count_lengths(
    data: str | Path,
    tokenizer: str | Path,
    *,
    mode: str = "auto",
    field: str | None = None,
    chat_template: bool = False,
    workers: int | None = None,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    progress: bool = False,
    chunk_size: int = 512,
) -> LengthsResult:
    """Count every record's tokens (see :mod:`padfree.data.tokenization` for the rules).

    ``mode`` ``text``: ``field`` (default ``text``) holds a document; ``messages``: ``field`` (default
    ``messages``) holds a chat; ``auto``: a ``.jsonl`` record is a chat if it has ``messages``, else a
    document in ``text`` (a columnar source uses its ``messages`` column if it has one, else ``text``).
    A malformed record raises :class:`InputError` naming the file, the record and (for .jsonl) the line.
    """
    t0 = time.perf_counter()
    data = Path(data)
    kind = records.source_kind(data)
    tokenizer_kind(tokenizer)  # a clear error before any work
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    workers = default_workers() if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be an integer >= 1 (got {workers!r})")
    column = None
    if kind != "jsonl":
        mode, column = _columnar_mode(data, mode, field)
        field = column
    elif mode != "auto":
        field = field or ("text" if mode == "text" else "messages")
    cache_file = None
    if use_cache:
        key = _cache_key(data, tokenizer, mode, field, chat_template)
        cache_file = Path(cache_dir or default_cache_dir()) / "lengths" / f"{key}.npz"
        hit = _read_cache(cache_file)
        if hit is not None:
            return LengthsResult(hit[0], hit[1], True, cache_file, time.perf_counter() - t0)
    totals, loss = _count(
        data, tokenizer, kind, mode, field, column, chat_template, workers, progress, chunk_size
    )
    if cache_file is not None:
        _write_cache(cache_file, totals, loss)
    return LengthsResult(totals, loss, False, cache_file, time.perf_counter() - t0)


def _columnar_mode(data: Path, mode: str, field: str | None) -> tuple[str, str]:
    names = records.columns_of(data) or []
    if mode == "auto":
        if field:
            mode = "messages" if field == "messages" else "text"
        elif "messages" in names:
            return "messages", "messages"
        elif "text" in names:
            return "text", "text"
        else:
            raise InputError(
                f"no 'messages' or 'text' column (columns: {', '.join(names)}); use --field or --messages",
                path=str(data),
            )
    column = field or ("text" if mode == "text" else "messages")
    if column not in names:
        raise InputError(f"missing column {column!r} (columns: {', '.join(names)})", path=str(data))
    return mode, column


def _cache_key(data: Path, tokenizer: str | Path, mode: str, field: str | None, chat_template: bool) -> str:
    opts = {"rule": RULE_VERSION, "mode": mode, "field": field, "chat_template": bool(chat_template)}
    h = hashlib.sha256()
    h.update(records.content_hash(data).encode())
    h.update(records.content_hash(tokenizer, skip_weights=True).encode())
    h.update(json.dumps(opts, sort_keys=True).encode())
    return h.hexdigest()


def _read_cache(path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            return z["lengths"].astype(np.int64), z["loss_tokens"].astype(np.int64)
    except (OSError, KeyError, ValueError, EOFError):  # absent or damaged: count again
        return None


def _write_cache(path: Path, totals: np.ndarray, loss: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, lengths=totals, loss_tokens=loss)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache must not fail the command
        print(f"padfree: warning: cannot write the cache {path} ({exc.strerror or exc})", file=sys.stderr)


# --- counting: one tokenizer per worker process --------------------------------------------------------

_COUNTER: TokenCounter | None = None
_LOAD_ERROR: str | None = None


def _init_worker(tokenizer: str, chat_template: bool) -> None:
    global _COUNTER, _LOAD_ERROR
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    try:
        _COUNTER = TokenCounter(tokenizer, chat_template)
    except ConfigError as exc:  # raising in an initializer would make the pool respawn workers forever
        _LOAD_ERROR = str(exc)


def _work(task: tuple) -> tuple:
    values, first, progress_at, mode, field, jsonl = task
    if _COUNTER is None:
        return first, progress_at, None, None, (None, _LOAD_ERROR or "tokenizer not loaded")
    totals, loss, err = count_values(_COUNTER, values, mode, field or "", jsonl)
    return first, progress_at, totals, loss, err


def _count(
    data: Path,
    tokenizer: str | Path,
    kind: str,
    mode: str,
    field: str | None,
    column: str | None,
    chat_template: bool,
    workers: int,
    progress: bool,
    chunk_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    jsonl = kind == "jsonl"
    tasks = (
        (c.values, c.first, c.progress, mode, field, jsonl)
        for c in records.iter_chunks(data, column, chunk_size)
    )
    out_t: list[np.ndarray] = []
    out_l: list[np.ndarray] = []
    bar = _Bar(records.source_size(data), f"tokenizing {data.name}") if progress else None
    try:
        if workers == 1:
            global _COUNTER
            _COUNTER = TokenCounter(tokenizer, chat_template)  # raises ConfigError here
            results = map(_work, tasks)
            _collect(results, data, jsonl, out_t, out_l, bar)
        else:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            init = (str(tokenizer), chat_template)
            # the pool's feeder thread would read the whole source ahead; a semaphore keeps it a few
            # chunks ahead of the results, so memory stays flat on big datasets
            ahead = threading.Semaphore(4 * workers)
            stop = threading.Event()

            def bounded():  # noqa: ANN202
                for t in tasks:
                    while not ahead.acquire(timeout=0.1):
                        if stop.is_set():
                            return
                    yield t

            with ctx.Pool(workers, initializer=_init_worker, initargs=init) as pool:
                try:
                    _collect(pool.imap(_work, bounded()), data, jsonl, out_t, out_l, bar, ahead.release)
                finally:
                    stop.set()
    finally:
        if bar is not None:
            bar.close()
    if not out_t:
        raise InputError("no records", path=str(data))
    return np.concatenate(out_t), np.concatenate(out_l)


def _collect(results, data: Path, jsonl: bool, out_t: list, out_l: list, bar: _Bar | None, done=None) -> None:
    for first, progress_at, totals, loss, err in results:
        if done is not None:
            done()
        if err is not None and err[0] is None:
            raise ConfigError(err[1])
        if err is not None:
            raise_record_error(str(data), jsonl, first + err[0], err[1])
        out_t.append(totals)
        out_l.append(loss)
        if bar is not None:
            bar.update(progress_at)


class _Bar:
    """A rich progress bar on stderr (units: bytes of the file, or rows)."""

    def __init__(self, total: int | None, label: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        self._p = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,  # a log file gets the summary line only
        )
        self._p.start()
        self._task = self._p.add_task(label, total=total)

    def update(self, completed: int) -> None:
        self._p.update(self._task, completed=completed)

    def close(self) -> None:
        self._p.stop()
