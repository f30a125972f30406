"""Train a DFlash or EAGLE-3 drafter on a frozen target, online, with a padfree plan: DDP, kill-safe.

One process:      python examples/train_drafter.py --method dflash --strategy packed --max-steps 20
Your target:      python examples/train_drafter.py --target my_model/ --data chats.jsonl --export-dir served/
Several ranks:    torchrun --nproc_per_node 2 examples/train_drafter.py --method eagle3 --grad-accum 2
Kill and resume:  add --checkpoint-dir ckpt --checkpoint-every 5, then rerun with --resume (any world size)

What it does (the data, plan, checkpoint, resume, seen-log and SIGTERM machinery is the library's, as in
``train.py``: :mod:`padfree.recipes.loop`'s ``train_loop``, ``add_run_args``; ``padfree.torch.run.loop``'s
``resume_from``):
- the target: ``--target DIR``, a local transformers causal-LM folder (config, safetensors weights,
  tokenizer: what ``save_pretrained`` writes; nothing is downloaded), loaded in ``--dtype`` on ``--device``,
  its tokenizer tokenizing the data; without it a tiny Llama with random weights, the data's token ids folded
  modulo ``--vocab-size`` (default 2048: a tiny LM head, so the example trains in minutes on a CPU). The
  drafter takes the target's sizes and fuses the target layers its recipe's rule chooses.
- tokenizes ``--data`` as ``train.py`` does (loss on assistant turns by default).
- a method with anchors (DFlash) counts each sample's anchors (:func:`padfree.core.anchors.anchor_counts`:
  the policy's quota from the loss mask alone) and gives them to :class:`padfree.torch.PlanBatchSampler`
  (``anchors=``), which keeps every micro-batch within ``--anchor-budget`` draft blocks (if set) and balances
  ranks by the method's cost model; plan config, anchors, cost, memory bound and the expected peak are one
  :func:`padfree.drafter.setup.drafter_setup`. Anchors themselves are chosen
  per document from ``(seed, epoch, sample id)`` by the collator, the same whatever the packing, rank or
  resume. Samples that keep no supervised token after ``--overlong truncate`` are counted and said.
- target and drafter come from :func:`padfree.drafter.train.build_models`; every micro-batch the frozen target
  runs forward under ``no_grad`` on the micro-batch's rows (packed rows with per-document attention), its
  chosen layers' hidden states feed the drafter (DDP), whose loss is ``KL(target || drafter)`` summed over
  supervised draft positions. The step's loss is normalized over all supervised draft positions of the step on
  all ranks (``batch.positions``, all-reduced once per step, before any forward), so the gradient is exactly
  the mean over the step's draft positions. A micro-batch with no document, no anchor or no supervised
  position trains on with a zero loss that still reaches every parameter, so the ranks' all-reduces stay in
  step (:func:`padfree.drafter.train.loss_sums`).
- ``--anchor-log FILE`` (methods with anchors): every rank appends one JSON line per trained sample and step,
  ``{"run", "epoch", "step", "rank", "index", "anchors"}``, for the kill/resume check that every sample
  trains with the same anchors (``tests/testing/test_train_drafter.py``).
- a checkpoint records the drafter's options (resuming under others is one line naming them) and what
  export needs (:func:`padfree.drafter.export.checkpoint_extra`): ``padfree export-drafter CKPT --format
  dflash|speculators --out DIR`` writes a folder a server loads; ``--export-dir DIR`` does it at the end of
  training.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from padfree.core.items import dropped_samples, overlong_line
from padfree.drafter import proc
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.export import (
    META_KEY,
    check_export_dir,
    check_exportable,
    checkpoint_extra,
    export_drafter,
    formats,
)
from padfree.drafter.methods import METHODS
from padfree.drafter.options import add_recipe_arguments, recipe_from_args
from padfree.drafter.setup import TargetShape, drafter_setup
from padfree.drafter.target import (
    DTYPES,
    check_target_folder,
    check_target_tokenizer,
    default_mask_token,
    load_target,
)
from padfree.drafter.train import build_models, loss_sums, token_counts
from padfree.errors import ConfigError, OutputError, PadfreeError
from padfree.options import (
    NUMERIC,
    Bounded,
    add_data_and_model_args,
    check_device,
    example_parser,
    plan_config,
    run_example,
    training_data,
)
from padfree.recipes.loop import add_run_args, train_loop
from padfree.torch import PlanBatchSampler, PlannedDataset, all_reduce_sum, step_loss, sync_unless
from padfree.torch.run.checkpoint import CheckpointDir
from padfree.torch.run.lifecycle import StopOnSignal, die_with_parent, launched_by_torchrun
from padfree.torch.run.loop import resume_from, run_id, setup_distributed

IDENTITY = ("method", "draft_layers", "vocab_size", "target", "mask_token_id")
"""The options a drafter checkpoint is bound to besides its recipe's fields (a resume under others is refused,
naming them)."""


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
"""Real chat, math, code and document samples and a 32K SentencePiece tokenizer, vendored in the repo."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = example_parser(__doc__)
    add_data_and_model_args(p, FIXTURES)
    add_run_args(p)
    p.add_argument("--method", default="dflash", choices=list(METHODS))
    add_recipe_arguments(p)
    p.add_argument(
        "--anchor-budget", type=NUMERIC["--anchor-budget"], default=None, help="blocks per micro-batch"
    )
    free = " and ".join(m.title for m in METHODS.values() if m.draft_layers is None)
    p.add_argument("--draft-layers", type=NUMERIC["--draft-layers"], default=1, help=f"{free} draft layers")
    p.add_argument("--anchor-log", default=None, help="append each trained sample's anchors (DFlash)")
    p.add_argument(
        "--memory-gb",
        type=Bounded(float, 0, 2**20, above=True),
        default=None,
        help="activation memory a micro-batch may take (GiB): bounds its draft blocks / attention",
    )
    p.add_argument(
        "--target",
        default=None,
        help="a local transformers causal-LM folder (config, safetensors, tokenizer); its tokenizer reads "
        "--data (default: a tiny Llama with random weights, token ids folded modulo --vocab-size)",
    )
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="the target's dtype")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: cuda if available)")
    p.add_argument(
        "--mask-token-id",
        type=NUMERIC["--seed"],
        default=None,
        help="DFlash's mask token (default: the target tokenizer's mask, pad or unknown token; 1 for the "
        "tiny target)",
    )
    p.add_argument(
        "--export-format",
        choices=list(formats()),
        default=None,
        help="--export-dir's format (default: "
        + ", ".join(f"{m.export_format} for {m.title}" for m in METHODS.values())
        + ")",
    )
    p.add_argument(
        "--export-dir",
        default=None,
        help="write the trained drafter here in a served format (a new or empty folder, or an earlier "
        "export; checked before training)",
    )
    # tiny defaults that run as they are
    p.set_defaults(vocab_size=None, tokenizer=None, budget=1024, overlong="truncate")
    args = p.parse_args(argv)
    if args.target is not None:
        if args.vocab_size is not None:
            p.error("--vocab-size folds token ids for the tiny random target; with --target the target's "
                    "tokenizer and vocabulary are used")  # fmt: skip
        if args.tokenizer is not None:
            p.error("--tokenizer: with --target the target folder's own tokenizer reads the data")
    else:
        args.vocab_size = args.vocab_size or 2048
        args.tokenizer = args.tokenizer or str(FIXTURES / "tokenizers/llama_sp32k.model")
    return args


class DraftLoss(torch.nn.Module):
    """The drafter's loss as a module's forward, so that DDP sees the forward it synchronizes."""

    def __init__(self, models) -> None:
        super().__init__()
        self.models = models
        self.drafter = models.drafter

    def forward(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_sums(self.models, batch)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if launched_by_torchrun():
        die_with_parent()
    stop = StopOnSignal()
    rank, world, device = setup_distributed()
    if args.device is not None:
        device = torch.device(check_device(args.device))
    ckpt = CheckpointDir(args.checkpoint_dir, rank, world, say=print) if args.checkpoint_dir else None
    try:
        return train(args, rank, world, device, ckpt, stop)
    except PadfreeError:
        if rank == 0:
            raise
        return 2
    finally:
        stop.restore()
        if ckpt is not None:
            ckpt.release()
        if world > 1:
            torch.distributed.destroy_process_group()


def train(args, rank, world, device, ckpt, stop) -> int:
    log = print if rank == 0 else (lambda *a, **k: None)
    run = run_id(rank, world)
    if ckpt is not None:
        ckpt.acquire(run)
    check_outputs(args)  # before any work: a bad output must not cost a finished run
    target, samples, lengths, loss_tokens = load_target_and_data(args)
    recipe = recipe_from_args(args, args.method)
    models = build_models(
        args.method, vocab=args.vocab_size, seed=args.seed, recipe=recipe, target=target,
        draft_layers=args.draft_layers, counts=token_counts(samples, args.vocab_size),
    )  # fmt: skip
    options = {k: getattr(args, k) for k in IDENTITY} | {"target": args.target or "tiny"}
    # the options that bound the plan, by their own names (not the plan fields they set)
    options |= {"--memory-gb": args.memory_gb, "--anchor-budget": args.anchor_budget}
    extra = checkpoint_extra(
        models, mask_token_id=args.mask_token_id, target_path=args.target, options=options
    )
    fmt = args.export_format or models.method.export_format
    if args.export_dir:
        check_exportable(extra[META_KEY], fmt, format_option="--export-format", verifier_option=None)
    mask = np.concatenate([np.asarray(s["loss_mask"], bool) for s in samples])
    setup = drafter_setup(
        recipe, plan_config(args), target=TargetShape.of_config(models.target.config), lengths=lengths,
        loss_mask=mask, memory_gb=args.memory_gb, anchor_budget=args.anchor_budget,
        draft_layers=args.draft_layers,
    )  # fmt: skip
    setup.check_fit(lengths)
    for line in (
        overlong_line(lengths, setup.cut, args.overlong, setup.limit_line()),
        unsupervised_line(mask, lengths, setup.cut, args.overlong),
    ):
        if line:
            log(line)
    sampler = PlanBatchSampler(
        lengths, setup.config, loss_tokens=loss_tokens, anchors=setup.anchors, balance=args.balance,
        balance_every=args.balance_every,
    )  # fmt: skip
    layout = "packed" if setup.config.packed else "padded"
    collate = DrafterCollator(
        args.method, recipe=recipe, seed=args.seed, layout=layout, mask_token_id=args.mask_token_id
    )
    loader = DataLoader(PlannedDataset(samples), batch_sampler=sampler, collate_fn=collate)
    models.target.to(device)
    drafter = models.drafter.to(device)
    params = models.trainable()
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    step = 0
    state = ckpt.resume(device) if ckpt is not None and args.resume else None
    if state is not None:
        step = resume_from(
            state, ckpt, drafter, optimizer, sampler, state.get("drafter", {}), extra["drafter"]
        )
        log(f"resumed from {state['path']} at step {step}, epoch {sampler.epoch}, world size {world}")
        del state
    if rank == 0:  # the plan the sampler made (planned once: the run trains this very plan)
        log(setup.peak_line(sampler.plan, proc.resident_bytes()))
    step_loss_module = DraftLoss(models)
    ddp = DistributedDataParallel(step_loss_module) if world > 1 else step_loss_module
    log(
        f"run {run}: {args.method}, {recipe.describe()}, {len(samples)} samples, "
        f"{int(lengths.sum())} tokens, {sum(p.numel() for p in params) / 1e6:.2f}M drafter params, "
        f"{args.strategy} budget {args.budget}, world {world} x grad_accum {args.grad_accum}"
    )

    def count(micro_batches) -> float:
        """The step's loss denominator on all ranks, as the recipe counts it (every rank calls it once per
        step, before any forward)."""
        return float(all_reduce_sum(sum(mb.denominator for mb in micro_batches), device).item())

    def micro_step(micro_batches, denominator):
        loss_sum = torch.zeros((), device=device)
        for mb in micro_batches:
            with sync_unless(ddp, mb.info.last), sampler.timed(ddp):
                num, _ = ddp(mb)
                total = num.sum()
                step_loss(total, denominator, world).backward()
            loss_sum += total.detach()
        return loss_sum, sum(mb.positions for mb in micro_batches)

    parts = (sampler, loader, drafter, optimizer)
    with AnchorLog(args.anchor_log if setup.anchors is not None else None, rank) as anchor_log:
        code = train_loop(
            args, rank, device, ckpt, stop, run, parts, count, micro_step, step=step, after_step=anchor_log,
            extra=extra, dropped=dropped_samples(lengths, setup.cut, args.overlong),
        )  # fmt: skip
    log(f"peak memory {proc.peak_resident_bytes() / 2**30:.2f} GiB (this process's high-water mark)")
    if code == 0 and args.export_dir and rank == 0:
        state = {k: v.detach().cpu() for k, v in drafter.state_dict().items()}
        try:
            out = export_drafter(state, extra[META_KEY], fmt, args.export_dir, protect=export_protects(args))
        except OutputError as exc:  # checked before training; failed since (a full device...)
            if ckpt is None:
                raise
            raise OutputError(
                f"{exc.rule}; the trained drafter is checkpointed in {args.checkpoint_dir}: export it with "
                f"padfree export-drafter {args.checkpoint_dir} --out DIR",
                path=exc.path,
            ) from None
        log(f"exported the drafter in {fmt} format to {out}")
    return code


def load_target_and_data(args):
    """The target (``--target``'s folder, or ``None``: the tiny random one), and the data tokenized by its
    tokenizer (token ids folded modulo ``--vocab-size`` for the tiny target); sets ``args.vocab_size``,
    ``args.mask_token_id`` and ``args.target`` (resolved) from the target."""
    target = None
    given_mask = args.mask_token_id is not None
    if args.target is not None:
        args.tokenizer = str(check_target_folder(args.target))
        check_target_tokenizer(args.target)  # its tokenizer is its model's, before any option is blamed
        target = load_target(args.target, dtype=args.dtype, device="cpu")
        args.vocab_size = int(target.config.vocab_size)
        if args.mask_token_id is None:
            args.mask_token_id = default_mask_token(args.target)
        args.target = str(Path(args.target).resolve())
    elif args.mask_token_id is None:
        args.mask_token_id = 1
    if args.mask_token_id >= args.vocab_size:
        raise ConfigError(
            f"{'--mask-token-id' if given_mask else 'the target tokenizer’s mask/pad/unknown token'} "
            f"{args.mask_token_id} is outside the vocabulary of {args.vocab_size}"
        )
    samples, lengths, loss_tokens = training_data(args)
    for s in samples:
        if target is None:
            s["input_ids"] = s["input_ids"] % args.vocab_size
        elif len(s["input_ids"]) and int(s["input_ids"].max()) >= args.vocab_size:
            raise ConfigError(
                f"{args.target}: its tokenizer gives token id {int(s['input_ids'].max())}, outside the "
                f"model's vocabulary of {args.vocab_size} (a tokenizer of another model?)"
            )
    return target, samples, lengths, loss_tokens


class AnchorLog:
    """``--anchor-log FILE``: every trained sample's anchors, one JSON line per sample and step (``None``:
    no log), written after each optimizer step (``train_loop``'s ``after_step``)."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.path, self.rank, self.fd = path, rank, None

    def __enter__(self) -> AnchorLog:
        if self.path:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)

    def __call__(self, micro_batches, run_id, epoch, at_step) -> None:
        if self.fd is None:
            return
        lines = [
            json.dumps(
                {
                    "run": run_id,
                    "epoch": epoch,
                    "step": at_step,
                    "rank": self.rank,
                    "index": sid,
                    "anchors": a,
                }
            )  # fmt: skip
            for mb in micro_batches
            for sid, a in zip(mb.info.indices, mb.anchors_by_doc(), strict=True)
        ]
        if lines:
            os.write(self.fd, ("\n" + "\n".join(lines) + "\n").encode())


def check_outputs(args: argparse.Namespace) -> None:
    """Every output of the run checked writable before it loads or trains anything (the checkpoint folder
    is, by taking its lock): ``--export-dir`` as the export writes it (a temporary folder beside it, a file
    in it), ``--anchor-log`` and ``--seen-log`` opened for appending, as the run opens them. Else one
    :class:`OutputError` line naming the option and the path."""
    if args.export_dir:
        check_export_dir(args.export_dir, protect=export_protects(args))
    for option, path in (("--anchor-log", args.anchor_log), ("--seen-log", args.seen_log)):
        if not path:
            continue
        try:  # an existing log opened for appending; else created and removed (a refused run leaves none)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(path):
                os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
            else:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                os.unlink(path)
        except OSError as exc:
            raise OutputError(f"cannot write the {option} file ({exc.strerror or exc})", path=path) from None


def export_protects(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """The folders ``--export-dir`` must not be nor lie in: the target and the checkpoint folder."""
    return [("the --target folder", args.target), ("the --checkpoint-dir folder", args.checkpoint_dir)]


def unsupervised_line(mask: np.ndarray, lengths: np.ndarray, cut: int, overlong: str) -> str | None:
    """What ``--overlong truncate`` at ``cut`` tokens leaves unsupervised, in one line (``None``: nothing)."""
    lost = unsupervised_after_cut(mask, lengths, cut) if overlong == "truncate" else 0
    if not lost:
        return None
    return (
        f"{lost} of {len(lengths)} samples keep no supervised token after --overlong {overlong} at {cut} "
        "tokens: they are planned and trained with no loss"
    )


def unsupervised_after_cut(mask: np.ndarray, lengths: np.ndarray, budget: int) -> int:
    """Samples (of ``lengths``, ``mask`` their loss masks concatenated) with supervised tokens that keep none
    in their first ``budget`` tokens, what ``--overlong truncate`` trains.

    >>> unsupervised_after_cut(np.array([0, 0, 1, 1, 0, 0, 0]), np.array([3, 1, 3]), 2)
    1
    """
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    cs = np.concatenate(([0], np.cumsum(mask, dtype=np.int64)))
    start, end = offsets[:-1], offsets[1:]
    head = cs[np.minimum(start + budget, end)] - cs[start]
    return int(((cs[end] - cs[start] > 0) & (head == 0)).sum())


if __name__ == "__main__":
    run_example(main)
