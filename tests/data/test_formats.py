"""Record formats: the same real conversations written as messages, OpenAI content parts, ShareGPT, Alpaca and
prompt/completion give identical counts, by every tokenizer kind; several sources count as their
concatenation; field maps, forced formats, DatasetDict splits; and training tokenizes exactly what is counted.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from padfree.cli import main
from padfree.data.count_lengths import count_lengths
from padfree.data.samples import load_samples, loss_tokens_of
from padfree.errors import ConfigError, InputError

SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}


def _records(fixtures_dir: Path, name: str, n: int) -> list[dict]:
    with gzip.open(fixtures_dir / "samples" / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(x) for x in f.readlines()[:n]]


@pytest.fixture(scope="module")
def single(fixtures_dir: Path) -> list[list[dict]]:
    """Single-turn real chats (user, assistant), every third with a system turn first."""
    out = []
    for name in ("gsm8k", "humaneval", "self_instruct_t0", "gpteacher_codegen"):
        out += [r["messages"] for r in _records(fixtures_dir, name, 15)]
    sys_turn = {"role": "system", "content": "You are a careful assistant.\nAnswer briefly."}
    return [[sys_turn, *c] if i % 3 == 0 else c for i, c in enumerate(out)]


@pytest.fixture(scope="module")
def multi(fixtures_dir: Path) -> list[list[dict]]:
    """Multi-turn real chats."""
    return [r["messages"] for r in _records(fixtures_dir, "hh_rlhf_harmless_test", 40)]


def as_parts(chat: list[dict]) -> dict:
    """OpenAI content parts: each content cut into up to three text parts."""

    def parts(s: str) -> list[dict]:
        k = len(s) // 3
        return [{"type": "text", "text": p} for p in (s[:k], s[k : 2 * k], s[2 * k :]) if p] or [
            {"type": "text", "text": ""}
        ]

    return {"messages": [{"role": m["role"], "content": parts(m["content"])} for m in chat]}


def as_sharegpt(chat: list[dict], i: int) -> dict:
    """ShareGPT; a leading system turn goes to the top-level `system` field on every other record."""
    rec: dict = {}
    if chat[0]["role"] == "system" and i % 2:
        rec["system"], chat = chat[0]["content"], chat[1:]
    rec["conversations"] = [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in chat]
    return rec


def as_alpaca(chat: list[dict]) -> dict:
    """Alpaca: the user turn split at its first line break into instruction and input (rejoined by '\\n')."""
    rec = {"system": chat[0]["content"]} if chat[0]["role"] == "system" else {}
    user, assistant = chat[-2]["content"], chat[-1]["content"]
    head, _, tail = user.partition("\n")
    instruction, given = (head, tail) if head and tail else (user, "")
    return {**rec, "instruction": instruction, "input": given, "output": assistant}


def as_prompt_completion(chat: list[dict]) -> dict:
    if len(chat) == 2:
        return {"prompt": chat[0]["content"], "completion": chat[1]["content"]}
    return {"prompt": chat[:-1], "completion": chat[-1:]}  # TRL's conversational form


def _jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def _count(data, tok, **kw):
    return count_lengths(data, tok, workers=1, use_cache=False, **kw)


def test_every_format_gives_the_counts_of_messages(single, multi, sp_model: Path, tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = single + multi
    assert any(("\n" in c[-2]["content"]) for c in single)  # the instruction/input split is exercised
    ref = _count(_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in chats]), sp_model)
    assert (ref.loss_tokens > 0).all() and (ref.loss_tokens < ref.lengths - 1).all()
    files = {
        "parts": _jsonl(tmp_path / "p.jsonl", [as_parts(c) for c in chats]),
        "sharegpt": _jsonl(tmp_path / "s.jsonl", [as_sharegpt(c, i) for i, c in enumerate(chats)]),
        "prompt_completion": _jsonl(tmp_path / "pc.jsonl", [as_prompt_completion(c) for c in chats]),
    }
    pq.write_table(pa.Table.from_pylist([as_sharegpt(c, 0) for c in chats]), tmp_path / "s.parquet")
    files["sharegpt-parquet"] = tmp_path / "s.parquet"
    for name, path in files.items():
        res = _count(path, sp_model)
        assert res.formats[0][1] == name.split("-")[0].replace("parts", "messages"), name
        np.testing.assert_array_equal(res.lengths, ref.lengths, err_msg=name)
        np.testing.assert_array_equal(res.loss_tokens, ref.loss_tokens, err_msg=name)
    # Alpaca holds one exchange (and a system prompt): the single-turn chats, from jsonl and a datasets folder
    alpaca = [as_alpaca(c) for c in single]
    datasets.Dataset.from_list(alpaca).save_to_disk(str(tmp_path / "alpaca_ds"))
    for path in (_jsonl(tmp_path / "a.jsonl", alpaca), tmp_path / "alpaca_ds"):
        res = _count(path, sp_model)
        assert res.formats[0][1] == "alpaca"
        np.testing.assert_array_equal(res.lengths, ref.lengths[: len(single)])
        np.testing.assert_array_equal(res.loss_tokens, ref.loss_tokens[: len(single)])


@pytest.fixture(scope="module")
def template_folder(hf_json: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real 129K tokenizer as a transformers folder with a ChatML chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(hf_json), bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>"
    )
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    out = tmp_path_factory.mktemp("chatml")
    tok.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("kind", ["sentencepiece", "tokenizer.json", "folder", "folder+template"])
def test_training_tokenizes_what_lengths_counts(
    kind: str, single, multi, sp_model: Path, hf_json: Path, template_folder: Path, tmp_path: Path
) -> None:
    """The one rule: load_samples' input_ids are as long as the counts, for every format and tokenizer."""
    tok = {"sentencepiece": sp_model, "tokenizer.json": hf_json}.get(kind, template_folder)
    template = kind == "folder+template"
    chats = (single + multi)[::2]
    docs = [{"text": c[-1]["content"]} for c in chats[:10]]
    data = [
        _jsonl(tmp_path / "s.jsonl", [as_sharegpt(c, i) for i, c in enumerate(chats)]),
        _jsonl(tmp_path / "d.jsonl", docs),
        _jsonl(tmp_path / "a.jsonl", [as_alpaca(c) for c in single[:8]]),
    ]
    res = _count(data, tok, chat_template=template)
    samples = load_samples(data, tok, chat_template=template)
    assert [len(s["input_ids"]) for s in samples] == res.lengths.tolist()
    assert loss_tokens_of(samples).tolist() == res.loss_tokens.tolist()
    n = len(chats)
    assert (res.loss_tokens[n : n + 10] == res.lengths[n : n + 10] - 1).all()  # documents: every label
    if kind in ("sentencepiece", "tokenizer.json", "folder"):
        bos_eos = samples[0]["input_ids"][[0, -1]].tolist()
        assert bos_eos[0] != bos_eos[1]  # each message is [BOS] ... [EOS]
    if kind == "folder":  # the ids are transformers' own
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(template_folder))
        m = chats[0][0]
        piece = hf(m["role"] + "\n" + m["content"] + "\n", add_special_tokens=False)["input_ids"]
        ids = samples[0]["input_ids"].tolist()
        assert ids[: len(piece) + 2] == [hf.bos_token_id, *piece, hf.eos_token_id]
    if template:  # the template writes the turn markers; the assistant's content and <|im_end|> carry loss
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(template_folder))
        first = [{"role": m["role"], "content": m["content"]} for m in chats[0]]
        want = hf.apply_chat_template(first, tokenize=False)
        assert hf.decode(samples[0]["input_ids"]) == want
        assert samples[0]["input_ids"].tolist() == hf(want, add_special_tokens=False)["input_ids"]
        loss_text = hf.decode(samples[0]["input_ids"][samples[0]["loss_mask"].astype(bool)])
        assert loss_text == first[-1]["content"] + "<|im_end|>\n"
    if kind in ("sentencepiece", "folder+template"):  # loss_on=all: every label position
        every = load_samples(data[:1], tok, loss_on="all", chat_template=template)
        assert loss_tokens_of(every).tolist() == (res.lengths[:n] - 1).tolist()


def test_sources_count_as_their_concatenation(multi, sp_model: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "d").mkdir()
    a = _jsonl(tmp_path / "d" / "1a.jsonl", [{"messages": c} for c in multi[:25]])
    b = _jsonl(tmp_path / "d" / "2b.jsonl", [as_sharegpt(c, 0) for c in multi[25:]])
    both = _jsonl(tmp_path / "both.jsonl", [{"messages": c} for c in multi])
    whole = _count(both, sp_model)
    for spec in ([a, b], [str(tmp_path / "d" / "*.jsonl")], [tmp_path / "d"]):
        res = _count(spec, sp_model)
        np.testing.assert_array_equal(res.lengths, whole.lengths)
        np.testing.assert_array_equal(res.loss_tokens, whole.loss_tokens)
        assert [f for _, f in res.formats] == ["messages", "sharegpt"]  # detected per file
    rev = _count([b, a], sp_model)  # the order given
    np.testing.assert_array_equal(rev.lengths, np.concatenate([whole.lengths[25:], whole.lengths[:25]]))
    out = tmp_path / "o.npy"
    assert main(["lengths", str(b), str(a), "--tokenizer", str(sp_model), "--out", str(out), "--no-cache",
                 "--quiet", "--workers", "2"]) == 0  # fmt: skip
    np.testing.assert_array_equal(np.load(out), rev.lengths)
    assert "2 sources, format messages, sharegpt" in capsys.readouterr().err


def test_field_map_forced_format_and_roles(sp_model: Path, tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}]
    ref = _count(_jsonl(tmp_path / "m.jsonl", [{"messages": chat}]), sp_model)
    renamed = {
        "dialog": [{"speaker": "HUMAN", "words": "Name a prime."}, {"speaker": "Gpt", "words": "Seven."}]
    }
    fields = {"conversations": "dialog", "from": "speaker", "value": "words"}
    res = _count(_jsonl(tmp_path / "r.jsonl", [renamed]), sp_model, fields=fields)
    assert res.formats[0][1] == "sharegpt" and res.lengths.tolist() == ref.lengths.tolist()
    assert res.loss_tokens.tolist() == ref.loss_tokens.tolist()  # roles matched in any case
    # a record with both keys: auto picks messages, --format text (or --field) reads the document
    both = _jsonl(tmp_path / "b.jsonl", [{"messages": chat, "text": "Seven."}])
    assert _count(both, sp_model).lengths.tolist() == ref.lengths.tolist()
    doc = _count(both, sp_model, mode="text")
    assert doc.formats[0][1] == "text" and doc.lengths[0] < ref.lengths[0]
    out = tmp_path / "o.npy"
    argv = [
        "lengths",
        str(tmp_path / "r.jsonl"),
        "--tokenizer",
        str(sp_model),
        "--out",
        str(out),
        "--no-cache",
    ]
    fm = ["--field-map", "conversations=dialog", "--field-map", "from=speaker", "--field-map", "value=words"]
    assert main([*argv, "--quiet", *fm]) == 0 and np.load(out).tolist() == ref.lengths.tolist()
    with pytest.raises(ConfigError, match="unknown key 'speaker'"):
        _count(both, sp_model, fields={"speaker": "x"})


def test_datasetdict_split(single, sp_model: Path, tmp_path: Path) -> None:
    import datasets

    recs = [{"messages": c} for c in single]
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(recs[:30]), "test": datasets.Dataset.from_list(recs[30:])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    ref = _count(_jsonl(tmp_path / "t.jsonl", recs[30:]), sp_model)
    res = _count(tmp_path / "dd", sp_model, split="test")
    np.testing.assert_array_equal(res.lengths, ref.lengths)
    with pytest.raises(
        InputError, match=r"a DatasetDict folder: choose a split with --split \((train, test|test, train)\)"
    ):
        _count(tmp_path / "dd", sp_model)
    with pytest.raises(InputError, match="no split 'dev'"):
        _count(tmp_path / "dd", sp_model, split="dev")
    assert (
        load_samples(tmp_path / "dd", sp_model, split="train", limit=5).where(4).endswith("[train] record 4")
    )


@pytest.mark.parametrize(
    ("records", "rule"),
    [
        ([{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}],
         r"messages\[0\]\.content\[0\] is a 'image_url' part: padfree counts and trains text only"),
        ([{"conversations": [{"from": "narrator", "value": "x"}]}],
         r"conversations\[0\]\.from 'narrator' is not a known role"),
        ([{"instruction": "a", "input": "b"}], r"missing field 'output'"),
        ([{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}],
         r"must both be strings or both lists of messages \(got str and list\)"),
        ([{"question": "a", "answer": "b"}],
         r"line 1: the record matches no format \(keys: question, answer\)"),
        ([{"instruction": "a", "output": "b"}, {"messages": []}],
         r"sample 1: line 2: missing field 'instruction'"),
    ],
)  # fmt: skip
def test_bad_records_name_the_record(records: list[dict], rule: str, sp_model: Path, tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(InputError, match=rule) as info:
        _count(path, sp_model)
    assert info.value.path == str(path)
    with pytest.raises(InputError, match=rule):
        load_samples(path, sp_model)
