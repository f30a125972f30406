"""Recipes: what the examples share above the library (``padfree.torch``, ``padfree.hf``): the command-line
training loop (:mod:`padfree.recipes.loop`) and what a run says about the samples it cannot train whole
(:mod:`padfree.recipes.reach`). They may use the command line's option kit (:mod:`padfree.options`) and the
seen-log (:mod:`padfree.testing.seenlog`); ``padfree.torch`` imports neither."""
