"""EAGLE-3: test-time-training steps at every position. ``spec`` (no torch): its cost, memory, recipe line and
target-layer rule; ``model`` (torch): its fields, drafter and export format."""
