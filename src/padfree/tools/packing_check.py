"""Does packing leak? Run a packed row of several documents and each document alone, compare the logits.

Packed training is only correct when every document of a row attends to itself alone. A wrong attention
implementation, or ``use_cache=True`` under ``sdpa``/``eager`` (transformers then skips packed-sequence
detection), lets documents see each other while the loss still goes down. This check catches that:

>>> from padfree.tools.packing_check import check_packing
>>> r = check_packing("tiny-llama", "padfree_varlen", overrides={"vocab_size": 64, "num_hidden_layers": 1})
>>> r.leaked, r.path
(False, 'per-document SDPA (CPU)')
>>> check_packing("tiny-llama", "leaky", overrides={"vocab_size": 64, "num_hidden_layers": 1}).leaked
True
"""

from __future__ import annotations

from dataclasses import dataclass

from padfree.errors import ConfigError

DOC_LENGTHS = (23, 41, 7, 64, 18)
DTYPES = ("float32", "bfloat16")
# The largest logit difference taken as numerical noise, per compute dtype. float32: packed and alone agree
# to ~1e-6. bfloat16 (autocast): a packed row and a document alone run matmuls of different shapes, so their
# bf16 roundings differ. Measured on CPU (torch 2.13, seeds 0-2, the four tiny families): correct
# attention (padfree_varlen, sdpa) <= 7.9e-3 (one bf16 step at logits of ~2), the leaky control >= 0.78.
# 5e-2 sits 6x above that noise and 15x below the smallest leak.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
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
            has nothing before it to leak from, included).
        max_logit_diff_later: the same over documents 2.. only.
        tolerance: the largest difference still counted as numerical noise.
        device, dtype: where the model ran, and its compute dtype (``bfloat16``: float32 weights under
            ``torch.autocast``).
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

    @property
    def leaked(self) -> bool:
        return not self.max_logit_diff <= self.tolerance


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
) -> PackingCheck:
    """Build ``model`` (a built-in tiny family or a local config directory; random weights, float32) with
    attention ``attn`` (any registered implementation, or ``leaky``: document-blind causal attention, for
    testing), run the packed row (PackCollator layout: restarting ``position_ids`` and ``cu_seq_lens_*``) and
    each document alone, and report the largest logit difference.

    ``dtype="bfloat16"`` runs both under ``torch.autocast`` (float32 weights), which on a GPU lets packed rows
    reach a fused varlen kernel; ``tolerance`` defaults to :data:`TOLERANCE` of the dtype."""
    import contextlib

    import torch

    import padfree.torch.attention as pa
    from padfree.models import build_model

    if not doc_lengths or min(doc_lengths) < 1:
        raise ConfigError(f"check-packing: document lengths must be >= 1 (got {list(doc_lengths)})")
    if dtype not in DTYPES:
        raise ConfigError(f"check-packing: dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"check-packing: --device {device}: no CUDA device here")
    tolerance = TOLERANCE[dtype] if tolerance is None else tolerance
    impl = ALIASES.get(attn, attn)
    try:
        net = build_model(
            model, attn_implementation=impl, seed=seed, max_params=MAX_PARAMS, **(overrides or {})
        )
    except (ValueError, KeyError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"check-packing: cannot build {model} with attention {attn!r}: {exc}") from exc
    try:
        net = net.to(device)
    except (RuntimeError, AssertionError) as exc:  # an unknown device name
        raise ConfigError(f"check-packing: cannot use device {device!r}: {exc}") from exc
    net.eval()
    vocab = net.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=gen).to(device) for n in doc_lengths]
    cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
    cu[1:] = torch.as_tensor(doc_lengths).cumsum(0)
    packed = {
        "input_ids": torch.cat(docs)[None],
        "position_ids": torch.cat([torch.arange(n) for n in doc_lengths])[None].to(device),
        "cu_seq_lens_q": cu.to(device),
        "cu_seq_lens_k": cu.to(device),
        "max_length_q": max(doc_lengths),
        "max_length_k": max(doc_lengths),
    }
    kind = "cuda" if device.startswith("cuda") else "cpu"
    cast = (
        torch.autocast(device_type=kind, dtype=torch.bfloat16)
        if dtype == "bfloat16"
        else contextlib.nullcontext()
    )
    pa.reset_path()
    with torch.no_grad(), cast:
        logits = net(**packed, use_cache=use_cache).logits[0].float()
        path = pa.last_path() or f"transformers {impl}"
        alone = [net(input_ids=d[None], use_cache=use_cache).logits[0].float() for d in docs]
    diffs = [(p - a).abs().max().item() for p, a in zip(logits.split(list(doc_lengths)), alone, strict=True)]
    return PackingCheck(
        model=model,
        family=net.config.model_type,
        attn=attn,
        path=path,
        use_cache=use_cache,
        doc_lengths=tuple(doc_lengths),
        max_logit_diff=max(diffs),
        max_logit_diff_later=max(diffs[1:], default=0.0),
        tolerance=tolerance,
        device=device,
        dtype=dtype,
    )
