"""Mixed precision and the GPU attention path, checked on the CPU: bf16 autocast training steps, the attention
path each strategy records, check-packing's bf16 tolerance, and how torch's ``varlen_attn`` is called (its
keywords differ between torch releases) or skipped, with the reason, when it cannot run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import TINY_MODEL

import padfree.torch.documents.attention as pa
from padfree.bench.samples import random_samples
from padfree.bench.train_report import markdown
from padfree.bench.train_speed import BenchConfig, run_bench
from padfree.bench.trainer import Trainer
from padfree.cli import main
from padfree.torch.documents.boundaries import Boundaries

# ----- bench: bf16 autocast and the attention path -------------------------------------------------------


def test_bf16_bench_records_dtype_and_attention_path() -> None:
    lengths = np.random.default_rng(0).integers(2, 30, 40)
    samples = random_samples(lengths, 128, 0, "test")
    cfg = BenchConfig(budget=64, steps=2, warmup=1, model_overrides=TINY_MODEL,
                      strategies=("sorted", "packed"), threads=1, dtype="bfloat16")  # fmt: skip
    res = run_bench(samples, cfg)
    assert res["machine"]["dtype"] == "bfloat16" and "autocast" in res["machine"]["precision"]
    s, p = res["strategies"]["sorted"], res["strategies"]["packed"]
    assert s["attention_path"] == "transformers sdpa"
    assert p["attention_path"] == "per-document SDPA (CPU)"
    assert s["real_tok_per_s"] > 0 and p["real_tok_per_s"] > 0
    assert "per-document SDPA (CPU)" in markdown(res) and "autocast(bfloat16)" in markdown(res)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_step_runs_the_forward_in_its_dtype_and_keeps_float32_weights(
    packed: bool, dtype: str
) -> None:
    tr = Trainer("tiny-llama", TINY_MODEL, 0, "cpu", 1e-3, 1.0, packed, dtype=dtype)
    seen = []
    tr.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    batch = tr.collate([{"input_ids": np.arange(1, 9)}, {"input_ids": np.arange(3, 8)}])
    before = tr.model.lm_head.weight.detach().clone()
    sec, loss = tr.step(batch, batch.loss_tokens)
    assert seen == [getattr(torch, dtype)]
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())
    assert not torch.equal(before, tr.model.lm_head.weight) and np.isfinite(loss) and sec > 0
    assert tr.attention_path == ("per-document SDPA (CPU)" if packed else "transformers sdpa")
    assert tr.attention_paths == {tr.attention_path: 1}


def test_trainer_reports_every_path_when_they_differ() -> None:
    tr = Trainer("tiny-llama", TINY_MODEL, 0, "cpu", 1e-3, 1.0, True)
    tr.attention_paths = {"torch varlen_attn (GPU)": 3, "per-document SDPA (GPU; x)": 1}
    assert tr.attention_path == "torch varlen_attn (GPU) (x3); per-document SDPA (GPU; x) (x1)"
    with pytest.raises(Exception, match="dtype"):
        Trainer("tiny-llama", TINY_MODEL, 0, "cpu", 1e-3, 1.0, True, dtype="float16")


def test_bench_cli_rejects_bf16_converge(capsys) -> None:
    assert main(["bench", "--converge", "--dtype", "bfloat16"]) == 2
    assert "--converge trains in float32" in capsys.readouterr().err


# ----- check-packing in bf16 ------------------------------------------------------------------------------


def test_check_packing_bf16_passes_and_leak_still_caught(capsys) -> None:
    assert main(["check-packing", "--dtype", "bfloat16", "--json"]) == 0
    ok = json.loads(capsys.readouterr().out)
    assert ok["dtype"] == "bfloat16" and ok["tolerance"] == 5e-2 and not ok["leaked"]
    assert ok["max_logit_diff"] <= 2e-2  # vs the model's own eager attention alone: a bf16 step or two at ~2
    assert main(["check-packing", "--dtype", "bfloat16", "--attn", "leaky"]) == 1
    out = capsys.readouterr().out
    assert "LEAK" in out and "cpu, bfloat16 (autocast)" in out


# ----- torch varlen_attn: the call its signature allows, the fallback when it fails ------------------------


def _fake_2_11(
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """torch 2.11's keywords; attention done document by document (needs as many k/v heads as q heads)."""
    assert q.shape[1] == k.shape[1], "2.11 has no enable_gqa: heads must have been repeated"
    assert window_size[1] == 0
    lengths = torch.diff(cu_seq_q).tolist()
    x = [t.transpose(0, 1)[None] for t in (q, k, v)]
    window = None if window_size[0] < 0 else window_size[0] + 1
    return pa._per_document(*x, lengths, scale, 0.0, window, None)


def _fake_2_13(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False, seqused_k=None):  # fmt: skip
    raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore")


def _qkv(heads=4, kv_heads=2, lengths=(5, 9, 3)):
    g = torch.Generator().manual_seed(0)
    t = sum(lengths)
    q = torch.randn(1, heads, t, 16, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, kv_heads, t, 16, generator=g, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, list(lengths)


def _rows(lengths):
    return Boundaries(tuple(lengths), tuple(lengths), 1)


def test_varlen_call_follows_the_signature() -> None:
    assert pa.varlen_call(_fake_2_11, None, None, gqa=True) == ({"window_size": (-1, 0)}, True)
    assert pa.varlen_call(_fake_2_11, 0.5, 8, gqa=False) == ({"scale": 0.5, "window_size": (7, 0)}, False)
    assert pa.varlen_call(_fake_2_13, None, None, gqa=True) == (
        {"window_size": (-1, 0), "enable_gqa": True},
        False,
    )

    def no_window(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False):
        pass

    assert pa.varlen_call(no_window, None, None, gqa=False) == ({"is_causal": True}, False)
    assert pa.varlen_call(no_window, 0.5, None, gqa=False) is None  # no `scale` keyword


@pytest.fixture
def fake_varlen(monkeypatch):
    monkeypatch.setattr(pa, "_flash_attn_available", lambda: False)
    monkeypatch.setattr(pa, "_probed", {})

    def use(fn):
        monkeypatch.setattr(pa, "_torch_varlen", lambda: fn)

    return use


@pytest.mark.parametrize("window", [None, 4])
def test_gpu_varlen_calls_a_2_11_style_kernel_with_repeated_heads(fake_varlen, window) -> None:
    fake_varlen(_fake_2_11)
    q, k, v, lengths = _qkv()
    out, path = pa._gpu_varlen(q, k, v, _rows(lengths), None, 0.0, window, None)
    assert path == "torch varlen_attn (GPU)"
    ref = pa._per_document(q, k, v, lengths, None, 0.0, window, None)
    torch.testing.assert_close(out, ref)


def test_gpu_varlen_falls_back_with_the_reason_when_the_kernel_fails(fake_varlen) -> None:
    fake_varlen(_fake_2_13)
    q, k, v, lengths = _qkv()
    out, why = pa._gpu_varlen(q, k, v, _rows(lengths), None, 0.0, None, None)
    assert out is None
    assert (
        why == "torch varlen_attn unusable: RuntimeError: FlashAttention only supports Ampere GPUs or newer."
    )
    assert len(pa._probed) == 1  # probed once, remembered
    assert pa._gpu_varlen(q, k, v, _rows(lengths), None, 0.0, None, None) == (None, why)
    assert pa._gpu_varlen(q.float(), k.float(), v.float(), _rows(lengths), None, 0.0, None, None)[1] == (
        "fused varlen kernels need fp16/bf16, q is float32"
    )


def test_gpu_varlen_with_this_torch_never_raises(monkeypatch) -> None:
    monkeypatch.setattr(pa, "_flash_attn_available", lambda: False)
    monkeypatch.setattr(pa, "_probed", {})
    q, k, v, lengths = _qkv()
    out, path = pa._gpu_varlen(q, k, v, _rows(lengths), None, 0.0, None, None)  # CPU tensors: no flash kernel
    if out is None:
        assert path.startswith(("torch varlen_attn", "torch has no"))
    else:
        torch.testing.assert_close(out, pa._per_document(q, k, v, lengths, None, 0.0, None, None))


def test_autocast_hands_the_kernel_one_low_precision_dtype(monkeypatch) -> None:
    # rotary embeddings return float32 q/k next to a bf16 v under autocast; a fused kernel needs all bf16
    from padfree.checks.packing import check_packing

    seen = []
    kernel = pa._per_document

    def spy(q, k, v, *args):
        seen.append((q.dtype, k.dtype, v.dtype))
        return kernel(q, k, v, *args)

    monkeypatch.setattr(pa, "_per_document", spy)
    check_packing("tiny-llama", dtype="bfloat16", overrides=TINY_MODEL)
    assert seen and set(seen) == {(torch.bfloat16,) * 3}
    seen.clear()
    check_packing("tiny-llama", dtype="float32", overrides=TINY_MODEL)
    assert set(seen) == {(torch.float32,) * 3}
