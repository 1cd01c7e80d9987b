"""Advantage estimators: hand-computed values, group permutation invariance, registry errors."""

import math

import numpy as np
import pytest
import torch

from hybridrl.algos import ADV_ESTIMATORS, compute_advantage, get_adv_estimator


def outcome(scores, lengths, R=3):
    """Rewards (B, R) with each score on the last valid token, and the right-padded mask."""
    mask = (torch.arange(R)[None] < torch.tensor(lengths)[:, None]).float()
    rewards = torch.zeros(len(scores), R)
    rewards[torch.arange(len(scores)), torch.tensor(lengths) - 1] = torch.tensor(scores, dtype=torch.float32)
    return rewards, mask


def uids(*names):
    return np.array(names, dtype=object)


# Group "a" scores (1, 0, 1): mean 2/3; unbiased std sqrt(((1/3)^2 + (2/3)^2 + (1/3)^2) / 2) = sqrt(1/3).
# Group "b" is a single sample with score 2: mean 0, std 1 by convention.
REWARDS, MASK = outcome([1, 0, 1, 2], [3, 2, 1, 3])
INDEX = uids("a", "a", "a", "b")


def scalars(adv):
    """The per-sequence value broadcast over valid tokens (checks masked tokens are 0)."""
    assert torch.all(adv[MASK == 0] == 0)
    return (adv * MASK).sum(-1) / MASK.sum(-1)


def test_grpo_bessel_std_and_singleton_group():
    adv, ret = compute_advantage("grpo", REWARDS, MASK, INDEX)
    s = math.sqrt(1 / 3) + 1e-6
    expected = torch.tensor([(1 / 3) / s, (-2 / 3) / s, (1 / 3) / s, 2 / (1 + 1e-6)])
    torch.testing.assert_close(scalars(adv), expected)
    assert ret is adv or torch.equal(ret, adv)


def test_dr_grpo_skips_the_std():
    adv, _ = compute_advantage("grpo", REWARDS, MASK, INDEX, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(scalars(adv), torch.tensor([1 / 3, -2 / 3, 1 / 3, 2.0]))


def test_grpo_passk_only_the_best_sample_gets_the_margin():
    rewards, mask = outcome([1, 3, 2, 3, 3, 1], [3, 3, 3, 3, 3, 3])
    index = uids("a", "a", "a", "b", "b", "b")
    adv, _ = compute_advantage("grpo_passk", rewards, mask, index)
    # group a: max 3, second 2, std([1, 3, 2]) = 1 -> 1 / (1 + 1e-6) on row 1; group b ties -> 0
    torch.testing.assert_close(adv[:, 0], torch.tensor([0, 1 / (1 + 1e-6), 0, 0, 0, 0]))
    adv, _ = compute_advantage("grpo_passk", rewards, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0, 1.0, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="grpo_passk needs >= 2 samples per group; uid 'b' has 1"):
        compute_advantage("grpo_passk", rewards[:4], mask[:4], index[:4])


def test_rloo_leave_one_out_baseline():
    adv, _ = compute_advantage("rloo", REWARDS, MASK, INDEX)
    # 1 - (0 + 1) / 2 = 0.5 ; 0 - (1 + 1) / 2 = -1 ; singleton keeps its raw score 2
    torch.testing.assert_close(scalars(adv), torch.tensor([0.5, -1.0, 0.5, 2.0]))


def test_opo_length_weighted_baseline():
    rewards, mask = outcome([1, 0, 5], [2, 3, 1])
    adv, _ = compute_advantage("opo", rewards, mask, uids("a", "a", "b"))
    # baseline a = (2 * 1 + 3 * 0) / 5 = 0.4 ; singleton baseline 0
    torch.testing.assert_close(adv.sum(-1) / mask.sum(-1), torch.tensor([0.6, -0.4, 5.0]))


def test_gpg_scales_by_fraction_of_nonzero_scores():
    adv, _ = compute_advantage("gpg", REWARDS, MASK, INDEX)
    # 3 of 4 scores non-zero -> alpha = 4 / 3 ; a: 4/3 * (s - 2/3) ; b: 4/3 * 2
    torch.testing.assert_close(scalars(adv), torch.tensor([4 / 9, -8 / 9, 4 / 9, 8 / 3]))


def test_reinforce_plus_plus_baseline_whitens_over_the_batch():
    rewards, mask = outcome([1, 0, 1], [1, 1, 1], R=1)
    adv, ret = compute_advantage("reinforce_plus_plus_baseline", rewards, mask, uids("a", "a", "a"))
    # centered (1/3, -2/3, 1/3): mean 0, unbiased var 1/3 -> divided by sqrt(1/3 + 1e-8)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1 / 3, -2 / 3, 1 / 3]) / math.sqrt(1 / 3 + 1e-8))
    torch.testing.assert_close(ret, adv)


def test_reinforce_plus_plus_discounts_and_skips_observation_tokens():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    full, holed = torch.ones(1, 3), torch.tensor([[1.0, 0.0, 1.0]])
    _, ret = compute_advantage("reinforce_plus_plus", rewards, full, None, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[2.75, 3.5, 3.0]]))  # 3 ; 2 + 1.5 ; 1 + 1.75
    adv, ret = compute_advantage("reinforce_plus_plus", rewards, holed, None, gamma=0.5)
    # the masked token has return 0 and carries G = 3 through: 1 + 0.5 * 3 = 2.5
    torch.testing.assert_close(ret, torch.tensor([[2.5, 0.0, 3.0]]))
    # whitening two values gives -+1/sqrt(2) (unbiased var 0.125)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 1.0]]) / math.sqrt(2.0), rtol=1e-5, atol=1e-6)


def test_remax_subtracts_the_greedy_baseline():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = compute_advantage("remax", rewards, mask, None, reward_baselines=torch.tensor([0.4]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.6, 0.6, 0.0]]))


def test_gae_recursion_and_masked_carry_through():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.1]])
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72):
    # t2: delta = 1 - 0.1 = 0.9 ; t1: delta = 0.9 * 0.1 - 0.2 = -0.11, A = -0.11 + 0.72 * 0.9 = 0.538
    # t0: delta = 0.9 * 0.2 - 0.5 = -0.32, A = -0.32 + 0.72 * 0.538 = 0.06736
    _, ret = compute_advantage("gae", rewards, torch.ones(1, 3), None, values=values, gamma=0.9, lam=0.8)
    torch.testing.assert_close(ret, torch.tensor([[0.06736 + 0.5, 0.538 + 0.2, 0.9 + 0.1]]))
    # token 1 is an observation: V and A carry through it, so at t0 next value = V2 = 0.1:
    # delta = 0.09 - 0.5 = -0.41, A0 = -0.41 + 0.72 * 0.9 = 0.238 ; the masked slot holds 0.9
    holed = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = compute_advantage("gae", rewards, holed, None, values=values, gamma=0.9, lam=0.8)
    torch.testing.assert_close(ret, torch.tensor([[0.738, 1.1, 1.0]]))
    # whitened over the two valid tokens (0.238, 0.9): mean 0.569, -+1/sqrt(2)
    torch.testing.assert_close(
        adv[0, [0, 2]], torch.tensor([-1.0, 1.0]) / math.sqrt(2.0), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("name", ["grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"])
def test_permuting_groups_permutes_advantages(name):
    gen = torch.Generator().manual_seed(0)
    B, G, R = 12, 3, 5
    scores = torch.randn(B, generator=gen)  # continuous: no ties for pass@k
    rewards, mask = outcome(scores.tolist(), torch.randint(1, R + 1, (B,), generator=gen).tolist(), R)
    index = np.array([f"p{i // G}" for i in range(B)], dtype=object)
    adv, _ = compute_advantage(name, rewards, mask, index)
    perm = torch.randperm(B, generator=gen)
    adv_perm, _ = compute_advantage(name, rewards[perm], mask[perm], index[perm.numpy()])
    torch.testing.assert_close(adv_perm, adv[perm])


def test_every_estimator_takes_the_uniform_signature():
    gen = torch.Generator().manual_seed(1)
    rewards, mask = outcome(torch.rand(6, generator=gen).tolist(), [3, 1, 2, 3, 2, 3])
    kwargs = dict(
        values=torch.randn(6, 3, generator=gen),
        reward_baselines=torch.rand(6, generator=gen),
        gamma=1.0,
        lam=1.0,
        norm_adv_by_std_in_grpo=True,
        epsilon=1e-6,
    )
    for name in ADV_ESTIMATORS.names():
        adv, ret = compute_advantage(name, rewards, mask, uids(*"aabbcc"), **kwargs)
        assert adv.shape == ret.shape == (6, 3) and torch.isfinite(adv).all(), name


def test_registry_and_input_errors():
    with pytest.raises(
        ValueError, match=r"unknown adv_estimator 'grpoo'; valid: gae, grpo, .*did you mean 'grpo'"
    ):
        get_adv_estimator("grpoo")
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['gama'\]"):
        compute_advantage("grpo", REWARDS, MASK, INDEX, gama=0.9)
    with pytest.raises(ValueError, match="needs values"):
        compute_advantage("gae", REWARDS, MASK, INDEX)
    with pytest.raises(ValueError, match="needs reward_baselines"):
        compute_advantage("remax", REWARDS, MASK, INDEX)
    with pytest.raises(ValueError, match="needs index"):
        compute_advantage("grpo", REWARDS, MASK, None)
    with pytest.raises(ValueError, match="index has 3 uids for 4 rows"):
        compute_advantage("rloo", REWARDS, MASK, INDEX[:3])
