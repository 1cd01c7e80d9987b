"""Shared fixture for the data tests: the built-in tiny tokenizer."""

import pytest

from hybridrl.models.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tiny_tokenizer()
