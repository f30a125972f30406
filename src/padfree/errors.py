"""Every error padfree raises on purpose, in one place.

The CLI turns any :class:`PadfreeError` into one line on stderr and exit code 2; library users catch the
typed subclasses. Each message names the file (when there is one), the sample (when there is one) and the
rule that was broken.
"""

from __future__ import annotations


def one_line(text: str) -> str:
    """``text`` with its control characters escaped (a newline in a file name becomes ``\\n``), so that an
    error naming it stays one line.

    >>> one_line("ck\\npt: cannot write")
    'ck\\\\npt: cannot write'
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class PadfreeError(ValueError):
    """Base class: a problem with what padfree was given, never a bug inside padfree."""


class _FileError(PadfreeError):
    """An error about a file (``.path``) and, for an input, one of its samples (``.sample``): the message
    names them before the ``rule`` that was broken."""

    def __init__(self, rule: str, *, path: str | None = None, sample: int | None = None) -> None:
        self.rule = rule
        self.path = path
        self.sample = sample
        parts = [p for p in (path, None if sample is None else f"sample {sample}") if p]
        super().__init__(": ".join([*parts, rule]))


class InputError(_FileError):
    """A lengths file or sample that breaks a rule (empty, non-integer, negative, unreadable...).

    >>> str(InputError("zero length", path="x.npy", sample=3))
    'x.npy: sample 3: zero length'
    """


class OutputError(_FileError):
    """An output that cannot be written: its folder is missing or a file, it is read-only, the device is
    full (``.path`` is the output). Not an :class:`InputError`: nothing was wrong with what was read."""


class ConfigError(PadfreeError):
    """A planning option outside its allowed range (budget < 1, growth <= 1, unknown strategy...)."""


class OverlongError(InputError):
    """Samples longer than the token budget under ``overlong='error'``."""


class StateError(PadfreeError):
    """A sampler state that does not belong to this dataset, config or seed."""


class StateWarning(UserWarning):
    """A sampler state accepted with a reservation (e.g. one written before states carried a digest)."""
