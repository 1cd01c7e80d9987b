"""Numerical faults: NaN/Inf in rewards, advantages, losses or gradients, found and handled by policy.

``trainer.nan_policy`` (a hybridrl addition) says what a non-finite value does:

- ``stop``: raise :class:`NonFiniteError` naming the training step, the phase, the rank and the
  values, so the run ends at the step that went wrong (the last checkpoint is untouched).
- ``skip``: do not apply the update that saw the value, log a warning with the same facts, count
  it, and continue. The driver reports the running count as ``training/skipped_steps``.

Two places check (both cheap next to a forward pass):

- the driver, once per step after the advantages (:func:`check_batch`): the batch columns that
  feed the update, over valid response tokens. ``skip`` drops the whole step's actor/critic updates.
- each worker rank, after every optimizer step (:func:`check_update`): the global loss and grad
  norm and this rank's own loss terms (which show the rank a NaN came from). The engine never
  applies an optimizer step whose grad norm is not finite; ``skip`` drops that step's loss metrics
  and counts ``<role>/skipped_updates``.

Non-finite reward *function* results (a NaN returned by the scorer) are caught earlier, per sample,
by the reward manager under ``reward.on_error``; :func:`check_batch` catches what gets past it
(e.g. a finite Python float that overflows float32).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch

NAN_POLICIES = ("stop", "skip")

# The stage that produces each checked batch column: errors name the phase where a value went bad.
BATCH_PHASES = {
    "token_level_scores": "reward",
    "old_log_probs": "compute_log_prob",
    "ref_log_probs": "compute_ref_log_prob",
    "values": "compute_values",
    "token_level_rewards": "kl_penalty",
    "advantages": "compute_advantage",
    "returns": "compute_advantage",
}

logger = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
    """A NaN/Inf under ``trainer.nan_policy=stop``; ``step``, ``phase``, ``rank`` and ``detail`` say where."""

    def __init__(self, step: int, phase: str, rank: int | str, detail: str) -> None:
        self.step, self.phase, self.rank, self.detail = step, phase, rank, detail
        super().__init__(f"{describe(step, phase, rank, detail)}. trainer.nan_policy=stop ends the run here; "
                         "trainer.nan_policy=skip skips such updates and continues")

    def __reduce__(self):
        return (type(self), (self.step, self.phase, self.rank, self.detail))


def describe(step: int, phase: str, rank: int | str, detail: str) -> str:
    return f"non-finite values at step {step} in phase {phase} on rank {rank}: {detail}"


def check_policy(policy: str) -> None:
    if policy not in NAN_POLICIES:
        raise ValueError(f"trainer.nan_policy={policy!r}; allowed: {list(NAN_POLICIES)}")


def nonfinite_summary(name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> str | None:
    """``"name: k of n non-finite (first at row i, col j: nan)"``, or None when all are finite.

    ``values`` (B, R) or (B,); ``mask`` (same shape, optional) selects the entries that count."""
    bad = ~torch.isfinite(values)
    if mask is not None:
        bad &= mask.bool()
    count = int(bad.sum())
    if count == 0:
        return None
    total = int(mask.bool().sum()) if mask is not None else values.numel()
    first = tuple(int(i) for i in bad.nonzero()[0])
    where = f"row {first[0]}" + (f", col {first[1]}" if len(first) > 1 else "")
    return f"{name}: {count} of {total} non-finite (first at {where}: {float(values[first])})"


def check_batch(batch: Mapping[str, torch.Tensor], step: int, policy: str) -> bool:
    """True when every present column of :data:`BATCH_PHASES` is finite on ``response_mask (B,R)``.

    Under ``stop`` a non-finite column raises :class:`NonFiniteError` (phase: the earliest stage
    whose output is bad); under ``skip`` it logs a warning and returns False."""
    mask = batch["response_mask"]
    problems = [(BATCH_PHASES[k], s) for k in BATCH_PHASES if k in batch
                if (s := nonfinite_summary(k, batch[k], mask)) is not None]
    if not problems:
        return True
    phase, detail = problems[0][0], "; ".join(s for _, s in problems)
    return _handle(step, phase, "driver", detail, policy, "skipping this step's actor/critic updates")


def check_update(metrics: Mapping[str, float], local_terms: Mapping[str, float], *, step: int, phase: str,
                 rank: int, policy: str) -> bool:
    """True when one optimizer step's ``loss`` and ``grad_norm`` (global) and this rank's loss
    terms ``local_terms`` (before the all-reduce) are finite; else stop/skip as in :func:`check_batch`.
    The engine has already declined to apply a step whose grad norm is not finite."""
    values = {"loss": metrics.get("loss", 0.0), "grad_norm": metrics.get("grad_norm", 0.0)}
    values.update({f"this rank's {k}": v for k, v in local_terms.items()})
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if not bad:
        return True
    detail = ", ".join(f"{k}={v}" for k, v in bad.items())
    if math.isfinite(values["grad_norm"]):
        detail += " (the gradient norm was finite, so the engine applied this optimizer step)"
    return _handle(step, phase, rank, detail, policy, "skipping this optimizer step")


def _handle(step: int, phase: str, rank: int | str, detail: str, policy: str, action: str) -> bool:
    check_policy(policy)
    if policy == "stop":
        raise NonFiniteError(step, phase, rank, detail)
    logger.warning("hybridrl: %s; trainer.nan_policy=skip: %s", describe(step, phase, rank, detail), action)
    return False


def screen_update(out: dict[str, float], engine_metrics: Mapping[str, float], local_terms: Mapping[str, float], *,
                  role: str, step: int, rank: int, policy: str) -> dict[str, float]:
    """A worker's metrics ``out`` for one optimizer step, screened by :func:`check_update`.

    Adds ``<role>/skipped_updates`` (0 or 1); a skipped step keeps only its ``<role>/lr``, so the
    step's NaN losses do not turn the averaged metrics into NaN."""
    if check_update(engine_metrics, local_terms, step=step, phase=f"update_{role}", rank=rank, policy=policy):
        return {**out, f"{role}/skipped_updates": 0.0}
    return {f"{role}/lr": out[f"{role}/lr"], f"{role}/skipped_updates": 1.0}


def poison(values: torch.Tensor) -> torch.Tensor:
    """All-NaN tensor like ``values``: what a ``:nan`` fault (hybridrl.utils.faults) feeds an update."""
    return torch.full_like(values, float("nan"))
