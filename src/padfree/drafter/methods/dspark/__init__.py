"""DSpark (DeepSpec's, as vllm speculators' ``DSparkDraftModel`` trains it): DFlash's blocks sampled from the
anchor, with a Markov head and a confidence head (:mod:`.spec` without torch, :mod:`.model` with it)."""
