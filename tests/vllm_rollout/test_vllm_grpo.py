"""GRPO end to end with actor_rollout_ref.rollout.name=vllm: two Ray ranks (FSDP2 on gloo), each
with its own in-process vLLM engine that starts from dummy weights and is synced from the actor.

Runs only where vLLM is installed (`make test-vllm`); skipped in the main venv.
"""

from __future__ import annotations

import pytest

# not plain "vllm": with tests/ on sys.path, this folder imports as a namespace package "vllm"
pytest.importorskip("vllm.entrypoints.llm")

from trainer.e2e_helpers import EXPECTED_KEYS, all_finite, config, make_assets, read_metrics  # noqa: E402

from hybridrl.trainer.main_ppo import run  # noqa: E402

pytestmark = [pytest.mark.e2e]

VLLM = {
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.dtype": "float32",  # fp32: rollout and trainer log-probs agree to 1e-4
    "actor_rollout_ref.rollout.enforce_eager": True,
    "actor_rollout_ref.rollout.max_num_seqs": 16,
    "actor_rollout_ref.rollout.calculate_log_probs": True,
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("vllm_e2e_assets"))


def test_grpo_with_vllm_rollout(assets, tmp_path, ray_session):
    run_dir = tmp_path / "grpo_vllm"
    # truncated IS correction on (verl's TIS): the actor reweights by pi_old / pi_rollout
    run(config(assets, run_dir, **VLLM, **{"actor_rollout_ref.actor.tis_imp_ratio_cap": 2.0}))
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == [0, 1, 2]
    for step in (1, 2):
        assert all_finite(metrics[step]), metrics[step]
        missing = [k for k in EXPECTED_KEYS if k not in metrics[step]]
        assert not missing, missing
        # step 1 samples from the dummy-loaded engine after its initial sync, step 2 after the
        # sync that followed step 1's update: both must be the trainer's policy, to fp32 error
        assert metrics[step]["training/rollout_log_probs_diff_max"] < 1e-4, metrics[step]
        assert metrics[step]["training/rollout_probs_diff_max"] < 1e-4
    assert metrics[2]["actor/grad_norm"] > 0
    assert "val-core/hybridrl/addition/reward/mean@1" in metrics[0]
