"""The one tokenization rule: records become ``input_ids`` and a loss mask here, for training and counting.

``padfree lengths`` counts ``len(input_ids)`` of exactly what :func:`encode_samples` builds, and training
(:mod:`padfree.data.samples`, ``examples/train.py``, ``padfree bench``) trains on it: the two cannot differ.

Tokenizers (SentencePiece ``.model``, ``tokenizer.json``, a ``transformers`` folder) are loaded by
:mod:`padfree.data.tokenizer`.

**Default rule.** ``encode`` never adds special tokens of its own; the rule adds them:

* a document: ``encode(text) + [EOS]``;
* a chat: for every message ``[BOS] + encode(role + "\\n" + content + "\\n") + [EOS]``, in order (an assistant
  turn's tool calls follow its content, one JSON line each: :func:`padfree.data.formats.message_text`):
  the BOS and EOS of each message stand for the turn's begin and end markers. So a chat has
  ``len(encode(...)) + 2`` tokens per message, the rule behind ``shared/data/lengths/*.npy`` (it
  reproduces ``<name>.mistral_v1.npy`` exactly with ``llama_sp32k.model``).

BOS and EOS are the tokenizer's own (a ``tokenizer.json``: from a ``tokenizer_config.json`` beside it, else
its ``<s>``/``</s>``-like special tokens; a tokenizer without a BOS uses its EOS for both).

**Chat template** (``chat_template=True``, a transformers folder): a chat is ``encode(template(messages))``
(the template writes its own special tokens).

**Loss mask** (``loss_on="assistant"``, the default): every token of an assistant message (its BOS and EOS
included) under the default rule; under a template, the tokens whose first character lies in what an
assistant turn adds to the rendering of the conversation before it (generation prompt counted as prompt).
A document's tokens all carry loss. ``loss_on="all"``: every token. The **loss-bearing count** of a sample
(``OUT.assistant.npy``, the sampler's ``loss_tokens``) counts label positions after the first token, as the
collators do: nothing predicts a sample's first token.

>>> tok = Tokenizer("fixtures/tokenizers/llama_sp32k.model")  # run from the repository root
>>> chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
>>> enc = encode_samples(tok, [chat, "A doc."])
>>> enc.lengths, enc.loss_tokens  # user turn 6 + assistant 7; document 3 + EOS
(array([13,  4]), array([7, 3]))
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from padfree.data import records
from padfree.data.formats import RecordError, message_text, to_sample
from padfree.data.tokenizer import MAX_UNCUT_CHARS, Tokenizer, UncutText, tokenizer_kind
from padfree.errors import ConfigError, InputError

__all__ = ["RULE_VERSION", "Encoded", "Tokenizer", "encode_chunk", "encode_samples", "tokenizer_kind"]

RULE_VERSION = 2  # bump when a rule changes: it is part of the cache key
# --- records -> input_ids and loss mask ---------------------------------------------------------------


@dataclass(frozen=True)
class Encoded:
    """Samples tokenized end to end, stored flat: sample ``i`` is ``ids[offsets[i]:offsets[i + 1]]``.

    Attributes:
        ids: token ids (int32).
        mask: 1 where the token carries loss (int8).
        offsets: ``len + 1`` sample boundaries (int64).
    """

    ids: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def loss_tokens(self) -> np.ndarray:
        """Loss-bearing label positions per sample: masked tokens after each sample's first token."""
        a, b = self.offsets[:-1], self.offsets[1:]
        if not self.ids.shape[0]:
            return np.zeros(len(self), np.int64)
        cs = np.concatenate([[0], np.cumsum(self.mask, dtype=np.int64)])
        first = np.where(b > a, self.mask[np.minimum(a, self.ids.shape[0] - 1)], 0)
        return cs[b] - cs[a] - first.astype(np.int64)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b], self.mask[a:b]


class SampleError(Exception):
    """Sample ``position`` of a batch cannot be tokenized (e.g. the chat template refuses it)."""

    def __init__(self, position: int, rule: str) -> None:
        super().__init__(rule)
        self.position, self.rule = position, rule


def encode_samples(tok: Tokenizer, samples: list, loss_on: str = "assistant") -> Encoded:
    """Tokenize chats (lists of ``{"role", "content"}``) and documents (strings) by the rule above."""
    if loss_on not in ("assistant", "all"):
        raise ConfigError(f"loss_on must be 'assistant' or 'all' (got {loss_on!r})")
    every = loss_on == "all"
    texts: list[str | None] = []
    owner: list[int] = []
    flag: list[int] = []
    begin: list[bool] = []
    templated: list[tuple[int, int]] = []  # (sample, piece) of each templated chat

    def piece(text: str | None, sample: int, loss: bool, role: bool) -> None:
        texts.append(text)
        owner.append(sample)
        flag.append(int(loss))
        begin.append(role)

    for i, s in enumerate(samples):
        if isinstance(s, str):
            piece(s, i, True, False)
        elif tok.chat_template:
            templated.append((i, len(texts)))
            piece(None, i, True, False)
        else:
            for m in s:
                piece(m["role"] + "\n" + message_text(m) + "\n", i, every or m["role"] == "assistant", True)
    plain = [k for k, t in enumerate(texts) if t is not None]
    pieces: list = [None] * len(texts)
    try:
        encoded = tok.encode([t for t in texts if t is not None])  # a long text in pieces, bounded memory
    except UncutText as exc:
        raise SampleError(owner[plain[exc.index]], exc.rule) from None
    for k, ids in zip(plain, encoded, strict=True):
        pieces[k] = ids
    end = np.ones(len(texts), bool)
    token_flags: np.ndarray | None = None
    if templated:
        ids_list, masks = _templated(tok, [samples[i] for i, _ in templated], [i for i, _ in templated])
        per_piece: list[np.ndarray | None] = [None] * len(texts)
        for (_, k), ids, m in zip(templated, ids_list, masks, strict=True):
            pieces[k], per_piece[k], end[k] = ids, (np.ones(len(ids), np.int8) if every else m), False
        token_flags = np.concatenate(
            [
                p if p is not None else np.full(len(pieces[k]), flag[k], np.int8)
                for k, p in enumerate(per_piece)
            ]
            or [np.zeros(0, np.int8)]
        )
    bos, eos = tok.markers if (any(begin) or end.any()) else (0, 0)
    return _assemble(pieces, np.array(owner, np.int64), np.array(flag, np.int8), np.array(begin, bool), end,
                     bos, eos, len(samples), token_flags)  # fmt: skip


def _assemble(pieces, owner, flag, begin, end, bos, eos, n, token_flags) -> Encoded:
    """Flat ids/mask from per-piece token lists: ``[BOS]? + piece + [EOS]?`` each, vectorized."""
    size = np.fromiter(map(len, pieces), np.int64, count=len(pieces))
    if any(isinstance(p, np.ndarray) for p in pieces):  # a long text encoded in pieces: int32 already
        flat = np.concatenate([np.asarray(p, dtype=np.int32) for p in pieces])
    else:
        flat = np.fromiter(itertools.chain.from_iterable(pieces), np.int32, count=int(size.sum()))
    seg = size + begin + end
    start = np.cumsum(seg) - seg
    ids = np.empty(int(seg.sum()), np.int32)
    text = np.ones(ids.shape[0], bool)
    ids[start[begin]] = bos
    text[start[begin]] = False
    last = (start + seg - 1)[end]
    ids[last] = eos
    text[last] = False
    ids[text] = flat
    mask = np.repeat(flag, seg)
    if token_flags is not None:
        mask[text] = token_flags
    offsets = np.zeros(n + 1, np.int64)
    offsets[1:] = np.cumsum(np.bincount(owner, weights=seg, minlength=n).astype(np.int64))
    return Encoded(ids, mask, offsets)


def _templated(tok: Tokenizer, chats: list, positions: list[int]) -> tuple[list, list]:
    """Token ids of each rendered chat and the loss mask of its tokens."""
    full: list[str] = []
    spans: list[list[tuple[str, str]]] = []
    for ms, pos in zip(chats, positions, strict=True):
        try:
            text = tok.render(ms)
            if len(text) > MAX_UNCUT_CHARS:  # a template's text is encoded at once (its mask needs offsets)
                raise SampleError(
                    pos,
                    f"the chat template renders {len(text):,} characters, over {MAX_UNCUT_CHARS:,} (a "
                    "rendered chat is encoded at once); split the conversation or count without "
                    "--chat-template",
                )
            sp = []
            for j, m in enumerate(ms):
                if m["role"] == "assistant":
                    through = text if j == len(ms) - 1 else tok.render(ms[: j + 1])
                    before = tok.render(ms[:j], generation_prompt=True) if j else ""
                    sp.append((before, through))
        except SampleError:
            raise
        except Exception as exc:  # jinja2 TemplateError and whatever the template raises on purpose
            first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
            raise SampleError(pos, f"the chat template cannot render it ({first})") from None
        full.append(text)
        spans.append(sp)
    stable = [
        all(t.startswith(th) and th.startswith(b) for b, th in sp) for t, sp in zip(full, spans, strict=True)
    ]
    ids_list: list[list[int]] = []
    masks: list[np.ndarray | None] = []
    if tok.backend is not None:
        encs = tok.backend.encode_batch(full, add_special_tokens=False)
        for enc, sp, ok, text in zip(encs, spans, stable, full, strict=True):
            ids_list.append(enc.ids)
            masks.append(_span_mask(enc, sp, len(text)) if ok else None)
    else:
        try:
            ids_list = tok.encode(full)
        except UncutText as exc:
            raise SampleError(positions[exc.index], exc.rule) from None
        masks = [None] * len(full)
    # the rest (slow tokenizers; templates whose rendering of a conversation does not start with the
    # rendering of its first turns): a turn's tokens are those its rendering adds, counted in tokens
    todo = [c for c, m in enumerate(masks) if m is None]
    if todo:
        texts = [t for c in todo for b, th in spans[c] for t in (b, th)]
        counts = iter(map(len, tok.encode(texts)))
        for c in todo:
            m = np.zeros(len(ids_list[c]), np.int8)
            for _ in spans[c]:
                a, b = next(counts), next(counts)
                m[a:b] = 1
            masks[c] = m
    return ids_list, masks


def _span_mask(enc, spans: list[tuple[str, str]], size: int) -> np.ndarray:
    """1 on the tokens whose first character is in ``[len(before), len(through))`` of some span."""
    n = len(enc.ids)
    m = np.zeros(n, np.int8)
    for before, through in spans:
        m[_token_at(enc, len(before), size, n) : _token_at(enc, len(through), size, n)] = 1
    return m


def _token_at(enc, pos: int, size: int, n: int) -> int:
    """Index of the first token that starts at or after character ``pos`` (``n`` when none does)."""
    while pos < size:
        t = enc.char_to_token(pos)
        if t is not None:
            return t if enc.token_to_chars(t)[0] >= pos else t + 1
        pos += 1  # a character no token covers (dropped by the normalizer): look at the next one
    return n


# --- one chunk of raw records -------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkResult:
    """What :func:`encode_chunk` returns: the encoded records, or the first bad one.

    Attributes:
        encoded: the chunk's samples (``None`` when ``error`` is set).
        error: ``(position in the chunk, rule)`` of the first bad record, else ``None``.
        replaced: positions of records whose lone UTF-16 surrogates were replaced by U+FFFD.
    """

    encoded: Encoded | None
    error: tuple[int, str] | None
    replaced: tuple[int, ...] = ()


def encode_chunk(
    tok: Tokenizer, values: list, jsonl: bool, fmt: str, fields: Mapping[str, str], loss_on: str = "assistant"
) -> ChunkResult:
    """Raw ``.jsonl`` lines (``jsonl=True``) or row dicts of format ``fmt`` -> :class:`ChunkResult`."""
    samples = []
    replaced = []
    for i, v in enumerate(values):
        try:
            if jsonl:
                v, fixed = records.parse_line(v)
                if fixed:
                    replaced.append(i)
            samples.append(to_sample(v, fmt, fields))
        except RecordError as exc:
            return ChunkResult(None, (i, exc.rule), tuple(replaced))
    try:
        return ChunkResult(encode_samples(tok, samples, loss_on), None, tuple(replaced))
    except SampleError as exc:
        return ChunkResult(None, (exc.position, exc.rule), tuple(replaced))


def raise_record_error(path: str, jsonl: bool, index: int, rule: str) -> NoReturn:
    """Raise the :class:`InputError` for record ``index`` of ``path`` (``.jsonl``: naming the line too)."""
    where = f"line {index + 1}: " if jsonl else ""
    raise InputError(where + rule, path=path, sample=index)
