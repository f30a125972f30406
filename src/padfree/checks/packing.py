"""Does packing keep every document as the model itself would run it alone? Against the model's own attention.

Packed training is only correct when every document of a row trains exactly as that document alone through
the model. A wrong attention implementation, ``use_cache=True`` under ``sdpa``/``eager`` (transformers then
skips packed-sequence detection), a convolution / recurrence run over the whole row (hybrid models under
``sdpa``), a dropped sliding window or chunk, or attention to future tokens all let training "work" while the
loss is wrong. The reference is the model's OWN implementation: each document alone through its ``eager``
attention (``sdpa`` where a family has none), never padfree's path. Three measurements:

- packed vs alone through the model's own attention: every logit, and (float32) the parameter gradients of
  the same per-token loss (:func:`padfree.torch.documents.leak_probe.against_own_attention`);
- the leak probe (:mod:`padfree.torch.documents.leak_probe`): change the first document, no later logit may
move;
- the causality probe: change every document's last token, no earlier logit may move.

Both probes run on the packed path and are decisive in every dtype (held to the noise measured on the spot,
0 for dense models on CPU); the comparison with the model's own attention is held to a tolerance:

>>> from padfree.checks.packing import check_packing
>>> r = check_packing("tiny-llama", "padfree_varlen", overrides={"vocab_size": 64, "num_hidden_layers": 1})
>>> r.leaked, r.path, r.reference
(False, 'per-document SDPA (CPU)', 'eager')
>>> check_packing("tiny-llama", "leaky", overrides={"vocab_size": 64, "num_hidden_layers": 1}).leaked
True
"""

from __future__ import annotations

from dataclasses import dataclass

from padfree.errors import ConfigError

DOC_LENGTHS = (23, 41, 7, 64, 18)
DTYPES = ("float32", "bfloat16")
# The largest logit difference taken as numerical noise, per compute dtype. float32: packed and alone agree
# to ~1e-6; the gradients (float32 only) to a relative ~1e-6 (GRAD_TOLERANCE). bfloat16 (autocast): a
# packed row and a document alone run matmuls of different shapes, so their
# bf16 roundings differ. Measured on CPU (torch 2.13, seeds 0-2, the four tiny families): correct
# attention (padfree_varlen, sdpa) <= 7.9e-3 (one bf16 step at logits of ~2), the leaky control >= 0.78.
# 5e-2 sits 6x above that noise and 15x below the smallest leak.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
GRAD_TOLERANCE = 1e-4
ALIASES = {"leaky": "padfree_leaky", "varlen": "padfree_varlen"}


@dataclass(frozen=True)
class PackingCheck:
    """What :func:`check_packing` measured.

    Attributes:
        model: the model name or directory; family: the config's ``model_type``.
        attn: the attention implementation asked for; path: the kernel that actually ran.
        use_cache: whether the forward passes ran with ``use_cache=True``.
        doc_lengths: the documents of the packed row.
        max_logit_diff: max |packed - alone| over every logit of every document (the first document, which
            has nothing before it to leak from, included), alone through the model's own attention.
        max_logit_diff_later: the same over documents 2.. only.
        reference: the model's own attention the documents ran alone through (``eager``, else ``sdpa``).
        grad_diff: relative L2 difference of the parameter gradients, packed vs the documents alone (float32
            only; ``None`` in bfloat16), held to :data:`GRAD_TOLERANCE`.
        causal_diff: the largest change of an earlier logit when every document's last token changes.
        tolerance: the largest packed-vs-alone difference still counted as numerical noise.
        probe_diff: the largest change of a later document's logit when the first document changes;
        probe_allowance: the run-to-run / expert-grouping noise it is held to (0 for dense models on CPU).
        probe_leaked, sees_future: the probe's verdicts (:class:`padfree.torch.documents.leak_probe.Probe`):
            ``probe_diff`` or ``causal_diff`` above the allowance.
        mixers: the token mixers padfree ran per document (class names).
        device, dtype: where the model ran, and its compute dtype (``bfloat16``: float32 weights under
            ``torch.autocast``).
        weights: ``saved`` (a folder's weights, loaded with ``from_pretrained`` as a user loads it) or
            ``random`` (built from the config).
    """

    model: str
    family: str
    attn: str
    path: str
    use_cache: bool
    doc_lengths: tuple[int, ...]
    max_logit_diff: float
    max_logit_diff_later: float
    tolerance: float
    device: str = "cpu"
    dtype: str = "float32"
    probe_diff: float = 0.0
    probe_allowance: float = 0.0
    mixers: tuple[str, ...] = ()
    weights: str = "random"
    reference: str = "eager"
    grad_diff: float | None = None
    causal_diff: float = 0.0
    probe_leaked: bool = False
    sees_future: bool = False

    @property
    def differs(self) -> bool:
        """Packed differs from the documents alone through the model's own attention."""
        grads = self.grad_diff is not None and not self.grad_diff <= GRAD_TOLERANCE
        return grads or not self.max_logit_diff <= self.tolerance

    @property
    def leaked(self) -> bool:
        return self.probe_leaked or self.sees_future or self.differs


MAX_PARAMS = 2**30
"""The largest model check-packing builds (random float32 weights on this machine: 4 GiB)."""


def check_packing(
    model: str = "tiny-llama",
    attn: str = "padfree_varlen",
    *,
    use_cache: bool = False,
    doc_lengths: tuple[int, ...] = DOC_LENGTHS,
    tolerance: float | None = None,
    seed: int = 0,
    overrides: dict | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    mixers_apart: bool = True,
) -> PackingCheck:
    """Load ``model`` (a built-in tiny family or a local directory: its saved weights through
    ``from_pretrained`` when it has them, as a user loads it, else random weights from its config; float32)
    with attention ``attn`` (any registered implementation, or ``leaky``: the leaky control, causal attention
    over the whole row, for testing), run the packed row (PackCollator layout: restarting ``position_ids`` and
    ``cu_seq_lens_*``) and each document alone through the model's own attention (eager, else sdpa), and
    report the largest logit (and, in float32, gradient) difference beside the leak and causality probes.

    ``dtype="bfloat16"`` runs both under ``torch.autocast`` (float32 weights), which on a GPU lets packed rows
    reach a fused varlen kernel; ``tolerance`` defaults to :data:`TOLERANCE` of the dtype.
    ``mixers_apart=False`` runs the model's convolutions and recurrences over the whole row, as padfree did
    before :mod:`padfree.torch.documents.mixers` (to see the leak that module closes)."""
    import torch

    import padfree.torch.documents.attention as pa
    from padfree.models import family_of, load_model, loads_saved, packing_refusal
    from padfree.torch.documents.leak_probe import against_own_attention, probe_leak
    from padfree.torch.documents.mixers import mixers_of, per_document_mixers

    if not doc_lengths or min(doc_lengths) < 1:
        raise ConfigError(f"check-packing: document lengths must be >= 1 (got {list(doc_lengths)})")
    if dtype not in DTYPES:
        raise ConfigError(f"check-packing: dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"check-packing: --device {device}: no CUDA device here")
    tolerance = TOLERANCE[dtype] if tolerance is None else tolerance
    impl = ALIASES.get(attn, attn)
    where = f"check-packing --model {model}"
    try:
        net = load_model(model, impl, seed, MAX_PARAMS, where=where, **(overrides or {}))
    except (ValueError, KeyError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"check-packing: cannot build {model} with attention {attn!r}: {exc}") from exc
    weights = "saved" if loads_saved(model, overrides or {}) else "random"
    try:
        net = net.to(device)
    except (RuntimeError, AssertionError) as exc:  # an unknown device name
        raise ConfigError(f"check-packing: cannot use device {device!r}: {exc}") from exc
    net.eval()
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    pa.reset_path()
    try:
        with per_document_mixers(mixers_apart):
            ref = against_own_attention(
                net,
                doc_lengths,
                seed,
                grads=autocast is None,
                autocast=autocast,
                use_cache=use_cache,
                seq_idx=mixers_apart,
            )
            path = pa.last_path() or f"transformers {impl}"
            probe = probe_leak(net, doc_lengths, seed, autocast=autocast, seq_idx=mixers_apart)
    except ConfigError:
        raise
    except Exception as exc:  # the family's own code fails on a packed row: the entry points' one sentence
        if mixers_apart:
            raise packing_refusal(where, family_of(model), exc, impl) from None
        text = " ".join(str(exc).split())[:240] or type(exc).__name__  # the whole-row layout, on request
        raise ConfigError(f"check-packing: {model} refuses the packed row ({text})") from None
    mixers = tuple(sorted({type(net.get_submodule(q)).__name__ for q in mixers_of(net)}))
    return PackingCheck(
        model=model,
        family=net.config.model_type,
        attn=attn,
        path=path,
        use_cache=use_cache,
        doc_lengths=tuple(doc_lengths),
        max_logit_diff=ref.logits,
        max_logit_diff_later=ref.logits_later,
        tolerance=tolerance,
        device=device,
        dtype=dtype,
        probe_diff=probe.diff,
        probe_allowance=probe.allowance,
        mixers=mixers,
        weights=weights,
        reference=ref.attn,
        grad_diff=ref.grads,
        causal_diff=probe.causal,
        probe_leaked=probe.leaked,
        sees_future=probe.sees_future,
    )
