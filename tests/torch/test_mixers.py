"""Hybrid and recurrent families packed exactly: per-document mixers, the leak probe, the guard, the sweep."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import TrainingArguments

from padfree.checks.families import check_family, sweep
from padfree.cli import main
from padfree.core.config import PlanConfig
from padfree.errors import ConfigError
from padfree.hf import PadfreeTrainer
from padfree.models import build_model
from padfree.torch import PackCollator
from padfree.torch.documents.leak_probe import leaking_modules, probe_leak, require_exact_packing
from padfree.torch.documents.mixers import mixers_of, per_document_mixers

SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip

# the LFM2: conv, attention, conv, attention; and a Qwen3.5-style gated delta-net hybrid
HYBRIDS = {
    "lfm2": {**SMALL, "model_type": "lfm2", "num_hidden_layers": 4,
             "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "qwen3_5_text": {**SMALL, "model_type": "qwen3_5_text", "num_hidden_layers": 2, "head_dim": 8,
                     "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                     "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8},
}  # fmt: skip


@pytest.fixture(params=sorted(HYBRIDS))
def hybrid_dir(request, tmp_path):
    d = tmp_path / request.param
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HYBRIDS[request.param]))
    return d


def test_whole_row_mixers_leak_in_both_dtypes_and_per_document_is_exact(hybrid_dir, capsys) -> None:
    """Before padfree kept mixers per document (``--whole-row-mixers``) the probe sees the leak in float32
    and in bfloat16, where the packed-vs-alone tolerance alone would pass it; per document: exact."""
    for dtype in ("float32", "bfloat16"):
        code = main(["check-packing", "--model", str(hybrid_dir), "--whole-row-mixers", "--dtype", dtype])
        out, err = capsys.readouterr()
        if (
            hybrid_dir.name == "qwen3_5_text"
        ):  # transformers itself refuses packed rows through its delta rule
            assert code == 2 and err.count("\n") == 1
            assert "refuses the packed row (`chunk_gated_delta_rule` can't keep packed sequences apart" in err
        else:
            assert code == 1
            assert "LEAK: documents see each other (changing document 1 moves later documents" in out
        assert main(["check-packing", "--model", str(hybrid_dir), "--dtype", dtype]) == 0
        out = capsys.readouterr().out
        assert "run per document" in out and "probe:          changing document 1 moves later documents' " \
            "logits by 0 " in out  # fmt: skip


def test_bf16_tolerance_alone_would_have_passed_the_leak(tmp_path) -> None:
    from padfree.checks.packing import check_packing

    d = tmp_path / "lfm2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HYBRIDS["lfm2"]))
    r = check_packing(str(d), dtype="bfloat16", mixers_apart=False)
    assert r.leaked and r.probe_leaked and r.probe_allowance == 0.0
    assert r.max_logit_diff <= r.tolerance  # the old verdict (bf16 tolerance) called this OK


def _step_data():
    rng = np.random.default_rng(1)
    return [{"input_ids": rng.integers(0, SMALL["vocab_size"], n)} for n in (23, 9, 31, 14)]


def _alone_step(model, data, lr):
    """One SGD step on the token-mean loss over every document, each run alone (no packing at all)."""
    total, tokens = 0.0, 0
    model.zero_grad()
    losses = []
    for d in data:
        ids = torch.as_tensor(d["input_ids"])[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        losses.append(torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:], reduction="sum"))
        tokens += ids.shape[1] - 1
    loss = torch.stack(losses).sum() / tokens
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    total = loss.item()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, total, grads


def test_packed_step_through_padfree_trainer_equals_documents_alone(hybrid_dir, tmp_path) -> None:
    data, lr = _step_data(), 0.5
    lengths = [len(d["input_ids"]) for d in data]
    config = PlanConfig(strategy="packed", budget=sum(lengths), grad_accum=1, seed=0)
    alone = build_model(str(hybrid_dir), attn_implementation="padfree_varlen", seed=3)
    expected, expected_loss, _ = _alone_step(alone, data, lr)
    model = build_model(str(hybrid_dir), attn_implementation="padfree_varlen", seed=3)
    assert mixers_of(model)  # the hybrid's conv / delta-net layers run per document
    common = {"optim": "sgd", "learning_rate": lr, "lr_scheduler_type": "constant", "weight_decay": 0.0}
    common |= {"max_grad_norm": 0.0, "remove_unused_columns": False, "report_to": [], "logging_steps": 1}
    common |= {"save_strategy": "no", "use_cpu": True, "disable_tqdm": True, "gradient_checkpointing": True}
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, **common)
    trainer = PadfreeTrainer(model=model, args=args, train_dataset=data, lengths=lengths, plan_config=config)
    batches = list(trainer.padfree_sampler)
    assert len(batches) == 1 and len(batches[0]) == len(data)  # one packed row holds every document
    trainer.train()
    got = trainer.model.state_dict()
    for k, v in expected.items():  # float32: the packed step moved every weight as the documents alone did
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
    logged = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    assert logged == pytest.approx(expected_loss, rel=2e-4)


def test_packed_gradients_equal_alone_with_and_without_checkpointing(hybrid_dir) -> None:
    data = _step_data()
    ref_model = build_model(str(hybrid_dir), attn_implementation="padfree_varlen", seed=5)
    _, _, ref = _alone_step(ref_model, data, 0.0)
    for checkpointing in (False, True):
        model = build_model(str(hybrid_dir), attn_implementation="padfree_varlen", seed=5)
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
        batch = PackCollator()([dict(d) for d in data])
        inputs = dict(batch)
        labels = inputs.pop("labels")
        logits = model(**inputs).logits[0, :-1].float()
        target = labels[0, 1:]
        loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
        (loss / (target != -100).sum()).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-6, msg=f"{n} ({checkpointing=})")


def test_the_guard_refuses_a_leaking_setup_naming_family_and_module(tmp_path) -> None:
    lfm2 = tmp_path / "lfm2"
    lfm2.mkdir()
    (lfm2 / "config.json").write_text(json.dumps(HYBRIDS["lfm2"]))
    model = build_model(str(lfm2), attn_implementation="padfree_varlen", seed=0)
    require_exact_packing(model)  # exact: nothing raised
    with per_document_mixers(False):  # the convolutions over the whole row: found, and named
        assert probe_leak(model, seq_idx=False).leaked
        culprits = leaking_modules(model, seq_idx=False)
        kinds = {type(model.get_submodule(c)).__name__ for c in culprits}
        assert kinds == {"Lfm2ShortConv"} and culprits[0] == "model.layers.0.conv"
    leaky = build_model("tiny-llama", attn_implementation="padfree_leaky", vocab_size=64, num_hidden_layers=1)
    data = _step_data()
    args = TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=1, report_to=[], use_cpu=True,
                             remove_unused_columns=False)  # fmt: skip
    config = PlanConfig(strategy="packed", budget=128, grad_accum=1, seed=0)
    lengths = [len(d["input_ids"]) for d in data]
    match = r"packed documents of llama see each other through LlamaAttention \(model\.layers\.0\.self_attn\)"
    with pytest.raises(ConfigError, match=match + r".*--strategy bucketed"):
        PadfreeTrainer(model=leaky, args=args, train_dataset=data, lengths=lengths, plan_config=config)
    # a padded plan never leaks: the same model is accepted under bucketed
    bucketed = PlanConfig(strategy="bucketed", budget=128, grad_accum=1, seed=0)
    PadfreeTrainer(model=leaky, args=args, train_dataset=data, lengths=lengths, plan_config=bucketed)


def test_two_packed_rows_in_one_batch_stay_apart(hybrid_dir) -> None:
    """Rows of several documents each, batched (B=2): each mixer runs per document of each row."""
    model = build_model(str(hybrid_dir), attn_implementation="padfree_varlen", seed=0).eval()
    rng = np.random.default_rng(2)
    rows = [[rng.integers(0, 96, n) for n in (5, 11)], [rng.integers(0, 96, n) for n in (9, 7)]]
    ids = torch.as_tensor(np.stack([np.concatenate(r) for r in rows]))
    pos = torch.as_tensor(np.stack([np.concatenate([np.arange(len(x)) for x in r]) for r in rows]))
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        for b, r in enumerate(rows):
            start = 0
            for x in r:
                alone = model(input_ids=torch.as_tensor(x)[None], use_cache=False).logits[0]
                torch.testing.assert_close(packed[b, start : start + len(x)], alone, rtol=1e-4, atol=1e-5)
                start += len(x)


def test_family_sweep_subset() -> None:
    rows = {
        r.family: r for r in sweep(["llama", "lfm3", "mamba", "qwen3_5_text", "bloom", "gpt_oss", "bart"])
    }
    assert rows["bart"].status == "out of scope"
    for fam in ("llama", "lfm3", "mamba", "qwen3_5_text", "bloom", "gpt_oss"):
        assert rows[fam].status == "exact", rows[fam]
        assert rows[fam].probe == 0.0 and rows[fam].alone is not None and rows[fam].alone <= 1e-4
    assert rows["mamba"].mixers == ("MambaMixer",) and "per-document MambaMixer" in rows["mamba"].path
    assert rows["bloom"].mixers == ("BloomAttention",)  # ALiBi from the row's mask: run per document
    assert "sinks" in rows["gpt_oss"].path and not rows["llama"].mixers
    assert check_family("no_such_family").status == "not buildable"


def test_drafter_against_a_qwen3_5_style_target_passes_check_drafter(tmp_path, capsys) -> None:
    d = tmp_path / "qwen3_5"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**HYBRIDS["qwen3_5_text"], "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2}))  # fmt: skip
    for method in ("dflash", "eagle3"):
        assert main(["check-drafter", "--target", str(d), "--method", method, "--docs", "3",
                     "--max-tokens", "64"]) == 0  # fmt: skip
        out = capsys.readouterr().out
        assert "target probe:    changing document 1 moves later documents' logits by 0\n" in out
        assert "OK: every document trains as if it were alone" in out


def test_check_packing_families_from_the_command_line(capsys) -> None:
    # what each family's status is belongs to the installed transformers (falcon turned exact in 5.25): the
    # command must report what the sweep finds under the installed release, whatever that is; only padfree's
    # own promises are pinned (its reference family packs exactly; an encoder-decoder is out of scope)
    families = ["qwen3", "bart", "gpt_neo", "mpt"]
    expected = {r.family: r.status for r in sweep(families)}
    assert expected["qwen3"] == "exact" and expected["bart"] == "out of scope"
    assert main(["check-packing", "--families", ",".join(families), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert {r["family"]: r["status"] for r in got["families"]} == expected
    statuses = ("exact", "refused", "not buildable", "out of scope")
    assert got["summary"] == {s: sum(v == s for v in expected.values()) for s in statuses}
    for row in got["families"]:  # a refusal says why and what to do instead, whichever family it is
        if row["status"] == "refused":
            assert "not under padfree_varlen" in row["detail"] and "--strategy bucketed" in row["detail"]
    assert main(["check-packing", "--families", "no_such_family"]) == 2
    assert "no_such_family: not a causal-LM family" in capsys.readouterr().err


def test_the_fused_kernel_is_chosen_by_asking_whether_it_runs_on_the_device(monkeypatch) -> None:
    """transformers' fused kernels run a packed row whole only where its own availability checks say they are
    installed for a CUDA device and the mixer's kind hands them the boundaries; a Mamba-1 scan never does."""
    import transformers
    import transformers.utils as tu

    from padfree.torch.documents import mixers

    cfg = transformers.AutoConfig.for_model(**HYBRIDS["lfm2"])
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="padfree_varlen")
    conv = next(m for m in model.modules() if type(m).__name__ == "Lfm2ShortConv")
    scan = type("ZambaMambaMixer", (torch.nn.Module,), {})()  # a Mamba-1 selective scan: no boundaries
    assert not mixers.fused_kernel(conv, "cpu") and not mixers.fused_kernel(scan, "cpu")
    assert mixers.fused_kernel(conv, "cuda") == tu.is_causal_conv1d_available()
    for name in (
        "is_causal_conv1d_available",
        "is_mamba_2_ssm_available",
        "is_flash_linear_attention_available",
    ):
        monkeypatch.setattr(tu, name, lambda: True)
    assert mixers.fused_kernel(conv, "cuda") and not mixers.fused_kernel(conv, "cpu")
    assert not mixers.fused_kernel(scan, "cuda")
    with pytest.raises(TypeError):
        mixers.KERNELS["Mamba selective scan"] = ("mamba_ssm",)  # type: ignore[index]
    assert not hasattr(mixers, "KERNEL_PATH")  # no state filled in from refusals
