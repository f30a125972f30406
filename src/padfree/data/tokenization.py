"""Counting the tokens of training records with a local tokenizer.

Tokenizers (nothing is downloaded):

* a SentencePiece ``.model`` file (``sentencepiece``),
* a Hugging Face ``tokenizer.json`` file (``tokenizers``),
* a local ``transformers`` tokenizer folder (``AutoTokenizer.from_pretrained(..., local_files_only=True)``),
  the only kind that can carry a chat template.

Counting rules. A *document* (a text field) counts ``len(encode(text)) + 1``: the text plus one
end-of-document token. A *chat* sample (a list of ``{"role", "content"}`` messages) is, without a chat
template, the **fallback rule**: every message counts ``len(encode(role + "\\n" + content + "\\n")) + 2`` (two
tokens standing in for the turn's begin/end markers), and the sample is the sum over its messages. ``encode``
never adds special tokens of its own (no BOS/EOS), so the rule is the same for every tokenizer. This is the
rule behind ``shared/data/lengths/*.npy`` (it reproduces ``<name>.mistral_v1.npy`` and
``<name>.mistral_v1.assistant.npy`` exactly with ``llama_sp32k.model``).

With ``chat_template=True`` a chat sample is rendered with the tokenizer's template and counted as
``len(encode(rendered))``, again without extra special tokens (the template writes its own).

Loss-bearing tokens: a document's are all its tokens; a chat sample's are those of its assistant turns
(fallback: the assistant messages' counts; template: for each assistant message, the tokens added by
rendering it after the conversation before it, generation prompt included in the prefix).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from padfree.errors import ConfigError, InputError

RULE_VERSION = 1  # bump when a counting rule changes: it is part of the cache key
MESSAGE_EXTRA = 2
DOCUMENT_EXTRA = 1


def tokenizer_kind(path: str | Path) -> str:
    """``sentencepiece`` (a ``.model`` file), ``tokenizers`` (a ``.json`` file) or ``transformers`` (a
    folder)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: tokenizer not found")
    if p.is_dir():
        return "transformers"
    if p.suffix == ".model":
        return "sentencepiece"
    if p.suffix == ".json":
        return "tokenizers"
    raise ConfigError(
        f"{p}: unknown tokenizer: give a SentencePiece .model, a tokenizer.json or a transformers folder"
    )


class TokenCounter:
    """One loaded tokenizer and the counting rules; build one per process (tokenizers are not shared)."""

    def __init__(self, path: str | Path, chat_template: bool = False) -> None:
        self.path = str(path)
        self.kind = tokenizer_kind(path)
        self.chat_template = chat_template
        self._tok = _load(self.path, self.kind)
        if chat_template and (self.kind != "transformers" or not getattr(self._tok, "chat_template", None)):
            raise ConfigError(
                f"{self.path}: --chat-template needs a transformers tokenizer folder with a chat "
                "template; without --chat-template chats are counted by the fallback rule"
            )

    def lengths(self, texts: list[str]) -> np.ndarray:
        """Token count of each text, no special tokens added."""
        if not texts:
            return np.zeros(0, np.int64)
        if self.kind == "sentencepiece":
            ids = self._tok.encode(texts)
        elif self.kind == "tokenizers":
            ids = [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        else:
            ids = self._tok(texts, add_special_tokens=False)["input_ids"]
        return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(texts))

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        """The chat template's text for ``messages``."""
        return self._tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )


def _load(path: str, kind: str):  # -> the tokenizer object
    try:
        if kind == "sentencepiece":
            import sentencepiece as spm

            return spm.SentencePieceProcessor(model_file=path)
        if kind == "tokenizers":
            from tokenizers import Tokenizer

            return Tokenizer.from_file(path)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except ImportError as exc:
        raise ConfigError(f"loading a {kind} tokenizer needs {exc.name}: pip install 'padfree[hf]'") from None
    except Exception as exc:  # each library raises its own types for a foreign file
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path}: not a loadable {kind} tokenizer ({first})") from None


def count_values(
    counter: TokenCounter, values: list, mode: str, field: str, jsonl: bool
) -> tuple[np.ndarray, np.ndarray, tuple[int, str] | None]:
    """Count a chunk of records.

    ``values`` are raw JSON lines (``jsonl=True``) or decoded column values. ``mode`` is ``text`` (``field``
    holds a document), ``messages`` (``field`` holds a chat) or ``auto`` (per ``.jsonl`` record: ``messages``
    if present, else ``text``). Returns ``(totals, loss_bearing, error)``; ``error`` is ``(position in the
    chunk, rule)`` for the first malformed record, and then the counts are empty.
    """
    docs: list[tuple[int, str]] = []
    chats: list[tuple[int, list[dict]]] = []
    for i, v in enumerate(values):
        rec = v
        kind, name = mode, field
        if jsonl:
            if not v.strip():
                return _fail(i, "empty line (one JSON object per line expected)")
            try:
                rec = json.loads(v)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                return _fail(i, f"malformed JSON ({str(exc).splitlines()[0][:100]})")
            if not isinstance(rec, dict):
                return _fail(i, f"a JSON {type(rec).__name__}, not an object")
            if mode == "auto":
                kind, name = ("messages", "messages") if "messages" in rec else ("text", "text")
                if name not in rec:
                    return _fail(i, "record has neither 'messages' nor 'text' (use --field or --messages)")
            if name not in rec:
                return _fail(i, f"missing field {name!r}")
            rec = rec[name]
        if kind == "text":
            if not isinstance(rec, str):
                return _fail(i, f"field {name!r} must be a string (got {_type(rec)})")
            docs.append((i, rec))
        else:
            rule = _check_messages(rec, name)
            if rule:
                return _fail(i, rule)
            chats.append((i, rec))
    n = len(values)
    totals = np.zeros(n, np.int64)
    loss = np.zeros(n, np.int64)
    if docs:
        at = np.array([i for i, _ in docs], np.int64)
        counts = counter.lengths([t for _, t in docs]) + DOCUMENT_EXTRA
        totals[at] = counts
        loss[at] = counts
    if chats:
        try:
            if counter.chat_template:
                _count_templated(counter, chats, totals, loss)
            else:
                _count_fallback(counter, chats, totals, loss)
        except _RecordError as exc:
            return _fail(exc.position, exc.rule)
    return totals, loss, None


class _RecordError(Exception):
    def __init__(self, position: int, rule: str) -> None:
        self.position, self.rule = position, rule


def _count_fallback(counter: TokenCounter, chats: list, totals: np.ndarray, loss: np.ndarray) -> None:
    owner = np.array([i for i, ms in chats for _ in ms], np.int64)
    assistant = np.array([m["role"] == "assistant" for _, ms in chats for m in ms], bool)
    texts = [m["role"] + "\n" + m["content"] + "\n" for _, ms in chats for m in ms]
    per_message = counter.lengths(texts) + MESSAGE_EXTRA
    n = totals.shape[0]
    totals += np.bincount(owner, weights=per_message, minlength=n).astype(np.int64)
    loss += np.bincount(owner[assistant], weights=per_message[assistant], minlength=n).astype(np.int64)


def _count_templated(counter: TokenCounter, chats: list, totals: np.ndarray, loss: np.ndarray) -> None:
    texts: list[str] = []
    whole: list[int] = []  # text index of each conversation's full rendering
    pairs: list[tuple[int, int, int]] = []  # (position, text index with the turn, text index before it)
    for pos, ms in chats:
        try:
            whole.append(len(texts))
            texts.append(counter.render(ms))
            for j, m in enumerate(ms):
                if m["role"] == "assistant":
                    texts.append(counter.render(ms[: j + 1]))
                    texts.append(counter.render(ms[:j], generation_prompt=True) if j else "")
                    pairs.append((pos, len(texts) - 2, len(texts) - 1))
        except Exception as exc:  # jinja2 TemplateError and whatever the template raises on purpose
            first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
            raise _RecordError(pos, f"the chat template cannot render it ({first})") from None
    counts = counter.lengths(texts)
    at = np.array([pos for pos, _ in chats], np.int64)
    totals[at] = counts[np.array(whole, np.int64)]
    if pairs:
        p = np.array(pairs, np.int64)
        added = np.maximum(counts[p[:, 1]] - counts[p[:, 2]], 0)
        loss += np.bincount(p[:, 0], weights=added, minlength=loss.shape[0]).astype(np.int64)


def _check_messages(v: object, name: str) -> str | None:
    if not isinstance(v, list):
        return f"field {name!r} must be a list of messages (got {_type(v)})"
    if not v:
        return f"field {name!r} holds no messages"
    for j, m in enumerate(v):
        if not isinstance(m, dict):
            return f"{name}[{j}] must be an object with 'role' and 'content' (got {_type(m)})"
        for key in ("role", "content"):
            if key not in m:
                return f"{name}[{j}] has no {key!r}"
            if not isinstance(m[key], str):
                return f"{name}[{j}].{key} must be a string (got {_type(m[key])})"
    return None


def _type(v: object) -> str:
    return "null" if v is None else type(v).__name__


def _fail(position: int, rule: str) -> tuple[np.ndarray, np.ndarray, tuple[int, str]]:
    empty = np.zeros(0, np.int64)
    return empty, empty, (position, rule)


def raise_record_error(path: str, jsonl: bool, index: int, rule: str) -> None:
    """Raise the :class:`InputError` for record ``index`` of ``path`` (``.jsonl``: naming the line too)."""
    where = f"line {index + 1}: " if jsonl else ""
    raise InputError(where + rule, path=path, sample=index)
