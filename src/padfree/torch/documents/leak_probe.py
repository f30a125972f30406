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
GUARD_TOLERANCE = 1e-3
"""The guard's bound on |packed - alone through the model's own attention|, relative to the logits' scale
(float32; correct attention agrees to ~1e-6 of it)."""
NOISE_FACTOR = 4.0
"""A change counts as a leak above this many times the noise measured on the spot (see :class:`Probe`)."""


@dataclass(frozen=True)
class Probe:
    """What :func:`probe_leak` measured, all on the packed path, in the model's compute dtype.

    ``diff``: the largest change of a later document's logit when every token of the first document changes
    (a leak between documents); ``causal``: the largest change of any logit before a changed token when the
    last token of every document changes (attention to future tokens); ``noise``: the largest change of the
    same logits in a row whose input did not change at all, run beside the changed one in the same batch
    (rows of a batch never see each other; a mixture-of-experts layer groups each expert's tokens across the
    batch, so the unchanged row's arithmetic is regrouped exactly as the changed row's, with no path for
    information: the model's own noise, measured for the model at hand) or in two identical runs
    (nondeterministic kernels). Dense models: 0 on CPU, in every dtype. A leak is a change above
    :data:`NOISE_FACTOR` times that noise."""

    diff: float
    noise: float
    scale: float
    doc_lengths: tuple[int, ...]
    causal: float = 0.0

    @property
    def allowance(self) -> float:
        return NOISE_FACTOR * self.noise

    @property
    def leaked(self) -> bool:
        return not self.diff <= self.allowance

    @property
    def sees_future(self) -> bool:
        return not self.causal <= self.allowance

    @property
    def broken(self) -> bool:
        """A leak between documents or attention to future tokens."""
        return self.leaked or self.sees_future


def packed_inputs(
    docs: Sequence[torch.Tensor], device: torch.device | str = "cpu", seq_idx: bool = True
) -> dict[str, Any]:
    """PackCollator's layout for a row of ``docs`` (1-D id tensors): ids, restarting ``position_ids``,
    ``cu_seq_lens_*``, ``max_length_*`` and (``seq_idx``) the per-token document index."""
    from padfree.torch.feed.collate import packed_layout

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


def last_changed(docs: Sequence[torch.Tensor], vocab: int) -> list[torch.Tensor]:
    """``docs`` with the last token of every document changed (the causality probe's row)."""
    hi = max(2, min(vocab, 1 << 20))
    out = []
    for d in docs:
        e = d.clone()
        e[-1] = (e[-1] + 1) % hi
        out.append(e)
    return out


def batched_inputs(
    rows: Sequence[Sequence[torch.Tensor]], device: torch.device | str = "cpu"
) -> dict[str, Any]:
    """Several packed rows of the same document lengths as one batch ``(B, T)``: per-row ``position_ids`` and
    ``seq_idx``, ``cu_seq_lens_*`` over the flattened batch (what padfree's attention and mixers read)."""
    one = [packed_inputs(r, device) for r in rows]
    lengths = [int(d.numel()) for r in rows for d in r]
    from padfree.torch.feed.collate import packed_layout

    flat = packed_layout(lengths)
    out = {
        "input_ids": torch.cat([o["input_ids"] for o in one]),
        "position_ids": torch.cat([o["position_ids"] for o in one]),
        "seq_idx": torch.cat([o["seq_idx"] for o in one]),
        "cu_seq_lens_q": flat["cu_seq_lens_q"].to(device),
        "cu_seq_lens_k": flat["cu_seq_lens_k"].to(device),
        "max_length_q": flat["max_length_q"],
        "max_length_k": flat["max_length_k"],
    }
    return out


@contextlib.contextmanager
def _eval(model: torch.nn.Module) -> Iterator[None]:
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def _logits(model: torch.nn.Module, inputs: dict[str, Any], row: int | None = 0) -> torch.Tensor:
    out = model(**{"use_cache": False, **inputs})
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.float() if row is None else logits[row].float()


def probe_leak(
    model: torch.nn.Module,
    doc_lengths: Sequence[int] = PROBE_DOCS,
    seed: int = 0,
    autocast: torch.dtype | None = None,
    seq_idx: bool = True,
) -> Probe:
    """Run the probe rows on ``model`` (eval mode, no gradients; the mode is restored) on its device: the
    original row beside itself, beside its first document changed and beside every last token changed
    (batches of two rows), and the first pair again for run-to-run noise (see :class:`Probe`). A model that
    cannot take a batch of packed rows is probed one row at a time (noise: run to run only)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    vocab = vocab_of(model)
    docs, changed = probe_docs(vocab, doc_lengths, seed)
    future = last_changed(docs, vocab)
    cast = torch.autocast(device_type=device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    first = int(doc_lengths[0])
    ends = torch.tensor(doc_lengths).cumsum(0) - 1
    before = torch.ones(int(sum(doc_lengths)), dtype=torch.bool)
    before[ends] = False  # every logit but the changed tokens' own

    def row(*rows: Sequence[torch.Tensor]) -> dict[str, Any]:
        inputs = batched_inputs(rows, device) if len(rows) > 1 else packed_inputs(rows[0], device)
        if not seq_idx:
            inputs.pop("seq_idx")
        return inputs

    def largest(x: torch.Tensor) -> float:
        return float(x.abs().max().item()) if x.numel() else 0.0

    with _eval(model), cast:
        try:
            same = _logits(model, row(docs, docs), None)
            same2 = _logits(model, row(docs, docs), None)
            lead = _logits(model, row(docs, changed), None)
            late = _logits(model, row(docs, future), None)
            a, b, c = same[1], lead[1], late[1]
            noise = max(
                largest((same - same2)[:, first:]),
                largest((lead[0] - same[0])[first:]),
                largest((late[0] - same[0])[before]),
            )
        except (RuntimeError, ValueError, TypeError, IndexError):  # one packed row per call only
            a = _logits(model, row(docs))
            noise = largest((a - _logits(model, row(docs)))[first:])
            b, c = _logits(model, row(changed)), _logits(model, row(future))
    return Probe(
        diff=largest((a - b)[first:]),
        noise=noise,
        scale=largest(a),
        doc_lengths=tuple(int(n) for n in doc_lengths),
        causal=largest((a - c)[before]),
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
    """Refuse ``where`` on ``model`` in one line when the probe sees its packed documents leak or attend to
    future tokens, naming the family, the module and the way out (a kernel, or a padded strategy); a float32
    model is also held to each probe document alone through its own attention (:func:`against_own_attention`,
    logits within :data:`GUARD_TOLERANCE` of their scale: a dropped window, chunk or bias is far above it)."""
    probe = probe_leak(model)
    cfg: Any = getattr(model, "config", None)
    family = getattr(cfg, "model_type", type(model).__name__)
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    if not probe.broken and dtype == torch.float32 and hasattr(model, "set_attn_implementation"):
        try:
            ref: Reference | None = against_own_attention(model, grads=False)
        except NoReference:  # nothing of the model's own to compare with: the probes decide
            ref = None
        if ref is not None and not ref.logits <= GUARD_TOLERANCE * max(1.0, probe.scale):
            raise ConfigError(
                f"{where}: packed documents of {family} differ from each document alone through its own "
                f"{ref.attn} attention by {ref.logits:.3g} (logits): padfree_varlen does not keep its "
                "attention pattern; train with --strategy bucketed or report the family"
            )
    if not probe.broken:
        return
    if not probe.leaked:
        raise ConfigError(
            f"{where}: packed documents of {family} attend to their own future tokens (changing a "
            f"document's last token moves its earlier logits by {probe.causal:.3g}, allowed "
            f"{probe.allowance:.3g}): train with --strategy bucketed or report the family"
        )
    culprits = leaking_modules(model)
    what = ", ".join(sorted({type(model.get_submodule(n)).__name__ for n in culprits})) or "an unknown module"
    where_in = f" ({culprits[0]})" if culprits else ""
    raise ConfigError(
        f"{where}: packed documents of {family} see each other through {what}{where_in} (probe difference "
        f"{probe.diff:.3g}, allowed {probe.allowance:.3g}); padfree keeps such a module per document only "
        "when it is in padfree.torch.documents.mixers.MIXERS: train with --strategy bucketed (padded rows "
        "never leak) "
        "or report the family"
    )


class NoReference(ConfigError):
    """The model cannot be switched to an attention of its own to compare with."""


@dataclass(frozen=True)
class Reference:
    """Packed through padfree against each document alone through the model's own attention (:func:`own`).

    ``logits``: max |packed - alone| over every logit of every document; ``grads``: the relative difference
    (L2 over every parameter) between the packed row's gradients and the sum of the documents' alone, for
    the same per-token loss (a fixed random weighting of the logits); ``None`` when not measured."""

    attn: str
    logits: float
    grads: float | None
    doc_lengths: tuple[int, ...]
    logits_later: float = 0.0


def own(model: torch.nn.Module, impls: Sequence[str] = ("eager", "sdpa")) -> str:
    """Switch ``model`` to its own attention implementation to compare with: the first of ``impls`` it takes
    (``eager``, else ``sdpa`` where a family has no eager path). A model whose attention is its own code (no
    attention interface; transformers then keeps the name) gets the name on its configs directly: the name
    still picks the mask it is given."""
    hf: Any = model
    for impl in impls:
        try:
            hf.set_attn_implementation(impl)
        except (ValueError, ImportError, NotImplementedError, AttributeError, TypeError):
            continue
        for mod in model.modules():
            cfg = getattr(mod, "config", None)
            if cfg is not None and getattr(cfg, "_attn_implementation", impl) != impl:
                cfg._attn_implementation = impl
        return impl
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    raise NoReference(f"{family}: the model has neither an eager nor an sdpa attention to compare with")


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().float().clone() for p in params]


def against_own_attention(
    model: torch.nn.Module,
    doc_lengths: Sequence[int] = PROBE_DOCS,
    seed: int = 0,
    grads: bool = True,
    autocast: torch.dtype | None = None,
    use_cache: bool = False,
    seq_idx: bool = True,
) -> Reference:
    """Run a packed row through ``model`` as it is configured (padfree's attention and mixers), then each
    document alone through the model's own attention (:func:`own`), and compare logits and (``grads``)
    parameter gradients. Eval mode (no dropout), the attention implementation, the mode and the gradients
    are restored."""
    hf: Any = model
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    docs, _ = probe_docs(vocab_of(model), doc_lengths, seed)
    cast = torch.autocast(device_type=device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    before = hf.config._attn_implementation
    names = {k: getattr(c, "_attn_implementation", None) for k, c in configs.items()}
    was = model.training
    params = [p for p in model.parameters() if p.requires_grad] if grads else []
    saved = [p.grad for p in params]
    model.eval()
    try:
        with torch.set_grad_enabled(grads), cast:
            for p in params:
                p.grad = None
            packed = _logits(model, {**packed_inputs(docs, device, seq_idx), "use_cache": use_cache})
            gen = torch.Generator().manual_seed(seed + 1)
            weights = torch.randn(packed.shape, generator=gen).to(device)
            if grads:
                (packed * weights).sum().backward()
            g_packed = _grads(params)
            for p in params:
                p.grad = None
            impls = ["eager", "sdpa"]
            while True:
                impl = own(model, impls)
                try:
                    alone = []
                    for d, w in zip(docs, weights.split(list(doc_lengths)), strict=True):
                        out = _logits(model, {"input_ids": d[None].to(device)})
                        if grads:
                            (out * w).sum().backward()
                        alone.append(out.detach())
                    break
                except RuntimeError:  # the family's eager path fails on this config: its sdpa one
                    impls = impls[impls.index(impl) + 1 :]
                    if not impls:
                        raise
                    for p in params:
                        p.grad = None
            g_alone = _grads(params)
    finally:
        if hf.config._attn_implementation != before:
            hf.set_attn_implementation(before)
        for k, c in configs.items():
            if names[k] is not None and c._attn_implementation != names[k]:
                c._attn_implementation = names[k]
        for p, g in zip(params, saved, strict=True):
            p.grad = g
        model.train(was)
    per_doc = [
        float((p - a).abs().max().item())
        for p, a in zip(packed.detach().split(list(doc_lengths)), alone, strict=True)
    ]
    rel = None
    if grads:
        num = sum(float((a - b).pow(2).sum().item()) for a, b in zip(g_packed, g_alone, strict=True))
        den = sum(float(b.pow(2).sum().item()) for b in g_alone)
        rel = (num / den) ** 0.5 if den > 0 else (0.0 if num == 0 else float("inf"))
    lengths = tuple(int(n) for n in doc_lengths)
    return Reference(impl, max(per_doc), rel, lengths, max(per_doc[1:], default=0.0))
