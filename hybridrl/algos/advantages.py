"""Advantage estimators, selected by verl's ``algorithm.adv_estimator``.

Every estimator has ONE signature so the trainer can call any of them::

    fn(token_level_rewards (B, R), response_mask (B, R), index (B,) | None = None, *,
       values (B, R) | None = None, reward_baselines (B,) | None = None,
       gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, epsilon=1e-6)
    -> (advantages (B, R), returns (B, R))

``index`` is the numpy object array of ``uid`` (one per prompt, shared by its G samples): the
group of a sample. Outcome estimators use the sequence score ``token_level_rewards.sum(-1)``.
Outputs are zero on masked positions except where verl's GAE leaves them (see ``gae``).
Everything runs under ``torch.no_grad``: advantages are constants for the policy loss.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hybridrl.algos.functional import masked_whiten
from hybridrl.algos.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("adv_estimator")


def register_adv_estimator(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator adding a custom estimator under ``name`` (it must take the uniform signature)."""
    return ADV_ESTIMATORS.register(name)


def get_adv_estimator(name: str) -> AdvantageFn:
    """The estimator registered as ``name``; ValueError listing the valid names otherwise."""
    return ADV_ESTIMATORS.get(name)


ESTIMATOR_KWARGS = ("values", "reward_baselines", "gamma", "lam", "norm_adv_by_std_in_grpo", "epsilon")


def compute_advantage(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run estimator ``name`` with the uniform signature (see module docstring).

    ``kwargs`` are limited to ``ESTIMATOR_KWARGS``; each estimator ignores those it does not use,
    so a typo is caught here rather than silently swallowed.
    """
    unknown = sorted(set(kwargs) - set(ESTIMATOR_KWARGS))
    if unknown:
        raise TypeError(
            f"compute_advantage: unknown argument(s) {unknown}; valid: {', '.join(ESTIMATOR_KWARGS)}"
        )
    return get_adv_estimator(name)(token_level_rewards, response_mask, index, **kwargs)


# ---------------------------------------------------------------- group helpers


def group_ids(index: np.ndarray | None, batch_size: int, estimator: str) -> tuple[torch.Tensor, int]:
    """Map each uid in ``index`` to a dense group id (B,) int64, in order of first appearance."""
    if index is None:
        raise ValueError(f"adv_estimator={estimator!r} needs index (the 'uid' column) to group samples")
    if len(index) != batch_size:
        raise ValueError(f"adv_estimator={estimator!r}: index has {len(index)} uids for {batch_size} rows")
    ids: dict = {}
    dense = [ids.setdefault(uid, len(ids)) for uid in list(index)]
    return torch.tensor(dense, dtype=torch.long), len(ids)


def _group_sum(x: torch.Tensor, gid: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, gid, x)


def group_mean_std(scores: torch.Tensor, gid: torch.Tensor, num_groups: int):
    """Per-sample group mean, unbiased (Bessel) std and size, each (B,).

    A group of one sample gets mean 0 and std 1 (verl's convention: its score passes through).
    """
    gid = gid.to(scores.device)
    count = torch.bincount(gid, minlength=num_groups).to(scores.dtype)
    mean = _group_sum(scores, gid, num_groups) / count
    sq_dev = _group_sum((scores - mean[gid]) ** 2, gid, num_groups)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid], std[gid], count[gid]


def _outcome(scalar: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Broadcast a per-sequence scalar (B,) over its valid tokens; returns = advantages."""
    adv = scalar.unsqueeze(-1) * response_mask
    return adv, adv


# ---------------------------------------------------------------- estimators


@register_adv_estimator("gae")
@torch.no_grad()
def gae(token_level_rewards, response_mask, index=None, *, values=None, gamma=1.0, lam=1.0, **_):
    """GAE (Schulman et al. 2015, arXiv 1506.02438), verl's ``compute_gae_advantage_return``.

    Reverse recursion ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam *
    A_{t+1}``, where a position with mask 0 carries ``V_{t+1}`` and ``A_{t+1}`` through unchanged
    (multi-turn observation tokens are skipped, not treated as steps). ``returns = A + values``
    BEFORE whitening; advantages are then whitened over the mask (unbiased var, rsqrt(var+1e-8)).
    Positions after the last valid token hold whitened, non-zero values (as in verl): the policy
    loss masks them.
    """
    if values is None:
        raise ValueError("adv_estimator='gae' needs values (B, R) from the critic")
    response_mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    last_adv = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        mask_t = response_mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * last_adv
        next_value = values[:, t] * mask_t + (1 - mask_t) * next_value
        last_adv = adv_t * mask_t + (1 - mask_t) * last_adv
        reversed_adv.append(last_adv)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    return masked_whiten(advantages, response_mask), returns


@register_adv_estimator("grpo")
@torch.no_grad()
def grpo(token_level_rewards, response_mask, index=None, *, norm_adv_by_std_in_grpo=True, epsilon=1e-6, **_):
    """GRPO (DeepSeekMath, arXiv 2402.03300): ``(score - mean_g) / (std_g + 1e-6)`` per group.

    std is unbiased (Bessel); a group of one has mean 0, std 1. With
    ``norm_adv_by_std_in_grpo=False`` the advantage is ``score - mean_g`` (Dr.GRPO, arXiv
    2503.20783). The scalar is broadcast over valid tokens; returns = advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    gid, num_groups = group_ids(index, scores.shape[0], "grpo")
    mean, std, _count = group_mean_std(scores, gid, num_groups)
    centered = scores - mean
    return _outcome(centered / (std + epsilon) if norm_adv_by_std_in_grpo else centered, response_mask)


@register_adv_estimator("grpo_passk")
@torch.no_grad()
def grpo_passk(
    token_level_rewards, response_mask, index=None, *, norm_adv_by_std_in_grpo=True, epsilon=1e-6, **_
):
    """Pass@k GRPO (arXiv 2503.19595): only the best sample of a group gets ``r_max - r_2nd``.

    Divided by ``std_g + 1e-6`` (unbiased) when ``norm_adv_by_std_in_grpo``. Ties for the best go
    to the sample ``torch.topk`` returns first, as in verl. Every group needs >= 2 samples.
    """
    scores = token_level_rewards.sum(dim=-1)
    gid, num_groups = group_ids(index, scores.shape[0], "grpo_passk")
    scalar = torch.zeros_like(scores)
    for g in range(num_groups):
        members = torch.nonzero(gid == g, as_tuple=True)[0].to(scores.device)
        rewards = scores[members]
        if rewards.numel() < 2:
            raise ValueError(
                f"grpo_passk needs >= 2 samples per group; uid {index[members[0].item()]!r} has 1"
            )
        top, top_idx = torch.topk(rewards, 2)
        adv = top[0] - top[1]
        if norm_adv_by_std_in_grpo:
            adv = adv / (torch.std(rewards) + epsilon)
        scalar[members[top_idx[0]]] = adv
    return _outcome(scalar, response_mask)


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(token_level_rewards, response_mask, index=None, *, gamma=1.0, **_):
    """REINFORCE++ (arXiv 2501.03262): discounted return-to-go, whitened over the whole batch.

    ``G_t = r_t + gamma * G_{t+1}`` where a masked position carries ``G`` through unchanged and has
    return 0. advantages = masked_whiten(returns) * mask; returns are the masked ``G``.
    """
    response_mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[-1])):
        mask_t = response_mask[:, t]
        updated = token_level_rewards[:, t] + gamma * running
        returns[:, t] = updated * mask_t
        running = updated * mask_t + running * (1 - mask_t)
    return masked_whiten(returns, response_mask) * response_mask, returns


@register_adv_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(token_level_rewards, response_mask, index=None, **_):
    """REINFORCE++-baseline (arXiv 2501.03262): ``score - mean_g``, then whitened over the batch.

    A group of one has mean 0. advantages = returns = masked_whiten((score - mean_g) * mask) * mask.
    """
    scores = token_level_rewards.sum(dim=-1)
    gid, num_groups = group_ids(index, scores.shape[0], "reinforce_plus_plus_baseline")
    mean, _std, _count = group_mean_std(scores, gid, num_groups)
    centered = (scores - mean).unsqueeze(-1).expand_as(token_level_rewards) * response_mask
    adv = masked_whiten(centered, response_mask) * response_mask
    return adv, adv


@register_adv_estimator("rloo")
@torch.no_grad()
def rloo(token_level_rewards, response_mask, index=None, **_):
    """RLOO (arXiv 2402.14740): score minus the mean of the OTHER samples of the group.

    ``score - (sum_g - score) / (n - 1) = n / (n - 1) * (score - mean_g)``; a group of one keeps
    its raw score (no baseline), as in verl.
    """
    scores = token_level_rewards.sum(dim=-1)
    gid, num_groups = group_ids(index, scores.shape[0], "rloo")
    mean, _std, n = group_mean_std(scores, gid, num_groups)
    factor = n / (n - 1).clamp(min=1)
    scalar = torch.where(n > 1, scores * factor - mean * factor, scores)
    return _outcome(scalar, response_mask)


@register_adv_estimator("opo")
@torch.no_grad()
def opo(token_level_rewards, response_mask, index=None, **_):
    """OPO (arXiv 2505.23585): baseline = length-weighted group mean ``sum(|y| r) / sum(|y|)``.

    ``|y|`` = valid tokens of the sample; a group of one has baseline 0.
    """
    scores = token_level_rewards.sum(dim=-1)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    gid, num_groups = group_ids(index, scores.shape[0], "opo")
    gid = gid.to(scores.device)
    baseline = _group_sum(lengths * scores, gid, num_groups) / _group_sum(lengths, gid, num_groups)
    count = torch.bincount(gid, minlength=num_groups)
    baseline = torch.where(count > 1, baseline, torch.zeros_like(baseline))
    return _outcome(scores - baseline[gid], response_mask)


@register_adv_estimator("remax")
@torch.no_grad()
def remax(token_level_rewards, response_mask, index=None, *, reward_baselines=None, **_):
    """ReMax (arXiv 2310.10505): return-to-go minus the reward of the greedy response.

    returns = reverse cumsum of ``rewards * mask`` (no discount); advantages =
    ``returns - reward_baselines[:, None] * mask``. ``reward_baselines`` (B,) is the score of the
    greedy (argmax) rollout of the same prompt.
    """
    if reward_baselines is None:
        raise ValueError("adv_estimator='remax' needs reward_baselines (B,): the greedy response's score")
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - reward_baselines.unsqueeze(-1) * response_mask, returns


@register_adv_estimator("gpg")
@torch.no_grad()
def gpg(token_level_rewards, response_mask, index=None, **_):
    """GPG (arXiv 2504.02546): ``alpha * (score - mean_g)`` with ``alpha = B / max(#nonzero scores, 1)``.

    The batch-level ``alpha`` rescales when few samples have a non-zero score; a group of one has
    mean 0. No std normalisation (verl's ``f_norm`` is fixed at 1).
    """
    scores = token_level_rewards.sum(dim=-1)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    gid, num_groups = group_ids(index, scores.shape[0], "gpg")
    mean, _std, _count = group_mean_std(scores, gid, num_groups)
    return _outcome(alpha * (scores - mean), response_mask)
