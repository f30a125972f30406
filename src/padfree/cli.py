"""The ``padfree`` command line. Each command lives in ``padfree.commands.<name>`` as a thin shell around a
library function: ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.

Every :class:`~padfree.errors.PadfreeError` and every usage error becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from padfree.errors import PadfreeError

COMMANDS = (
    "analyze",
    "check-packing",
    "plan",
    "lengths",
    "report",
    "calibrate",
    "simulate",
    "bench",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage block
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="padfree", description="Padding-free, well-mixed batching plans for LLM training.")
    parser.add_argument("--version", action="version", version=f"padfree {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        mod = importlib.import_module(f"padfree.commands.{name.replace('-', '_')}")
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _version() -> str:
    from padfree import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, run, and turn every expected failure into one line and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except PadfreeError as exc:
        print(f"padfree: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("padfree: error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
