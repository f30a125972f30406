"""Where an export is written: atomically (a killed export leaves the earlier export whole), never into the
target folder, the checkpoint folder or through a link planted in the output folder, checked before training
(``train_drafter.py --export-dir``); a damaged newest checkpoint is named and passed over, a failed write or a
newer checkpoint is one line."""

import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch

from padfree.cli import main as cli
from padfree.drafter.export import META_KEY
from padfree.testing.targets import save_target_folder

TINY = ["--limit-samples", "6", "--budget", "256", "--block-size", "4", "--max-anchors", "4"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, example):
    """A checkpoint folder of the tiny target's DFlash drafter at steps 1 and 2."""
    d = tmp_path_factory.mktemp("run") / "ckpt"
    args = [*TINY, "--max-steps", "2", "--checkpoint-dir", str(d), "--checkpoint-every", "1"]
    assert example.main(args) == 0
    assert sorted(p.name for p in d.glob("step-*.pt")) == ["step-000000001.pt", "step-000000002.pt"]
    return d


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("padfree: error: "), err
    return err[0]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_killed_export_leaves_the_earlier_export_whole(tmp_path, ckpt, capsys):
    out = tmp_path / "served"
    assert cli(["export-drafter", str(ckpt), "--out", str(out)]) == 0
    before = _files(out)
    from safetensors import torch as st

    real = st.save_file

    def killed_after_weights(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt  # the process dies between the weights and the config

    with mock.patch.object(st, "save_file", killed_after_weights), pytest.raises(KeyboardInterrupt):
        from padfree.drafter.export import export_drafter, read_checkpoint

        state, meta = read_checkpoint(ckpt)
        export_drafter(state, meta, "dflash", out, dtype="bfloat16")
    assert _files(out) == before  # not bfloat16 weights under the float32 config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]  # no temporary folder left beside it
    killed = tmp_path / ".served.999999999.abc.tmp"  # what a SIGKILLed export leaves (no such process)
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"half")
    assert cli(["export-drafter", str(ckpt), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "served"
    ]  # the earlier export and the leftover gone


def test_replacing_an_export_without_an_atomic_exchange(tmp_path, ckpt, monkeypatch):
    from padfree.drafter import export

    out = tmp_path / "served"
    assert cli(["export-drafter", str(ckpt), "--out", str(out)]) == 0
    monkeypatch.setattr(export, "_exchange", lambda a, b: False)  # a system without renameat2
    assert cli(["export-drafter", str(ckpt), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]


def test_an_export_never_writes_through_a_planted_link(tmp_path, ckpt, capsys):
    out = tmp_path / "served"
    assert cli(["export-drafter", str(ckpt), "--out", str(out)]) == 0
    victim = tmp_path / "victim.json"
    victim.write_text("precious\n")
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(victim)
    assert cli(["export-drafter", str(ckpt), "--out", str(out)]) == 0
    assert victim.read_text() == "precious\n"
    assert (
        not (out / "config.json").is_symlink()
        and json.loads((out / "config.json").read_text())["dflash_config"]
    )

    link = tmp_path / "link"
    link.symlink_to(out)
    assert cli(["export-drafter", str(ckpt), "--out", str(link)]) == 2
    assert f"{link}: is a symbolic link" in _one_error(capsys)


def test_an_export_never_goes_into_the_checkpoint_folder(tmp_path, ckpt, capsys):
    before = _files(ckpt)
    for out in (ckpt, ckpt / "served"):
        assert cli(["export-drafter", str(ckpt), "--out", str(out)]) == 2
        line = _one_error(capsys)
        assert f"{out}: is" in line and f"the checkpoint folder ({ckpt.resolve()})" in line, line
    assert _files(ckpt) == before and not (ckpt / "served").exists()
    other = tmp_path / "notes"
    other.mkdir()
    (other / "README.md").write_text("mine\n")
    assert cli(["export-drafter", str(ckpt), "--out", str(other)]) == 2
    assert "holds README.md, which is not an export's file" in _one_error(capsys)
    assert (other / "README.md").read_text() == "mine\n"


def test_an_export_never_overwrites_the_target_folder(tmp_path, hf_json, ckpt, example, capsys):
    target = save_target_folder(tmp_path / "target", hf_json, family="llama")
    before = _files(target)
    capsys.readouterr()
    trained = torch.load(ckpt / "step-000000002.pt", weights_only=True)[META_KEY]["target"]["config"]
    verifier = _verifier_like(tmp_path / "verifier", trained)
    kept = _files(verifier)
    assert cli(["export-drafter", str(ckpt), "--verifier", str(verifier), "--out", str(verifier)]) == 2
    assert f"{verifier}: is the target folder" in _one_error(capsys) and _files(verifier) == kept
    with pytest.raises(SystemExit) as info:  # checked before the target is even loaded
        example.run_example(
            lambda: example.main(
                ["--target", str(target), *TINY, "--max-steps", "1", "--export-dir", str(target)]
            )
        )
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and f"{target}: is the --target folder" in err[0], err
    assert "run " not in captured.out and _files(target) == before


def test_a_bad_export_dir_is_refused_before_training(tmp_path, example, capsys):
    run = tmp_path / "ckpt"
    args = [*TINY, "--max-steps", "1", "--checkpoint-dir", str(run), "--export-dir", str(run / "served")]
    with pytest.raises(SystemExit) as info:
        example.run_example(lambda: example.main(args))
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "is inside the --checkpoint-dir folder" in err[0], err
    assert "finished at step" not in captured.out and not list(run.glob("step-*.pt"))


def test_a_damaged_newest_checkpoint_is_named_and_passed_over(tmp_path, ckpt, capsys):
    folder = tmp_path / "ckpt"
    shutil.copytree(ckpt, folder)
    newest = folder / "step-000000002.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    assert cli(["export-drafter", str(folder), "--out", str(tmp_path / "served")]) == 0
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "step-000000002.pt: damaged checkpoint" in err[0], err
    assert f"from {folder / 'step-000000001.pt'}, the newest intact (1 newer damaged)" in captured.out
    (folder / "step-000000001.pt").write_bytes(b"garbage")
    assert cli(["export-drafter", str(folder), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "no intact checkpoint" in err[-1] and len(err) == 3, err


def test_a_failed_write_is_one_line_naming_the_folder(tmp_path, ckpt, capsys):
    from safetensors import SafetensorError
    from safetensors import torch as st

    full = SafetensorError(
        'Error while serializing: I/O error: No space left on device (os error 28) at path "/x/.tmpAb"'
    )
    out = tmp_path / "served"
    with mock.patch.object(st, "save_file", side_effect=full):
        assert cli(["export-drafter", str(ckpt), "--out", str(out)]) == 2
    line = _one_error(capsys)
    assert f"{out}: cannot write the exported drafter (No space left on device)" in line, line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_checkpoint_of_a_newer_padfree_says_so(tmp_path, ckpt, capsys):
    state = torch.load(ckpt / "step-000000002.pt", weights_only=True)
    state[META_KEY] = {**state[META_KEY], "version": 2}
    newer = tmp_path / "step-000000002.pt"
    torch.save(state, newer)
    assert cli(["export-drafter", str(newer), "--out", str(tmp_path / "served")]) == 2
    line = _one_error(capsys)
    assert "version 2, written by a newer padfree" in line and "before export was supported" not in line


@pytest.mark.parametrize(
    ("args", "said", "not_said"),
    [
        (
            ["--method", "dflash", "--export-format", "speculators"],
            "this drafter is dflash (export it with --export-format dflash)",
            "--format dflash",
        ),
        (["--method", "eagle3"], "tiny random target; train with --target DIR", "--verifier"),
    ],
)
def test_the_example_names_its_own_export_options(tmp_path, example, args, said, not_said, capsys):
    out = tmp_path / "served"
    with pytest.raises(SystemExit) as info:
        example.run_example(
            lambda: example.main([*TINY, "--max-steps", "1", *args, "--export-dir", str(out)])
        )
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and said in err[0] and not_said not in err[0], err
    assert "finished at step" not in captured.out and not out.exists()


def _verifier_like(folder: Path, config: dict) -> Path:
    """A target folder whose config is ``config`` (the weights and tokenizer are only looked for)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.mark.parametrize(
    ("change", "differs"),
    [
        ({"hidden_size": 96, "num_hidden_layers": 5}, "(hidden size and layers differ)"),
        ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "(architecture differs)"),
        ({"vocab_size": 4096}, "(vocabulary differs)"),
    ],
)
def test_a_verifier_of_other_sizes_or_architecture_is_refused(tmp_path, ckpt, change, differs, capsys):
    trained = torch.load(ckpt / "step-000000002.pt", weights_only=True)[META_KEY]["target"]["config"]
    other = _verifier_like(tmp_path / "other", {**trained, **change})
    out = tmp_path / "served"
    assert cli(["export-drafter", str(ckpt), "--verifier", str(other), "--out", str(out)]) == 2
    line = _one_error(capsys)
    assert f"--verifier {other}: a " in line and "this drafter was trained on a llama target" in line, line
    assert differs in line and not out.exists()
    same = _verifier_like(tmp_path / "same", trained)  # a fine-tune of the very target is its verifier
    assert cli(["export-drafter", str(ckpt), "--verifier", str(same), "--out", str(out)]) == 0


def test_a_checkpoint_missing_a_tensor_names_the_file_and_the_tensor(tmp_path, ckpt, capsys):
    state = torch.load(ckpt / "step-000000002.pt", weights_only=True)
    del state["model"]["fc.weight"]
    damaged = tmp_path / "old" / "step-000000002.pt"
    damaged.parent.mkdir()
    torch.save(state, damaged)
    assert cli(["export-drafter", str(damaged), "--out", str(tmp_path / "served")]) == 2
    line = _one_error(capsys)
    assert f"padfree: error: {damaged}: the checkpoint's drafter has no tensor fc.weight" in line, line
    assert not (tmp_path / "served").exists()


@pytest.mark.parametrize("output", ["--export-dir", "--anchor-log"])
def test_every_output_the_run_cannot_write_is_refused_before_training(tmp_path, example, output, capsys):
    if output == "--export-dir":
        # a name the folder fits but the export's temporary folder beside it (".NAME.PID.XXXXXXXX.tmp")
        # does not: found only after training, the drafter lost, before it was probed as it is written
        path = tmp_path / ("s" * 239)
        said = f"{path}: cannot write the exported drafter (File name too long)"
    else:
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "anchors.jsonl"  # under a file: no folder can hold it
        said = f"{path}: cannot write the --anchor-log file"
    with pytest.raises(SystemExit) as info:
        example.run_example(lambda: example.main([*TINY, "--max-steps", "1", output, str(path)]))
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and said in err[0], err
    assert "run " not in captured.out and "finished at step" not in captured.out


@pytest.mark.parametrize("fails", ["weights", "rename"])
def test_a_failed_export_leaves_a_non_empty_export_folder_whole(tmp_path, ckpt, fails, monkeypatch, capsys):
    from padfree.drafter import export

    out = tmp_path / "served"
    assert cli(["export-drafter", str(ckpt), "--out", str(out)]) == 0
    before = _files(out)
    if fails == "weights":
        from safetensors import torch as st

        monkeypatch.setattr(st, "save_file", mock.Mock(side_effect=OSError(28, "No space left on device")))
    else:  # no atomic exchange, and the new folder cannot take the old one's place
        real = export.os.rename
        monkeypatch.setattr(export, "_exchange", lambda a, b: False)
        monkeypatch.setattr(
            export.os,
            "rename",
            lambda a, b: real(a, b) if Path(b) != out else (_ for _ in ()).throw(OSError(5, "I/O error")),
        )
    assert cli(["export-drafter", str(ckpt), "--out", str(out), "--dtype", "bfloat16"]) == 2
    assert f"{out}: cannot write the exported drafter" in _one_error(capsys)
    assert _files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["served"]


def test_an_export_failing_after_training_says_where_the_drafter_is(tmp_path, example, monkeypatch, capsys):
    from safetensors import torch as st

    monkeypatch.setattr(st, "save_file", mock.Mock(side_effect=OSError(28, "No space left on device")))
    run, out = tmp_path / "ckpt", tmp_path / "served"
    args = [*TINY, "--max-steps", "1", "--checkpoint-dir", str(run), "--export-dir", str(out)]
    with pytest.raises(SystemExit) as info:
        example.run_example(lambda: example.main(args))
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert f"{out}: cannot write the exported drafter (No space left on device)" in err[0], err
    assert (
        f"the trained drafter is checkpointed in {run}: export it with padfree export-drafter {run}" in err[0]
    )
    assert list(run.glob("step-*.pt")) and not out.exists()
