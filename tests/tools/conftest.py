"""Shared assets of the tools tests: one tiny model folder and one small synthetic parquet."""

import pytest

from hybridrl.data.preprocess import prepare
from hybridrl.models import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tools_model") / "tiny", preset="tiny")


@pytest.fixture(scope="session")
def addition_parquet(tmp_path_factory):
    return prepare("addition", tmp_path_factory.mktemp("tools_data"), n=8, n_test=6, seed=0, max_digits=2)["test"]
