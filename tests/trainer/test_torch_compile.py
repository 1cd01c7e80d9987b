"""``actor_rollout_ref.actor.use_torch_compile``: the actor and reference engines compile their
transformer blocks, and a training step gives the eager step's numbers."""

from __future__ import annotations

import math

import pytest
import torch._dynamo

from hybridrl.engine import cpu_attention
from hybridrl.trainer.main_ppo import run
from tests.trainer.e2e_helpers import all_finite, comparable, config, make_assets, read_metrics

ONE_STEP = {"trainer.backend": "local", "trainer.n_cpu_workers": 1, "trainer.total_training_steps": 1,
            "trainer.test_freq": -1, "trainer.val_before_train": False,
            "actor_rollout_ref.actor.use_kl_loss": True}  # the reference model runs too


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("compile"))


def test_compiled_step_gives_the_eager_numbers(assets, tmp_path):
    run(config(assets, tmp_path / "eager", **ONE_STEP))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    before, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    run(config(assets, tmp_path / "compiled", **ONE_STEP, **{"actor_rollout_ref.actor.use_torch_compile": True}))
    assert counters["stats"]["unique_graphs"] > before  # the local backend runs in this process
    # the attention kernels are custom ops: each block is one graph, shared prompts included
    assert cpu_attention.available() and sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    eager, compiled = comparable(read_metrics(tmp_path / "eager")[1]), comparable(read_metrics(tmp_path / "compiled")[1])
    assert all_finite(compiled) and eager.keys() == compiled.keys()
    assert "actor/kl_loss" in compiled
    for key, value in eager.items():
        # ppo_kl is the mean difference between the old log-probs and the update's for the same weights:
        # rounding alone (the prompt-sharing forwards of each phase compile to different graphs, whose
        # log-probs agree to the engine's 5e-6 tolerance, tests/engine/test_shared_prefix.py)
        tol = 5e-6 if key == "actor/ppo_kl" else 1e-6
        assert math.isclose(compiled[key], value, rel_tol=1e-4, abs_tol=tol), (key, compiled[key], value)
