"""Clipped value loss of the PPO critic (``critic.cliprange_value``, ``critic.loss_agg_mode``)."""

from __future__ import annotations

import torch

from hybridrl.algos.functional import clip_by_value, masked_mean
from hybridrl.algos.loss_agg import agg_loss


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``0.5 * agg(max((v - R)^2, (clip(v, V_old - c, V_old + c) - R)^2))`` (verl's ``compute_value_loss``).

    vpreds: current critic values (B, R); values: the critic's values at rollout time (B, R);
    returns: targets (B, R), e.g. GAE returns. The new prediction may move at most
    ``cliprange_value`` from the old one before the clipped term dominates (PPO, arXiv 1707.06347).
    The normalizer arguments are those of :func:`agg_loss`. Returns ``(vf_loss, vf_clipfrac)``
    where vf_clipfrac is the masked fraction of tokens whose clipped loss is strictly larger.
    """
    vpred_clipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.max(loss_unclipped, loss_clipped),
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask).detach()
    return vf_loss, vf_clipfrac
