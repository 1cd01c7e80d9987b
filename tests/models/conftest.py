"""Shared fixtures for tests/models: tiny model folders built once per session in a temp dir."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A qwen2 `tiny` preset folder (seed 0), private to this test session."""
    from hybridrl.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("models") / "tiny-qwen2", preset="tiny", arch="qwen2")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from hybridrl.models import build_tiny_tokenizer

    return build_tiny_tokenizer()
