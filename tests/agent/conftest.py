"""Fixtures for the multi-turn tests: the real tiny tokenizer (built once) and a tiny model folder."""

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from hybridrl.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from hybridrl.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("agent-models") / "tiny", preset="tiny", arch="qwen2")
