"""Truncated importance-sampling weights for the rollout / trainer probability mismatch.

The rollout engine (vLLM, a KV-cache sampler, bf16 kernels) and the training forward pass give
slightly different probabilities for the same tokens, so PPO's "on-policy" samples are in fact
drawn from ``pi_rollout``. Weighting each token's loss by ``w = pi_old / pi_rollout`` corrects
the measure; truncating ``w`` at a threshold (TIS) bounds the variance. This is verl's
``algorithm.rollout_correction`` (``rollout_is``, ``rollout_is_threshold``; the older
``actor.tis_imp_ratio_cap``). The weights multiply the per-token policy loss
(``rollout_is_weights`` of :func:`compute_policy_loss`).
"""

from __future__ import annotations

import torch

from hybridrl.algos.functional import masked_mean, masked_sum

ROLLOUT_IS_LEVELS = ("token", "sequence", "geometric")
SAFETY_BOUND = 20.0


def compute_rollout_is_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    threshold: float = 2.0,
    threshold_lower: float | None = None,
    veto_threshold: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached IS weights (B, R) = ``exp(old_log_probs - rollout_log_probs)``, truncated, masked.

    ``level="token"``: one weight per token; ``"sequence"``: ``exp(sum_t log ratio)`` broadcast
    over the sequence; ``"geometric"``: ``exp(mean_t log ratio)``, the geometric mean of the token
    ratios, broadcast. The log ratio is clamped to +-20 before ``exp``. With only ``threshold``
    the weights are clamped to ``<= threshold`` (TIS); with ``threshold_lower`` too, weights
    outside ``[threshold_lower, threshold]`` are set to 0 (IcePop). ``veto_threshold``: a sequence
    with any token ratio below it gets weight 0 throughout (verl's catastrophic-outlier veto).
    Masked positions get 0. Metrics (``rollout_corr/``): mean of the kept weights, fraction of
    tokens truncated/zeroed, and with a veto the fraction of sequences vetoed.
    """
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is level {level!r}; valid: {', '.join(ROLLOUT_IS_LEVELS)}")
    if threshold <= 0 or (threshold_lower is not None and not 0 < threshold_lower <= threshold):
        raise ValueError(
            f"rollout_is thresholds must satisfy 0 < lower <= upper, got {threshold_lower}, {threshold}"
        )
    token_log_ratio = old_log_probs.detach() - rollout_log_probs.detach()
    log_ratio = token_log_ratio
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1).expand_as(old_log_probs)
    elif level == "geometric":
        log_ratio = masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1).expand_as(old_log_probs)
    raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) * response_mask
    if threshold_lower is None:
        weights = raw.clamp(max=threshold)
        out_of_bounds = raw > threshold
    else:
        out_of_bounds = (raw < threshold_lower) | (raw > threshold)
        weights = torch.where(out_of_bounds, torch.zeros_like(raw), raw)
    metrics = {}
    if veto_threshold is not None:
        token_ratio = torch.exp(torch.clamp(token_log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
        vetoed = ((token_ratio < veto_threshold) & response_mask.bool()).any(dim=-1, keepdim=True)
        weights = torch.where(vetoed, torch.zeros_like(weights), weights)
        metrics["rollout_corr/rollout_is_veto_fraction"] = vetoed.float().mean()
    metrics["rollout_corr/rollout_is_mean"] = masked_mean(weights, response_mask)
    metrics["rollout_corr/rollout_is_clipped_fraction"] = masked_mean(out_of_bounds.float(), response_mask)
    return weights, metrics
