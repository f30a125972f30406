"""Drafter training on padfree batches (torch + transformers): the document contract of packed rows, the
frozen target's forward, masks, collators, reference drafters and their check.

Anchors live in the numpy core (:mod:`padfree.core.anchors`) so that planners can count them. Each method is
one folder, ``methods/<name>/``: ``spec.py`` (no torch: cost, memory terms, recipe line, memory bound, the
``Method`` record), ``model.py`` (torch: fields, drafter, export format) and ``__init__.py`` (its docstring);
the registry (:mod:`padfree.drafter.methods`) imports the spec and its presets are in
:mod:`padfree.drafter.recipes` (docs/drafters.md, "How to add a method"). Sizes are one record,
:class:`padfree.drafter.sizes.Sizes`.
"""
