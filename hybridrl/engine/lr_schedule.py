"""Learning-rate schedules as ``LambdaLR`` multipliers, with verl's conventions.

Step ``s`` counts optimizer steps already taken (0 for the first update). With ``warmup_steps=W``
the multiplier is ``s / W`` for ``s < W`` (so the first update runs at lr 0, as in verl and
transformers), then:

- ``constant``: 1.0
- ``cosine``:   ``min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(2 pi num_cycles p))`` with
  ``p = (s - W) / max(1, total_steps - W)``, clamped to ``p <= 1`` so the lr stays where it ends
  once ``total_steps`` have run; ``num_cycles=0.5`` (the default, verl's) is one half cosine down to
  the floor.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["LR_SCHEDULES", "build_lr_scheduler", "lr_multiplier"]

LR_SCHEDULES = ("constant", "cosine")


def lr_multiplier(
    step: int, *, schedule: str, warmup_steps: int = 0, total_steps: int | None = None, min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> float:
    """The factor applied to the base lr for the update at optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(2.0 * math.pi * num_cycles * progress))
    raise ValueError(f"lr_scheduler must be one of {LR_SCHEDULES}, got {schedule!r}")


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    schedule: str = "constant",
    *,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> LambdaLR:
    """A ``LambdaLR`` following ``lr_multiplier``; validates the arguments first."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_scheduler must be one of {LR_SCHEDULES}, got {schedule!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if num_cycles <= 0:
        raise ValueError(f"num_cycles must be > 0, got {num_cycles}")
    if schedule == "cosine" and (total_steps is None or total_steps <= warmup_steps):
        raise ValueError(
            f"lr_scheduler='cosine' needs total_steps > warmup_steps, got total_steps={total_steps}, "
            f"warmup_steps={warmup_steps}"
        )
    fn = partial(
        lr_multiplier, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio,
        num_cycles=num_cycles,
    )
    return LambdaLR(optimizer, fn)
