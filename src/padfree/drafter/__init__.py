"""Drafter training on padfree batches (torch + transformers): the document contract of packed rows, the
frozen target's forward, DFlash and EAGLE-3 masks, collators, reference drafters and their check.

Anchors live in the numpy core (:mod:`padfree.core.anchors`) so that planners can count them.
"""
