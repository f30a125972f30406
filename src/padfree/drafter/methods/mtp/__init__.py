"""MTP fine-tuning: steps on the target's last layer. ``spec`` (no torch): its cost, memory, recipe line and
target-layer rule; ``model`` (torch): its fields, drafter and export format."""
