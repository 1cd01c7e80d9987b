"""Policy losses: hand-computed values, gradients, metrics, invariance, registry errors."""

import math

import pytest
import torch

from hybridrl.algos import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    GlobalBatchInfo,
    PolicyLossParams,
    compute_policy_loss,
    count_normalizers,
    get_policy_loss,
)

LN = math.log


def run(mode, old, new, adv, mask, agg="token-mean", **kw):
    """Loss, d loss / d log_prob, metrics as floats."""
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(mode, old, log_prob, adv, mask, agg, **kw)
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.item(), grad, {k: float(v) for k, v in metrics.items()}


# Four tokens of one sequence, clip 0.2, dual-clip c = 3:
#  t0: A=+1, r=1.5 -> max(-1.5, -1.2) = -1.2          (clipped above)
#  t1: A=-1, r=0.5 -> max(0.5, 0.8) = 0.8             (clipped below)
#  t2: A=-1, r=4   -> max(4, 1.2) = 4 -> min(4, 3) = 3 (dual clip)
#  t3: A=+2, r=1.1 -> -2.2                            (inside the trust region)
OLD = torch.zeros(1, 4)
NEW = torch.tensor([[LN(1.5), LN(0.5), LN(4.0), LN(1.1)]])
ADV = torch.tensor([[1.0, -1.0, -1.0, 2.0]])
ONES = torch.ones(1, 4)


def test_vanilla_clip_and_dual_clip():
    loss, grad, m = run("vanilla", OLD, NEW, ADV, ONES)
    assert loss == pytest.approx((-1.2 + 0.8 + 3.0 - 2.2) / 4, rel=1e-6)
    # only t3 is unclipped: d(-A r)/d log r = -A r = -2.2, over 4 tokens
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0, -0.55]]))
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(0.25)
    assert m["actor/ppo_kl"] == pytest.approx(-LN(1.5 * 0.5 * 4.0 * 1.1) / 4, rel=1e-6)


def test_vanilla_clip_higher():
    params = PolicyLossParams(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, _, _ = run("vanilla", OLD, NEW, ADV, ONES, params=params)
    assert loss == pytest.approx((-1.28 + 0.8 + 3.0 - 2.2) / 4, rel=1e-6)


def test_vanilla_log_ratio_clamp_keeps_loss_finite():
    # log r = 50 -> clamped to 20; A < 0 so the dual clip caps the loss at 3
    loss, grad, m = run(
        "vanilla", torch.zeros(1, 1), torch.full((1, 1), 50.0), -torch.ones(1, 1), torch.ones(1, 1)
    )
    assert loss == pytest.approx(3.0) and grad.item() == 0.0
    assert m["actor/ppo_kl"] == pytest.approx(-20.0)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1.0"):
        run("vanilla", OLD, NEW, ADV, ONES, params=PolicyLossParams(clip_ratio_c=1.0))


def test_gspo_sequence_ratio():
    # row 0: log r (0.1, 0.3, masked 5) -> s = exp(0.2) = 1.2214 > 1.2, A=+1: clipped -> -1.2 per token
    # row 1: log r (-0.1, -0.1) -> s = exp(-0.1), A=-1: unclipped -> +s per token, grad -A s / 4
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.1, 0.3, 5.0], [-0.1, -0.1, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss, grad, m = run("gspo", old, new, adv, mask)
    s = math.exp(-0.1)
    assert loss == pytest.approx((-2.4 + 2 * s) / 4, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0], [s / 4, s / 4, 0.0]]))
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)


def test_gpg_is_plain_policy_gradient():
    loss, grad, m = run(
        "gpg", torch.zeros(1, 2), torch.tensor([[-1.0, -2.0]]), torch.tensor([[1.0, 0.5]]), torch.ones(1, 2)
    )
    assert loss == pytest.approx((1.0 + 1.0) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -0.25]]))
    assert m == {}


def test_cispo_keeps_gradient_through_clipped_tokens():
    # t0: r = e^0.5 clipped to 1.2, A=2, logp=-1 -> loss -1.2 * 2 * -1 = 2.4, grad -2.4
    # t1: r = 1, A=-1, logp=-2 -> loss -2, grad +1 ; token-mean halves both
    old = torch.tensor([[-1.5, -2.0]])
    new = torch.tensor([[-1.0, -2.0]])
    loss, grad, m = run("cispo", old, new, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2))
    assert loss == pytest.approx(0.2, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-1.2, 0.5]]))
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)


def test_geo_mean_clips_token_log_ratios_then_takes_the_geometric_mean():
    # row 0: A=+1, log r (0.1, 0.5) -> (0.1, 0.2) -> exp(0.15) ; loss -exp(0.15)
    # row 1: A=-1, log r (-0.5, 0.1) -> (-0.2, 0.1) -> exp(-0.05) ; loss +exp(-0.05)
    old = torch.zeros(2, 2)
    new = torch.tensor([[0.1, 0.5], [-0.5, 0.1]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, _, m = run("geo_mean", old, new, adv, torch.ones(2, 2))
    expected_sum = -math.exp(0.15) + math.exp(-0.05)
    assert loss == pytest.approx(expected_sum / 2, rel=1e-6)  # mean over rows (verl)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.25) and m["actor/pg_clipfrac_lower"] == pytest.approx(
        0.25
    )
    loss, _, _ = run(
        "geo_mean", old, new, adv, torch.ones(2, 2), batch_info=GlobalBatchInfo(global_batch_size=4)
    )
    assert loss == pytest.approx(expected_sum / 4, rel=1e-6)


def test_clip_cov_detaches_eligible_high_covariance_tokens():
    # A (1, -1, 1, -1), logp (-1, -3, -1, -3): cov = (A - 0)(logp + 2) = 1 on every token.
    # t2 has r = 1.5 with A > 0, so PPO clips it and it is not eligible; the other three are
    # zeroed (clip_cov_ratio 1 -> up to 4 tokens). Loss = t2's clipped -1.2, over 4 tokens.
    new = torch.tensor([[-1.0, -3.0, -1.0, -3.0]])
    old = new.clone()
    old[0, 2] = -1.0 - LN(1.5)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    params = PolicyLossParams(clip_cov_ratio=1.0, clip_cov_lb=0.5, clip_cov_ub=5.0)
    loss, grad, m = run("clip_cov", old, new, adv, ONES, params=params)
    assert loss == pytest.approx(-0.3, rel=1e-6)
    assert torch.all(grad == 0) and m["actor/pg_clipfrac"] == pytest.approx(0.75)
    # a window no token falls in: plain PPO, (-1 + 1 - 1.2 + 1) / 4
    params = PolicyLossParams(clip_cov_ratio=1.0, clip_cov_lb=1.5, clip_cov_ub=5.0)
    loss, _, m = run("clip_cov", old, new, adv, ONES, params=params)
    assert loss == pytest.approx(-0.05, rel=1e-6) and m["actor/pg_clipfrac"] == 0.0


def test_kl_cov_penalises_the_top_covariance_token():
    # A (2, -1, 1, -1): mean 0.25 ; logp (-1, -2, -2, -3): mean -2 -> cov (1.75, 0, 0, 1.25)
    # ratio 0.25 of 4 tokens -> 1 token (t0) gets + 0.5 * |log r| = 0.05 ; log r = 0.1 everywhere
    new = torch.tensor([[-1.0, -2.0, -2.0, -3.0]])
    adv = torch.tensor([[2.0, -1.0, 1.0, -1.0]])
    params = PolicyLossParams(kl_cov_ratio=0.25, ppo_kl_coef=0.5)
    loss, _, m = run("kl_cov", new - 0.1, new, adv, ONES, params=params)
    assert loss == pytest.approx((-1.0 * math.exp(0.1) + 0.05) / 4, rel=1e-5)
    assert m["actor/ppo_kl"] == pytest.approx(0.1, rel=1e-5)


def random_batch(seed, B=8, R=6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])[:B]
    mask = (torch.arange(R)[None] < lengths[:, None]).float()
    old = -torch.rand(B, R, generator=gen) * 3
    new = old + torch.randn(B, R, generator=gen) * 0.3
    adv = torch.randn(B, R, generator=gen)
    return old, new, adv, mask


@pytest.mark.parametrize("mode", POLICY_LOSSES.names())
def test_masked_tokens_get_zero_gradient(mode):
    old, new, adv, mask = random_batch(0)
    new = torch.where(mask.bool(), new, torch.full_like(new, 7.0))  # garbage where masked
    for agg in LOSS_AGG_MODES:
        _, grad, _ = run(mode, old, new, adv, mask, agg, params=PolicyLossParams(clip_cov_ratio=0.2))
        assert torch.all(grad[mask == 0] == 0), (mode, agg)
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "gpg", "cispo", "geo_mean"])
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_micro_batch_split_matches_whole_batch(mode, agg):
    old, new, adv, mask = random_batch(1)
    num_tokens, num_seqs = count_normalizers(mask)
    info = GlobalBatchInfo(batch_num_tokens=num_tokens, global_batch_size=num_seqs)
    whole, grad_whole, _ = run(mode, old, new, adv, mask, agg, batch_info=info)
    log_prob = new.clone().requires_grad_(True)
    parts = [
        compute_policy_loss(
            mode, old[i : i + 2], log_prob[i : i + 2], adv[i : i + 2], mask[i : i + 2], agg, batch_info=info
        )[0]
        for i in range(0, 8, 2)
    ]
    (grad_split,) = torch.autograd.grad(sum(parts), log_prob)
    assert sum(parts).item() == pytest.approx(whole, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad_split, grad_whole)


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "gpg", "cispo", "kl_cov"])
def test_rollout_is_weights_scale_each_token(mode):
    old, new, adv, mask = random_batch(2)
    base, grad, _ = run(mode, old, new, adv, mask, params=PolicyLossParams(kl_cov_ratio=0.1))
    doubled, _, _ = run(
        mode,
        old,
        new,
        adv,
        mask,
        params=PolicyLossParams(kl_cov_ratio=0.1),
        rollout_is_weights=torch.full_like(adv, 2.0),
    )
    assert doubled == pytest.approx(2 * base, rel=1e-6)
    weights = torch.ones_like(adv)
    weights[0] = 0.0
    _, grad_w, _ = run(
        mode, old, new, adv, mask, params=PolicyLossParams(kl_cov_ratio=0.1), rollout_is_weights=weights
    )
    assert torch.all(grad_w[0] == 0) and torch.any(grad[0] != 0)


def test_registry_error_lists_valid_modes():
    with pytest.raises(ValueError, match=r"unknown policy_loss.loss_mode 'vanila'; valid: vanilla, gspo"):
        get_policy_loss("vanila")
