"""Training samples from data files: records -> ``input_ids`` and ``loss_mask`` by the one tokenization rule.

:func:`load_samples` reads the same sources, formats and tokenizers as ``padfree lengths`` and tokenizes with
the same function (:func:`padfree.data.tokenization.encode_samples`), so ``len(input_ids)`` of every sample is
what ``padfree lengths`` wrote for it. :func:`check_lengths` verifies a lengths file against the samples: any
difference, shorter or longer, is an error naming the sample and both numbers (never a silent truncation).

Used by ``examples/train.py``, ``examples/hf_trainer.py`` and ``padfree bench``.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from padfree.data.reading import field_map, readings
from padfree.data.records import iter_chunks
from padfree.data.tokenization import Tokenizer, encode_chunk, raise_record_error
from padfree.errors import InputError


class SampleSet(list):
    """Samples ``{"input_ids": int32 array, "loss_mask": int8 array}`` that know where each came from."""

    def __init__(self, items: list, origins: list[tuple[int, str, bool]]) -> None:
        super().__init__(items)
        self._origins = origins  # (first sample, source name, jsonl) per source, in order

    def where(self, i: int) -> str:
        """The file and line (``.jsonl``) or record of sample ``i``, e.g. ``data/a.jsonl.gz line 57``."""
        k = bisect.bisect_right([o[0] for o in self._origins], i) - 1
        first, name, jsonl = self._origins[k]
        return f"{name} line {i - first + 1}" if jsonl else f"{name} record {i - first}"


def load_samples(
    data: str | Path | Sequence[str | Path],
    tokenizer: str | Path,
    limit: int | None = None,
    loss_on: str = "assistant",
    max_len: int | None = None,
    per_file: int | None = None,
    *,
    mode: str = "auto",
    fields: Mapping[str, str] | None = None,
    split: str | None = None,
    chat_template: bool = False,
    chunk_size: int = 512,
) -> SampleSet:
    """Tokenized samples in source order, cut to ``max_len`` tokens; at most ``per_file`` from each source
    and ``limit`` in all. ``data``, ``mode``, ``fields`` and ``split`` as for
    :func:`padfree.data.count_lengths.count_lengths`; ``loss_on``: ``assistant`` or ``all``."""
    names = field_map(mode, None, fields)
    tok = Tokenizer(tokenizer, chat_template)
    items: list[dict] = []
    origins: list[tuple[int, str, bool]] = []
    for r in readings(data, mode, names, split):
        origins.append((len(items), r.source.name, r.jsonl))
        taken = 0
        for chunk in iter_chunks(r.source, r.columns, chunk_size):
            room = ([per_file - taken] if per_file is not None else []) + (
                [limit - len(items)] if limit is not None else []
            )
            values = chunk.values[: max(min(room), 0)] if room else chunk.values
            res = encode_chunk(tok, values, r.jsonl, r.fmt, names, loss_on)
            if res.error is not None:
                raise_record_error(r.source.name, r.jsonl, chunk.first + res.error[0], res.error[1])
            enc = res.encoded
            assert enc is not None  # no error: the chunk was encoded
            for i in range(len(enc)):
                ids, mask = enc.sample(i)
                items.append({"input_ids": ids[:max_len], "loss_mask": mask[:max_len]})
            taken += len(enc)
            if (per_file is not None and taken >= per_file) or (limit is not None and len(items) >= limit):
                break
        if limit is not None and len(items) >= limit:
            break
    return SampleSet(items, origins)


def loss_tokens_of(samples: list[dict]) -> np.ndarray:
    """Loss-bearing tokens per sample (label positions after the first token), as the collators count them."""
    return np.array([int(s["loss_mask"][1:].sum()) for s in samples], dtype=np.int64)


def check_lengths(samples: SampleSet, lengths: np.ndarray, path: str, what: str = "tokens") -> None:
    """Refuse a lengths file that disagrees with the samples (count or any value), naming the first sample.

    ``what`` names the numbers (``tokens``, or ``loss-bearing tokens`` for an ``.assistant.npy``).
    """
    have = np.array([s["input_ids"].shape[0] for s in samples], np.int64)
    if what != "tokens":
        have = loss_tokens_of(samples)
    want = np.asarray(lengths, np.int64)
    if want.shape[0] != have.shape[0]:
        raise InputError(
            f"the lengths file holds {want.shape[0]:,} samples, the data {have.shape[0]:,}: count it again "
            "with `padfree lengths` on the same data",
            path=path,
        )
    bad = np.flatnonzero(want != have)
    if bad.size:
        i = int(bad[0])
        raise InputError(
            f"the lengths file says {int(want[i]):,} {what}, the data has {int(have[i]):,} "
            f"({samples.where(i)}; {bad.size:,} of {want.shape[0]:,} samples differ): count again with "
            "`padfree lengths` and the same tokenizer, --format and --chat-template",
            path=path,
            sample=i,
        )


def load_training_data(
    data: str | Path | Sequence[str | Path],
    tokenizer: str | Path,
    *,
    lengths_file: str | Path | None = None,
    limit: int | None = None,
    loss_on: str = "assistant",
    mode: str = "auto",
    fields: Mapping[str, str] | None = None,
    split: str | None = None,
    chat_template: bool = False,
) -> tuple[SampleSet, np.ndarray, np.ndarray]:
    """``(samples, lengths, loss_tokens)``: the samples tokenized by padfree's one rule
    (:func:`load_samples`), whole; with ``lengths_file`` (``padfree lengths`` output) the plan gets the
    file's lengths, each checked against its sample, and so are the loss-bearing counts beside it
    (``loss_on="assistant"``). Samples longer than the budget follow the plan's overlong policy, as in
    ``padfree plan``."""
    from padfree.data.length_files import assistant_path, read_lengths

    samples = load_samples(
        data,
        tokenizer,
        limit,
        loss_on,
        None,
        mode=mode,
        fields=fields,
        split=split,
        chat_template=chat_template,
    )
    loss_tokens = loss_tokens_of(samples)
    if not lengths_file:
        return samples, np.array([len(s["input_ids"]) for s in samples], np.int64), loss_tokens
    lengths = read_lengths(lengths_file)[:limit]
    check_lengths(samples, lengths, str(lengths_file))
    aux = assistant_path(Path(lengths_file))
    if loss_on == "assistant" and aux.exists():
        loss_file = np.load(aux, allow_pickle=False)[:limit]  # may hold zeros: not read_lengths
        check_lengths(samples, loss_file, str(aux), "loss-bearing tokens")
    return samples, lengths, loss_tokens
