"""`padfree lengths --chat-template` against the default rule: time per chunk of real chats, same tokenizer.

The tokenizer is a real ``tokenizer.json`` (default: the vendored 129K ``deepseek_v3_tokenizer.json.xz``)
saved as a transformers folder with a ChatML template. Both rules tokenize the same chats with
:func:`padfree.data.tokenization.encode_chunk` in one process (``TOKENIZERS_PARALLELISM=false``, as in the
``padfree lengths`` workers), timed alternately; the minimum of ``--repeats`` runs is reported, as a ratio
(the machine may be shared: absolute times are noisy, the ratio of interleaved runs much less).

    .venv/bin/python benchmarks/chat_template_speed.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import os
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"

ROOT = Path(__file__).resolve().parents[1]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def folder(tokenizer_json: Path, out: Path) -> Path:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_json),
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>",
    )
    tok.chat_template = CHATML
    tok.save_pretrained(str(out))
    return out


def chat_lines(names: list[str]) -> list[bytes]:
    lines = []
    for name in names:
        with gzip.open(ROOT / "fixtures" / "samples" / f"{name}.jsonl.gz", "rb") as f:
            lines += [x for x in f if b'"messages"' in x]
    return lines


def measure(tok_folder: Path, lines: list[bytes], repeats: int) -> dict:
    from padfree.data.formats import field_names
    from padfree.data.tokenization import Tokenizer, encode_chunk

    fields = field_names()
    toks = {t: Tokenizer(tok_folder, chat_template=t) for t in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for t in (False, True):
        encode_chunk(toks[t], lines, True, "messages", fields)  # warm-up (tokenizer caches, template)
    for _ in range(repeats):
        for t in (False, True):
            t0 = time.perf_counter()
            encode_chunk(toks[t], lines, True, "messages", fields)
            times[t].append(time.perf_counter() - t0)
    turns = sum(len(json.loads(x)["messages"]) for x in lines)
    a, b = min(times[False]), min(times[True])
    return {"chats": len(lines), "turns": turns, "default_s": a, "template_s": b, "ratio": b / a}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--tokenizer-json", type=Path, default=None, help="default: the vendored deepseek_v3 one")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--out", type=Path, default=None, help="write chat_template_speed.json here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tj = args.tokenizer_json
        if tj is None:
            tj = Path(d) / "tokenizer.json"
            xz = ROOT / "fixtures" / "tokenizers" / "deepseek_v3_tokenizer.json.xz"
            tj.write_bytes(lzma.decompress(xz.read_bytes()))
        tok = folder(tj, Path(d) / "chatml")
        sets = {
            "all fixtures chats (mostly 2 turns)": chat_lines(
                [
                    "gpteacher_codegen",
                    "gpteacher_roleplay_toolformer",
                    "gsm8k",
                    "hh_rlhf_harmless_test",
                    "humaneval",
                    "self_instruct_t0",
                ]  # fmt: skip
            ),
            "hh_rlhf multi-turn chats x3": chat_lines(["hh_rlhf_harmless_test"]) * 3,
        }
        res = {name: measure(tok, lines, args.repeats) for name, lines in sets.items()}
    for name, r in res.items():
        print(
            f"{name}: {r['chats']} chats, {r['turns']} turns: default {r['default_s']:.3f} s, "
            f"--chat-template {r['template_s']:.3f} s, ratio {r['ratio']:.2f}"
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "chat_template_speed.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
