"""Real text as training samples: ``samples/*.jsonl.gz`` records tokenized with a SentencePiece model.

A chat record (``{"messages": [{"role", "content"}, ...]}``) becomes ``<s>`` + ``role + "\\n" + content +
"\\n"`` per message + ``</s>``; a document (``{"text"}``) becomes ``<s> text </s>``. ``loss_on="assistant"``
puts loss on the tokens of assistant messages (and on ``</s>`` when the last message is the assistant's);
documents always have loss on every token. ``loss_on="all"`` puts loss on every token.

Used by ``examples/train.py`` and ``padfree bench``.
"""

from __future__ import annotations

import glob
import gzip
import json

import numpy as np

from padfree.errors import ConfigError, InputError


def sample_files(pattern: str) -> list[str]:
    """The files a glob names, sorted; an error when there are none."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise ConfigError(f"{pattern}: no sample files match")
    return files


def load_samples(
    pattern: str,
    tokenizer: str,
    limit: int | None = None,
    loss_on: str = "assistant",
    max_len: int | None = None,
    per_file: int | None = None,
) -> list[dict]:
    """Tokenized samples ``{"input_ids": int32 array, "loss_mask": int8 array}`` in file order, cut to
    ``max_len`` tokens; at most ``per_file`` from each file and ``limit`` in all."""
    import sentencepiece as spm

    if loss_on not in ("assistant", "all"):
        raise ConfigError(f"loss_on must be 'assistant' or 'all' (got {loss_on!r})")
    try:
        sp = spm.SentencePieceProcessor(model_file=tokenizer)
    except (OSError, RuntimeError) as exc:
        raise ConfigError(f"{tokenizer}: not a SentencePiece model ({exc})") from None
    samples: list[dict] = []
    for path in sample_files(pattern):
        taken = 0
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(samples) >= limit:
                    return samples
                if per_file is not None and taken >= per_file:
                    break
                try:
                    rec = json.loads(line)
                    ids, mask = _encode(sp, rec, loss_on)
                except (ValueError, KeyError, TypeError, AttributeError):
                    raise InputError(
                        "a record is a JSON object with 'messages' [{role, content}] or 'text'",
                        path=path,
                        sample=lineno - 1,
                    ) from None
                cut = len(ids) if max_len is None else max_len
                samples.append(
                    {
                        "input_ids": np.asarray(ids[:cut], np.int32),
                        "loss_mask": np.asarray(mask[:cut], np.int8),
                    }
                )
                taken += 1
    return samples


def _encode(sp, rec: dict, loss_on: str) -> tuple[list[int], list[int]]:
    ids, mask = [sp.bos_id()], [0]
    if "messages" in rec:
        for m in rec["messages"]:
            piece = sp.encode(m["role"] + "\n" + m["content"] + "\n")
            ids += piece
            mask += [int(loss_on == "all" or m["role"] == "assistant")] * len(piece)
        last_is_assistant = bool(rec["messages"]) and rec["messages"][-1]["role"] == "assistant"
        ids.append(sp.eos_id())
        mask.append(int(loss_on == "all" or last_is_assistant))
    else:
        piece = sp.encode(rec["text"])
        ids += piece + [sp.eos_id()]
        mask += [1] * (len(piece) + 1)
    return ids, mask


def loss_tokens_of(samples: list[dict]) -> np.ndarray:
    """Loss-bearing tokens per sample (label positions after the first token), as the collators count them."""
    return np.array([int(s["loss_mask"][1:].sum()) for s in samples], dtype=np.int64)
