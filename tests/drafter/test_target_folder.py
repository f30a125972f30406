"""A user's target folder: examples/train_drafter.py --target DIR trains on a folder written by
save_pretrained (its tokenizer reads the data, its layers follow the recipe's rule), checkpoints what export
needs, and exports at the end of training and through ``padfree export-drafter``; a folder that is missing
something is one line naming it."""

import json
from pathlib import Path

import pytest
import torch

from padfree.cli import main as cli
from padfree.drafter.export import META_KEY, read_checkpoint
from padfree.drafter.methods.dflash.spec import spread_layers
from padfree.drafter.target import check_target_folder, load_target
from padfree.errors import ConfigError
from padfree.testing.targets import save_target_folder


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, hf_json):
    return save_target_folder(tmp_path_factory.mktemp("target") / "tiny-llama", hf_json, family="llama")


def test_train_on_a_target_folder_checkpoint_and_export(tmp_path, target_dir, fixtures_dir, example, capsys):
    ckpt, served = tmp_path / "ckpt", tmp_path / "served"
    args = [
        "--target", str(target_dir), "--data", str(fixtures_dir / "samples/gsm8k.jsonl.gz"),
        "--limit-samples", "6", "--budget", "256", "--block-size", "4", "--max-anchors", "4", "--max-steps",
        "2", "--log-every", "1", "--checkpoint-dir", str(ckpt), "--export-dir", str(served),
    ]  # fmt: skip
    assert example.main(args) == 0
    out = capsys.readouterr().out
    assert "finished at step 2" in out and f"exported the drafter in dflash format to {served}" in out, out
    state, meta = read_checkpoint(ckpt)
    cfg = json.loads((target_dir / "config.json").read_text())
    assert meta["target"]["path"] == str(target_dir.resolve())
    assert tuple(meta["target_layers"]) == spread_layers(cfg["num_hidden_layers"], 5)  # the recipe's rule
    assert meta["drafter"]["hidden_size"] == cfg["hidden_size"] and meta["drafter"]["head_size"] == 16
    saved = torch.load(next(ckpt.glob("step-*.pt")), weights_only=True)
    assert saved["drafter"]["vocab_size"] == cfg["vocab_size"] == 129280  # the tokenizer's ids, not folded
    assert saved[META_KEY] == meta and state["embed_tokens.weight"].shape[0] == cfg["vocab_size"]
    config = json.loads((served / "config.json").read_text())
    assert config["dflash_config"] == {
        "block_size": 4,
        "mask_token_id": meta["mask_token_id"],
        "target_layer_ids": meta["target_layers"],
    }
    assert config["num_target_layers"] == cfg["num_hidden_layers"] and config["num_hidden_layers"] == 1

    again = tmp_path / "again"
    assert cli(["export-drafter", str(ckpt), "--out", str(again)]) == 0
    assert "wrote" in capsys.readouterr().out
    from safetensors.torch import load_file

    a, b = load_file(served / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "layers.0.self_attn.q_proj.weight" in a and "embed_tokens.weight" not in a

    assert cli(["export-drafter", str(ckpt), "--format", "speculators", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds eagle3 drafters; this drafter is dflash" in err[0], err


def _broken(root: Path, target_dir: Path, what: str) -> Path:
    d = root / what
    d.mkdir()
    for f in target_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    if what == "no_config":
        (d / "config.json").unlink()
    elif what == "bad_config":
        (d / "config.json").write_text("{not json")
    elif what == "no_weights":
        (d / "model.safetensors").unlink()
    elif what == "bad_weights":
        (d / "model.safetensors").write_bytes(b"garbage")
    elif what == "no_tokenizer":
        (d / "tokenizer.json").unlink()
    elif what in ("no_head", "shard_lacks_head", "bad_shape", "extra_tensor"):
        _edit_weights(d, what)
    return d


def _edit_weights(d: Path, what: str) -> None:
    """Weights transformers loads with a report and fresh random values (or drops): the untied LM head left
    out, a shard index naming a shard that lacks it, a tensor of another shape, a tensor of another model."""
    from safetensors.torch import load_file, save_file

    weights = load_file(d / "model.safetensors")
    if what == "no_head":
        del weights["lm_head.weight"]
    elif what == "bad_shape":
        weights["model.norm.weight"] = torch.ones(weights["model.norm.weight"].shape[0] + 1)
    elif what == "extra_tensor":
        weights["model.extra_proj.weight"] = torch.ones(2, 2)
    if what != "shard_lacks_head":
        save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
        return
    (d / "model.safetensors").unlink()
    names = sorted(set(weights) - {"lm_head.weight"})
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {"lm_head.weight": "model-00002-of-00002.safetensors"}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(d / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("what", "said"),
    [
        ("missing", "target not found"),
        ("no_config", "config.json: cannot read the model config"),
        ("bad_config", "config.json: not a model config (malformed JSON"),
        ("no_weights", "no model.safetensors"),
        ("bad_weights", "transformers cannot load a causal LM from it"),
        ("no_tokenizer", "no tokenizer (tokenizer.json or tokenizer.model)"),
        ("no_head", "its weights lack tensor lm_head.weight"),
        ("shard_lacks_head", "shard model-00002-of-00002.safetensors, where model.safetensors.index.json"),
        ("bad_shape", "tensor model.norm.weight has shape [33] in the weights, [32] in the model"),
        ("extra_tensor", "the weights hold tensor model.extra_proj.weight, which the model"),
    ],
)
def test_a_target_folder_missing_something_is_one_line(tmp_path, target_dir, what, said):
    d = tmp_path / "nowhere" if what == "missing" else _broken(tmp_path, target_dir, what)
    with pytest.raises(ConfigError) as info:
        check_target_folder(d)
        load_target(d)
    assert said in str(info.value) and str(d) in str(info.value) and "\n" not in str(info.value)


def test_a_tied_target_needs_no_head_tensor(tmp_path, hf_json):
    d = save_target_folder(tmp_path / "tied", hf_json, family="qwen3", tie_word_embeddings=True)
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names
    model = load_target(d)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_a_target_without_its_head_stops_the_example_in_one_line(tmp_path, target_dir, example, capfd):
    d = _broken(tmp_path, target_dir, "no_head")
    served = tmp_path / "served"
    with pytest.raises(SystemExit) as info:
        example.run_example(
            lambda: example.main(["--target", str(d), "--max-steps", "1", "--export-dir", str(served)])
        )
    err = capfd.readouterr().err.strip().splitlines()  # transformers' load report would come before it
    assert info.value.code == 2 and len(err) == 1, err
    assert f"{d}: its weights lack tensor lm_head.weight" in err[0] and not served.exists(), err


def test_the_example_refuses_a_bad_target_and_folding_in_one_line(tmp_path, target_dir, example, capsys):
    with pytest.raises(SystemExit) as info:
        example.run_example(lambda: example.main(["--target", str(tmp_path / "nowhere")]))
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "nowhere: target not found" in err[0], err
    with pytest.raises(SystemExit) as info:
        example.main(["--target", str(target_dir), "--vocab-size", "256"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "--vocab-size folds token ids" in err[0], err


def _with_tokenizer(root: Path, target_dir: Path, name: str, files: dict) -> Path:
    """A copy of the target folder whose tokenizer files are replaced by ``files`` (name -> bytes or a
    path)."""
    d = root / name
    d.mkdir()
    for f in target_dir.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens")):
            (d / f.name).write_bytes(f.read_bytes())
    for f, content in files.items():
        (d / f).write_bytes(content if isinstance(content, bytes) else Path(content).read_bytes())
    return d


def _word_tokenizer(path: Path, n: int) -> Path:
    """A fast tokenizer.json of ``n`` ids (words ``w0 .. w{n-1}``, ``<s>`` = 1 and ``</s>`` = 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(n)}
    vocab.update({"<s>": 1, "</s>": 2})
    tok = Tokenizer(
        models.WordLevel({k: v for k, v in vocab.items() if k not in ("w1", "w2")}, unk_token="w0")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_a_tokenizer_of_another_model_is_named_not_an_option_nobody_gave(tmp_path, target_dir, fixtures_dir,
                                                                         example, capsys):  # fmt: skip
    """Issue 33 item 11: the target's 129K tokenizer beside a 32K-vocabulary model was blamed on
    --mask-token-id (its default taken from that tokenizer); the tokenizer-vs-vocabulary line comes first."""
    import transformers

    from padfree.testing.targets import SIZES

    small = tmp_path / "small"
    transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(vocab_size=32000, **SIZES)
    ).save_pretrained(small)
    for f in target_dir.glob("tokenizer*"):
        (small / f.name).write_bytes(f.read_bytes())
    capsys.readouterr()  # save_pretrained's progress bar
    data = str(fixtures_dir / "samples/gsm8k.jsonl.gz")
    args = [
        "--target",
        str(small),
        "--data",
        data,
        "--limit-samples",
        "4",
        "--budget",
        "256",
        "--max-steps",
        "1",
    ]
    with pytest.raises(SystemExit) as info:
        example.run_example(lambda: example.main(args))
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert "its tokenizer has 129280 ids, more than the model's vocabulary of 32000 (config.json)" in err[0]
    assert "--mask-token-id" not in err[0]


def test_a_tokenizer_whose_ids_merely_fit_or_whose_specials_differ_is_refused(tmp_path, target_dir):
    """Issue 33 item 11: a 32K tokenizer beside the 129K target fits the vocabulary and trained silently; a
    tokenizer whose BOS differs from config.json's likewise. Both are one line naming what differs; the
    folder's own tokenizer passes."""
    from padfree.drafter.target import check_target_tokenizer

    check_target_tokenizer(target_dir)  # the folder's own
    tok = _word_tokenizer(tmp_path / "words.json", 32000)
    conf = json.dumps({"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"})
    short = _with_tokenizer(
        tmp_path, target_dir, "short", {"tokenizer.json": tok, "tokenizer_config.json": conf.encode()}
    )
    with pytest.raises(ConfigError) as info:
        check_target_tokenizer(short)
    assert "its tokenizer has 32000 ids, far fewer than the model's vocabulary of 129280" in str(info.value)
    cfg = json.loads((target_dir / "config.json").read_text())
    bos = _with_tokenizer(tmp_path, target_dir, "bos", {
        f.name: f for f in target_dir.glob("tokenizer*")})  # fmt: skip
    (bos / "config.json").write_text(json.dumps({**cfg, "bos_token_id": cfg["bos_token_id"] + 5}))
    with pytest.raises(ConfigError) as info:
        check_target_tokenizer(bos)
    b = cfg["bos_token_id"]
    said = f"its tokenizer's bos token is id {b}, config.json's bos_token_id {b + 5}"
    assert said in str(info.value) and "\n" not in str(info.value)


def test_a_sentencepiece_tokenizer_that_needs_protobuf_says_protobuf(tmp_path, target_dir, fixtures_dir):
    """Issue 33 item 11: a folder whose tokenizer is a tokenizer.model alone said "tiktoken is required"
    (transformers' fallback) where protobuf is what is missing; with protobuf it loads and, a 32K tokenizer
    beside a 129K model, is refused as another model's."""
    import importlib.util

    from padfree.drafter.target import check_target_tokenizer

    d = _with_tokenizer(
        tmp_path, target_dir, "sp", {"tokenizer.model": fixtures_dir / "tokenizers/llama_sp32k.model"}
    )
    with pytest.raises(ConfigError) as info:
        check_target_tokenizer(d)
    try:
        protobuf = importlib.util.find_spec("google.protobuf") is not None
    except ModuleNotFoundError:
        protobuf = False
    said = (
        "far fewer than the model's vocabulary"
        if protobuf
        else "tokenizer.model (SentencePiece) needs the protobuf"
    )
    assert said in str(info.value) and "tiktoken" not in str(info.value) and "\n" not in str(info.value)
