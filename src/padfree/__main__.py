"""``python -m padfree``: the same command line as the ``padfree`` script (useful where padfree is used from a
source checkout on ``PYTHONPATH`` rather than installed)."""

from padfree.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
