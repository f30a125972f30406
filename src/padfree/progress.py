"""Progress bars on long runs: rich's, on stderr, shown only on a terminal (never into a CI log, a pipe or a
file, never under ``--quiet``); lines printed meanwhile go above the bar."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator


def bars_wanted(quiet: bool = False) -> bool:
    """Whether a long run shows a progress bar: not under ``quiet``, not under CI (``CI`` set), and only
    when stderr and stdout are both a terminal (while the bar is shown, the run's printed lines go above it
    through stderr's console: with stdout sent to a file they would leave the file).

    >>> bars_wanted(quiet=True)
    False
    """
    if quiet or os.environ.get("CI", "").lower() not in ("", "0", "false"):
        return False
    try:
        return sys.stderr.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


@contextlib.contextmanager
def progress_bar(description: str, total: float | None, *, enabled: bool) -> Iterator[Callable[..., None]]:
    """A bar of ``total`` units (``None``: unknown) for the block, yielding ``advance(n=1, description=None)``
    (a new description, e.g. the latest loss, when given); a no-op when not ``enabled``.

    >>> with progress_bar("steps", 3, enabled=False) as advance:
    ...     advance(description="loss 1.0")
    """
    if not enabled:
        yield lambda n=1, description=None: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)

        def advance(n: float = 1, description: str | None = None) -> None:
            bar.advance(task, n)
            if description is not None:
                bar.update(task, description=description)

        yield advance


__all__ = ["bars_wanted", "progress_bar"]
