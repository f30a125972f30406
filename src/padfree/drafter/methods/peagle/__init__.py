"""P-EAGLE: parallel depths over COD-sampled chains. ``spec`` (no torch): its cost, memory and recipe line;
``model`` (torch): its fields, drafter and export format."""
