"""The drafter recipe's command-line options (``--recipe`` and one per recipe field), made from
:data:`padfree.drafter.recipes.FIELDS`; the commands and ``examples/train_drafter.py`` share them."""

from __future__ import annotations

import argparse
import dataclasses

from padfree.options import NUMERIC, Bounded


# ----- drafter recipes -------------------------------------------------------------------------------------
def _optional_int(kind: Bounded):
    """An argparse type: ``kind``, or ``none`` for no value (a recipe field that may be off)."""

    def parse(text: str) -> int | float | str:
        return "none" if text.strip().lower() == "none" else kind(text)

    parse.__name__ = f"{kind.range} or none"
    return parse


def _yes_no(text: str) -> bool:
    t = text.strip().lower()
    if t in ("yes", "true", "on", "1"):
        return True
    if t in ("no", "false", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"must be yes or no (got {text[:40]!r})")


def add_recipe_arguments(p: argparse.ArgumentParser) -> None:
    """``--recipe`` and one option per recipe field (:class:`padfree.drafter.recipes.Recipe`), each left unset
    (``None``: the recipe's own value) unless given: ``--recipe speculators --block-size 8``."""
    from padfree.drafter import recipes

    g = p.add_argument_group("drafter recipe (default: the recipe's own value for every field)")
    g.add_argument(
        "--recipe",
        choices=list(recipes.NAMES),
        default=recipes.DEFAULT,
        help=f"the published recipe to train as (default {recipes.DEFAULT}; docs/drafters.md)",
    )
    for name, rule in recipes.FIELDS.items():
        flag = "--" + name.replace("_", "-")
        if rule.kind == "choice":
            g.add_argument(flag, choices=list(rule.choices), default=None, help=rule.help)
        elif rule.kind == "bool":
            g.add_argument(flag, type=_yes_no, default=None, metavar="yes|no", help=rule.help)
        else:  # a number: one range for the option and the recipe (NUMERIC's where other commands share it)
            lo, hi = rule.cli_range
            kind = NUMERIC.get(flag) or Bounded(
                int if rule.kind == "int" else float, lo, hi, above=rule.above
            )
            g.add_argument(
                flag, type=_optional_int(kind) if rule.optional else kind, default=None, help=rule.help
            )


def recipe_from_args(args: argparse.Namespace, method: str):
    """The recipe ``--recipe`` names for ``method`` with every given field option applied (``none`` turns an
    optional field off)."""
    from padfree.drafter import recipes

    changes = {k: getattr(args, k, None) for k in recipes.FIELDS}
    base = recipes.get(args.recipe, method)
    off = {k: None for k, v in changes.items() if v == "none"}
    changed = recipes.override(base, **{k: v for k, v in changes.items() if v != "none"})
    return dataclasses.replace(changed, **off) if off else changed  # type: ignore[arg-type]
