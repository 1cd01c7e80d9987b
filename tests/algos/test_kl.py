"""KL estimators, straight-through variants, controllers and KL-in-reward."""

import math

import pytest
import torch

from hybridrl.algos import (
    KL_PENALTIES,
    AdaptiveKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
)

LN2 = math.log(2.0)
# log p = ln 0.5, log p_ref = ln 0.25: d = log p - log p_ref = ln 2
LOGP = torch.tensor([math.log(0.5)])
REF = torch.tensor([math.log(0.25)])


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("kl", "k1"), LN2),
        (("abs",), LN2),
        (("mse", "k2"), 0.5 * LN2**2),
        (("low_var_kl", "k3"), 0.5 + LN2 - 1),  # exp(-ln2) - (-ln2) - 1
    ],
)
def test_estimator_values(names, expected):
    for name in names:
        assert kl_penalty(LOGP, REF, name).item() == pytest.approx(expected, rel=1e-6)
        assert kl_penalty(LOGP, REF, name + "+").item() == pytest.approx(expected, rel=1e-6)


def test_low_var_kl_clamps():
    logp = torch.zeros(3)
    ref = torch.tensor([30.0, -30.0, 0.5])
    out = kl_penalty(logp, ref, "low_var_kl")
    # ref - logp clamped to +-20: exp(20) - 21 and exp(-20) + 19 both exceed 10 -> clamped to 10
    assert out[0].item() == 10.0 and out[1].item() == 10.0
    assert out[2].item() == pytest.approx(math.exp(0.5) - 1.5, rel=1e-6)  # inside both clamps


@pytest.mark.parametrize("name", [n for n in KL_PENALTIES.names() if n.endswith("+")])
def test_straight_through_has_k2_gradient(name):
    logp = torch.tensor([-0.3, -2.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -0.5, -1.0])
    (grad,) = torch.autograd.grad(kl_penalty(logp, ref, name).sum(), logp)
    torch.testing.assert_close(grad, (logp - ref).detach())  # d/dlogp 0.5 (logp - ref)^2


def test_k1_gradient_is_one_without_plus():
    logp = torch.tensor([-0.3, -2.0], requires_grad=True)
    (grad,) = torch.autograd.grad(kl_penalty(logp, torch.zeros(2), "k1").sum(), logp)
    torch.testing.assert_close(grad, torch.ones(2))


def test_unknown_kl_type():
    with pytest.raises(ValueError, match=r"unknown kl_penalty 'k4'; valid: kl, k1, abs"):
        kl_penalty(LOGP, REF, "k4")


def test_adaptive_controller_update_rule():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.02, horizon=1000)
    ctrl.update(current_kl=0.05, n_steps=100)  # error clip(1.5) = 0.2 -> x (1 + 0.2 * 0.1)
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.019, n_steps=100)  # error -0.05 -> x (1 - 0.005)
    assert ctrl.value == pytest.approx(0.102 * 0.995)
    fresh = build_kl_controller("adaptive", 1.0, target_kl=0.02, horizon=1000)
    fresh.load_state_dict(ctrl.state_dict())
    assert fresh.value == ctrl.value


def test_controller_errors():
    with pytest.raises(ValueError, match="unknown kl_ctrl.type 'fix'; valid: fixed, adaptive"):
        build_kl_controller("fix", 0.1)
    with pytest.raises(ValueError, match="horizon must be > 0"):
        build_kl_controller("adaptive", 0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="needs kl_ctrl.target_kl"):
        build_kl_controller("adaptive", 0.1)


def test_apply_kl_penalty_uses_beta_before_update_and_logs_sequence_mean():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ref = torch.zeros(2, 3)
    old = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.2, 9.0]])  # 9.0 is masked out
    ctrl = build_kl_controller("adaptive", 0.5, target_kl=0.1, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, "kl")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 1.9, 0.0]]))
    # per-sequence means 0.2 and 0.3 -> 0.25 ; error clip(1.5) = 0.2 ; beta 0.5 * (1 + 0.2 * 2 / 10)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.25)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    assert ctrl.value == pytest.approx(0.52)
    fixed = build_kl_controller("fixed", 0.5)
    apply_kl_penalty(scores, old, ref, mask, fixed, "low_var_kl")
    assert fixed.value == 0.5
