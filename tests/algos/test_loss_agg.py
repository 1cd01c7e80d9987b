"""agg_loss: hand values per mode, and micro-batch / rank invariance with global normalizers."""

import pytest
import torch

from hybridrl.algos import LOSS_AGG_MODES, agg_loss, count_normalizers

# Row 2 is fully masked: it must not count as a sequence in the seq-mean modes.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("token-sum", 7.0),
        ("seq-mean-token-sum", 3.5),  # sequences 3 and 4, mean over the 2 non-empty ones
        ("seq-mean-token-mean", 2.75),  # sequence means 1.5 and 4 (each / (n + 1e-8))
        ("seq-mean-token-sum-norm", 3.5 / 3),  # default loss_scale_factor = R = 3
    ],
)
def test_hand_values(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected, rel=1e-6)


def test_explicit_normalizers():
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7).item() == pytest.approx(0.5)
    # token-mean with a global count of 14 tokens over 2 ranks: 7 / 14 * 2
    assert agg_loss(LOSS, MASK, "token-mean", dp_size=2, batch_num_tokens=14).item() == pytest.approx(1.0)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", dp_size=2, global_batch_size=4).item() == pytest.approx(
        3.5
    )


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'token_mean'; valid: token-mean"):
        agg_loss(LOSS, MASK, "token_mean")
    with pytest.raises(ValueError, match="dp_size=2 needs the global batch_num_tokens"):
        agg_loss(LOSS, MASK, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        agg_loss(LOSS, MASK, "seq-mean-token-mean", dp_size=2)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_micro_batch_gives_zero_not_nan(mode):
    empty = torch.zeros(2, 3)
    assert agg_loss(torch.ones(2, 3), empty, mode).item() == 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_split_over_ranks_and_micro_batches_matches_whole_batch(mode):
    gen = torch.Generator().manual_seed(0)
    B, R = 8, 6
    weights = torch.randn(B, R, generator=gen, requires_grad=True)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])  # one empty sequence
    mask = (torch.arange(R)[None] < lengths[:, None]).float()

    whole = agg_loss(weights**2, mask, mode)
    (grad_whole,) = torch.autograd.grad(whole, weights)

    # 2 ranks x 2 micro-batches of 2; counts all-reduced over the whole mini-batch.
    num_tokens, num_seqs = count_normalizers(mask)
    assert (num_tokens.item(), num_seqs.item()) == (27.0, 7)
    ranks = []
    for rank_rows in (range(0, 4), range(4, 8)):
        micro = [
            agg_loss(
                weights[i : i + 2] ** 2,
                mask[i : i + 2],
                mode,
                dp_size=2,
                batch_num_tokens=num_tokens,
                global_batch_size=num_seqs,
            )
            for i in list(rank_rows)[::2]
        ]
        ranks.append(sum(micro))
    # FSDP/DDP average gradients over ranks: the average of the per-rank sums is the whole loss.
    split = sum(ranks) / 2
    (grad_split,) = torch.autograd.grad(split, weights)
    torch.testing.assert_close(split, whole)
    torch.testing.assert_close(grad_split, grad_whole)
    # Masked tokens get no gradient.
    assert torch.all(grad_whole[mask == 0] == 0)
