"""Reducing a per-token loss matrix (B, R) to the scalar that is back-propagated.

``loss_agg_mode`` (verl's ``actor_rollout_ref.actor.loss_agg_mode`` / ``critic.loss_agg_mode``):

==========================  ===========================================================
``token-mean``              sum over valid tokens / number of valid tokens (default)
``token-sum``               sum over valid tokens
``seq-mean-token-sum``      per sequence: sum over its tokens; then mean over sequences
``seq-mean-token-mean``     per sequence: mean over its tokens; then mean over sequences
``seq-mean-token-sum-norm`` ``seq-mean-token-sum / loss_scale_factor`` (Dr.GRPO; default R)
==========================  ===========================================================

How the caller keeps the loss independent of micro-batching and data parallelism
---------------------------------------------------------------------------------
A mini-batch is split over ``dp_size`` ranks and, on each rank, over micro-batches; each
micro-batch's loss is back-propagated and the gradients accumulate. Before the first
micro-batch the caller counts, over the WHOLE mini-batch (all micro-batches of all ranks, an
all-reduce SUM across ranks)::

    batch_num_tokens  = response_mask.sum()                       # token-mean
    global_batch_size = (response_mask.sum(-1) > 0).sum()         # seq-mean-*

(:func:`count_normalizers` does the local part) and passes both, with ``dp_size``, to every
``agg_loss`` call. Each micro-batch then contributes ``its share * dp_size``, so:

- summing the micro-batch losses of one rank and AVERAGING over ranks (what FSDP/DDP do to
  gradients) equals the loss of the whole mini-batch computed at once with ``dp_size=1``;
- with ``dp_size=1`` the plain sum over micro-batches equals the whole-batch loss.

Do not divide by the number of micro-batches (gradient accumulation) on top of this. Without
normalizers (and ``dp_size == 1``) the local counts are used, which is exact for one whole batch.
``loss_scale_factor`` should be a constant (e.g. the max response length): its default, the
padded width ``R`` of the micro-batch, changes with padding.

Deviation from verl: when the locally computed count is 0 (a micro-batch without any valid
token and no global count given) verl returns 0/0 = NaN; here the count is taken as 1 so the
loss is 0 and its gradient zero. Every non-degenerate input gives verl's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.algos.functional import masked_sum

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@dataclass(frozen=True)
class GlobalBatchInfo:
    """Normalizers of a whole mini-batch (all ranks, all micro-batches), passed to :func:`agg_loss`.

    ``batch_num_tokens``: valid tokens; ``global_batch_size``: sequences with >= 1 valid token;
    ``dp_size``: data-parallel world size whose gradient average is undone;
    ``loss_scale_factor``: divisor of ``seq-mean-token-sum-norm`` (None: the padded width R).
    """

    dp_size: int = 1
    batch_num_tokens: float | torch.Tensor | None = None
    global_batch_size: float | torch.Tensor | None = None
    loss_scale_factor: float | None = None

    def as_kwargs(self) -> dict:
        return {
            "dp_size": self.dp_size,
            "batch_num_tokens": self.batch_num_tokens,
            "global_batch_size": self.global_batch_size,
            "loss_scale_factor": self.loss_scale_factor,
        }


def count_normalizers(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Local ``(num_tokens, num_seqs)`` of a (B, R) mask; all-reduce SUM them across ranks/micro-batches."""
    num_tokens = response_mask.sum()
    num_seqs = (response_mask.sum(dim=-1) > 0).sum()
    return num_tokens, num_seqs


def _local_or_global(local: torch.Tensor, given, dp_size: int, name: str, mode: str):
    if given is not None:
        return given
    if dp_size > 1:
        raise ValueError(f"agg_loss: loss_agg_mode={mode!r} with dp_size={dp_size} needs the global {name}")
    # A micro-batch with nothing valid: count 1 so the loss is 0 instead of 0/0 = NaN.
    return torch.where(local > 0, local, torch.ones_like(local))


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` (B, R) over ``loss_mask`` (B, R) into a scalar (verl's ``agg_loss``).

    See the module docstring for the modes and for how ``dp_size``, ``batch_num_tokens``
    (token-mean) and ``global_batch_size`` (seq-mean-*) make the sum over micro-batches and the
    average over ranks equal to the whole-batch loss. Sequences whose mask is all zero do not
    count in the seq-mean denominators. ``seq-mean-token-mean`` averages each sequence with a
    ``+1e-8`` in its token count, as verl does.
    """
    if loss_agg_mode == "token-mean":
        denom = _local_or_global(
            loss_mask.sum(), batch_num_tokens, dp_size, "batch_num_tokens", loss_agg_mode
        )
        return masked_sum(loss_mat, loss_mask) / denom * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        tokens_per_seq = loss_mask.sum(dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (tokens_per_seq + 1e-8)
        seq_mask = (tokens_per_seq > 0).float()
        denom = _local_or_global(
            seq_mask.sum(), global_batch_size, dp_size, "global_batch_size", loss_agg_mode
        )
        loss = masked_sum(seq_losses, seq_mask) / denom * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])
        return loss
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
