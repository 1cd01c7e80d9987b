"""An exactly on-policy update (one PPO epoch, one mini-batch) skips the old-log-prob forward and
uses the update's own detached log-probs: same step as with the forward, to float rounding."""

from __future__ import annotations

import math

import pytest

from hybridrl.trainer.main_ppo import run
from hybridrl.trainer.ppo_trainer import old_log_probs_needed
from tests.trainer.e2e_helpers import all_finite, config, make_assets, read_metrics

ON_POLICY = {"actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
             "trainer.backend": "local", "trainer.n_cpu_workers": 1, "trainer.total_training_steps": 1,
             "trainer.test_freq": -1, "trainer.val_before_train": False}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("on_policy"))


@pytest.mark.parametrize(("extra", "needed"), [
    ({}, False),
    ({"actor_rollout_ref.actor.ppo_mini_batch_size": 2}, True),  # two mini-batches: the second is off-policy
    ({"actor_rollout_ref.actor.ppo_epochs": 2}, True),
    ({"algorithm.use_kl_in_reward": True}, True),  # the KL penalty reads old_log_probs before the update
    ({"actor_rollout_ref.actor.tis_imp_ratio_cap": 2.0, "actor_rollout_ref.rollout.calculate_log_probs": True}, True),
    ({"actor_rollout_ref.actor.policy_loss.loss_mode": "clip_cov"}, True),
    # rollout IS weights only measured (rollout_is=false) still read the old log-probs
    ({"algorithm.rollout_is_threshold": 2.0, "actor_rollout_ref.rollout.calculate_log_probs": True}, True),
])
def test_old_log_probs_needed(assets, tmp_path, extra, needed):
    assert old_log_probs_needed(config(assets, tmp_path, **{**ON_POLICY, **extra})) is needed


def test_skipped_forward_gives_the_same_step(assets, tmp_path):
    skip = tmp_path / "skip"
    run(config(assets, skip, **ON_POLICY))
    # KL-in-reward at coefficient 0 leaves rewards unchanged but makes the trainer compute old log-probs
    full = tmp_path / "full"
    run(config(assets, full, **ON_POLICY, **{"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.kl_coef": 0.0}))
    a, b = read_metrics(skip)[1], read_metrics(full)[1]
    assert all_finite(a)
    assert "timing_s/old_log_prob" not in a and "timing_s/old_log_prob" in b
    assert a["actor/ppo_kl"] == 0.0 and a["actor/pg_clipfrac"] == 0.0  # ratio exactly 1
    assert abs(b["actor/ppo_kl"]) < 1e-5
    assert a["critic/advantages/mean"] == b["critic/advantages/mean"]  # same samples, same rewards
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
        assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (key, a[key], b[key])


@pytest.mark.parametrize("applied", [False, True])
def test_rollout_is_weights_are_measured_or_applied(assets, tmp_path, applied):
    """algorithm.rollout_is_threshold with rollout_is=false logs the rollout_corr/ metrics and leaves
    the loss alone (verl's "metrics only"); with rollout_is=true, geometric level and a veto, the
    weights apply and the veto fraction is logged."""
    extra = {**ON_POLICY, "algorithm.rollout_is_threshold": 2.0, "actor_rollout_ref.rollout.calculate_log_probs": True,
             "algorithm.rollout_is": applied}
    if applied:
        extra.update({"algorithm.rollout_is_level": "geometric", "algorithm.rollout_is_veto_threshold": 1e-4})
    run(config(assets, tmp_path, **extra))
    metrics = read_metrics(tmp_path)[1]
    assert all_finite(metrics) and "rollout_corr/rollout_is_mean" in metrics
    assert ("rollout_corr/rollout_is_veto_fraction" in metrics) is applied
