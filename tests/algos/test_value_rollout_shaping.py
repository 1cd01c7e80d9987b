"""Clipped value loss, rollout IS weights and DAPO's overlong penalty."""

import math

import pytest
import torch

from hybridrl.algos import compute_rollout_is_weights, compute_value_loss, overlong_penalty


def test_clipped_value_loss_hand_values():
    # cliprange 0.2 around the old values:
    #  t0: v=1.0 -> clip 0.7 ; (1-2)^2 = 1 < (0.7-2)^2 = 1.69 -> 1.69 (clipped)
    #  t1: v=0.0 -> clip 0.3 ; 0 < 0.09 -> 0.09 (clipped)
    #  t2: v=0.6 inside [0.3, 0.7] ; 0.16 both
    vpreds = torch.tensor([[1.0, 0.0, 0.6]], requires_grad=True)
    values = torch.full((1, 3), 0.5)
    returns = torch.tensor([[2.0, 0.0, 1.0]])
    loss, clipfrac = compute_value_loss(vpreds, returns, values, torch.ones(1, 3), 0.2)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.09 + 0.16) / 3, rel=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 3)
    (grad,) = torch.autograd.grad(loss, vpreds)
    # clipped tokens have no gradient through vpreds; t2: 0.5 * 2 * (0.6 - 1) / 3
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -0.4 / 3]]))
    summed, _ = compute_value_loss(vpreds, returns, values, torch.ones(1, 3), 0.2, "token-sum")
    assert summed.item() == pytest.approx(0.5 * 1.94, rel=1e-6)


def test_rollout_is_weights_token_sequence_and_icepop():
    rollout = torch.zeros(1, 4)
    old = torch.tensor([[math.log(0.5), math.log(1.2), math.log(3.0), 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, metrics = compute_rollout_is_weights(old, rollout, mask, "token", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.2, 2.0, 0.0]]))  # truncated at 2, masked 0
    assert metrics["rollout_corr/rollout_is_clipped_fraction"].item() == pytest.approx(1 / 3)
    w, _ = compute_rollout_is_weights(old, rollout, mask, "token", threshold=2.0, threshold_lower=0.6)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.2, 0.0, 0.0]]))  # outside [0.6, 2] -> 0
    w, _ = compute_rollout_is_weights(old, rollout, mask, "sequence", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.8, 1.8, 1.8, 0.0]]))  # 0.5 * 1.2 * 3 = 1.8
    assert not w.requires_grad
    w, _ = compute_rollout_is_weights(old, rollout, mask, "geometric", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.8 ** (1 / 3)] * 3 + [0.0]]))  # (0.5 * 1.2 * 3) ** (1/3)
    with pytest.raises(ValueError, match="unknown rollout_is level 'seq'; valid: token, sequence, geometric"):
        compute_rollout_is_weights(old, rollout, mask, "seq")


def test_rollout_is_veto_zeroes_a_sequence_with_a_catastrophic_token():
    """verl's veto: any (unmasked) token ratio below the veto threshold zeroes its whole sequence,
    whatever the level; a masked token never vetoes."""
    rollout = torch.zeros(3, 3)
    old = torch.log(torch.tensor([[1.0, 1e-5, 1.0], [0.9, 1.1, 1.0], [1.0, 1.0, 1e-6]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    for level in ("token", "sequence", "geometric"):
        w, metrics = compute_rollout_is_weights(old, rollout, mask, level, threshold=2.0, veto_threshold=1e-4)
        assert torch.equal(w[0], torch.zeros(3)) and (w[1] > 0).all() and (w[2, :2] > 0).all()
        assert metrics["rollout_corr/rollout_is_veto_fraction"].item() == pytest.approx(1 / 3)
    w, metrics = compute_rollout_is_weights(old, rollout, mask, "token", threshold=2.0)
    assert w[0, 0] > 0 and "rollout_corr/rollout_is_veto_fraction" not in metrics


def test_overlong_penalty_is_linear_in_the_buffer():
    # expected length 512 - 112 = 400 ; 456 is half way into the buffer -> -0.5 * factor
    out = overlong_penalty(torch.tensor([100, 400, 456, 512]), 512, 112, 1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.5, -1.0]))
    torch.testing.assert_close(overlong_penalty(torch.tensor([456]), 512, 112, 0.5), torch.tensor([-0.25]))
    with pytest.raises(ValueError, match="overlong_buffer.len must be > 0"):
        overlong_penalty(torch.tensor([1]), 512, 0, 1.0)
    with pytest.raises(
        ValueError, match=r"max_response_length \(100\) must be >= overlong_buffer.len \(112\)"
    ):
        overlong_penalty(torch.tensor([1]), 100, 112, 1.0)
