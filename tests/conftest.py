import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
"""Real data vendored in the repository (see fixtures/README.md): tests need nothing outside it."""


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
