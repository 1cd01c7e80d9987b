"""rollout.name=vllm without vLLM installed fails at engine build with the command to run.

Runs in every venv (vLLM is hidden via sys.modules), so the main venv checks the message too.
"""

from __future__ import annotations

import sys

import pytest

from hybridrl.config import load_config
from hybridrl.models import make_tiny_model_dir
from hybridrl.rollout.vllm_engine import build_vllm_engine, import_vllm


@pytest.fixture()
def no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError


def test_import_error_names_install_commands(no_vllm):
    with pytest.raises(ImportError) as err:
        import_vllm()
    message = str(err.value)
    assert "pip install 'hybridrl[vllm]'" in message
    assert "make vllm-venv" in message
    assert sys.executable in message


def test_engine_build_from_config_reports_missing_vllm(no_vllm, tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny", preset="tiny")
    cfg = load_config([f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=vllm",
                       "actor_rollout_ref.rollout.tensor_model_parallel_size=1"], preset="grpo_quickstart")
    with pytest.raises(ImportError, match="make vllm-venv"):
        build_vllm_engine(cfg.actor_rollout_ref, cfg.trainer.device)
