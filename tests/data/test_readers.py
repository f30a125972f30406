"""Lengths read from tokenized data (datasets folders, parquet ids, Megatron .bin/.idx, datatrove shards),
each written by its own library, equal to counting the same records with ``padfree lengths``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from padfree.cli import main
from padfree.data.count_lengths import count_lengths
from padfree.data.readers import read_tokenized, tokenized_kind
from padfree.data.tokenization import Tokenizer, encode_samples
from padfree.errors import InputError


@pytest.fixture(scope="module")
def corpus(fixtures_dir: Path, sp_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """Chats and documents as a .jsonl, their padfree counts, and their token ids and loss masks."""
    recs, files = [], []
    folder = tmp_path_factory.mktemp("corpus")
    for name, n in (("hh_rlhf_harmless_test", 25), ("llamafactory_c4_wiki_docs", 10)):
        with gzip.open(fixtures_dir / "samples" / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
            part = [json.loads(x) for x in f.readlines()[:n]]
        files.append(folder / f"{name}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
        recs += part
    data = files[0]
    counted = count_lengths(files, sp_model, workers=1, use_cache=False)
    samples = [r.get("messages", r.get("text")) for r in recs]
    enc = encode_samples(Tokenizer(sp_model), samples)
    ids = [enc.sample(i)[0].tolist() for i in range(len(enc))]
    masks = [enc.sample(i)[1].tolist() for i in range(len(enc))]
    assert counted.loss_tokens.sum() < counted.lengths.sum() - len(recs)  # chats: prompts carry no loss
    return data, counted, ids, masks


def test_datasets_folder_input_ids_and_loss_mask(corpus, tmp_path: Path) -> None:
    import datasets

    _, counted, ids, masks = corpus
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(folder))
    assert tokenized_kind(folder) == "datasets"
    res = read_tokenized([folder])
    np.testing.assert_array_equal(res.lengths, counted.lengths)
    np.testing.assert_array_equal(res.loss_tokens, counted.loss_tokens)


def test_datasets_seq_len_column_states_it_holds_no_loss(corpus, tmp_path: Path) -> None:
    import datasets

    _, counted, ids, _ = corpus
    folder = tmp_path / "ds"
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"seq_len": [len(x) for x in ids]})})
    dd.save_to_disk(str(folder))
    res = read_tokenized([folder], split="train")
    np.testing.assert_array_equal(res.lengths, counted.lengths)
    assert res.loss_tokens is None and "no loss mask" in res.note


def test_parquet_ids_with_labels(corpus, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, counted, ids, masks = corpus
    labels = [[t if m else -100 for t, m in zip(a, b, strict=True)] for a, b in zip(ids, masks, strict=True)]
    half = len(ids) // 2
    for k, sl in enumerate((slice(0, half), slice(half, None))):
        pq.write_table(pa.table({"input_ids": ids[sl], "labels": labels[sl]}), tmp_path / f"p{k}.parquet")
    res = read_tokenized([str(tmp_path / "p*.parquet")])
    np.testing.assert_array_equal(res.lengths, counted.lengths)
    np.testing.assert_array_equal(res.loss_tokens, counted.loss_tokens)
    assert [n for _, n in res.sources] == [half, len(ids) - half]


def test_megatron_indexed_dataset_written_by_megatron(corpus, tmp_path: Path) -> None:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    _, counted, ids, _ = corpus
    prefix = tmp_path / "mega_text_document"
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    for x in ids:
        builder.add_item(torch.tensor(x, dtype=torch.int32))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    for spec in (prefix, Path(str(prefix) + ".bin"), Path(str(prefix) + ".idx")):
        assert tokenized_kind(spec) == "megatron"
        res = read_tokenized([spec])
        np.testing.assert_array_equal(res.lengths, counted.lengths)
        assert res.loss_tokens is None and "Megatron" in res.note and "no loss" in res.note


def test_datatrove_shards_written_by_datatrove(corpus, tmp_path: Path) -> None:
    from datatrove.io import get_datafolder
    from datatrove.pipeline.tokens.tokenizer import TokenizedFile

    _, counted, ids, masks = corpus
    half = len(ids) // 2
    for k, sl in enumerate((slice(0, half), slice(half, None))):
        out = TokenizedFile(get_datafolder(str(tmp_path)), f"{k:05d}_shard.ds", save_loss_metadata=True,
                            token_size=4)  # fmt: skip
        for x, m in zip(ids[sl], masks[sl], strict=True):
            out.write(x, np.array(m, dtype=bool))
        out.close()
    assert tokenized_kind(tmp_path) == "datatrove"
    res = read_tokenized([tmp_path])
    np.testing.assert_array_equal(res.lengths, counted.lengths)
    np.testing.assert_array_equal(res.loss_tokens, counted.loss_tokens)
    for q in tmp_path.glob("*.ds.loss"):
        q.unlink()
    res = read_tokenized([tmp_path / "00000_shard.ds"])
    np.testing.assert_array_equal(res.lengths, counted.lengths[:half])
    assert res.loss_tokens is None and ".ds.loss" in res.note


def test_cli_reads_token_ids_without_a_tokenizer(corpus, tmp_path: Path, capsys) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, counted, ids, masks = corpus
    pq.write_table(pa.table({"input_ids": ids, "loss_mask": masks}), tmp_path / "ids.parquet")
    out = tmp_path / "l.npy"
    (tmp_path / "l.assistant.npy").write_bytes(b"stale")
    assert main(["lengths", str(tmp_path / "ids.parquet"), "--out", str(out)]) == 0
    np.testing.assert_array_equal(np.load(out), counted.lengths)
    np.testing.assert_array_equal(np.load(tmp_path / "l.assistant.npy"), counted.loss_tokens)
    assert "not tokenized again" in capsys.readouterr().err
    pq.write_table(pa.table({"seq_len": [len(x) for x in ids]}), tmp_path / "ids.parquet")
    assert main(["lengths", str(tmp_path / "ids.parquet"), "--out", str(out)]) == 0
    assert not (tmp_path / "l.assistant.npy").exists()  # no stale loss counts beside new lengths
    assert "no loss-bearing counts written" in capsys.readouterr().err


def test_bad_tokenized_inputs_are_one_line(corpus, tmp_path: Path, capsys) -> None:
    data, *_ = corpus
    bad = tmp_path / "x.idx"
    bad.write_bytes(b"NOTMEGA" + bytes(40))
    with pytest.raises(InputError, match="x.idx: not a Megatron .idx file"):
        read_tokenized([bad])
    assert main(["lengths", str(bad), str(data), "--out", str(tmp_path / "o.npy")]) == 2
    err = capsys.readouterr().err.strip()
    assert "raw records mixed with token ids" in err and len(err.splitlines()) == 1
    assert main(["lengths", str(data), "--out", str(tmp_path / "o.npy")]) == 2
    assert "--tokenizer is required" in capsys.readouterr().err
