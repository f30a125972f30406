"""DFlash2: DFlash's draft blocks with a block-local dynamic convolution and a candidate selector. ``spec``
(no torch): its cost, memory and recipe line; ``model`` (torch): its fields, drafter and export format."""
