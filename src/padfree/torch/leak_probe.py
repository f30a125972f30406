"""Do packed documents see each other in this model? A perturbation probe, decisive in every dtype.

Change every token of the first document of a packed row and run the row again: if any logit of a *later*
document moves, something carried the first document into them (attention without boundaries, a
convolution or a recurrence over the whole row). Without a leak nothing moves at all: each later token's
computation is the same arithmetic on the same numbers, so the difference is exactly 0 in float32 and in
bfloat16 alike, where comparing a packed row with documents run alone can only be held to a tolerance (other
matmul shapes round differently) and a small leak hides under it. The one allowance is the model's own
run-to-run noise (two identical runs on a nondeterministic kernel), measured on the spot.

:func:`leaking_modules` names the modules that leak: those whose output on later documents changes while their
input there did not.

>>> from padfree.models import build_model
>>> m = build_model("tiny-llama", attn_implementation="padfree_varlen", vocab_size=64, num_hidden_layers=1)
>>> probe_leak(m).leaked
False
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from padfree.errors import ConfigError

PROBE_DOCS = (7, 12, 5, 9)
GROUPING_NOISE = 2e-6


@dataclass(frozen=True)
class Probe:
    """What :func:`probe_leak` measured: the largest change of a later document's logit when the first
    document changes (``diff``), the run-to-run noise of two identical runs (``noise``), the largest logit
    (``scale``) and the row. A leak is a change above 4x the noise and, for mixture-of-experts models only,
    above ``grouping`` of the logits' scale: their layers batch each expert's tokens together, so a token's
    matmul is grouped with other rows when the first document routes elsewhere (measured up to 3e-7 of the
    scale on CPU float32, :data:`GROUPING_NOISE`; two roundings in half precision). Dense models get no
    allowance beyond their run-to-run noise: 0 on CPU, in every dtype."""

    diff: float
    noise: float
    scale: float
    doc_lengths: tuple[int, ...]
    grouping: float = 0.0

    @property
    def allowance(self) -> float:
        return max(4 * self.noise, self.grouping * self.scale)

    @property
    def leaked(self) -> bool:
        return not self.diff <= self.allowance


def packed_inputs(
    docs: Sequence[torch.Tensor], device: torch.device | str = "cpu", seq_idx: bool = True
) -> dict[str, Any]:
    """PackCollator's layout for a row of ``docs`` (1-D id tensors): ids, restarting ``position_ids``,
    ``cu_seq_lens_*``, ``max_length_*`` and (``seq_idx``) the per-token document index."""
    from padfree.torch._collate import packed_layout

    layout = packed_layout([int(d.numel()) for d in docs])
    row = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in layout.items()}
    if not seq_idx:
        row.pop("seq_idx")
    return {"input_ids": torch.cat(list(docs))[None].to(device), **row}


def vocab_of(model: torch.nn.Module) -> int:
    cfg: Any = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(getattr(text, "vocab_size", None) or getattr(cfg, "vocab_size", 0) or 2)


def probe_docs(
    vocab: int, doc_lengths: Sequence[int] = PROBE_DOCS, seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The probe's documents and the same with the first document's every token changed."""
    gen = torch.Generator().manual_seed(seed)
    hi = max(2, min(vocab, 1 << 20))
    docs = [torch.randint(0, hi, (n,), generator=gen) for n in doc_lengths]
    changed = [(docs[0] + 1 + torch.randint(0, hi - 1, docs[0].shape, generator=gen)) % hi, *docs[1:]]
    return docs, changed


@contextlib.contextmanager
def _eval(model: torch.nn.Module) -> Iterator[None]:
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def _logits(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    out = model(**inputs, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[0].float()


def probe_leak(
    model: torch.nn.Module,
    doc_lengths: Sequence[int] = PROBE_DOCS,
    seed: int = 0,
    autocast: torch.dtype | None = None,
    seq_idx: bool = True,
) -> Probe:
    """Run the probe row on ``model`` (eval mode, no gradients; the mode is restored) on its device."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    docs, changed = probe_docs(vocab_of(model), doc_lengths, seed)
    cast = torch.autocast(device_type=device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    first = int(doc_lengths[0])

    with _eval(model), cast:
        a = _logits(model, packed_inputs(docs, device, seq_idx))
        a2 = _logits(model, packed_inputs(docs, device, seq_idx))
        b = _logits(model, packed_inputs(changed, device, seq_idx))
    noise = (a - a2)[first:].abs().max().item()
    diff = (a - b)[first:].abs().max().item()
    compute = autocast or next((p.dtype for p in model.parameters()), torch.float32)
    grouping = 0.0
    if has_experts(model):
        grouping = GROUPING_NOISE if compute == torch.float32 else 2 * torch.finfo(compute).eps
    return Probe(
        float(diff), float(noise), float(a.abs().max().item()), tuple(int(n) for n in doc_lengths), grouping
    )


def has_experts(model: torch.nn.Module) -> bool:
    """Whether ``model`` routes tokens to experts (a module named like ``...Experts``, ``...MoE``, ``...Moe``
    or ``...Router``): the one case where a later token's arithmetic may be grouped differently."""
    marks = ("Expert", "MoE", "Moe", "Router")
    return any(any(m in type(mod).__name__ for m in marks) for mod in model.modules())


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for v in (kwargs.get("hidden_states"), kwargs.get("hidden"), *args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    return None


def leaking_modules(
    model: torch.nn.Module, doc_lengths: Sequence[int] = PROBE_DOCS, seed: int = 0, seq_idx: bool = True
) -> list[str]:
    """The qualified names of the modules through which packed documents leak: a module whose hidden-state
    input ``(B, T, H)`` is unchanged on the later documents while its output there changes, and none of whose
    submodules does the same. Only the first leaking layer shows per pass (after it every later input
    differs): wrap what it names, then ask again."""
    total, first = int(sum(doc_lengths)), int(doc_lengths[0])
    seen: dict[str, list[tuple[torch.Tensor | None, torch.Tensor | None]]] = {}
    names = {m: n for n, m in model.named_modules()}
    handles = []

    def hook(mod: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        x = _first_tensor(args, kwargs)
        y = (
            out
            if isinstance(out, torch.Tensor)
            else _first_tensor(tuple(out), {})
            if isinstance(out, tuple)
            else None
        )
        keep = [
            t if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] == total else None
            for t in (x, y)
        ]
        seen.setdefault(names[mod], []).append((keep[0], keep[1]))

    for mod in names:
        handles.append(mod.register_forward_hook(hook, with_kwargs=True))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    docs, changed = probe_docs(vocab_of(model), doc_lengths, seed)
    try:
        with _eval(model):
            _logits(model, packed_inputs(docs, device, seq_idx))
            _logits(model, packed_inputs(changed, device, seq_idx))
    finally:
        for h in handles:
            h.remove()
    flagged = []
    for name, calls in seen.items():
        half = len(calls) // 2
        for (x1, y1), (x2, y2) in zip(calls[:half], calls[half:], strict=True):
            if x1 is None or y1 is None or x2 is None or y2 is None or x1.shape != x2.shape:
                continue
            if torch.equal(x1[:, first:], x2[:, first:]) and not torch.equal(y1[:, first:], y2[:, first:]):
                flagged.append(name)
                break
    return [n for n in flagged if not any(o != n and o.startswith(n + ".") for o in flagged)]


def require_exact_packing(model: torch.nn.Module, where: str = "packed training") -> None:
    """Refuse ``where`` on ``model`` in one line when the probe sees its packed documents leak, naming the
    family, the module and the way out (a kernel, or a padded strategy)."""
    probe = probe_leak(model)
    if not probe.leaked:
        return
    cfg: Any = getattr(model, "config", None)
    family = getattr(cfg, "model_type", type(model).__name__)
    culprits = leaking_modules(model)
    what = ", ".join(sorted({type(model.get_submodule(n)).__name__ for n in culprits})) or "an unknown module"
    where_in = f" ({culprits[0]})" if culprits else ""
    raise ConfigError(
        f"{where}: packed documents of {family} see each other through {what}{where_in} (probe difference "
        f"{probe.diff:.3g}); padfree keeps such a module per document only when it is in "
        "padfree.torch.mixers.MIXERS: train with --strategy bucketed (padded rows never leak) or report the "
        "family"
    )
