"""A huge record is counted in bounded memory: a text over PIECE_CHARS is encoded piece by piece, cut at a
single space between two ASCII letters or digits, and the pieces give exactly the ids of the whole text
(SentencePiece and tokenizer.json, whose cuts differ: the space goes with the next piece or is dropped); a
text with no such place within MAX_UNCUT_CHARS is one line, exit 2. The peak memory on a 50 MB record is
measured by benchmarks/record_memory.py (docs/errors.md)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

import padfree.data.tokenizer as tokenizer_module
from padfree.cli import main
from padfree.data.count_lengths import count_lengths
from padfree.data.samples import load_samples
from padfree.data.tokenization import encode_samples
from padfree.data.tokenizer import Tokenizer
from padfree.errors import PadfreeError

WORDS = [
    *("the", "Quick", "brown", "über", "Ähnlichkeit", "12", "3.14", "x_1", "def", "return", "naïve"),
    *("日本語", "中文字", "emoji😀", "a", "I", "don't", "--", "()", "{", "λx", "0x1F", "1999", "-42"),
    "http://a.b/c?d=1",
]
SEPS = [" "] * 30 + ["  ", "\n", "\n\n", "\t", " \n", ", ", ". ", "   ", "", "\r\n"]


def _text(rng: random.Random, n: int) -> str:
    out, size = [], 0
    while size < n:
        w = rng.choice(WORDS) + rng.choice(SEPS)
        out.append(w)
        size += len(w)
    return "".join(out)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of ~2,000 characters and at most 20,000 without a cut: many cuts on small texts."""
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 2000)
    monkeypatch.setattr(tokenizer_module, "MAX_UNCUT_CHARS", 20_000)


@pytest.fixture(params=["sp", "json"])
def tok(request, sp_model: Path, hf_json: Path) -> Tokenizer:
    return Tokenizer(sp_model if request.param == "sp" else hf_json)


def test_each_tokenizer_kind_is_probed_for_its_own_cut(sp_model: Path, hf_json: Path):
    assert Tokenizer(sp_model).piece_mode() == "after"  # the dummy prefix gives the next piece its space
    assert Tokenizer(hf_json).piece_mode() == "before"  # a byte-level word begins with its space


def test_pieces_encode_to_exactly_the_ids_of_the_whole_text(tok: Tokenizer, small_pieces):
    rng = random.Random(7)
    for _ in range(30):
        text = _text(rng, rng.randint(2_001, 40_000))
        got = tok.encode([text, "short one"])
        assert isinstance(got[0], np.ndarray)  # encoded in pieces
        assert got[0].tolist() == list(tok._encode([text])[0])
        assert list(got[1]) == list(tok._encode(["short one"])[0])


def test_counted_lengths_and_training_samples_match_the_whole_record_counts(
    tok: Tokenizer, small_pieces, tmp_path: Path, monkeypatch
):
    rng = random.Random(3)
    docs = [_text(rng, n) for n in (50, 30_000, 5_000, 19_000)]
    chat = [
        {"role": "user", "content": _text(rng, 9_000)},
        {"role": "assistant", "content": _text(rng, 7_000)},
    ]
    data = [tmp_path / "d.jsonl", tmp_path / "c.jsonl"]
    data[0].write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data[1].write_text(json.dumps({"messages": chat}) + "\n")
    pieced = count_lengths(data, tok.path, workers=1, use_cache=False)
    assert pieced.lengths[1] > 5_000  # the long ones really were long
    samples = load_samples(data, tok.path)
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 10**9)  # now every text at once
    whole = count_lengths(data, tok.path, workers=1, use_cache=False)
    assert pieced.lengths.tolist() == whole.lengths.tolist()
    assert pieced.loss_tokens.tolist() == whole.loss_tokens.tolist()
    expected = encode_samples(Tokenizer(tok.path), [*docs, chat])
    assert [len(s["input_ids"]) for s in samples] == expected.lengths.tolist()
    assert all(
        np.array_equal(np.asarray(s["input_ids"]), expected.sample(i)[0]) for i, s in enumerate(samples)
    )


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_text_with_no_place_to_cut_is_one_line(
    tok: Tokenizer, small_pieces, tmp_path: Path, capsys, workers
):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "ok then"}) + "\n" + json.dumps({"text": "日本語" * 10_000}) + "\n")
    code = main(["lengths", str(data), "--tokenizer", tok.path, "--out", str(tmp_path / "o.npy"), "--quiet",
                 "--no-cache", "--workers", workers])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert (
        f"{data}: sample 1: line 2: a text of 30,000 characters" in err
        and "no such space within 20,000" in err
    )
    with pytest.raises(PadfreeError, match="no such space"):
        load_samples(data, tok.path)  # training refuses the same record
