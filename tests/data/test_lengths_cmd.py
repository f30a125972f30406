"""`padfree lengths`: token counts from real samples and real tokenizers, the cache, bad records, formats."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from padfree.cli import main
from padfree.data.count_lengths import count_lengths
from padfree.errors import ConfigError, InputError


def _records(fixtures_dir: Path, name: str, n: int | None = None) -> list[dict]:
    with gzip.open(fixtures_dir / "samples" / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
        lines = f.readlines()
    return [json.loads(x) for x in lines[:n]]


@pytest.fixture(scope="module")
def chats(fixtures_dir: Path) -> list[dict]:
    """Chats with several turns."""
    return _records(fixtures_dir, "hh_rlhf_harmless_test", 60)


@pytest.fixture(scope="module")
def docs(fixtures_dir: Path) -> list[dict]:
    """Long documents."""
    return _records(fixtures_dir, "llamafactory_c4_wiki_docs", 30)


def _write_jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def _direct(encode, recs: list[dict]) -> tuple[list[int], list[int]]:
    """The documented rule, one record at a time, with the tokenizer called directly: a chat is
    [BOS] + role\\ncontent\\n + [EOS] per message, a document text + [EOS]; loss-bearing counts are label
    positions after the first token (assistant messages; every token of a document)."""
    tot, loss = [], []
    for r in recs:
        if "messages" in r:
            per = [len(encode(m["role"] + "\n" + m["content"] + "\n")) + 2 for m in r["messages"]]
            tot.append(sum(per))
            assert r["messages"][0]["role"] != "assistant"  # else the first token would not count
            loss.append(sum(c for c, m in zip(per, r["messages"], strict=True) if m["role"] == "assistant"))
        else:
            tot.append(len(encode(r["text"])) + 1)
            loss.append(tot[-1] - 1)
    return tot, loss


def test_reproduces_the_reference_mistral_counts(fixtures_dir: Path, sp_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "he.npy"
    rc = main(
        [
            "lengths",
            str(fixtures_dir / "samples" / "humaneval.jsonl.gz"),
            "--tokenizer",
            str(sp_model),
            "--out",
            str(out),
            "--workers",
            "2",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--quiet",
        ]
    )
    assert rc == 0
    ref = fixtures_dir / "lengths"
    np.testing.assert_array_equal(np.load(out), np.load(ref / "humaneval.mistral_v1.npy"))
    np.testing.assert_array_equal(
        np.load(tmp_path / "he.assistant.npy"), np.load(ref / "humaneval.mistral_v1.assistant.npy")
    )


def test_sentencepiece_counts_equal_direct_count(
    chats: list[dict], docs: list[dict], sp_model: Path, tmp_path: Path
) -> None:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    data = [_write_jsonl(tmp_path / "chats.jsonl", chats), _write_jsonl(tmp_path / "docs.jsonl", docs)]
    res = count_lengths(data, sp_model, workers=2, use_cache=False, chunk_size=16)
    tot, loss = _direct(sp.encode, chats + docs)
    assert res.lengths.tolist() == tot
    assert res.loss_tokens.tolist() == loss
    assert (res.loss_tokens < res.lengths - 1).sum() == 60  # every chat has a user turn, documents do not


def test_tokenizer_json_counts_equal_direct_count(
    chats: list[dict], docs: list[dict], hf_json: Path, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_json))
    data = tmp_path / "mixed.jsonl.gz"
    with gzip.open(data, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in docs)
    res = count_lengths(
        [_write_jsonl(tmp_path / "c.jsonl", chats), data], hf_json, workers=1, use_cache=False
    )
    tot, loss = _direct(lambda s: tok.encode(s, add_special_tokens=False).ids, chats + docs)
    assert res.lengths.tolist() == tot
    assert res.loss_tokens.tolist() == loss


def test_cache_hit_on_second_run_and_miss_on_new_tokenizer(
    chats: list[dict], sp_model: Path, hf_json: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = _write_jsonl(tmp_path / "d.jsonl", chats[:40])
    cache = tmp_path / "cache"
    first = count_lengths(data, sp_model, workers=1, cache_dir=cache)
    second = count_lengths(data, sp_model, workers=1, cache_dir=cache)
    other = count_lengths(data, hf_json, workers=1, cache_dir=cache)
    assert (first.cache_hit, second.cache_hit, other.cache_hit) == (False, True, False)
    assert second.cache_file == first.cache_file and other.cache_file != first.cache_file
    np.testing.assert_array_equal(first.lengths, second.lengths)
    assert not np.array_equal(first.lengths, other.lengths)
    # the data's bytes are part of the key too
    _write_jsonl(data, chats[:39])
    assert not count_lengths(data, sp_model, workers=1, cache_dir=cache).cache_hit
    # the CLI says which it was; PADFREE_CACHE_DIR is honoured
    args = ["lengths", str(data), "--tokenizer", str(sp_model), "--out", str(tmp_path / "o.npy"), "--quiet"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PADFREE_CACHE_DIR", str(cache))
        assert main([*args, "--workers", "1"]) == 0
    assert "cache hit" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "rule"),
    [
        ('{"messages": [{"role": "user", "content": "hi"}', "malformed JSON"),
        ('{"id": 3}', "missing field 'messages'"),
        ('{"text": "a document in a file of chats"}', "missing field 'messages'"),
        (
            '{"messages": [{"role": "ASSISTANT!", "content": "x"}]}',
            "messages[0].role 'ASSISTANT!' is not a known",
        ),
        ('{"messages": [{"role": "", "content": "x"}]}', "messages[0].role '' is not a known role"),
        ('{"messages": "hello"}', "field 'messages' must be a list of messages (got str)"),
        ('{"messages": [{"role": "user", "content": null}]}', "messages[0].content must be a string"),
        ('{"messages": [{"content": "x"}]}', "messages[0] has no 'role'"),
        ('["not", "an", "object"]', "not an object"),
        ('\ufeff{"messages": []}', "field 'messages' holds no messages"),  # a BOM is skipped
    ],
)
def test_malformed_record_names_file_and_line(
    line: str, rule: str, tmp_path: Path, sp_model: Path, capsys: pytest.CaptureFixture
) -> None:
    good = '{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}'
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join([good] * 6 + [line] + [good] * 3) + "\n")
    args = ["lengths", str(data), "--tokenizer", str(sp_model), "--out", str(tmp_path / "o.npy")]
    rc = main([*args, "--workers", "2", "--no-cache", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    assert f"{data}: sample 6: line 7: " in err and rule in err
    with pytest.raises(InputError) as info:
        count_lengths(data, sp_model, workers=1, use_cache=False, chunk_size=4)
    assert info.value.sample == 6 and info.value.path == str(data)
    assert not (tmp_path / "o.npy").exists()


def test_field_and_messages_options(tmp_path: Path, sp_model: Path) -> None:
    data = _write_jsonl(
        tmp_path / "x.jsonl",
        [{"body": "a b c", "conv": [{"role": "assistant", "content": "x"}]}] * 3,
    )
    as_doc = count_lengths(data, sp_model, mode="text", field="body", workers=1, use_cache=False)
    as_chat = count_lengths(data, sp_model, mode="messages", field="conv", workers=1, use_cache=False)
    assert as_doc.lengths.tolist() != as_chat.lengths.tolist()
    # only an assistant turn: every token but the first (nothing predicts it) carries loss
    assert as_chat.loss_tokens.tolist() == (as_chat.lengths - 1).tolist()
    with pytest.raises(InputError, match="missing field 'text'"):
        count_lengths(data, sp_model, mode="text", workers=1, use_cache=False)


def test_parquet_and_datasets_folder_give_the_jsonl_counts(
    fixtures_dir: Path, sp_model: Path, tmp_path: Path
) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = _records(fixtures_dir, "gsm8k", 120)
    ref = count_lengths(_write_jsonl(tmp_path / "g.jsonl", chats), sp_model, workers=1, use_cache=False)
    table = pa.Table.from_pylist([{"id": r["id"], "messages": r["messages"]} for r in chats])
    pq.write_table(table, tmp_path / "g.parquet", row_group_size=50)
    from_pq = count_lengths(tmp_path / "g.parquet", sp_model, workers=2, use_cache=False, chunk_size=32)
    datasets.Dataset.from_list(chats).save_to_disk(str(tmp_path / "g_ds"))
    from_ds = count_lengths(tmp_path / "g_ds", sp_model, workers=1, use_cache=False)
    for res in (from_pq, from_ds):
        np.testing.assert_array_equal(res.lengths, ref.lengths)
        np.testing.assert_array_equal(res.loss_tokens, ref.loss_tokens)
    docs = _records(fixtures_dir, "llamafactory_c4_wiki_docs", 20)
    pq.write_table(pa.Table.from_pylist([{"body": d["text"]} for d in docs]), tmp_path / "d.parquet")
    res = count_lengths(
        tmp_path / "d.parquet", sp_model, mode="text", field="body", workers=1, use_cache=False
    )
    np.testing.assert_array_equal(res.lengths - 1, res.loss_tokens)
    # a null in a columnar source is reported by row
    bad = [{"messages": r["messages"]} for r in chats[:5]] + [{"messages": None}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    with pytest.raises(InputError, match=r"bad\.parquet: sample 5: field 'messages' must be a list"):
        count_lengths(tmp_path / "bad.parquet", sp_model, workers=1, use_cache=False)


def _chat_tokenizer_folder(path: Path) -> Path:
    """A transformers tokenizer folder with a chat template: every word is one token, role markers are
    special tokens, so the tokens of a turn are easy to count by hand."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>"]})
    fast.eos_token = "<|end|>"  # the default rule needs one
    fast.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(str(path))
    return path


def test_chat_template_counts(chats: list[dict], tmp_path: Path, sp_model: Path) -> None:
    folder = _chat_tokenizer_folder(tmp_path / "tok")
    chats = chats[:20]
    data = _write_jsonl(tmp_path / "c.jsonl", chats)
    res = count_lengths(data, folder, chat_template=True, workers=1, use_cache=False)
    words = [len(" ".join(m["content"] for m in r["messages"]).split()) for r in chats]
    assert (res.lengths >= np.array(words)).all()
    for r, total, loss in zip(chats, res.lengths, res.loss_tokens, strict=True):
        n_words = [len(_words(m["content"])) for m in r["messages"]]
        assert total == sum(n_words) + 2 * len(r["messages"])  # marker + words + end per turn
        expect = sum(n + 1 for n, m in zip(n_words, r["messages"], strict=True) if m["role"] == "assistant")
        assert loss == expect  # the words and <|end|> of assistant turns; the marker is the prompt's
    fallback = count_lengths(data, folder, workers=1, use_cache=False)
    assert not np.array_equal(fallback.lengths, res.lengths)
    with pytest.raises(ConfigError, match="--chat-template needs a transformers tokenizer folder"):
        count_lengths(data, sp_model, chat_template=True, workers=1, use_cache=False)


def _words(text: str) -> list[str]:
    from tokenizers import pre_tokenizers

    return [w for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text)]


def test_bad_inputs_are_one_line_errors(
    tmp_path: Path, sp_model: Path, capsys: pytest.CaptureFixture
) -> None:
    data = _write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    cases = [
        (["lengths", str(tmp_path / "none.jsonl"), "--tokenizer", str(sp_model)], "file not found"),
        (["lengths", str(data), "--tokenizer", str(tmp_path / "t.model")], "tokenizer not found"),
        (["lengths", str(data), "--tokenizer", str(data)], "unknown tokenizer"),
        (["lengths", str(tmp_path / "x.csv"), "--tokenizer", str(sp_model)], "file not found"),
    ]
    (tmp_path / "empty.jsonl").write_text("")
    cases.append((["lengths", str(tmp_path / "empty.jsonl"), "--tokenizer", str(sp_model)], "no records"))
    for argv, msg in cases:
        rc = main([*argv, "--out", str(tmp_path / "o.npy"), "--no-cache", "--quiet", "--workers", "1"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and msg in err and len(err.splitlines()) == 1, (argv, err)
    rc = main(["lengths", str(data), "--tokenizer", str(sp_model), "--out", str(tmp_path / "o.txt")])
    assert rc == 2 and ".npy" in capsys.readouterr().err


def test_an_unwritable_cache_named_with_a_newline_is_one_warning_line(
    chats: list[dict], sp_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = _write_jsonl(tmp_path / "d.jsonl", chats[:5])
    blocked = tmp_path / "ca\nche"
    blocked.write_text("a file where the cache folder would go")
    out = tmp_path / "o.npy"
    args = ["lengths", str(data), "--tokenizer", str(sp_model), "--out", str(out), "--quiet"]
    assert main([*args, "--workers", "1", "--cache-dir", str(blocked)]) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "cannot write the cache" in line]
    assert len(warning) == 1 and "ca\\nche" in warning[0] and "(Not a directory)" in warning[0], err
    assert np.load(out).shape == (5,)


def test_a_record_of_too_many_messages_is_one_line_naming_file_and_record(
    tmp_path: Path, sp_model: Path, capsys: pytest.CaptureFixture
) -> None:
    from padfree.data.formats import MAX_MESSAGES

    turns = [{"role": "user" if j % 2 == 0 else "assistant", "content": "a"} for j in range(MAX_MESSAGES + 1)]
    data = _write_jsonl(tmp_path / "d.jsonl", [{"messages": turns[:2]}, {"messages": turns}])
    out = tmp_path / "o.npy"
    args = ["lengths", str(data), "--tokenizer", str(sp_model), "--out", str(out), "--quiet"]
    assert main([*args, "--workers", "1", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "d.jsonl: sample 1: line 2" in err, err
    assert f"holds {MAX_MESSAGES + 1:,} messages, over {MAX_MESSAGES:,}" in err and not out.exists()
    _write_jsonl(data, [{"messages": turns[:2]}, {"messages": turns[:MAX_MESSAGES]}])  # at the bound: counted
    assert main([*args, "--workers", "1", "--no-cache"]) == 0
    pair, whole = np.load(out).tolist()
    assert whole == pair * MAX_MESSAGES // 2
