"""``--device`` names a device this machine lacks (``cuda`` without one, ``cuda:5`` beside one GPU), one torch
does not know (``gpu``) or one padfree does not run on (``meta``): every command and example that takes it
says so in one line, exit 2, before any work."""

from unittest import mock

import pytest

from padfree.cli import main as cli

NO_GPU = {"is_available": False, "device_count": 0}
ONE_GPU = {"is_available": True, "device_count": 1}
CASES = [
    ("cuda", NO_GPU, "--device cuda: no CUDA device on this machine"),
    ("cuda:5", NO_GPU, "--device cuda:5: no CUDA device on this machine"),
    ("cuda:5", ONE_GPU, "--device cuda:5: this machine has 1 CUDA device(s), cuda:0 to cuda:0"),
    ("gpu", NO_GPU, "--device 'gpu': not a device name (cpu, cuda or cuda:N)"),
    ("meta", NO_GPU, "--device meta: padfree runs on cpu or cuda, not on meta devices"),
]


def _machine(gpus: dict):
    return mock.patch.multiple(
        "torch.cuda", is_available=mock.Mock(return_value=gpus["is_available"]),
        device_count=mock.Mock(return_value=gpus["device_count"]),
    )  # fmt: skip


@pytest.mark.parametrize("command", [["check-packing"], ["calibrate", "--quick"], ["bench"]])
@pytest.mark.parametrize(("device", "gpus", "said"), CASES)
def test_a_command_refuses_a_device_it_cannot_use(command, device, gpus, said, capsys):
    with _machine(gpus):
        assert cli([*command, "--device", device]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0] and "unexpected" not in err[0], err


@pytest.mark.parametrize(("device", "gpus", "said"), CASES)
def test_the_drafter_example_refuses_a_device_it_cannot_use(tmp_path, example, device, gpus, said, capsys):
    args = ["--max-steps", "1", "--limit-samples", "4", "--checkpoint-dir", str(tmp_path / "ckpt")]
    with _machine(gpus), pytest.raises(SystemExit) as info:
        example.run_example(lambda: example.main([*args, "--device", device]))
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and said in err[0], err
    assert not list((tmp_path / "ckpt").glob("step-*.pt"))
