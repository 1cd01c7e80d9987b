"""KL estimators, KL controllers and the KL penalty folded into the reward.

Estimators of KL(pi || pi_ref) per token from log-probs (J. Schulman, "Approximating KL
divergence", 2020), named as verl's ``algorithm.kl_penalty`` and ``actor.kl_loss_type``:

=====================  ==================================================================
``kl`` / ``k1``        ``logp - ref_logp``
``abs``                ``|logp - ref_logp|``
``mse`` / ``k2``       ``0.5 * (logp - ref_logp)^2``
``low_var_kl`` / ``k3`` ``exp(d) - d - 1`` with ``d = ref_logp - logp`` clamped to [-20, 20],
                       the result clamped to [-10, 10] (verl's numerical guards)
``<name>+``            straight-through: forward value of ``<name>``, gradient of ``k2``
=====================  ==================================================================

The ``+`` variants exist because k1 and k3 are unbiased for the KL VALUE but their gradients are
not the gradient of the KL; k2's gradient is. ``k2+``/``mse+`` are the same as ``k2``.
"""

from __future__ import annotations

import torch

from hybridrl.algos.functional import masked_mean
from hybridrl.algos.registry import Registry

KL_PENALTIES: Registry = Registry("kl_penalty")


@KL_PENALTIES.register("kl", "k1")
def _kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


@KL_PENALTIES.register("abs")
def _kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


@KL_PENALTIES.register("mse", "k2")
def _kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_PENALTIES.register("low_var_kl", "k3")
def _kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    # Clamps from verl: exp(20) is finite in fp32, and capping the estimate at 10 keeps one
    # token with a huge ratio from dominating the loss.
    log_ratio = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)


for _name in list(KL_PENALTIES.names()):
    KL_PENALTIES.register(_name + "+")(KL_PENALTIES.get(_name))


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate (B, R) of type ``kl_type`` (see module table), unmasked.

    A name ending in ``+`` returns the base estimate's value with k2's gradient
    (``k2 - k2.detach() + base.detach()``). Raises ValueError listing valid names otherwise.
    """
    forward = KL_PENALTIES.get(kl_type)(log_prob, ref_log_prob)
    if not kl_type.endswith("+") or kl_type in ("k2+", "mse+"):
        return forward
    backward = _kl_k2(log_prob, ref_log_prob)
    return backward - backward.detach() + forward.detach()


# The argument of apply_kl_penalty is named kl_penalty like verl's config key, shadowing the function.
_estimate_kl = kl_penalty


class FixedKLController:
    """Constant KL coefficient (``algorithm.kl_ctrl.type=fixed``, ``kl_coef``)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays ``kl_coef``."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv 1909.08593), as in verl.

    ``update``: ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``;
    ``value *= 1 + e * n_steps / horizon`` (``n_steps`` = sequences in the batch).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(
                f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}"
            )
        if target_kl <= 0:
            raise ValueError(
                f"algorithm.kl_ctrl.target_kl must be > 0 for the adaptive controller, got {target_kl}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


KL_CONTROLLER_TYPES = ("fixed", "adaptive")


def build_kl_controller(
    ctrl_type: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """Controller for ``algorithm.kl_ctrl.{type,kl_coef,target_kl,horizon}``."""
    if ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if ctrl_type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("algorithm.kl_ctrl.type=adaptive needs kl_ctrl.target_kl and kl_ctrl.horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl.type {ctrl_type!r}; valid: {', '.join(KL_CONTROLLER_TYPES)}")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward (``algorithm.use_kl_in_reward``): ``rewards = scores - beta * kl * mask``.

    All tensors (B, R). ``beta`` is ``kl_ctrl.value`` BEFORE this call's update. The logged KL is
    the mean over sequences of each sequence's masked token mean; the controller is then updated
    with it and ``n_steps = B`` (verl's ``apply_kl_penalty``). Returns
    ``(token_level_rewards, {"actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"})``.
    """
    kld = _estimate_kl(old_log_probs, ref_log_probs, kl_penalty) * response_mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = torch.mean(masked_mean(kld, response_mask, axis=-1), dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
