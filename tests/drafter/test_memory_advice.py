"""``--memory-gb`` in ``examples/train_drafter.py``: when a document has more anchors than the draft blocks
its memory allows a micro-batch, the one-line error names the options that fix it (``--max-anchors N``,
``--memory-gb``, ``--budget``), and following it trains."""

import re

import pytest

from padfree.drafter import recipes
from padfree.drafter.train import build_models, memory_model

TINY = ["--limit-samples", "6", "--budget", "256", "--block-size", "4", "--max-anchors", "4"]


def test_memory_gb_below_a_documents_anchors_names_max_anchors_and_it_works(example, capsys):
    recipe = recipes.override(recipes.get("specforge", "dflash"), block_size=4)
    m = memory_model(build_models("dflash", vocab=2048, recipe=recipe))
    two_blocks = m.fixed + m.per_token * 256 + 2 * (m.per_block + m.per_reach * 256 / 2)
    gb = f"{two_blocks * 1.0001 / 2**30:.9f}"
    argv = [*TINY, "--max-steps", "1", "--memory-gb", gb]
    with pytest.raises(SystemExit) as info:
        example.run_example(lambda: example.main(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert "allows 2 draft blocks" in err[0] and "raise --memory-gb or lower --budget" in err[0], err
    assert "anchor_budget" not in err[0] and "policy" not in err[0], err
    fix = re.search(r"pass (--max-anchors \d+)", err[0]).group(1).split()
    assert example.main([*argv, *fix]) == 0
