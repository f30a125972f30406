"""Counting on Ray (``padfree lengths --ray``): a local Ray cluster counts held fixtures through the Ray Data
stage to exactly the single-machine arrays; shards from another tokenizer or rule are refused at merge."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from padfree.cli import main
from padfree.data.count_lengths import count_lengths
from padfree.data.ray_lengths import CountBatch, count_records, merge_shards
from padfree.errors import ConfigError, InputError

DATA = ["gsm8k.jsonl.gz", "humaneval.jsonl.gz", "hh_rlhf_harmless_test.jsonl.gz"]


def test_count_records_is_the_one_rule(fixtures_dir: Path, sp_model: Path) -> None:
    import pyarrow as pa

    src = fixtures_dir / "samples" / "hh_rlhf_harmless_test.jsonl.gz"
    ref = count_lengths([src], sp_model, workers=1, use_cache=False)
    import gzip

    with gzip.open(src, "rt", encoding="utf-8") as f:
        recs = [json.loads(x) for x in f][:40]
    got = count_records(pa.Table.from_pylist(recs), sp_model)
    np.testing.assert_array_equal(got["length"], ref.lengths[:40])
    np.testing.assert_array_equal(got["loss_tokens"], ref.loss_tokens[:40])
    stage = CountBatch(str(sp_model))
    numpy_batch = {
        "messages": np.array([r["messages"] for r in recs[:5]], dtype=object)
    }  # Ray's numpy format
    np.testing.assert_array_equal(stage(numpy_batch)["length"], ref.lengths[:5])


@pytest.mark.slow
def test_local_ray_cluster_counts_exactly_what_padfree_lengths_does(
    fixtures_dir: Path, sp_model: Path, tmp_path: Path, capsys, request
) -> None:
    import gzip

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = [str(fixtures_dir / "samples" / n) for n in DATA]
    with gzip.open(data[2], "rt", encoding="utf-8") as f:  # the same chats as parquet row groups and datasets
        chats = [json.loads(x) for x in f][:300]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "chats.parquet", row_group_size=70)
    datasets.Dataset.from_list(chats).save_to_disk(str(tmp_path / "chats_ds"))
    data += [str(tmp_path / "chats.parquet"), str(tmp_path / "chats_ds")]
    ref = tmp_path / "ref.npy"
    assert main(["lengths", *data, "--tokenizer", str(sp_model), "--out", str(ref), "--no-cache",
                 "--workers", "1", "--quiet"]) == 0  # fmt: skip
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # --ray reuses it, then shuts it down
    request.addfinalizer(ray.shutdown)  # also when an assertion stops the test before --ray runs
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    rows = ray.data.from_items(chats).map_batches(
        CountBatch,
        fn_constructor_kwargs={"tokenizer": str(sp_model)},
        batch_format="pyarrow",
        batch_size=64,
        compute=ray.data.ActorPoolStrategy(size=1),
    )
    stage_counts = np.array([r["length"] for r in rows.take_all()])
    out = tmp_path / "ray.npy"
    assert main(["lengths", *data, "--tokenizer", str(sp_model), "--out", str(out), "--ray", "--workers", "2",
                 "--rows-per-shard", "128"]) == 0  # fmt: skip
    assert "counted on Ray (2 workers" in capsys.readouterr().err
    np.testing.assert_array_equal(np.load(out), np.load(ref))
    np.testing.assert_array_equal(stage_counts, np.load(ref)[-600:-300])  # the chats, through CountBatch
    np.testing.assert_array_equal(
        np.load(tmp_path / "ray.assistant.npy"), np.load(tmp_path / "ref.assistant.npy")
    )
    shards = tmp_path / "ray.shards"
    manifest = json.loads((shards / "manifest.json").read_text())
    assert [Path(s["path"]).name for s in manifest["sources"]] == [*DATA, "chats.parquet", "chats_ds"]
    assert len(manifest["shards"]) > len(data)
    assert all(s["sha256"] and s["rows"] > 0 for s in manifest["sources"])
    # the merge refuses shards counted with another tokenizer, or under another rule, in one line
    other = tmp_path / "other.model"
    other.write_bytes(sp_model.read_bytes() + b"\0")
    with pytest.raises(InputError, match="counted with another tokenizer"):
        merge_shards(shards, other)
    manifest["rule"] = 1
    (shards / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match="counted under tokenization rule version 1") as exc:
        merge_shards(shards, sp_model)
    assert "\n" not in str(exc.value)


def test_unreachable_address_is_one_line(fixtures_dir: Path, sp_model: Path, tmp_path: Path, capsys) -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    data = str(fixtures_dir / "samples" / DATA[0])
    rc = main(["lengths", data, "--tokenizer", str(sp_model), "--out", str(tmp_path / "o.npy"),
               "--ray", f"127.0.0.1:{port}"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no Ray cluster answers at 127.0.0.1" in err[0]


def test_missing_ray_extra_is_one_line(
    monkeypatch, fixtures_dir: Path, sp_model: Path, tmp_path: Path
) -> None:
    import builtins

    real = builtins.__import__

    def no_ray(name, *a, **kw):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    from padfree.data.ray_lengths import count_on_ray

    with pytest.raises(ConfigError, match=r"needs the ray extra: pip install 'padfree\[ray\]'"):
        count_on_ray([fixtures_dir / "samples" / DATA[0]], sp_model, tmp_path / "s")
