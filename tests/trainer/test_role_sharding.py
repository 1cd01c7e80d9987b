"""Each role's ``fsdp_config`` reaches its TrainEngine: fsdp_size, reshard_after_forward,
forward_prefetch and model_dtype (test_ppo_e2e runs them on 2 Ray ranks; tests/engine/test_replicas
checks what the engine does with them)."""

from __future__ import annotations

import pytest
from e2e_helpers import config, make_assets

import hybridrl.workers.common as common
import hybridrl.workers.ref as ref_module
from hybridrl.engine import TrainEngine, destroy_distributed
from hybridrl.workers.actor import ActorWorker
from hybridrl.workers.critic import CriticWorker
from hybridrl.workers.ref import RefWorker


@pytest.fixture()
def engines(monkeypatch):
    """The keyword arguments of every TrainEngine the workers build (real engines still built)."""
    made = []

    class Recording(TrainEngine):
        def __init__(self, model, **kwargs):
            made.append(kwargs)
            super().__init__(model, **kwargs)

    monkeypatch.setattr(common, "TrainEngine", Recording)
    monkeypatch.setattr(ref_module, "TrainEngine", Recording)
    return made


@pytest.fixture()
def one_rank(one_rank_env):
    """A worker group of one rank: the workers join it (setup_distributed); torn down after."""
    yield
    destroy_distributed()


def test_each_role_passes_its_own_fsdp_config(tmp_path, engines, one_rank):
    assets = make_assets(tmp_path / "assets")
    cfg = config(assets, tmp_path / "run", **{
        "trainer.n_cpu_workers": 1, "critic.model.path": assets["model"], "critic.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.actor.fsdp_config.fsdp_size": 1,
        "actor_rollout_ref.actor.fsdp_config.reshard_after_forward": False,
        "actor_rollout_ref.ref.fsdp_config.fsdp_size": -1, "actor_rollout_ref.ref.fsdp_config.forward_prefetch": True,
        "actor_rollout_ref.ref.fsdp_config.model_dtype": "bf16",
        "critic.model.fsdp_config.fsdp_size": 4})
    ActorWorker(cfg, total_training_steps=2)
    RefWorker(cfg)
    CriticWorker(cfg, total_training_steps=2)
    sharding = [{k: e[k] for k in ("fsdp_size", "reshard_after_forward", "forward_prefetch", "param_dtype")}
                for e in engines]
    assert sharding == [
        {"fsdp_size": 1, "reshard_after_forward": False, "forward_prefetch": False, "param_dtype": "float32"},
        {"fsdp_size": -1, "reshard_after_forward": True, "forward_prefetch": True, "param_dtype": "bfloat16"},
        {"fsdp_size": 4, "reshard_after_forward": True, "forward_prefetch": False, "param_dtype": "float32"},
    ]
