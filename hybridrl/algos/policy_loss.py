"""Policy-gradient losses, selected by verl's ``actor_rollout_ref.actor.policy_loss.loss_mode``.

Every loss has ONE signature::

    fn(old_log_prob (B, R), log_prob (B, R), advantages (B, R), response_mask (B, R),
       loss_agg_mode="token-mean", *, params: PolicyLossParams, rollout_is_weights (B, R) | None,
       batch_info: GlobalBatchInfo) -> (pg_loss scalar, metrics: dict[str, detached tensor])

Metric names are verl's (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``).
``rollout_is_weights`` (detached, e.g. from :func:`compute_rollout_is_weights`) multiplies the
per-token loss before aggregation: the truncated importance-sampling correction for the
mismatch between the rollout engine's and the trainer's probabilities. ``batch_info`` carries
the global normalizers of :func:`agg_loss` (see ``loss_agg.py`` for how the caller fills it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridrl.algos.functional import masked_mean
from hybridrl.algos.loss_agg import GlobalBatchInfo, agg_loss
from hybridrl.algos.registry import Registry

LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class PolicyLossParams:
    """Plain-float knobs of the policy losses; defaults are verl's.

    clip_ratio / clip_ratio_low / clip_ratio_high: PPO epsilon; low/high default to clip_ratio
    (clip-higher, DAPO). clip_ratio_c: dual-clip bound for negative advantages (> 1).
    clip_cov_ratio / clip_cov_lb / clip_cov_ub: Clip-Cov token fraction and covariance window.
    kl_cov_ratio / ppo_kl_coef: KL-Cov token fraction and coefficient of its |log-ratio| term.
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy_loss.loss_mode")
_DEFAULT_PARAMS = PolicyLossParams()
_DEFAULT_BATCH_INFO = GlobalBatchInfo()


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator adding a custom policy loss under ``name`` (it must take the uniform signature)."""
    return POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The loss registered as ``name``; ValueError listing the valid names otherwise."""
    return POLICY_LOSSES.get(name)


def compute_policy_loss(
    loss_mode: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    params: PolicyLossParams = _DEFAULT_PARAMS,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo = _DEFAULT_BATCH_INFO,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run policy loss ``loss_mode`` with the uniform signature (see module docstring)."""
    fn = get_policy_loss(loss_mode)
    return fn(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        params=params,
        rollout_is_weights=rollout_is_weights,
        batch_info=batch_info,
    )


def _finish(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info) -> torch.Tensor:
    """Apply the rollout IS weights, then aggregate with the global normalizers."""
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **batch_info.as_kwargs())


def _detached(**metrics: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"actor/{key}": value.detach() for key, value in metrics.items()}


@register_policy_loss("vanilla")
def vanilla(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    *,
    params=_DEFAULT_PARAMS,
    rollout_is_weights=None,
    batch_info=_DEFAULT_BATCH_INFO,
):
    """PPO clip (arXiv 1707.06347) with clip-higher and dual-clip (arXiv 1912.09729), as verl.

    ``log r = clamp(log_prob - old_log_prob, -20, 20)``; ``L = max(-A r, -A clip(r, 1-low, 1+high))``;
    for ``A < 0`` additionally ``L = min(L, -A * clip_ratio_c)`` (bounds the loss of a very
    unlikely-now negative sample). Metrics: ``pg_clipfrac`` (fraction of tokens where the clipped
    term is larger), ``ppo_kl`` = masked mean of ``-log r``, ``pg_clipfrac_lower`` (dual clip hit).
    """
    if params.clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c must be > 1.0 for dual-clip PPO, got {params.clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - params.low, 1 + params.high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual_bound = -advantages * params.clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(loss_dual_bound, loss_ppo), loss_ppo)
    pg_loss = _finish(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info)
    return pg_loss, _detached(
        pg_clipfrac=masked_mean((loss_clipped > loss_unclipped).float(), response_mask),
        ppo_kl=masked_mean(-log_ratio, response_mask),
        pg_clipfrac_lower=masked_mean(((loss_ppo > loss_dual_bound) & negative).float(), response_mask),
    )


@register_policy_loss("gspo")
def gspo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    *,
    params=_DEFAULT_PARAMS,
    rollout_is_weights=None,
    batch_info=_DEFAULT_BATCH_INFO,
):
    """GSPO (arXiv 2507.18071): PPO clip on the sequence-level ratio ``s_i = (pi/pi_old)^(1/|y_i|)``.

    Per token ``log s_{i,t} = sg(mean_t log r_{i,t}) + log_prob - sg(log_prob)`` (value: the
    sequence ratio; gradient: the token's), clamped at max 10 before ``exp``; clip with
    ``1-low, 1+high`` (the paper uses small values such as 3e-4/4e-4). The paper aggregates with
    ``seq-mean-token-mean``; verl (and this) use the configured ``loss_agg_mode``.
    ``pg_clipfrac_lower`` is 0.
    """
    log_ratio = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    seq_log_ratio = torch.sum(log_ratio * response_mask, dim=-1) / seq_lengths
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))
    loss_unclipped = -advantages * seq_ratio
    loss_clipped = -advantages * torch.clamp(seq_ratio, 1 - params.low, 1 + params.high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    pg_loss = _finish(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info)
    return pg_loss, _detached(
        pg_clipfrac=masked_mean((loss_clipped > loss_unclipped).float(), response_mask),
        ppo_kl=masked_mean(-log_ratio, response_mask),
        pg_clipfrac_lower=torch.zeros((), device=pg_loss.device),
    )


@register_policy_loss("gpg")
def gpg(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    *,
    params=_DEFAULT_PARAMS,
    rollout_is_weights=None,
    batch_info=_DEFAULT_BATCH_INFO,
):
    """GPG (arXiv 2504.02546): plain policy gradient ``-log_prob * A``, no ratio, no clip. No metrics."""
    pg_losses = -log_prob * advantages
    return _finish(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info), {}


@register_policy_loss("cispo")
def cispo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    *,
    params=_DEFAULT_PARAMS,
    rollout_is_weights=None,
    batch_info=_DEFAULT_BATCH_INFO,
):
    """CISPO (MiniMax-M1, arXiv 2506.13585): ``-sg(clip(r, 1-low, 1+high)) * A * log_prob``.

    The clipped ratio is a constant weight, so every token keeps a gradient (PPO's clip zeroes
    it). ``log r`` is clamped to +-20. ``pg_clipfrac``: tokens where the ratio was clipped;
    ``pg_clipfrac_lower`` is 0.
    """
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - params.low, 1 + params.high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_loss = _finish(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info)
    return pg_loss, _detached(
        pg_clipfrac=masked_mean((ratio != clipped_ratio).float(), response_mask),
        ppo_kl=masked_mean(-log_ratio, response_mask),
        pg_clipfrac_lower=torch.zeros((), device=pg_loss.device),
    )


@register_policy_loss("geo_mean")
def geo_mean(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    *,
    params=_DEFAULT_PARAMS,
    rollout_is_weights=None,
    batch_info=_DEFAULT_BATCH_INFO,
):
    """GMPO (arXiv 2507.20673): PPO clip on the GEOMETRIC mean of token ratios of a sequence.

    Token log-ratios are clipped in log space to ``[-low, high]`` on the side the advantage sign
    selects (``sgn(A) * min(sgn(A) l, sgn(A) clip(l))``), averaged over the sequence, exp'd:
    ``L_i = -mean_t(A) * exp(mean_t(clipped l))``. Sequence-level: ``loss_agg_mode`` is ignored
    (as in verl); rollout IS weights enter as their per-sequence geometric mean. The loss is
    ``sum_i L_i / global_batch_size * dp_size`` when ``batch_info.global_batch_size`` is given,
    else the mean over the B rows (verl's ``torch.mean``; not micro-batch invariant).
    """
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -params.low, params.high)
    log_ratio_min = sign * torch.min(sign * log_ratio, sign * log_ratio_clamped)
    lengths = response_mask.sum(dim=-1)
    seq_ratio = torch.exp((log_ratio_min * response_mask).sum(dim=-1) / (lengths + 1e-8))
    seq_adv = (advantages * response_mask).sum(dim=-1) / (lengths + 1e-8)
    pg_losses = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights + 1e-10) * response_mask
        pg_losses = pg_losses * torch.exp(log_w.sum(dim=-1) / (lengths + 1e-8))
    if batch_info.global_batch_size is None:
        pg_loss = torch.mean(pg_losses)
    else:
        pg_loss = pg_losses.sum() / batch_info.global_batch_size * batch_info.dp_size
    clipped = log_ratio != log_ratio_clamped
    return pg_loss, _detached(
        pg_clipfrac=masked_mean((clipped & (advantages > 0)).float(), response_mask),
        ppo_kl=masked_mean(-log_ratio, response_mask),
        pg_clipfrac_lower=masked_mean((clipped & (advantages < 0)).float(), response_mask),
    )


def _centered_product(advantages, log_prob, response_mask) -> torch.Tensor:
    """Per-token covariance term ``(A - mean A) * (logp - mean logp)`` over valid tokens (detached)."""
    log_prob = log_prob.detach()
    return (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob, response_mask)
    )


@POLICY_LOSSES.register("clip_cov", "clip-cov")  # verl's docs spell it with a hyphen
def clip_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    *,
    params=_DEFAULT_PARAMS,
    rollout_is_weights=None,
    batch_info=_DEFAULT_BATCH_INFO,
):
    """Clip-Cov (arXiv 2505.22617): PPO clip, plus detaching a few high-covariance tokens.

    Among valid tokens that PPO did not clip and whose covariance term ``(A - mean A)(logp -
    mean logp)`` lies in ``(clip_cov_lb, clip_cov_ub)``, ``max(1, int(clip_cov_ratio * #valid))``
    are drawn at random (``torch.randperm`` on the global RNG, as verl) and their loss is zeroed,
    which slows the entropy collapse those tokens drive. No log-ratio clamp, no dual clip.
    ``pg_clipfrac``: fraction of tokens zeroed.
    """
    if params.clip_cov_ratio <= 0:
        raise ValueError(f"policy_loss.clip_cov_ratio must be > 0, got {params.clip_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - params.low, 1 + params.high)
    valid = response_mask > 0
    cov = _centered_product(advantages, log_prob, response_mask)
    eligible = (
        valid & ~(loss_clipped > loss_unclipped) & (cov > params.clip_cov_lb) & (cov < params.clip_cov_ub)
    )
    candidates = torch.nonzero(eligible)
    clip_num = max(int(params.clip_cov_ratio * response_mask.sum().item()), 1)
    chosen = candidates[torch.randperm(len(candidates))[:clip_num]] if len(candidates) else candidates
    keep = torch.ones_like(advantages)
    keep[chosen[:, 0], chosen[:, 1]] = 0
    pg_losses = torch.maximum(loss_unclipped, loss_clipped) * keep
    pg_loss = _finish(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info)
    return pg_loss, _detached(
        pg_clipfrac=masked_mean((keep == 0).float(), response_mask),
        ppo_kl=masked_mean(-log_ratio, response_mask),
    )


@POLICY_LOSSES.register("kl_cov", "kl-cov")
def kl_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    *,
    params=_DEFAULT_PARAMS,
    rollout_is_weights=None,
    batch_info=_DEFAULT_BATCH_INFO,
):
    """KL-Cov (arXiv 2505.22617): ``-A r``, plus ``ppo_kl_coef * |log r|`` on high-covariance tokens.

    The ``max(1, int(kl_cov_ratio * #valid))`` valid tokens with the LARGEST covariance term
    ``(A - mean A)(logp - mean logp)`` (means over valid tokens) get the KL penalty; no clipping
    anywhere. ``ppo_kl`` here is the masked mean of ``|log r|`` (verl's metric for this mode).
    """
    if params.kl_cov_ratio <= 0:
        raise ValueError(f"policy_loss.kl_cov_ratio must be > 0, got {params.kl_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    valid_flat = torch.nonzero(response_mask.reshape(-1) > 0, as_tuple=True)[0]
    if len(valid_flat) > 0:
        valid = response_mask > 0
        adv_v = advantages[valid].detach().reshape(-1)
        logp_v = log_prob[valid].detach().reshape(-1)
        cov = (adv_v - adv_v.mean()) * (logp_v - logp_v.mean())
        top = torch.topk(cov, max(1, int(len(cov) * params.kl_cov_ratio)), largest=True).indices
        penalised = torch.zeros(response_mask.numel(), dtype=torch.bool, device=pg_losses.device)
        penalised[valid_flat[top]] = True
        penalty = params.ppo_kl_coef * log_ratio.abs()
        pg_losses = torch.where(penalised.reshape(pg_losses.shape), pg_losses + penalty, pg_losses)
    pg_loss = _finish(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info)
    return pg_loss, _detached(ppo_kl=masked_mean(log_ratio.abs(), response_mask))
