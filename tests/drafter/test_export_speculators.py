"""An EAGLE-3 drafter exported by padfree loads in vllm speculators (``Eagle3DraftModel.from_pretrained``) and
gives the same logits as padfree's forward at every test-time-training step, under both recipes (SpecForge's:
pre-norm fed state, a trained head; speculators': post-norm fed state, a norm before ``fc``), with a draft
vocabulary (``d2t``/``t2d``)."""

import json

import numpy as np
import pytest
import torch

from padfree.drafter import recipes
from padfree.drafter.collate import DrafterCollator
from padfree.drafter.export import export_models
from padfree.drafter.target import load_target, run_target
from padfree.drafter.train import build_models, token_counts
from padfree.testing.targets import save_target_folder
from support.peers import import_peer, peer_missing

REASON = peer_missing("speculators")
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, hf_json):
    return save_target_folder(tmp_path_factory.mktemp("target") / "llama", hf_json, family="llama", seed=2)


def _exported(target, folder, recipe, doc, seed, out):
    """An EAGLE-3 drafter on ``target`` with perturbed (so not trivial) weights, exported in speculators'
    format to ``out``: ``(models, batch, the target's output, padfree's logits at every
    test-time-training step)``."""
    vocab = target.config.vocab_size
    m = build_models("eagle3", vocab=vocab, recipe=recipe, target=target, counts=token_counts([doc], vocab))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.trainable():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    batch = DrafterCollator("eagle3", recipe=recipe, layout="packed")([doc])
    out_t = run_target(m.target, batch.contract, m.layers)
    with torch.no_grad():
        ours = [m.drafter.lm_head(h) for h in m.drafter(out_t.hidden, batch)]
    export_models(m, "speculators", out, mask_token_id=0, target_path=folder)
    return m, batch, out_t, ours


@pytest.mark.parametrize("name", ["specforge", "speculators"])
def test_speculators_loads_the_export_and_computes_the_same_logits(tmp_path, folder, name):
    target = load_target(folder)
    recipe = recipes.override(recipes.get(name, "eagle3"), ttt=3, draft_vocab=300)
    n = 40
    rng = np.random.default_rng(1)
    ids = rng.integers(2, 3000, n)
    mask = np.zeros(n, bool)
    mask[10:] = True
    doc = {"input_ids": ids, "loss_mask": mask, "sample_id": 0}
    m, batch, out, ours = _exported(target, folder, recipe, doc, 0, tmp_path / "served")
    config = json.loads((tmp_path / "served" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in m.layers]
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(folder.resolve())

    import_peer("speculators")
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(str(tmp_path / "served"))
    cfg.transformer_layer_config._attn_implementation = "sdpa"  # their default is flex attention (GPU)
    theirs = Eagle3DraftModel.from_pretrained(str(tmp_path / "served"), config=cfg).eval()
    assert theirs.draft_vocab_size == 300 and bool(theirs.t2d[m.drafter.vocab.d2t].all())
    logits: list[torch.Tensor] = []
    hook = theirs.lm_head.register_forward_hook(lambda _m, _i, o: logits.append(o[0]))
    t = n - 1  # their rows are shifted: hidden state t beside token t + 1 (speculators' shift_batch)
    with torch.no_grad():
        theirs(
            hidden_states=out.hidden[:, :t],
            input_ids=torch.from_numpy(ids[1:])[None],
            document_ids=torch.zeros(1, t, dtype=torch.long),
            position_ids=torch.arange(1, t + 1)[None],
            ttt_steps=3,
        )
    hook.remove()
    assert len(logits) == 3
    for k in range(3):  # step k at position t is fed tokens up to t + 1 + k: compare where they exist
        worst = (logits[k][: t - k] - ours[k][: t - k]).abs().max().item()
        assert worst < 1e-4 * max(1.0, ours[k].abs().max().item()), (k, worst)


LOAD_ON_CPU = """\
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
cfg = Eagle3SpeculatorConfig.from_pretrained(path)
cfg.transformer_layer_config._attn_implementation = "sdpa"  # CPU: their default, flex attention, fails there
model = Eagle3DraftModel.from_pretrained(path, config=cfg)
"""
"""How the README loads an EAGLE-3 export in speculators' class on a CPU, verbatim."""

RUN_THEIRS = """
import sys, types, torch
path, io = sys.argv[1], sys.argv[2]
{load}
for name in ("openai", "hs_connectors"):  # the real packages (make drafter), not padfree's test stubs
    assert isinstance(sys.modules[name], types.ModuleType) and sys.modules[name].__file__, name
x = torch.load(io)
logits = []
model.lm_head.register_forward_hook(lambda _m, _i, o: logits.append(o[0]))
with torch.no_grad():
    model.eval()(hidden_states=x["hidden"], input_ids=x["ids"], document_ids=torch.zeros_like(x["ids"]),
                 position_ids=torch.arange(1, x["ids"].shape[1] + 1)[None], ttt_steps=x["ttt"])
torch.save(logits, io)
"""


def _installed(*names: str) -> bool:
    import importlib.metadata

    try:
        return all(importlib.metadata.version(n) for n in names)
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(
    not _installed("openai", "hs-connectors"), reason="openai / hs-connectors not installed (make drafter)"
)
def test_the_readme_loads_an_export_in_speculators_on_cpu_without_padfrees_stubs(tmp_path, folder):
    """A fresh process with what ``make drafter`` installs: no ``support.peers`` stubs, the README's
    lines; its logits are padfree's at every step."""
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert LOAD_ON_CPU in readme
    target = load_target(folder)
    recipe = recipes.override(recipes.get("specforge", "eagle3"), ttt=2, draft_vocab=300)
    rng = np.random.default_rng(3)
    n = 30
    doc = {"input_ids": rng.integers(2, 3000, n), "loss_mask": np.ones(n, bool), "sample_id": 0}
    m, batch, out, ours = _exported(target, folder, recipe, doc, 1, tmp_path / "served")
    t = n - 1
    io = tmp_path / "io.pt"
    ids = torch.from_numpy(doc["input_ids"][1:])[None]
    torch.save({"hidden": out.hidden[:, :t], "ids": ids, "ttt": 2}, io)
    script = RUN_THEIRS.format(load=LOAD_ON_CPU)
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "served"), str(io)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = torch.load(io)
    assert len(theirs) == 2
    for k in range(2):
        worst = (theirs[k][: t - k] - ours[k][: t - k]).abs().max().item()
        assert worst < 1e-4 * max(1.0, ours[k].abs().max().item()), (k, worst)
