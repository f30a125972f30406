"""Ranks as forked children of the calling process: each starts with everything the parent imported (torch,
transformers, a peer trainer: seconds of imports per rank saved), meets the others through a gloo file store,
and can be SIGKILLed all at once when the seen-log shows a chosen step. Linux only (``fork``).

``launch(main, world, seen_log, kill_at=...)`` runs ``main(rank, world, store)`` in ``world`` children and
returns their exit codes (``-SIGKILL`` for killed ones); an exception in a child is written to a file and
raised here as one :class:`RuntimeError` line.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from padfree.testing import seenlog


def launch(
    main: Callable[[int, int, str], None],
    world: int,
    seen_log: str | Path,
    *,
    run: str,
    kill_at: int | None = None,
    timeout: float = 300.0,
) -> list[int | None]:
    """Fork ``world`` ranks running ``main(rank, world, store_file)``; SIGKILL every rank once ``seen_log``
    holds a line of ``run`` at step ``>= kill_at`` (``None``: wait for them to finish)."""
    ctx = multiprocessing.get_context("fork")
    scratch = Path(tempfile.mkdtemp(prefix=f"forkranks-{run}-"))
    store = str(scratch / "store")

    def child(rank: int) -> None:
        code = 0
        try:
            main(rank, world, store)
        except BaseException:  # noqa: BLE001 - reported through the file the parent reads
            (scratch / f"error-{rank}").write_text(traceback.format_exc())
            code = 1
        os._exit(code)

    procs = [ctx.Process(target=child, args=(r,)) for r in range(world)]
    for p in procs:
        p.start()
    t0 = time.perf_counter()
    seen = Path(seen_log)
    while any(p.is_alive() for p in procs):
        if time.perf_counter() - t0 > timeout:
            for p in procs:
                p.kill()
            raise RuntimeError(f"ranks of run {run} still running after {timeout:.0f} s")
        if (
            kill_at is not None
            and seen.exists()
            and any(r["run"] == run and r["step"] >= kill_at for r in seenlog.read(seen))
        ):
            for p in procs:
                if p.pid is not None:
                    os.kill(p.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    for p in procs:
        p.join(timeout=60)
    errors = sorted(scratch.glob("error-*"))
    if errors:
        print(errors[0].read_text(), file=sys.stderr)
        raise RuntimeError(f"run {run}: {errors[0].name}: {errors[0].read_text().strip().splitlines()[-1]}")
    return [p.exitcode for p in procs]
