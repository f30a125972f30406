"""``padfree export-drafter``: a trained drafter checkpoint as a folder a server loads (z-lab DFlash, vllm
speculators EAGLE-3)."""

from __future__ import annotations

import argparse

NAME = "export-drafter"
HELP = (
    "write a drafter checkpoint of examples/train_drafter.py as a folder SGLang or vLLM load: DFlash in "
    "z-lab's format (dflash), EAGLE-3 in vllm speculators' (speculators); config.json + model.safetensors"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint", help="a checkpoint file (step-NNNNNNNNN.pt) or a checkpoint folder (its newest)"
    )
    p.add_argument(
        "--format",
        choices=["dflash", "speculators"],
        default=None,
        help="dflash (z-lab; DFlash drafters) or speculators (EAGLE-3 drafters); default: the drafter's",
    )
    p.add_argument("--out", required=True, help="folder to write (created; its config and weights replaced)")
    p.add_argument(
        "--verifier",
        default=None,
        help="the target folder a server will run, written into a speculators config (default: the folder "
        "the drafter was trained on)",
    )
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="weights' dtype (default float32)"
    )


def run(args: argparse.Namespace) -> int:
    from padfree.drafter.export import default_format, export_drafter, read_checkpoint, with_verifier

    state, meta = read_checkpoint(args.checkpoint)
    fmt = args.format or default_format(meta["method"])
    out = export_drafter(state, with_verifier(meta, args.verifier), fmt, args.out, dtype=args.dtype)
    layers = ", ".join(str(i) for i in meta["target_layers"])
    n = sum(v.numel() for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head.")))
    print(
        f"wrote {out} ({fmt} format, {meta['method']} drafter, {n / 1e6:.2f}M parameters besides embedding "
        f"and head, target layers {layers} of {meta['target']['config']['num_hidden_layers']})"
    )
    return 0
