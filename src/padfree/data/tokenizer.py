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
from pathlib import Path

from padfree.errors import ConfigError

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

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added."""
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
