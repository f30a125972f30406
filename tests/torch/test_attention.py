"""padfree_varlen: packed rows give the per-document losses and gradients; padded batches equal sdpa."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import GQA_MODEL

import padfree.torch.documents.attention as pa
from padfree.errors import ConfigError
from padfree.models import build_model

SMALL = GQA_MODEL
LENGTHS = (9, 17, 3, 26, 1, 12)


def small(family: str, attn: str = pa.NAME, **extra) -> torch.nn.Module:
    fields = {**SMALL, **({"head_dim": 16} if family == "tiny-gemma" else {}), **extra}
    return build_model(family, attn_implementation=attn, **fields).double()


def docs(lengths=LENGTHS, vocab: int = 128, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def pack(parts: list[torch.Tensor], flash_kwargs: bool = True) -> dict:
    """The PackCollator layout."""
    lengths = [len(d) for d in parts]
    cu = torch.zeros(len(parts) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    ids = torch.cat(parts)[None]
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100
    batch = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
    }
    if flash_kwargs:
        batch |= {
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max(lengths),
            "max_length_k": max(lengths),
        }
    return batch


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over tokens, in float64 (transformers' own loss upcasts to float32)."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma"])
@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_packed_loss_and_gradients_equal_per_document(family: str, flash_kwargs: bool) -> None:
    model = small(family)
    parts = docs()
    # summed token losses: a packed row of N predicted tokens vs each document alone
    batch = pack(parts, flash_kwargs)
    out = model(**batch)
    assert pa.last_path() == "per-document SDPA (CPU)"
    packed_sum = summed_loss(out.logits, batch["labels"])
    n_pred = sum(len(d) - 1 for d in parts)
    assert out.loss.item() == pytest.approx(packed_sum.item() / n_pred, rel=1e-6)  # the model's own loss
    packed_sum.backward()
    g_packed = grads(model)
    total = sum(summed_loss(model(input_ids=d[None]).logits, d[None]) for d in parts)
    total.backward()
    g_docs = grads(model)
    assert packed_sum.item() == pytest.approx(total.item(), rel=1e-12)
    assert g_packed.keys() == g_docs.keys() and len(g_docs) > 10
    worst = max((g_packed[n] - g_docs[n]).abs().max().item() for n in g_docs)
    # Gemma's RMSNorm computes in float32 even in a float64 model: float32-level agreement there
    assert worst < (1e-5 if family == "tiny-gemma" else 1e-10)


def test_dense_sdpa_agrees_but_leaky_attention_does_not() -> None:
    parts = docs()
    batch = pack(parts)
    ref = small("tiny-llama", "sdpa")(**batch).logits  # transformers' dense block-diagonal mask
    ours = small("tiny-llama")(**batch).logits
    leaky = small("tiny-llama", pa.LEAKY)(**batch).logits
    assert (ours - ref).abs().max().item() < 1e-10
    later = slice(len(parts[0]), None)  # the first document has nothing before it to leak from
    assert (leaky[0, later] - ref[0, later]).abs().max().item() > 1e-3


def test_padded_batch_through_varlen_equals_sdpa() -> None:
    parts = docs(seed=1)
    width = max(len(d) for d in parts)
    ids = torch.zeros(len(parts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(parts):
        ids[i, : len(d)] = d
        mask[i, : len(d)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    out = {}
    for attn in ("sdpa", pa.NAME):
        model = small("tiny-qwen2", attn)
        res = model(input_ids=ids, attention_mask=mask, labels=labels)
        res.loss.backward()
        out[attn] = (res.logits * mask[..., None], res.loss, grads(model))
    assert pa.last_path() == "sdpa (padded batch or cached decoding)"
    assert torch.equal(out["sdpa"][0], out[pa.NAME][0])
    assert out["sdpa"][1].item() == out[pa.NAME][1].item()
    assert all(torch.equal(out["sdpa"][2][n], g) for n, g in out[pa.NAME][2].items())


def test_sliding_window_is_honoured_per_document() -> None:
    parts = docs((30, 5, 22))
    model = small("tiny-mistral", sliding_window=4)
    packed = model(**pack(parts)).logits[0]
    alone = torch.cat([model(input_ids=d[None]).logits[0] for d in parts])
    assert (packed - alone).abs().max().item() < 1e-10
    model.set_attn_implementation("sdpa")  # transformers' own sliding-window mask
    ref = model(input_ids=parts[0][None]).logits[0]
    assert (ref - alone[:30]).abs().max().item() < 1e-10
    full = small("tiny-mistral", sliding_window=None)(input_ids=parts[0][None]).logits[0]
    assert (full[4:] - ref[4:]).abs().max().item() > 1e-4  # the window does change the result


def test_softcapping_and_scaling_are_honoured() -> None:
    cfg = transformers.Gemma2Config(
        **SMALL, head_dim=16, query_pre_attn_scalar=10, attn_logit_softcapping=0.05, sliding_window=8
    )
    cfg.use_cache = False
    parts = docs((14, 6, 20))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=pa.NAME).double()
    packed = model(**pack(parts)).logits[0]
    assert pa.last_path() == "per-document eager soft-capped (CPU)"
    alone = torch.cat([model(input_ids=d[None]).logits[0] for d in parts])
    model.set_attn_implementation("eager")
    eager = torch.cat([model(input_ids=d[None]).logits[0] for d in parts])
    assert (packed - alone).abs().max().item() < 1e-10
    assert (alone - eager).abs().max().item() < 1e-10


def test_several_packed_rows_in_one_batch() -> None:
    a, b = docs((5, 11, 8)), docs((4, 20), seed=3)
    rows = [pack(a), pack(b)]
    batch = {k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "position_ids")}
    model = small("tiny-llama")
    out = model(**batch).logits
    alone = torch.cat([model(input_ids=d[None]).logits[0] for d in a + b])
    assert (out.reshape(-1, out.shape[-1]) - alone).abs().max().item() < 1e-10


def test_use_cache_pitfall_is_guarded() -> None:
    parts = docs()
    batch = pack(parts)
    sdpa = small("tiny-llama", "sdpa")
    ref = sdpa(**batch).logits
    leaked = sdpa(**batch, use_cache=True).logits  # transformers skips packing detection with a cache
    assert (leaked - ref).abs().max().item() > 1e-3
    ours = small("tiny-llama")
    assert (ours(**batch, use_cache=True).logits - ref).abs().max().item() < 1e-10
    sdpa.config.use_cache = True
    pa.prepare_for_packing(sdpa)
    assert sdpa.config.use_cache is False and sdpa.config._attn_implementation == pa.NAME
    assert (sdpa(**batch).logits - ref).abs().max().item() < 1e-10


def test_boundaries() -> None:
    from padfree.torch.documents.boundaries import lengths_from_cu, lengths_from_position_ids

    assert lengths_from_cu(torch.tensor([0, 4, 5, 12], dtype=torch.int32)) == [4, 1, 7]
    pos = torch.tensor([[0, 1, 2, 3, 0, 0, 1, 2, 0, 1, 2, 3]])
    assert lengths_from_position_ids(pos) == [4, 1, 3, 4]
    assert lengths_from_position_ids(torch.arange(6).reshape(2, 3)) == [3, 3]  # a row start is a boundary
    assert pa.attn_for("packed") == "padfree_varlen"
    assert {pa.attn_for(s) for s in ("sorted", "random", "bucketed")} == {"sdpa"}


def test_inconsistent_boundaries_are_refused() -> None:
    batch = pack(docs())
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 5, 30], dtype=torch.int32)
    with pytest.raises(ConfigError, match="cover 30 tokens"):
        small("tiny-llama")(**batch)


def test_register_is_idempotent_and_no_dense_mask_is_built() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    pa.register()
    pa.register()
    assert AttentionInterface._global_mapping[pa.NAME] is pa.varlen_attention_forward
    assert AttentionMaskInterface._global_mapping[pa.NAME] is pa.varlen_mask
    cfg = small("tiny-llama").config  # a model padfree saw built: its layers keep causality themselves
    assert pa.varlen_mask(batch_size=1, q_length=50, kv_length=50, attention_mask=None, config=cfg) is None
    padded = pa.varlen_mask(
        batch_size=2,
        q_length=4,
        kv_length=4,
        attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool(),
        config=cfg,
    )
    assert padded.shape == (2, 1, 4, 4) and not padded[0, 0, 3, 3] and padded[1, 0, 3, 3]


_IMPORT_ALONE = """
import torch, transformers
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

def build(attn="sdpa"):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    ids, pos = torch.arange(12)[None] % 64, torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    marks = sorted({k for m in model.modules() for k in vars(m) if k.startswith("_padfree")})
    return logits, hooks, marks, model.config._attn_implementation

dispatch = lambda: (ALL_ATTENTION_FUNCTIONS["sdpa"], ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
before, sdpa = build(), dispatch()
import padfree.torch.documents.attention
after = build()
assert torch.equal(before[0], after[0]), "logits changed"
assert before[1:] == after[1:] == (0, [], "sdpa"), (before[1:], after[1:])
assert dispatch() == sdpa, "sdpa dispatch changed"
packed = build("padfree_varlen")  # a model naming padfree_varlen gets what prepare_for_packing states
assert packed[1] > 0 and "_padfree_rows" in packed[2] and "_padfree_apart" in packed[2], packed[1:]
print("unchanged")
"""


def test_importing_attention_leaves_a_model_of_another_attention_as_it_is() -> None:
    """In a fresh process: a model built with ``sdpa`` after ``import padfree.torch.documents.attention`` has
    no hook,
    no padfree attribute, the same attention and mask functions and the same logits as one built before it;
    a model built with ``padfree_varlen`` is watched and kept apart."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(pa.__file__).parents[3]), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _IMPORT_ALONE], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "unchanged", run.stderr[-2000:]
