"""Does a packed row sharded over SP or CP ranks still keep its documents apart, and equal the unsharded row?

The check behind ``padfree check-packing --sp N`` / ``--cp N``: a packed row of several documents of odd
lengths is laid out for sharding (:class:`~padfree.torch.PackCollator` with ``sp``/``cp``), run whole under
``padfree_varlen`` (the reference: logits and the parameter gradients of the row's token loss), then on
``N`` CPU ranks (forked processes meeting through gloo) each running its shard as training does
(:class:`padfree.torch.StepRunner`): Ulysses SP (:mod:`padfree.torch.execution.sequence_parallel`) or zigzag
CP (:mod:`padfree.torch.execution.context_parallel`). The shards'
logits, put back in row order, and their summed parameter gradients must equal the unsharded row's, and each
document's logits those of the document alone through the model's own attention (eager, else sdpa).
``attn="leaky"`` runs the leaky control (CP: one causal mask over the whole row, as accelerate's CP
hook does; SP: causal attention over the whole row after the all-to-all), which the check must report as a
leak.
"""

from __future__ import annotations

import datetime
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from padfree.errors import ConfigError

DOC_LENGTHS = (23, 41, 7, 18)
TOLERANCE = 1e-5
"""float32: sharded and unsharded agree to ~1e-7 on the tiny models (summation order); a leak moves logits
by > 1e-2."""


@dataclass(frozen=True)
class ShardedCheck:
    """What :func:`check_sharded` measured.

    Attributes:
        model, family: the model asked for and its ``model_type``; mode: ``"sp"`` or ``"cp"``; degree: the
            ranks the row was sharded over; attn: ``padfree`` or ``leaky``; impl: the attention that ran.
        doc_lengths: the documents; row_tokens: the padded row's length.
        logit_diff: max |sharded - unsharded| over the row's real tokens; grad_diff: max |summed shard
            gradient - unsharded gradient| over every parameter; alone_diff: max |sharded - the document run
            alone| over every real token; tolerance: the noise allowed to each.
    """

    model: str
    family: str
    mode: str
    degree: int
    attn: str
    impl: str
    doc_lengths: tuple[int, ...]
    row_tokens: int
    logit_diff: float
    grad_diff: float
    alone_diff: float
    tolerance: float = TOLERANCE

    @property
    def leaked(self) -> bool:
        return not self.alone_diff <= self.tolerance

    @property
    def exact(self) -> bool:
        return self.logit_diff <= self.tolerance and self.grad_diff <= self.tolerance and not self.leaked


def _names(mode: str, attn: str) -> str:
    from padfree.torch.execution import context_parallel as cpm
    from padfree.torch.execution import sequence_parallel as spm

    leaky = attn in ("leaky", "padfree_leaky")
    if not leaky and attn not in ("padfree", "padfree_varlen"):
        raise ConfigError(f"check-packing --{mode}: --attn must be padfree_varlen or leaky (got {attn!r})")
    if mode == "sp":
        return spm.LEAKY if leaky else spm.NAME
    return cpm.LEAKY if leaky else cpm.NAME


def check_sharded(
    model: str = "tiny-llama",
    *,
    sp: int = 1,
    cp: int = 1,
    attn: str = "padfree_varlen",
    doc_lengths: tuple[int, ...] = DOC_LENGTHS,
    seed: int = 0,
    overrides: dict | None = None,
    timeout: float = 120.0,
) -> ShardedCheck:
    """Run the check (see the module doc) for ``sp`` or ``cp`` (one of them > 1, the other 1) on that many
    forked CPU ranks with gloo; ``model`` is a built-in tiny family or a config directory (random weights,
    float32, built once and inherited by the ranks)."""
    import numpy as np
    import torch

    from padfree.core.config import PlanConfig
    from padfree.models import build_model
    from padfree.testing.forkranks import launch
    from padfree.torch import PackCollator, StepRunner
    from padfree.torch.documents.attention import needs_mask
    from padfree.torch.execution import context_parallel as cpm
    from padfree.torch.execution import sequence_parallel as spm

    _check_degrees(sp, cp, doc_lengths)
    mode, degree = ("sp", sp) if sp > 1 else ("cp", cp)
    impl = _names(mode, attn)
    net = build_model(
        model, attn_implementation="padfree_varlen", seed=seed, max_params=2**26, **(overrides or {})
    )
    spm.check_shardable(net, sp, cp)  # the Trainer's refusal: a hybrid, CP's soft-capping, SP's heads
    why = needs_mask(net)
    if why is not None:
        raise ConfigError(
            f"check-packing --{mode} {degree}: {why}; padfree's sharded attention keeps documents apart "
            "with no mask: train this model unsharded or padded"
        )
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, net.config.vocab_size, (n,), generator=gen) for n in doc_lengths]
    row = PackCollator(sp=sp, cp=cp)([{"input_ids": d.numpy()} for d in docs])
    n_loss = float((row["labels"] != -100).sum())
    scratch = Path(tempfile.mkdtemp(prefix=f"padfree-{mode}-check-"))

    total = int(row["input_ids"].shape[1])
    config = PlanConfig(strategy="packed", budget=-(-total // degree), grad_accum=1, sp=sp, cp=cp)
    cu = spm.row_boundaries(row)
    real = torch.cat([torch.arange(int(cu[i]), int(cu[i]) + n) for i, n in enumerate(doc_lengths)])
    if mode == "sp":
        order = torch.arange(total)
    else:
        order = torch.from_numpy(np.concatenate([cpm.zigzag_indices(cu, r, degree) for r in range(degree)]))

    def rank_main(rank: int, world: int, store: str) -> None:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, init_method=f"file://{store}",
            timeout=datetime.timedelta(seconds=timeout),
        )  # fmt: skip
        try:
            runner = StepRunner(config, net, rank=rank, world=world, attention=impl)  # this rank's shard
            net.train()
            params = list(net.parameters())
            loss, _, outputs = runner.loss_sum(net, row)
            logits = outputs.logits
            (loss / n_loss).backward()
            # the SP/CP group's gradient: every rank's summed (what DDP/FSDP over the group's mesh does)
            grads = _flat_grads(params)
            dist.all_reduce(grads)
            pieces = [torch.empty_like(logits[0]) for _ in range(world)]
            dist.all_gather(pieces, logits.detach()[0].contiguous())
            if rank == 0:  # the unsharded reference, here: the same padded row, whole, under padfree_varlen
                sharded = torch.empty(total, logits.shape[-1])
                sharded[order] = torch.cat(pieces)
                result = _compare(net, row, docs, sharded, grads, real, n_loss)
                (scratch / "result.json").write_text(json.dumps(result))
        finally:
            dist.destroy_process_group()

    try:
        launch(rank_main, degree, scratch / "no-seen-log", run=f"{mode}-check", timeout=timeout)
        result = json.loads((scratch / "result.json").read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return ShardedCheck(
        model=model,
        family=net.config.model_type,
        mode=mode,
        degree=degree,
        attn="leaky" if impl in (spm.LEAKY, cpm.LEAKY) else "padfree",
        impl=impl,
        doc_lengths=tuple(doc_lengths),
        row_tokens=total,
        **result,
    )


def _check_degrees(sp: int, cp: int, doc_lengths: tuple[int, ...]) -> None:
    """One of ``sp`` / ``cp`` above 1 (at most 8 CPU ranks), documents of 2 tokens or more; else one line."""
    if (sp > 1) == (cp > 1) or min(sp, cp) < 1:
        raise ConfigError(
            f"check-packing: give one of --sp N or --cp N (N >= 2), not both (got sp={sp}, cp={cp})"
        )
    if max(sp, cp) > 8:
        raise ConfigError(f"check-packing: at most 8 CPU ranks (got {max(sp, cp)})")
    if not doc_lengths or min(doc_lengths) < 2:
        raise ConfigError(f"check-packing: document lengths must be >= 2 (got {list(doc_lengths)})")


def _compare(net: Any, row: dict, docs: list, sharded: Any, grads: Any, real: Any, n_loss: float) -> dict:
    """The shards' logits (``sharded``, in row order) and summed gradients against the whole row run
    unsharded under ``padfree_varlen``, and each document's logits against it alone through the model's own
    attention: the largest differences."""
    import torch

    from padfree.torch.documents.leak_probe import own
    from padfree.torch.execution import sequence_parallel as spm

    params = list(net.parameters())
    cu = spm.row_boundaries(row)
    net.zero_grad()
    net.set_attn_implementation("padfree_varlen")
    whole = {k: v for k, v in row.items() if k not in ("labels", "seq_idx")}  # as collated (THD)
    ref = net(**whole, use_cache=False).logits
    (spm.shard_loss_sum(ref, spm.shift_labels(row["labels"])) / n_loss).backward()
    want = _flat_grads(params)
    own(net)  # each document alone through the model's own attention (eager, else sdpa)
    with torch.no_grad():
        alone = [net(input_ids=d[None], use_cache=False).logits[0] for d in docs]
    starts = [int(c) for c in cu[:-1]]
    result = {
        "logit_diff": (sharded[real] - ref[0].detach()[real]).abs().max().item(),
        "grad_diff": (grads - want).abs().max().item(),
        "alone_diff": max(
            (sharded[b : b + len(a)] - a).abs().max().item() for b, a in zip(starts, alone, strict=True)
        ),
    }
    return result


def _flat_grads(params: list) -> Any:
    """Every parameter's gradient flattened into one vector (zeros where a parameter got none)."""
    import torch

    return torch.cat(
        [torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1) for p in params]
    )
