"""``padfree export-drafter``: a trained drafter checkpoint as a folder a server loads (z-lab DFlash, vllm
speculators EAGLE-3)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from padfree.errors import one_line

NAME = "export-drafter"
HELP = (
    "write a drafter checkpoint of examples/train_drafter.py as a folder SGLang or vLLM load: DFlash in "
    "z-lab's format (dflash), EAGLE-3 in vllm speculators' (speculators); config.json + model.safetensors"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from padfree.drafter.methods import METHODS

    held = ", ".join(f"{m.export_format} ({m.title} drafters)" for m in METHODS.values())
    p.add_argument(
        "checkpoint", help="a checkpoint file (step-NNNNNNNNN.pt) or a checkpoint folder (its newest)"
    )
    p.add_argument(
        "--format",
        choices=[m.export_format for m in METHODS.values()],
        default=None,
        help=f"{held}; default: the drafter's",
    )
    p.add_argument(
        "--out",
        required=True,
        help="folder to write: a new or empty one, or an earlier export to replace (written beside it, then "
        "renamed into place); never the target or checkpoint folder",
    )
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
    from padfree.drafter.export import default_format, export_drafter, read_checkpoint_file, with_verifier

    passed: list[str] = []

    def damaged(line: str) -> None:
        passed.append(line)
        print(f"padfree: warning: {one_line(line)}", file=sys.stderr)

    source = Path(args.checkpoint)
    path, state, meta = read_checkpoint_file(source, say=damaged)
    fmt = args.format or default_format(meta["method"])
    folder = source if source.is_dir() else source.parent
    protect = [("the target folder the drafter was trained on", meta["target"].get("path"))]
    protect.append(("the checkpoint folder", folder))
    served = with_verifier(meta, args.verifier)
    out = export_drafter(state, served, fmt, args.out, dtype=args.dtype, protect=protect, source=path)
    layers = ", ".join(str(i) for i in meta["target_layers"])
    n = sum(v.numel() for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head.")))
    newest = f", the newest intact ({len(passed)} newer damaged)" if passed else ""
    total = meta["target"]["config"]["num_hidden_layers"]
    print(
        f"wrote {out} from {path}{newest} ({fmt} format, {meta['method']} drafter, {n / 1e6:.2f}M parameters "
        f"besides embedding and head, target layers {layers} of {total})"
    )
    return 0
