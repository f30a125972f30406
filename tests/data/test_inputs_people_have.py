"""Issue 19, item 5: inputs people have. `.json` arrays and JSON lines named `.json`, trailing blank lines,
OpenAI tool-call turns and tool messages (counted as training tokenizes them, checked against counts made
here with the tokenizer alone, and under a chat template against `apply_chat_template`), and image parts
refused with one line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from padfree.cli import main
from padfree.data.count_lengths import count_lengths
from padfree.data.samples import load_samples, loss_tokens_of

ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Name a colour.", "input": "", "output": "Blue, like the sea."},
    {"instruction": "Say hi in French.", "input": "", "output": "Bonjour !", "system": "Be brief."},
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOL_CHATS = [
    {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
            {"role": "assistant", "content": "It is 21 °C in Paris."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Add 2 and 3, then weather in Oslo."},
            {
                "role": "assistant",
                "content": "Working on it.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    },
                ],
            },
            {"role": "tool", "content": "5"},
            {"role": "tool", "content": [{"type": "text", "text": "cloudy"}]},
            {"role": "assistant", "content": "5; cloudy in Oslo."},
        ]
    },
]


def _count(data, tok, **kw):
    return count_lengths(data, tok, workers=1, use_cache=False, **kw)


def _independent(sp_model: Path, chats: list[list[tuple[str, str]]]) -> tuple[list[int], list[int]]:
    """Lengths and loss-bearing counts by the default rule written out here: per message BOS + the role, a
    newline, the text, a newline + EOS; loss on assistant messages, less the sample's first token."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    lengths, loss = [], []
    for chat in chats:
        sizes = [len(sp.encode(role + "\n" + text + "\n")) + 2 for role, text in chat]
        lengths.append(sum(sizes))
        loss.append(sum(n for (role, _), n in zip(chat, sizes, strict=True) if role == "assistant"))
    return lengths, loss


def _alpaca_turns(r: dict) -> list[tuple[str, str]]:
    user = "\n".join(p for p in (r["instruction"], r["input"]) if p)
    return ([("system", r["system"])] if r.get("system") else []) + [
        ("user", user),
        ("assistant", r["output"]),
    ]


@pytest.mark.parametrize("shape", ["array", "array.gz", "lines", "lines-trailing-blank"])
def test_json_files_are_read_by_what_they_hold(shape: str, sp_model: Path, tmp_path: Path) -> None:
    if shape.startswith("array"):
        text = json.dumps(ALPACA, indent=2) + "\n"
    else:
        text = "".join(json.dumps(r) + "\n" for r in ALPACA) + ("\n  \n\n" if "blank" in shape else "")
    path = tmp_path / ("data.json.gz" if shape.endswith(".gz") else "data.json")
    path.write_bytes(gzip.compress(text.encode()) if shape.endswith(".gz") else text.encode())
    res = _count(path, sp_model)
    lengths, loss = _independent(sp_model, [_alpaca_turns(r) for r in ALPACA])
    assert res.formats[0][1] == "alpaca"
    assert res.lengths.tolist() == lengths and res.loss_tokens.tolist() == loss
    samples = load_samples(path, sp_model)
    assert [len(s["input_ids"]) for s in samples] == lengths


def test_trailing_blank_lines_are_ignored_but_not_blank_lines_between_records(
    sp_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ALPACA) + "\n\n")
    assert _count(path, sp_model).lengths.shape[0] == 3
    path.write_text(json.dumps(ALPACA[0]) + "\n\n" + json.dumps(ALPACA[1]) + "\n")
    assert main(["lengths", str(path), "--tokenizer", str(sp_model), "--out", str(tmp_path / "l.npy")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 2: empty line" in err[0] and str(path) in err[0]


def test_a_json_file_of_something_else_is_one_line(sp_model: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "d.json"
    path.write_text('"just a string"')
    assert main(["lengths", str(path), "--tokenizer", str(sp_model), "--out", str(tmp_path / "l.npy")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "one JSON array of records or one JSON object per line" in err[0]


def _tool_turns(rec: dict) -> list[tuple[str, str]]:
    """The default rule's text of each message, written out by hand for TOOL_CHATS."""
    turns = []
    for m in rec["messages"]:
        content = m["content"]
        if isinstance(content, list):
            content = "".join(p["text"] for p in content)
        lines = [content] if content else []
        for c in m.get("tool_calls", []):
            args = c["function"]["arguments"]
            args_text = json.dumps(args) if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            lines.append('{"name": "' + c["function"]["name"] + '", "arguments": ' + args_text + "}")
        turns.append((m["role"], "\n".join(lines)))
    return turns


def test_tool_calls_and_tool_messages_count_as_training_tokenizes_them(
    sp_model: Path, tmp_path: Path
) -> None:
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in TOOL_CHATS))
    res = _count(path, sp_model)
    lengths, loss = _independent(sp_model, [_tool_turns(r) for r in TOOL_CHATS])
    assert res.lengths.tolist() == lengths and res.loss_tokens.tolist() == loss
    samples = load_samples(path, sp_model)
    assert [len(s["input_ids"]) for s in samples] == lengths
    assert loss_tokens_of(samples).tolist() == res.loss_tokens.tolist()


def test_tool_calls_under_a_chat_template_are_the_templates_rendering(hf_json: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(hf_json), bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>"
    )
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['content'] %}"
        "{{ m['content'] if m['content'] is string else m['content'][0]['text'] }}{% endif %}"
        "{% for c in m.get('tool_calls') or [] %}{{ '<tool_call>' + c['function']['name'] + ' ' }}"
        "{{ c['function']['arguments'] if c['function']['arguments'] is string "
        "else c['function']['arguments'] | tojson }}{{ '</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    folder = tmp_path / "tools_tok"
    tok.save_pretrained(str(folder))
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in TOOL_CHATS))
    res = _count(path, folder, chat_template=True)
    hf = AutoTokenizer.from_pretrained(str(folder))
    texts = [hf.apply_chat_template(r["messages"], tokenize=False) for r in TOOL_CHATS]
    want = [len(hf(t, add_special_tokens=False)["input_ids"]) for t in texts]
    rendered = hf.apply_chat_template(TOOL_CHATS[0]["messages"], tokenize=False)
    assert "<tool_call>get_weather" in rendered  # the template's own rendering of the call
    assert res.lengths.tolist() == want
    samples = load_samples(path, folder, chat_template=True)
    assert [len(s["input_ids"]) for s in samples] == want
    assert hf.decode(samples[0]["input_ids"]) == rendered


@pytest.mark.parametrize("kind", ["image_url", "input_audio"])
def test_image_and_audio_parts_are_refused_with_the_record_named(
    kind: str, sp_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    part = {"type": kind, kind: {"url": "http://x/y.png"}}
    recs = [
        TOOL_CHATS[0],
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look"}, part]}]},
    ]
    path = tmp_path / "mm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["lengths", str(path), "--tokenizer", str(sp_model), "--out", str(tmp_path / "l.npy")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "line 2" in err[0] and f"messages[0].content[1] is a '{kind}' part" in err[0]
    assert "text only" in err[0] and not (tmp_path / "l.npy").exists()
