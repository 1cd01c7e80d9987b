"""Masked statistics, entropy and log-probs: hand-computed values and verl's conventions."""

import math

import pytest
import torch

from hybridrl.algos import (
    entropy_from_logits,
    entropy_from_logits_chunked,
    log_probs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # selects 1, 2, 4


def test_masked_mean_sum_and_eps():
    # sum 1 + 2 + 4 = 7 over 3 elements; the denominator carries verl's +1e-8.
    assert masked_sum(X, M).item() == 7.0
    # float64 resolves the eps: 7 / (3 + 1e-8) differs from 7 / 3 by 7.8e-9
    mean64 = masked_mean(X.double(), M.double()).item()
    assert mean64 == pytest.approx(7 / (3 + 1e-8), abs=1e-14)
    assert mean64 != pytest.approx(7 / 3, abs=1e-9)
    # per row: row 0 -> 3/2, row 1 -> 4/1
    torch.testing.assert_close(masked_mean(X, M, axis=-1), torch.tensor([1.5, 4.0]))
    # an empty mask gives 0 rather than NaN
    assert masked_mean(X, torch.zeros_like(M)).item() == 0.0


def test_masked_values_outside_mask_never_leak():
    poisoned = X.clone()
    poisoned[0, 2] = float("nan")
    poisoned[1, 1] = float("inf")
    assert masked_mean(poisoned, M).item() == pytest.approx(7 / 3)


def test_masked_var_is_unbiased_and_whiten_uses_rsqrt_eps():
    # deviations from 7/3: -4/3, -1/3, 5/3 -> squares sum 42/9; biased 14/9; Bessel x 3/2 -> 7/3
    assert masked_var(X, M).item() == pytest.approx(7 / 3, rel=1e-6)
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(14 / 9, rel=1e-6)
    expected = (X - 7 / 3) / math.sqrt(7 / 3 + 1e-8)
    torch.testing.assert_close(masked_whiten(X, M), expected)
    torch.testing.assert_close(masked_whiten(X, M, shift_mean=False), expected + 7 / 3)


@pytest.mark.parametrize("count", [0, 1])
def test_masked_var_refuses_fewer_than_two_elements(count):
    mask = torch.zeros_like(M)
    mask.view(-1)[:count] = 1
    with pytest.raises(ValueError, match="mask selects"):
        masked_var(X, mask)


def test_entropy_hand_values_and_chunking():
    # uniform over 8 -> ln 8; probs (1/4, 3/4) from logits (0, ln 3)
    assert entropy_from_logits(torch.zeros(8)).item() == pytest.approx(math.log(8), rel=1e-6)
    two = torch.tensor([0.0, math.log(3.0)])
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(two).item() == pytest.approx(h, rel=1e-6)
    logits = torch.randn(3, 5, 17, generator=torch.Generator().manual_seed(0))
    for chunk in (1, 4, 100):
        torch.testing.assert_close(entropy_from_logits_chunked(logits, chunk), entropy_from_logits(logits))


def test_log_probs_divide_logits_by_temperature():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    label = torch.tensor([1])
    # T=1: p = 3/4. T=2: logits (0, ln3 / 2) -> p = sqrt3 / (1 + sqrt3)
    assert log_probs_from_logits(logits, label).item() == pytest.approx(math.log(0.75), rel=1e-6)
    s3 = math.sqrt(3.0)
    assert log_probs_from_logits(logits, label, temperature=2.0).item() == pytest.approx(
        math.log(s3 / (1 + s3)), rel=1e-6
    )


def test_log_probs_chunked_match_log_softmax_and_backprop():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 33, generator=gen, requires_grad=True)
    labels = torch.randint(0, 33, (4, 6), generator=gen)
    reference = torch.log_softmax(logits / 0.7, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    for chunk in (1, 5, 1000):
        torch.testing.assert_close(log_probs_from_logits(logits, labels, 0.7, chunk), reference)
    (grad,) = torch.autograd.grad(log_probs_from_logits(logits, labels, 0.7, 5).sum(), logits)
    (ref_grad,) = torch.autograd.grad(reference.sum(), logits)
    torch.testing.assert_close(grad, ref_grad)
    bf16 = log_probs_from_logits(logits.detach().bfloat16(), labels, 0.7, 5)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), reference.detach(), atol=0.1, rtol=0.05)


def test_log_probs_rejects_bad_temperature():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        log_probs_from_logits(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), temperature=0.0)
