"""Loading a local tokenizer (nothing is downloaded) and what the tokenization rule needs from it.

Kinds: a SentencePiece ``.model`` file, a Hugging Face ``tokenizer.json`` file, or a local ``transformers``
tokenizer folder (the only kind that can carry a chat template). :class:`Tokenizer` encodes texts without
special tokens, knows the BOS and EOS ids the default rule adds (a ``tokenizer.json``: from a
``tokenizer_config.json`` beside it, else its ``<s>``/``</s>``-like special tokens; a tokenizer without a BOS
uses its EOS for both) and renders chat templates.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from padfree.errors import ConfigError

PIECE_CHARS = 1 << 20
"""A text longer than this is encoded piece by piece, about this many characters each (bounded memory: a
tokenizer needs 50 to 90 bytes per character of the text it is given at once)."""
MAX_UNCUT_CHARS = 1 << 23
"""The most characters a text may hold without a place to cut it (see :data:`CUT`) when it is longer than
this: such a text is refused (one line), it cannot be counted in bounded memory."""
CUT = re.compile(r"[A-Za-z0-9] (?=[A-Za-z0-9])")
"""Where a long text is cut: at a single space between two ASCII letters or digits. Every tokenizer whose
pre-tokenization starts a word at such a space (SentencePiece with its dummy prefix, the byte-level and
Metaspace tokenizer.json kinds) encodes the two sides independently; which side the space goes to is probed
per tokenizer (:meth:`Tokenizer.piece_mode`) and every cut is checked on the text around it."""
_WINDOW = 256
_PROBES = (
    ("The quick brown fox", " jumps over 12 lazy dogs."),
    ("Ein Satz über Ähnlichkeit und 3 Dinge", " die man zählt, zum Beispiel 2024 Äpfel."),
    ("def main(args): return x", " + y  # comment"),
)


class UncutText(Exception):
    """A text too long to encode at once without a place to cut it (see :data:`MAX_UNCUT_CHARS`)."""

    def __init__(self, index: int, rule: str) -> None:
        super().__init__(rule)
        self.index, self.rule = index, rule


_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<｜begin▁of▁sentence｜>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<eos>", "<|endoftext|>", "<|im_end|>")


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


class Tokenizer:
    """One loaded tokenizer; build one per process (tokenizers are not shared across processes)."""

    def __init__(self, path: str | Path, chat_template: bool = False) -> None:
        self.path = str(path)
        self.kind = tokenizer_kind(path)
        self.chat_template = chat_template
        self._tok = _load(self.path, self.kind)
        self.backend = None  # the `tokenizers.Tokenizer` underneath, when there is one (it gives offsets)
        if self.kind == "tokenizers":
            self.backend = self._tok
        elif self.kind == "transformers" and getattr(self._tok, "is_fast", False):
            self.backend = getattr(self._tok, "backend_tokenizer", None)
        if chat_template and (self.kind != "transformers" or not getattr(self._tok, "chat_template", None)):
            raise ConfigError(
                f"{self.path}: --chat-template needs a transformers tokenizer folder with a chat "
                "template; without --chat-template chats follow the default rule"
            )
        self._markers: tuple[int, int] | None = None
        self._render = _fast_renderer(self._tok) if chat_template else None
        self._render_checked = False
        self._mode: str | None = None

    def encode(self, texts: list[str]) -> list:
        """Token ids of each text, no special tokens added (a list, or for a text longer than
        :data:`PIECE_CHARS` an int32 array encoded piece by piece, the same ids). Raises :class:`UncutText`
        for a text that can be neither encoded in pieces nor at once within :data:`MAX_UNCUT_CHARS`."""
        if not any(len(t) > PIECE_CHARS for t in texts):
            return self._encode(texts)
        out: list = []
        short: list[int] = []
        for k, t in enumerate(texts):
            out.append(None)
            if len(t) <= PIECE_CHARS:
                short.append(k)
            else:
                out[k] = self._encode_long(t, k)
        for k, ids in zip(short, self._encode([texts[k] for k in short]), strict=True):
            out[k] = ids
        return out

    def piece_mode(self) -> str:
        """How a text is cut at a :data:`CUT` space so that its pieces encode to the same ids as the whole:
        ``before`` (the space begins the next piece: byte-level pre-tokenizers), ``after`` (the space is
        dropped and the next piece begins with its word: SentencePiece's dummy prefix, Metaspace) or
        ``none`` (neither holds on every probe text: long texts are encoded at once)."""
        if self._mode is None:
            self._mode = "none"
            for mode in ("before", "after"):
                if all(self._splits_exactly(a, b, mode) for a, b in _PROBES):
                    self._mode = mode
                    break
        return self._mode

    def _splits_exactly(self, left: str, right: str, mode: str) -> bool:
        second = right if mode == "before" else right[1:]
        whole, a, b = self._encode([left + right, left, second])
        return list(whole) == list(a) + list(b)

    def _encode_long(self, text: str, index: int) -> np.ndarray | list[int]:
        mode = self.piece_mode()
        cuts = [] if mode == "none" else _cuts(text)
        if cuts is None or (mode == "none" and len(text) > MAX_UNCUT_CHARS):
            why = (
                "this tokenizer does not encode such pieces like the whole"
                if mode == "none"
                else (f"it has no such space within {MAX_UNCUT_CHARS:,} characters")
            )
            raise UncutText(index, _too_long(len(text), why))
        if mode == "none":
            return self._encode([text])[0]
        for c in cuts:  # every cut checked on the text around it
            lo, hi = max(0, c - _WINDOW), min(len(text), c + _WINDOW)
            if not self._splits_exactly(text[lo:c], text[c:hi], mode):
                if len(text) > MAX_UNCUT_CHARS:
                    why = f"this tokenizer does not encode the pieces at character {c:,} like the whole"
                    raise UncutText(index, _too_long(len(text), why))
                return self._encode([text])[0]
        bounds = [0, *cuts, len(text)]
        ids = []
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            start = a + 1 if (i > 0 and mode == "after") else a  # "after": the space at the cut is dropped
            ids.append(np.asarray(self._encode([text[start:b]])[0], dtype=np.int32))
        return np.concatenate(ids)

    def _encode(self, texts: list[str]) -> list:
        if not texts:
            return []
        if self.kind == "sentencepiece":
            return self._tok.encode(texts)
        if self.backend is not None:
            fast = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            return [e.ids for e in fast(texts, add_special_tokens=False)]
        return self._tok(texts, add_special_tokens=False)["input_ids"]

    @property
    def markers(self) -> tuple[int, int]:
        """``(BOS, EOS)`` token ids of the default rule."""
        if self._markers is None:
            self._markers = _markers(self._tok, self.kind, self.path)
        return self._markers

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        """The chat template's text for ``messages`` (what ``apply_chat_template(tokenize=False)`` gives)."""
        if self._render is not None and not self._render_checked:
            slow = [self._apply(messages, g) for g in (False, True)]  # a refused chat checks the next one
            if [self._render(messages, g) for g in (False, True)] != slow:  # pragma: no cover - safety net
                self._render = None
            self._render_checked = True
        if self._render is not None:
            return self._render(messages, generation_prompt)
        return self._apply(messages, generation_prompt)

    def _apply(self, messages: list[dict], generation_prompt: bool) -> str:
        return self._tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )


def _too_long(n: int, why: str) -> str:
    return (
        f"a text of {n:,} characters: over {MAX_UNCUT_CHARS:,} it is counted in pieces cut at a single space "
        f"between two ASCII letters or digits, but {why}; split the record or shorten it"
    )


def _cuts(text: str) -> list[int] | None:
    """Positions of the :data:`CUT` spaces that cut ``text`` into pieces of about :data:`PIECE_CHARS`
    (``None`` when some stretch of more than :data:`MAX_UNCUT_CHARS` has no such space)."""
    cuts: list[int] = []
    pos = 0
    while len(text) - pos > PIECE_CHARS:
        m = CUT.search(text, pos + PIECE_CHARS // 2, pos + MAX_UNCUT_CHARS)
        if m is None:
            return None if len(text) - pos > MAX_UNCUT_CHARS else cuts
        pos = m.start() + 1  # the space
        cuts.append(pos)
    return cuts


def _fast_renderer(tok):  # -> callable(messages, generation_prompt) -> str, or None
    """The compiled template rendered directly, with its globals merged once: ``apply_chat_template`` costs
    ~0.1 ms per call around the template, which for the several renderings a conversation needs was most
    of ``--chat-template``'s time. Checked against ``apply_chat_template`` on the first conversation (see
    :meth:`Tokenizer.render`); any other transformers or jinja2 version falls back to the public API."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(tok.get_chat_template())
        extra = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, (str, list))}
        base = {**dict(compiled.globals), **extra, "tools": None, "documents": None}
        concat, root = compiled.environment.concat, compiled.root_render_func
    except Exception:  # pragma: no cover - another transformers or jinja2 version: use the public API
        return None

    def render(messages: list[dict], generation_prompt: bool) -> str:
        ctx = compiled.new_context(
            {**base, "messages": messages, "add_generation_prompt": generation_prompt}, True
        )
        return concat(root(ctx))

    return render


def _load(path: str, kind: str):  # -> the tokenizer object
    try:
        if kind == "sentencepiece":
            import sentencepiece as spm

            return spm.SentencePieceProcessor(model_file=path)
        if kind == "tokenizers":
            from tokenizers import Tokenizer as HFTokenizer  # the package, not this module

            return HFTokenizer.from_file(path)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except ImportError as exc:
        raise ConfigError(f"loading a {kind} tokenizer needs {exc.name}: pip install 'padfree[hf]'") from None
    except Exception as exc:  # each library raises its own types for a foreign file
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path}: not a loadable {kind} tokenizer ({first})") from None


def _markers(tok, kind: str, path: str) -> tuple[int, int]:
    if kind == "sentencepiece":
        bos, eos = tok.bos_id(), tok.eos_id()
        bos, eos = (None if bos < 0 else bos), (None if eos < 0 else eos)
    elif kind == "transformers":
        bos, eos = tok.bos_token_id, tok.eos_token_id
    else:
        bos_name, eos_name = _config_tokens(Path(path).with_name("tokenizer_config.json"))
        bos = next((i for n in (bos_name, *_BOS_NAMES) if n and (i := tok.token_to_id(n)) is not None), None)
        eos = next((i for n in (eos_name, *_EOS_NAMES) if n and (i := tok.token_to_id(n)) is not None), None)
    if eos is None:
        raise ConfigError(
            f"{path}: cannot tell the tokenizer's end-of-sequence token (a tokenizer.json: put its "
            "tokenizer_config.json beside it, or give the transformers folder)"
        )
    return (eos if bos is None else int(bos)), int(eos)


def _config_tokens(cfg: Path) -> tuple[str | None, str | None]:
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, None

    def name(v: object) -> str | None:
        v = v.get("content") if isinstance(v, dict) else v
        return v if isinstance(v, str) else None

    return name(data.get("bos_token")), name(data.get("eos_token"))
