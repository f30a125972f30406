"""DFlash: draft blocks opened at anchors. ``spec`` (no torch): its cost, memory, recipe line and target-layer
rule; ``model`` (torch): its fields, drafter and export format."""
