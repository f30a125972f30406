"""``padfree check-packing``: do the documents of a packed row stay apart under this model and attention?"""

from __future__ import annotations

import argparse
import dataclasses
import json

from padfree.commands.common import add_output_options
from padfree.errors import ConfigError
from padfree.options import TOLERANCE, add_number, check_device

NAME = "check-packing"
HELP = (
    "run a packed row of several documents and each document alone through a randomly initialised model; "
    "print the attention path and the max logit difference; exit 1 if documents leak into each other"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="tiny-llama (default), tiny-mistral, tiny-qwen2, tiny-gemma, tiny-qwen3, or a directory with "
        "config.json",
    )
    p.add_argument(
        "--attn",
        default=None,
        help="attention implementation: padfree_varlen (default), sdpa, eager, ..., or leaky "
        "(the leaky control: causal attention over the whole row, deliberately wrong, to see a leak caught)",
    )
    p.add_argument(
        "--use-cache",
        action="store_true",
        help="run with use_cache=True (under sdpa/eager this makes transformers skip packing detection)",
    )
    p.add_argument(
        "--tolerance",
        type=TOLERANCE,
        default=None,
        help="largest logit difference taken as noise (default 1e-4 for float32, 5e-2 for bfloat16)",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="float32 (default), or bfloat16: float32 weights under torch.autocast(bfloat16), so that on a "
        "GPU "
        "the packed row reaches a fused varlen kernel. bf16 rounds differently in a packed row than in a "
        "document alone (matmuls of other shapes): on the tiny models correct attention differs by <= 8e-3 "
        "and a leak by >= 0.78, hence the 5e-2 default tolerance",
    )
    p.add_argument(
        "--whole-row-mixers",
        action="store_true",
        help="run convolutions, SSMs and linear attention over the whole packed row, as transformers does "
        "(padfree otherwise runs them per document): shows the leak on hybrid models",
    )
    add_number(
        p, "--sp", 1, "check a packed row sharded over this many CPU ranks (gloo) by Ulysses sequence "
        "parallelism: logits and gradients must equal the unsharded row's (default 1: no sharding)",
    )  # fmt: skip
    add_number(
        p, "--cp", 1, "the same under zigzag context parallelism (every document padded to 2 x cp and split "
        "over the ranks); with --attn leaky the CP attention is the leaky control (a causal mask over the "
        "whole row, as accelerate's CP hook uses) and the check reports the leak (default 1)",
    )  # fmt: skip
    p.add_argument(
        "--all-families",
        action="store_true",
        help="the family sweep: every decoder family of the installed transformers, tiny and random, one "
        "line each: exact / refused (why) / not buildable (why) / out of scope",
    )
    p.add_argument(
        "--families",
        default=None,
        help="the family sweep over these model types only (comma-separated; each checked once)",
    )
    add_output_options(p, "print the result as one JSON object", "seed for weights and tokens (default 0)")


MODEL, ATTN = "tiny-llama", "padfree_varlen"
"""What ``--model`` and ``--attn`` default to outside the family sweep (which takes neither)."""


def _model_and_attn(args: argparse.Namespace) -> tuple[str, str]:
    """``--model`` and ``--attn`` of a one-model check, their defaults where not given."""
    return (MODEL if args.model is None else args.model, ATTN if args.attn is None else args.attn)


def sweep_families(args: argparse.Namespace) -> list[str] | None:
    """The families ``--families`` names (each once, in the order given; ``None``: ``--all-families``), after
    refusing in one line every option the sweep cannot honour: it builds each family's own tiny config
    under padfree_varlen, unsharded, its mixers per document, without a cache."""
    flag = "--families" if args.families is not None else "--all-families"
    if args.all_families and args.families is not None:
        raise ConfigError("check-packing: give --all-families or --families NAMES, not both")
    ignored = {
        "--model": args.model is not None,
        "--attn": args.attn not in (None, ATTN),
        "--whole-row-mixers": args.whole_row_mixers,
        "--use-cache": args.use_cache,
        "--sp": args.sp > 1,
        "--cp": args.cp > 1,
        "--tolerance": args.tolerance is not None,
    }
    if any(ignored.values()):
        drop = ", ".join(k for k, v in ignored.items() if v)
        raise ConfigError(
            f"check-packing {flag}: the family sweep checks each family's own tiny config under "
            f"padfree_varlen, unsharded, its mixers per document, without a cache, at its own tolerance; "
            f"drop {drop}, or drop {flag} to check one model with {'them' if ', ' in drop else 'it'}"
        )
    if args.families is None:
        return None
    names = list(dict.fromkeys(f.strip() for f in args.families.split(",") if f.strip()))
    if not names:
        raise ConfigError(
            f"check-packing --families {args.families!r}: names no family; give model types separated by "
            "commas (e.g. llama,qwen3) or --all-families"
        )
    return names


def run_sweep(args: argparse.Namespace, device: str) -> int:
    from padfree.checks.families import as_json, summary, sweep

    names = sweep_families(args)
    log = None if args.json else lambda r: print(r.line(), flush=True)
    results = sweep(names, seed=args.seed, log=log, device=device, dtype=args.dtype)
    counts = summary(results)
    if args.json:
        print(json.dumps({"families": as_json(results), "summary": counts}))
    else:
        print(", ".join(f"{n} {s}" for s, n in counts.items()))
    return 0


def run_sharded(args: argparse.Namespace) -> int:
    from padfree.checks.sharded import check_sharded

    flag = "--sp" if args.sp > 1 else "--cp"
    others = {
        "--use-cache": args.use_cache,
        "--whole-row-mixers": args.whole_row_mixers,
        "--dtype bfloat16": args.dtype != "float32",
        "--device": args.device != "cpu",
        "--tolerance": args.tolerance is not None,
    }
    if any(others.values()):
        drop = ", ".join(k for k, v in others.items() if v)
        raise ConfigError(f"check-packing {flag}: runs float32 on CPU ranks (gloo) only; drop {drop}")
    model, attn = _model_and_attn(args)
    r = check_sharded(model, sp=args.sp, cp=args.cp, attn=attn, seed=args.seed)
    bad = r.leaked or not r.exact
    if args.json:
        print(json.dumps({**dataclasses.asdict(r), "leaked": r.leaked, "exact": r.exact}))
        return 1 if bad else 0
    kind = "Ulysses sequence parallelism" if r.mode == "sp" else "zigzag context parallelism"
    print(f"model:          {r.model} ({r.family})")
    print(f"sharding:       {kind}, {r.degree} CPU ranks (gloo); attention {r.impl}")
    print(
        f"documents:      {len(r.doc_lengths)} in one packed row, lengths {list(r.doc_lengths)}, "
        f"padded to {r.row_tokens} tokens for the shards"
    )
    print(f"max |logit diff| sharded vs unsharded row: {r.logit_diff:.3g}")
    print(f"max |grad diff|  sharded vs unsharded row: {r.grad_diff:.3g} (every parameter, shards summed)")
    print(f"max |logit diff| sharded vs each document alone: {r.alone_diff:.3g}")
    if r.leaked:
        print(
            f"LEAK: documents see each other across the shards ({r.alone_diff:.3g} > tolerance "
            f"{r.tolerance:g}); sharded packed training with this attention is wrong"
        )
        return 1
    if bad:
        print(f"DIFFERS: the shards do not reproduce the unsharded row (tolerance {r.tolerance:g})")
        return 1
    print(
        f"OK: the shards reproduce the unsharded row and every document sees only itself (<= {r.tolerance:g})"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    from padfree.checks.packing import check_packing

    device = check_device(args.device)  # once, before any model is built: a bad one is one line
    if args.all_families or args.families is not None:
        return run_sweep(args, device)
    if args.sp > 1 or args.cp > 1:
        return run_sharded(args)
    model, attn = _model_and_attn(args)
    r = check_packing(
        model,
        attn,
        use_cache=args.use_cache,
        tolerance=args.tolerance,
        seed=args.seed,
        device=device,
        dtype=args.dtype,
        mixers_apart=not args.whole_row_mixers,
    )
    if args.json:
        print(json.dumps({**dataclasses.asdict(r), "leaked": r.leaked}))
        return 1 if r.leaked else 0
    print(f"model:          {r.model} ({r.family})")
    loaded = "saved, loaded with from_pretrained" if r.weights == "saved" else "random, built from the config"
    print(f"weights:        {loaded}")
    print(f"attention:      {r.attn}{' with use_cache=True' if r.use_cache else ''}")
    print(f"device, dtype:  {r.device}, {r.dtype}{' (autocast)' if r.dtype != 'float32' else ''}")
    print(f"path used:      {r.path}")
    if r.mixers:
        how = "over the whole row (--whole-row-mixers)" if args.whole_row_mixers else "per document"
        print(f"token mixers:   {', '.join(r.mixers)} run {how}")
    print(f"documents:      {len(r.doc_lengths)} in one packed row, lengths {list(r.doc_lengths)}")
    grads = "" if r.grad_diff is None else f"; gradients, relative: {r.grad_diff:.3g}"
    print(
        f"packed vs alone through the model's own {r.reference} attention: max |logit diff| "
        f"{r.max_logit_diff:.3g} (documents 2..: {r.max_logit_diff_later:.3g}){grads}"
    )
    print(
        f"probe:          changing document 1 moves later documents' logits by {r.probe_diff:.3g} "
        f"(allowed: {r.probe_allowance:.3g}: the noise measured on the spot)"
    )
    print(f"causality:      changing each document's last token moves earlier logits by {r.causal_diff:.3g}")
    if r.leaked:
        why = (
            f"changing document 1 moves later documents by {r.probe_diff:.3g}"
            if r.probe_leaked
            else f"documents attend to their own future tokens ({r.causal_diff:.3g})"
            if r.sees_future
            else f"packed differs from the model's own {r.reference} attention alone (logits "
            f"{r.max_logit_diff:.3g} > {r.tolerance:g}"
            + ("" if r.grad_diff is None else f", gradients {r.grad_diff:.3g}")
            + ")"
        )
        print(f"LEAK: documents see each other ({why}); packed training with this setup is wrong")
        return 1
    print(
        f"OK: every document sees only itself, as alone through the model's own {r.reference} attention "
        f"(probes {r.probe_diff:.3g} / {r.causal_diff:.3g}, logits {r.max_logit_diff:.3g} <= {r.tolerance:g})"
    )
    return 0
