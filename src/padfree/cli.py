"""The ``padfree`` command line. Each command lives in ``padfree.commands.<name>`` as a thin shell around a
library function: ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.

Every :class:`~padfree.errors.PadfreeError` and every usage error becomes one line on stderr and exit code 2,
and so does every I/O failure (naming the file: an unreadable input, a full device, standard output included),
decoding failure or other exception that escapes a command: :func:`main` is the one boundary where nothing
becomes a traceback (``PADFREE_DEBUG=1`` lets the traceback of an unexpected exception through).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

from padfree.errors import OutputError, PadfreeError, one_line
from padfree.options import OneLineParser

COMMANDS = (
    "analyze",
    "check-packing",
    "check-drafter",
    "export-drafter",
    "plan",
    "lengths",
    "report",
    "calibrate",
    "simulate",
    "bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="padfree", description="Padding-free, well-mixed batching plans for LLM training."
    )
    parser.add_argument("--version", action="version", version=f"padfree {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
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
    """Entry point: parse, run, and turn every failure into one line on stderr and exit code 2."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a usage error (its line is printed) or --help / --version
        return exc.code if isinstance(exc.code, int) else 0
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    _cache_fallbacks()
    real_stdout, sys.stdout = sys.stdout, _NamedStdout(sys.stdout)
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # a full or closed stdout fails here, inside the boundary, not at exit
        return code
    except PadfreeError as exc:
        if isinstance(exc, OutputError) and exc.path == STDOUT:
            _silence_stdout()
        return _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130
    except BrokenPipeError:  # `padfree plan ... | head`: the reader has all it wanted
        _silence_stdout()
        return 0
    except OSError as exc:
        return _fail(_os_error(exc))
    except UnicodeError as exc:
        return _fail(f"cannot decode or encode text ({_first_line(exc)})")
    except MemoryError:
        return _fail("out of memory: the input is larger than this machine can plan (see docs/errors.md)")
    except Exception as exc:  # the last line of defence: a bug, or an input no rule foresaw
        if os.environ.get("PADFREE_DEBUG"):
            raise
        return _fail(
            f"unexpected {type(exc).__name__}: {_first_line(exc)} (please report it; PADFREE_DEBUG=1 shows "
            "the traceback)"
        )
    finally:
        sys.stdout = real_stdout


STDOUT = "<stdout>"


class _NamedStdout:
    """Standard output that names itself when a write fails (a full device, a closed descriptor): the
    error is then one :class:`OutputError` line like any other output's. A closed pipe stays a
    BrokenPipeError (the reader has all it wanted)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def _guard(self, fn, *a):
        try:
            return fn(*a)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(f"cannot write the output ({exc.strerror or exc})", path=STDOUT) from None

    def write(self, text: str) -> int:
        return self._guard(self._stream.write, text)

    def flush(self) -> None:
        return self._guard(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _cache_fallbacks() -> None:
    """A home folder that is not writable must not turn into warnings: matplotlib's config folder moves to
    the temporary directory (numba's kernel cache does the same in :mod:`padfree.core.kernels`; the token
    cache of ``padfree lengths`` says so in one warning line and goes on without it)."""
    if "MPLCONFIGDIR" in os.environ:
        return
    home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    probe = os.path.join(home, "matplotlib")
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not (os.path.isdir(probe) and os.access(probe, os.W_OK | os.X_OK)):
        import tempfile

        uid = os.getuid() if hasattr(os, "getuid") else 0
        fallback = os.path.join(tempfile.gettempdir(), f"padfree-matplotlib-{uid}")
        with contextlib.suppress(OSError):
            os.makedirs(fallback, exist_ok=True)
            os.environ["MPLCONFIGDIR"] = fallback


def _fail(line: str) -> int:
    with contextlib.suppress(OSError, ValueError):  # stderr itself may be full or closed
        print(f"padfree: error: {one_line(line)}", file=sys.stderr, flush=True)
    return 2


def _os_error(exc: OSError) -> str:
    """One line for an OSError, naming the file when it has one."""
    reason = exc.strerror or _first_line(exc)
    if exc.filename is not None:
        return f"{exc.filename}: {reason}"
    return f"input/output error ({reason})"


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null, so the interpreter's final flush of what is still buffered cannot fail."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
