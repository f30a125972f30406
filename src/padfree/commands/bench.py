"""``padfree bench``: train a real model under every strategy (padfree's and the peers') and compare
throughput; ``--converge``: held-out loss curves of sorted, random, bucketed and packed at equal tokens."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

from padfree.commands.common import check_input, check_output, writing
from padfree.errors import ConfigError
from padfree.options import (
    BUDGET,
    COUNT,
    FRACTION,
    LR,
    POOL,
    TOKENS,
    Bounded,
    add_number,
    add_path,
    check_device,
    model_overrides,
)

NAME = "bench"
HELP = (
    "train a real model under every strategy and the peers (tokens/s, padding, memory); "
    "--converge: held-out loss curves at equal tokens"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from padfree.commands.common import add_lengths_argument

    add_lengths_argument(p, required=False)
    p.add_argument("--data", default=None, help="real text: glob of samples .jsonl.gz (needs --tokenizer)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="SentencePiece .model, tokenizer.json or transformers folder for --data",
    )
    p.add_argument("--per-file", type=COUNT, default=400, help="--data: samples read per file (default 400)")
    p.add_argument("--loss-on", default="all", choices=["all", "assistant"], help="--data: loss tokens")
    p.add_argument("--model", default="tiny-llama", help="built-in tiny model or a config directory")
    p.add_argument(
        "--model-set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    add_number(
        p,
        "--vocab-size",
        None,
        "model vocabulary (token ids of --data are folded modulo it; random ids are drawn under it)",
    )
    add_number(
        p, "--budget", None, "tokens per micro-batch (default 16384, the motivating case's; --converge: 2048)"
    )
    _add_run_arguments(p)
    _add_converge_arguments(p.add_argument_group("convergence (--converge)"))


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """How each strategy's arm runs and what is written."""
    add_number(p, "--steps", 10, "about this many full micro-batches per strategy (default 10)")
    add_number(p, "--warmup", 2, "untimed steps per strategy first (default 2)")
    add_number(p, "--repeats", 1, "passes over the measured rounds, fastest time per step kept (default 1)")
    p.add_argument(
        "--pool",
        type=POOL,
        default=None,
        help="plan every strategy over a seeded random subset of this many samples instead of all of them "
        "(default: all, so that the plans pad as they would on the whole dataset; a small pool pads more, "
        "bucketed most, whose noise windows narrow with the data)",
    )
    p.add_argument(
        "--padded-attention",
        choices=["causal", "masked"],
        default="causal",
        help="padded strategies: causal (default) trains right-padded rows without an attention mask, "
        "which a causal LM does not need, so attention runs is_causal as for packed rows; masked passes "
        "the mask, as transformers' collators do (a masked SDPA kernel, slower whenever a micro-batch has "
        "a pad)",
    )
    p.add_argument(
        "--whole-epoch",
        action="store_true",
        help="train every micro-batch of an epoch of about --steps x --budget tokens (exactly the same work "
        "for every strategy) instead of --steps stratified micro-batches of a --pool epoch",
    )
    add_number(p, "--seed", 0)
    p.add_argument(
        "--max-len",
        type=BUDGET,
        default=None,
        help="--data: cut samples to this many tokens (default: --budget)",
    )
    p.add_argument("--overlong", default="truncate", choices=["truncate", "drop"], help="samples over budget")
    p.add_argument("--strategies", default=None, help="comma-separated subset (default: all, peers too)")
    p.add_argument("--lr", type=LR, default=None, help="peak learning rate (default 1e-4; converge 2e-3)")
    add_number(p, "--threads", 2, "torch CPU threads (default 2)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="float32 (default), or bfloat16: float32 weights and AdamW with forward and loss under "
        "torch.autocast(bfloat16), so that on a GPU packed rows reach a fused varlen attention kernel "
        "(throughput only, not --converge)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--no-isolate",
        dest="isolate",
        action="store_false",
        help="skip the preflight that trains each arm's heaviest micro-batch in a memory-capped child "
        "process first (an arm that runs out of memory there is recorded and left out)",
    )
    p.add_argument(
        "--arm-memory-gb",
        type=Bounded(float, 0, 2**20, above=True),
        default=None,
        help="the preflight's memory cap per arm (default: 80%% of the memory available)",
    )
    add_path(p, "--out", "directory for NAME.json, NAME.md and NAME.png")
    p.add_argument("--name", default=None, help="file name stem under --out (default train_speed / converge)")


def _add_converge_arguments(g: argparse._ArgumentGroup) -> None:
    """The held-out loss curves of ``--converge``."""
    g.add_argument("--converge", action="store_true", help="held-out loss curves instead of throughput")
    g.add_argument(
        "--train-tokens", type=TOKENS, default=1_500_000, help="loss tokens per run (default 1.5M)"
    )
    g.add_argument(
        "--eval-every", type=TOKENS, default=None, help="tokens between evals (default 1/12 of them)"
    )
    g.add_argument("--eval-samples", type=COUNT, default=200, help="held-out samples (default 200)")
    add_number(g, "--grad-accum", 4, "micro-batches per optimizer step (default 4)")
    g.add_argument("--warmup-frac", type=FRACTION, default=0.05, help="LR warm-up share of the tokens")
    g.add_argument(
        "--unmatched-steps",
        action="store_true",
        help="give every strategy the same --budget (padded plans then take more, smaller steps) instead of "
        "holding the optimizer steps to the same real tokens",
    )


def _vocab(args: argparse.Namespace, overrides: dict) -> int:
    from padfree.models import build_config

    return int(build_config(args.model, **overrides).vocab_size)


def _text_samples(args: argparse.Namespace, vocab: int, max_len: int):
    from padfree.bench.samples import Samples
    from padfree.data.samples import load_samples, loss_tokens_of

    if not args.tokenizer:
        raise ConfigError(
            "--data needs --tokenizer (a SentencePiece .model, tokenizer.json or transformers folder)"
        )
    check_input(Path(args.tokenizer), "tokenizer")
    raw: list = load_samples(args.data, args.tokenizer, None, args.loss_on, None, per_file=args.per_file)
    if args.overlong == "drop":
        raw = [s for s in raw if s["input_ids"].shape[0] <= max_len]
    raw = [
        {"input_ids": s["input_ids"][:max_len], "loss_mask": s["loss_mask"][:max_len]}
        for s in raw
        if s["input_ids"].shape[0] >= 2
    ]
    if not raw:
        raise ConfigError(f"{args.data}: no usable samples")
    ids = [(s["input_ids"].astype(np.int64) % vocab) for s in raw]
    tok = Path(args.tokenizer).name
    src = f"{args.data} ({args.per_file} per file, tokenizer {tok}, loss on {args.loss_on})"
    return Samples(ids, loss_tokens_of(raw), src), [s["loss_mask"] for s in raw]


def run(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401  (said here, before any work, when it is missing)
    except ImportError:
        raise ConfigError(
            "bench needs torch and transformers: pip install 'padfree[torch,hf,bench]'"
        ) from None
    if args.out is not None:
        check_output(args.out, "the results", folder=True)
    device = check_device(args.device)
    if args.budget is None:
        args.budget = 2048 if args.converge else 16384
    if args.data and args.lengths is not None:
        raise ConfigError("give a lengths file or --data, not both")
    command = (
        "padfree " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["bench"] else ""
    )
    overrides = model_overrides(args)
    if args.converge and args.dtype != "float32":
        raise ConfigError("--dtype bfloat16 is for the throughput bench; --converge trains in float32")
    if args.converge:
        return _run_converge(args, device, overrides, command)
    return _run_speed(args, device, overrides, command)


def _say(args: argparse.Namespace):
    return (
        (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    )


def _model_run(args: argparse.Namespace, device: str, overrides: dict, strategies: tuple, lr: float) -> dict:
    """The :class:`~padfree.bench.trainer.ModelRun` fields (and the strategies) both bench modes take from
    the command line; ``lr`` is the mode's default learning rate."""
    chosen = tuple(s.strip() for s in args.strategies.split(",")) if args.strategies else strategies
    return {
        "budget": args.budget,
        "seed": args.seed,
        "model": args.model,
        "model_overrides": overrides,
        "strategies": chosen,
        "lr": args.lr if args.lr is not None else lr,
        "device": device,
        "threads": args.threads,
    }


def _run_speed(args: argparse.Namespace, device: str, overrides: dict, command: str) -> int:
    from padfree.bench import train_speed as ts
    from padfree.bench.samples import Samples, fit_lengths, random_samples
    from padfree.bench.sampling import STRATEGIES
    from padfree.bench.train_report import markdown, plot
    from padfree.commands.common import load_lengths

    cfg = ts.BenchConfig(
        **_model_run(args, device, overrides, STRATEGIES, 1e-4),
        steps=args.steps,
        warmup=args.warmup,
        select="epoch" if args.whole_epoch else "stratified",
        repeats=args.repeats,
        dtype=args.dtype,
        padded_mask=args.padded_attention == "masked",
        isolate=args.isolate,
        memory_limit=None if args.arm_memory_gb is None else int(args.arm_memory_gb * 2**30),
    )
    vocab = _vocab(args, overrides)
    if args.data:
        pool, _ = _text_samples(args, vocab, _max_len(args))
        keep = _keep(args, pool.lengths)
        samples = Samples([pool.input_ids[i] for i in keep], pool.loss_tokens[keep], pool.source)
    else:
        lengths, _, display = load_lengths(args)
        lengths = fit_lengths(lengths, args.budget, args.overlong)
        lengths = lengths[lengths > 0]
        keep = _keep(args, lengths)
        samples = random_samples(
            lengths[keep], vocab, args.seed, f"{display} (random token ids, overlong {args.overlong})"
        )
    result = ts.run_bench(samples, cfg, progress=_say(args))
    result["command"] = command
    result["config"]["dtype"] = cfg.dtype
    if args.out is not None:
        _write(args.out, args.name or "train_speed", result, markdown(result, command), plot)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(markdown(result, command))
    return 0


def _max_len(args: argparse.Namespace) -> int:
    n = args.max_len or args.budget
    if not 2 <= n <= args.budget:
        raise ConfigError(f"--max-len must be between 2 and --budget {args.budget} (got {n})")
    return n


def _keep(args: argparse.Namespace, lengths: np.ndarray) -> np.ndarray:
    from padfree.bench.sampling import bench_subset

    if args.whole_epoch:
        return bench_subset(lengths, args.steps, args.budget, args.seed)
    n = lengths.shape[0]
    if args.pool is None:
        return np.arange(n)
    if args.pool < 2:
        raise ConfigError(f"--pool must be >= 2 (got {args.pool})")
    return np.sort(np.random.default_rng(args.seed).permutation(n)[: min(args.pool, n)])


def _run_converge(args: argparse.Namespace, device: str, overrides: dict, command: str) -> int:
    from padfree.bench import converge as cv
    from padfree.bench import converge_report as cr

    if not args.data or not args.tokenizer:
        raise ConfigError(
            "--converge trains on real text: pass --data 'DIR/*.jsonl.gz' and --tokenizer MODEL "
            "(in a clone: fixtures/samples/*.jsonl.gz and fixtures/tokenizers/llama_sp32k.model)"
        )
    if args.lengths is not None:
        raise ConfigError("--converge trains on real text (--data), not on a lengths file")
    cfg = cv.ConvergeConfig(
        **_model_run(args, device, overrides, cv.STRATEGIES, 2e-3),
        grad_accum=args.grad_accum,
        train_tokens=args.train_tokens,
        eval_every=args.eval_every,
        eval_samples=args.eval_samples,
        warmup_frac=args.warmup_frac,
        equal_steps=not args.unmatched_steps,
    )
    samples, masks = _text_samples(args, _vocab(args, overrides), _max_len(args))
    result = cv.run_converge(samples, masks, cfg, progress=_say(args))
    result["command"] = command
    if args.out is not None:
        _write(args.out, args.name or "converge", result, cr.markdown(result, command), cr.plot)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(cr.markdown(result, command))
    return 0


def _write(out: Path, stem: str, result: dict, md: str, plot) -> None:
    with writing(out, "the results"):
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / f"{stem}.md").write_text(md)
        plot(result, out / f"{stem}.png")
