"""padfree inside the drafter trainers people already run: a sampler, a collate wrapper and a model hook for
vllm ``speculators`` (:mod:`padfree.integrations.speculators`), their models fed from a padfree
``DrafterBatch`` (:mod:`padfree.integrations.feed`), and a length index plus a loader for SpecForge's offline
runs (:mod:`padfree.integrations.specforge`).

Neither trainer is a padfree dependency: these modules import their packages only when a function that needs
them runs, so ``import padfree.integrations.speculators`` works without speculators installed. Guide:
docs/integrations.md."""
