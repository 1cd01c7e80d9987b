"""Pure tensor math of RL post-training, with verl's conventions and config names.

Imports torch, numpy and the standard library only (no ray, torch.distributed, transformers or
config objects): callers read the config and pass plain floats/strings, and compute global
normalizers (token counts across ranks) themselves. See docs/algorithms.md.
"""

from hybridrl.algos.advantages import (
    ADV_ESTIMATORS,
    compute_advantage,
    get_adv_estimator,
    register_adv_estimator,
)
from hybridrl.algos.functional import (
    clip_by_value,
    entropy_from_logits,
    entropy_from_logits_chunked,
    log_probs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from hybridrl.algos.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
)
from hybridrl.algos.loss_agg import LOSS_AGG_MODES, GlobalBatchInfo, agg_loss, count_normalizers
from hybridrl.algos.policy_loss import (
    POLICY_LOSSES,
    PolicyLossParams,
    compute_policy_loss,
    get_policy_loss,
    register_policy_loss,
)
from hybridrl.algos.reward_shaping import overlong_penalty, scores_at_last_token
from hybridrl.algos.rollout_correction import compute_rollout_is_weights
from hybridrl.algos.value_loss import compute_value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "GlobalBatchInfo",
    "PolicyLossParams",
    "agg_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "clip_by_value",
    "compute_advantage",
    "compute_policy_loss",
    "compute_rollout_is_weights",
    "compute_value_loss",
    "count_normalizers",
    "entropy_from_logits",
    "entropy_from_logits_chunked",
    "get_adv_estimator",
    "get_policy_loss",
    "kl_penalty",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "register_adv_estimator",
    "register_policy_loss",
    "scores_at_last_token",
]
