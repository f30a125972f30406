"""Record formats: messages, ShareGPT, Alpaca, prompt/completion and plain text, all turned into one shape.

Every record becomes either a **chat** (a list of ``{"role", "content"}`` dicts with a known role and a
string content) or a **document** (a string). Tokenization (:mod:`padfree.data.tokenization`) only ever
sees those two shapes, so the same conversation gives the same tokens in every format.

* ``messages`` (detected by the key ``messages``): ``{"messages": [{"role", "content"}, ...]}``; a content
  is a string or a list of text parts ``[{"type": "text", "text": ...}, ...]``, joined with no separator.
  OpenAI tool use is read as given: an assistant turn may carry ``tool_calls`` (``[{"type": "function",
  "function": {"name", "arguments"}}, ...]``, ``arguments`` a JSON string or an object) with ``content``
  null or a string, and a ``tool`` turn answers with its ``content`` (``tool_call_id`` and ``name`` are
  kept for chat templates). The default rule writes a turn's text as :func:`message_text` does: its content,
  then one line per call, ``{"name": ..., "arguments": ...}`` (``json.dumps``, non-ASCII kept); a chat
  template renders ``tool_calls`` itself.
  **Image and audio parts** (``image_url``, ``input_audio``...) are refused with the record named: padfree
  counts and trains text only, and a count that silently skipped them would not be what a multimodal
  model trains on. Remove those parts (or replace them by their text) before counting.
* ``sharegpt`` (``conversations``): ``{"conversations": [{"from", "value"}, ...], "system"?}``.
* ``alpaca`` (``instruction``): ``{"instruction", "input"?, "output", "system"?}``. The user turn is the
  instruction, then the input on the next line when the input is not empty (``"\n".join`` of the non-empty
  ones); the assistant turn is the output.
* ``prompt_completion`` (``prompt``): ``{"prompt", "completion"}``, two strings (a user turn and an
  assistant turn) or two lists of messages (TRL's conversational form).
* ``text`` (``text``): ``{"text": "..."}``, a document.

An optional ``system`` string (ShareGPT, Alpaca) becomes a first system turn when it is not empty. Every
field name can be renamed (:func:`field_names`, ``--field-map KEY=NAME``).

Auto-detection is per file: the first record's keys (a columnar file's column names) pick the first format
of the table whose key is present, and every record of the file must then be in that format.

**Roles** are matched case-insensitively (``"ASSISTANT"`` is ``assistant``): ``system``; ``user`` (also
ShareGPT's ``human``); ``assistant`` (also ``gpt``); ``tool`` (also ``function``). Any other role, the empty
one included, is an error naming the record: a turn whose role padfree does not know would otherwise get
no loss, silently.

>>> to_sample({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
...           "sharegpt", field_names())
[{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'yo'}]
>>> to_sample({"instruction": "Add", "input": "2 and 3", "output": "5"}, "alpaca", field_names())[0]
{'role': 'user', 'content': 'Add\\n2 and 3'}
>>> call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
>>> m = to_sample({"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}, "messages",
...               field_names())[0]
>>> print(message_text(m))
{"name": "add", "arguments": "{\\"a\\": 2}"}
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from padfree.errors import ConfigError

MAX_MESSAGES = 1 << 16
"""The most messages one record may hold (65,536): each costs a few hundred bytes of Python objects whatever
its length, so a record of millions of tiny messages is refused (one line) instead of taking gigabytes."""
FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion", "text")
DETECT = (
    ("messages", "messages"),
    ("sharegpt", "conversations"),
    ("alpaca", "instruction"),
    ("prompt_completion", "prompt"),
    ("text", "text"),
)
"""``(format, key)`` in the order auto-detection tries them."""

DEFAULT_FIELDS = {
    "messages": "messages",
    "role": "role",
    "content": "content",
    "conversations": "conversations",
    "from": "from",
    "value": "value",
    "instruction": "instruction",
    "input": "input",
    "output": "output",
    "system": "system",
    "prompt": "prompt",
    "completion": "completion",
    "text": "text",
}
"""Every field name a format reads; ``--field-map KEY=NAME`` renames any of them."""

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "tool": "tool",
    "function": "tool",
}
"""Accepted role names (compared in lower case) and the role each one is."""

Chat = list[dict]
"""Canonical messages: ``{"role", "content"}`` strings, plus ``tool_calls`` (a list) on an assistant turn that
calls tools and ``tool_call_id`` / ``name`` on a tool turn that has them."""

MEDIA_PARTS = ("image_url", "image", "input_image", "input_audio", "audio", "audio_url", "video", "file")
"""Content part types refused with their own rule: text only (see the module docstring)."""


class RecordError(Exception):
    """A record that breaks a format rule (turned into an InputError naming file and record by the caller)."""

    def __init__(self, rule: str) -> None:
        super().__init__(rule)
        self.rule = rule


def field_names(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The field names to read: the defaults with ``overrides`` (``{"conversations": "dialog"}``) applied."""
    out = dict(DEFAULT_FIELDS)
    for key, name in (overrides or {}).items():
        if key not in DEFAULT_FIELDS:
            raise ConfigError(f"--field-map: unknown key {key!r}: choose from {', '.join(DEFAULT_FIELDS)}")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"--field-map: {key}= needs a field name")
        out[key] = name
    return out


def parse_field_map(items: Iterable[str]) -> dict[str, str]:
    """``["from=speaker", "value=text"]`` -> ``{"from": "speaker", "value": "text"}`` (checked)."""
    out = {}
    for kv in items:
        key, sep, name = kv.partition("=")
        if not sep:
            raise ConfigError(f"--field-map takes KEY=NAME (got {kv!r})")
        out[key.strip()] = name.strip()
    field_names(out)
    return out


def detect(keys: Iterable[str], fields: Mapping[str, str]) -> str | None:
    """The format whose key is among ``keys`` (first of :data:`DETECT`), or ``None``."""
    present = set(keys)
    for fmt, key in DETECT:
        if fields[key] in present:
            return fmt
    return None


def needed_columns(fmt: str, fields: Mapping[str, str], available: Iterable[str]) -> list[str]:
    """Columns a columnar source must provide for ``fmt`` (optional ones only when present)."""
    must = {
        "messages": ["messages"],
        "sharegpt": ["conversations"],
        "alpaca": ["instruction", "output"],
        "prompt_completion": ["prompt", "completion"],
        "text": ["text"],
    }[fmt]
    maybe = {"sharegpt": ["system"], "alpaca": ["input", "system"]}.get(fmt, [])
    have = set(available)
    return [fields[k] for k in must] + [fields[k] for k in maybe if fields[k] in have]


def to_sample(rec: object, fmt: str, fields: Mapping[str, str]) -> Chat | str:
    """One record as a chat (list of canonical messages) or a document (str); RecordError when malformed."""
    if not isinstance(rec, dict):
        raise RecordError(f"a JSON {type(rec).__name__}, not an object")
    if fmt == "text":
        return _string(rec, fields["text"])
    if fmt == "messages":
        return _messages(_need(rec, fields["messages"]), fields["messages"], fields)
    if fmt == "sharegpt":
        name = fields["conversations"]
        turns = _list_of_dicts(_need(rec, name), name)
        key_from, key_value = fields["from"], fields["value"]
        out = _system(rec, fields)
        for j, t in enumerate(turns):
            out.append(
                {
                    "role": _role(_field(t, key_from, f"{name}[{j}]"), f"{name}[{j}].{key_from}"),
                    "content": _text(_field(t, key_value, f"{name}[{j}]"), f"{name}[{j}].{key_value}"),
                }
            )
        return out
    if fmt == "alpaca":
        parts = [_string(rec, fields["instruction"]), _optional_string(rec, fields["input"])]
        return [
            *_system(rec, fields),
            {"role": "user", "content": "\n".join(p for p in parts if p)},
            {"role": "assistant", "content": _string(rec, fields["output"])},
        ]
    if fmt == "prompt_completion":
        kp, kc = fields["prompt"], fields["completion"]
        prompt, completion = _need(rec, kp), _need(rec, kc)
        if isinstance(prompt, str) and isinstance(completion, str):
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        if isinstance(prompt, list) and isinstance(completion, list):
            return _messages(prompt, kp, fields, empty_ok=True) + _messages(completion, kc, fields)
        raise RecordError(
            f"fields {kp!r} and {kc!r} must both be strings or both lists of messages "
            f"(got {_type(prompt)} and {_type(completion)})"
        )
    raise ConfigError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")


def _messages(v: object, name: str, fields: Mapping[str, str], empty_ok: bool = False) -> Chat:
    turns = _list_of_dicts(v, name, empty_ok)
    kr, kc = fields["role"], fields["content"]
    out = []
    for j, m in enumerate(turns):
        where = f"{name}[{j}]"
        role = _role(_field(m, kr, where), f"{where}.{kr}")
        calls = m.get("tool_calls")
        if calls is not None and role == "assistant":
            content = m.get(kc)
            msg = {
                "role": role,
                "content": "" if content is None else _text(content, f"{where}.{kc}"),
                "tool_calls": _tool_calls(calls, f"{where}.tool_calls"),
            }
        else:
            msg = {"role": role, "content": _text(_field(m, kc, where), f"{where}.{kc}")}
        if role == "tool":
            msg |= {k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)}
        out.append(msg)
    return out


def _tool_calls(v: object, where: str) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise RecordError(
            f"{where} must be a non-empty list of tool calls (got {_type(v) if v != [] else '[]'})"
        )
    for k, c in enumerate(v):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RecordError(
                f'{where}[{k}] must be {{"type": "function", "function": {{"name", "arguments"}}}}'
            )
        if not isinstance(fn.get("arguments", ""), (str, dict)):
            raise RecordError(f"{where}[{k}].function.arguments must be a JSON string or an object")
    return v


def message_text(m: Mapping) -> str:
    """The text of a canonical message under the default rule: its content, then one line per tool call,
    ``json.dumps({"name": ..., "arguments": ...}, ensure_ascii=False)`` (``arguments`` as given: the JSON
    string OpenAI writes, or an object), after a newline when the content is not empty.

    >>> message_text({"role": "assistant", "content": "Let me add.", "tool_calls": [
    ...     {"function": {"name": "add", "arguments": {"a": 2, "b": "é"}}}]})
    'Let me add.\\n{"name": "add", "arguments": {"a": 2, "b": "é"}}'
    """
    calls = m.get("tool_calls")
    if not calls:
        return m["content"]
    lines = [
        json.dumps(
            {"name": c["function"]["name"], "arguments": c["function"].get("arguments", "")},
            ensure_ascii=False,
        )
        for c in calls
    ]
    return "\n".join(([m["content"]] if m["content"] else []) + lines)


def _list_of_dicts(v: object, name: str, empty_ok: bool = False) -> list[dict]:
    if not isinstance(v, list):
        raise RecordError(f"field {name!r} must be a list of messages (got {_type(v)})")
    if not v and not empty_ok:
        raise RecordError(f"field {name!r} holds no messages")
    if len(v) > MAX_MESSAGES:
        raise RecordError(
            f"field {name!r} holds {len(v):,} messages, over {MAX_MESSAGES:,} (bounded memory per record); "
            "split the record"
        )
    for j, m in enumerate(v):
        if not isinstance(m, dict):
            raise RecordError(f"{name}[{j}] must be an object (got {_type(m)})")
    return v


def _role(v: object, where: str) -> str:
    role = ROLES.get(v.lower()) if isinstance(v, str) else None
    if role is None:
        got = repr(v) if isinstance(v, str) else _type(v)
        raise RecordError(
            f"{where} {got} is not a known role: use system, user, assistant or tool "
            "(any case; human, gpt and function are accepted too)"
        )
    return role


def _text(v: object, where: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        out = []
        for k, part in enumerate(v):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else _type(part)
                if kind in MEDIA_PARTS:
                    raise RecordError(
                        f"{where}[{k}] is a {kind!r} part: padfree counts and trains text only; remove image "
                        "and audio parts (or replace them by their text) before counting"
                    )
                raise RecordError(
                    f'{where}[{k}] must be a text part {{"type": "text", "text": ...}} (got {kind!r})'
                )
            out.append(part["text"])
        return "".join(out)
    raise RecordError(f"{where} must be a string or a list of text parts (got {_type(v)})")


def _system(rec: dict, fields: Mapping[str, str]) -> Chat:
    s = _optional_string(rec, fields["system"])
    return [{"role": "system", "content": s}] if s else []


def _need(rec: dict, key: str) -> object:
    if key not in rec:
        raise RecordError(f"missing field {key!r}")
    return rec[key]


def _field(m: dict, key: str, where: str) -> object:
    if key not in m:
        raise RecordError(f"{where} has no {key!r}")
    return m[key]


def _string(rec: dict, key: str) -> str:
    v = _need(rec, key)
    if not isinstance(v, str):
        raise RecordError(f"field {key!r} must be a string (got {_type(v)})")
    return v


def _optional_string(rec: dict, key: str) -> str:
    v = rec.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise RecordError(f"field {key!r} must be a string (got {_type(v)})")
    return v


def _type(v: object) -> str:
    return "null" if v is None else type(v).__name__
