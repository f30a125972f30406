"""Tokenize the shared sample files (``../shared/data/samples/*.jsonl.gz``) with a SentencePiece model, with a
loss mask, for the training examples (``examples/train.py``, ``examples/hf_trainer.py``).

Needs ``sentencepiece`` (the ``hf`` extra). A chat sample becomes ``<s>`` + ``role + "\\n" + content + "\\n"``
per message + ``</s>``; a document becomes ``<s> text </s>``. Loss (``loss_on``): ``"assistant"`` puts loss on
the tokens of assistant messages, and on ``</s>`` when the last message is the assistant's; documents always
have loss on every token. ``"all"`` puts loss on every token.
"""

from __future__ import annotations

import glob
import gzip
import json

import numpy as np


def load_samples(pattern: str, tokenizer: str, limit: int | None, loss_on: str, max_len: int) -> list[dict]:
    """Tokenized samples: ``{"input_ids": int32 array, "loss_mask": int8 array}``, in file order (files sorted
    by name), each cut to ``max_len`` tokens, at most ``limit`` of them."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    samples = []
    for path in sorted(glob.glob(pattern)):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                if limit is not None and len(samples) >= limit:
                    return samples
                rec = json.loads(line)
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
                samples.append(
                    {
                        "input_ids": np.asarray(ids[:max_len], np.int32),
                        "loss_mask": np.asarray(mask[:max_len], np.int8),
                    }
                )
    return samples


def loss_token_counts(samples: list[dict]) -> np.ndarray:
    """Loss-bearing tokens per sample as the collators count them: loss-mask positions after the first."""
    return np.array([int(np.asarray(s["loss_mask"])[1:].sum()) for s in samples], dtype=np.int64)
