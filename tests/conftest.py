import contextlib
import datetime
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, settings

# no deadline, no too-slow health check: a loaded 2-core machine (CI beside other jobs) runs an example many
# times slower than an idle one, and that says nothing about the code
_LOAD_PROOF = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", max_examples=60, **_LOAD_PROOF)
settings.register_profile("dev", max_examples=30, **_LOAD_PROOF)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

ROOT = Path(__file__).resolve().parents[1]
HANG_S = 400
"""How long a test's subprocess may run before the test calls it hung: a torch import alone takes tens of
seconds on a loaded 2-core machine, and a real hang never ends."""


def extras_packages(names: str) -> set[str]:
    """The package names (lower case, ``_`` as ``-``) the extras ``names`` ("a,b") of pyproject.toml require,
    ``padfree[...]`` self-references followed."""
    import re

    import tomllib

    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out: set[str] = set()
    todo = names.split(",")
    while todo:
        for req in table[todo.pop()]:
            self_ref = re.fullmatch(r"padfree\[([\w,-]+)\]", req)
            if self_ref:
                todo += self_ref.group(1).split(",")
            else:
                out.add(re.split(r"[<>=!\[ ;]", req, maxsplit=1)[0].lower().replace("_", "-"))
    return out


FIXTURES = ROOT / "fixtures"
"""Real data vendored in the repository (see fixtures/README.md): tests need nothing outside it."""

TINY_MODEL = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2}  # fmt: skip
"""The smallest model sizes the training tests build (``build_model(name, **TINY_MODEL)``); tests import it
with ``from conftest import TINY_MODEL`` and override what they need."""

GQA_MODEL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
"""Two layers with grouped-query heads: what the attention and chunked-schedule tests compare paths on."""


@pytest.fixture(autouse=True)
def _transformers_logs_to_the_real_stderr() -> Iterator[None]:
    """transformers binds its log handler to ``sys.stderr`` when it first logs: inside a test that captures
    output that is the test's capture stream, closed after it, and every later warning then prints a
    "Logging error" traceback into whichever test is capturing. Point it at the process's own stderr."""
    hf_logging = sys.modules.get("transformers.utils.logging")
    handler = getattr(hf_logging, "_default_handler", None)
    if handler is not None and handler.stream is not sys.__stderr__:
        handler.stream = sys.__stderr__  # not setStream: it would flush the closed stream first
        handler.flush = sys.__stderr__.flush  # transformers binds flush to the stream it started with
    yield


@pytest.fixture(scope="session")
def seed_mix() -> np.ndarray:
    from padfree.data.length_files import bundled_seed_mix

    return bundled_seed_mix().astype(np.int64)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def sp_model() -> Path:
    """The 32K SentencePiece tokenizer (LLaMA-style)."""
    return FIXTURES / "tokenizers" / "llama_sp32k.model"


@pytest.fixture(scope="session")
def hf_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 129K Hugging Face tokenizer.json, unpacked from its .xz once per session."""
    import lzma

    out = tmp_path_factory.mktemp("tokenizers") / "deepseek_v3_tokenizer.json"
    out.write_bytes(lzma.decompress((FIXTURES / "tokenizers" / "deepseek_v3_tokenizer.json.xz").read_bytes()))
    return out


@contextlib.contextmanager
def gloo_group(rank: int = 0, world: int = 1, store_file: str | None = None) -> Iterator[None]:
    """A gloo process group for the duration of the block: ranks spawned by a test meet through
    ``store_file`` (and run one CPU thread each, as two cores are shared), a single rank uses an in-memory
    store. Spawned workers import it with ``from conftest import gloo_group``."""
    import torch
    import torch.distributed as dist

    if store_file is None:
        where: dict = {"store": dist.HashStore()}
    else:
        torch.set_num_threads(1)
        where = {"init_method": f"file://{store_file}"}
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60), **where
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture()
def gloo() -> Iterator[None]:
    """A one-rank gloo process group around the test."""
    with gloo_group():
        yield


class Refusals:
    """Counts a property test's examples and the ones its code under test refused.

    ``refuse()`` rejects the example with ``assume(False)``: hypothesis draws another, so the examples it
    counts were all checked; ``check(most)`` fails when more than ``most`` of the examples were refused (a
    strategy that mostly draws refused inputs would test little)."""

    def __init__(self) -> None:
        self.runs = 0
        self.refused = 0

    def seen(self) -> None:
        self.runs += 1

    def refuse(self) -> None:
        self.refused += 1
        assume(False)

    def check(self, most: float) -> None:
        assert self.runs > 0
        share = self.refused / self.runs
        assert share <= most, f"{self.refused} of {self.runs} examples refused ({share:.0%} > {most:.0%})"


@pytest.fixture()
def refusals() -> Refusals:
    return Refusals()


@pytest.fixture(scope="module")
def example():
    """``examples/train_drafter.py`` as a module (``main(argv)``, ``run_example``), for the drafter tests."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "train_drafter_example", root / "examples" / "train_drafter.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
