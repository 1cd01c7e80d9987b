"""Rewards: scoring strings into floats, loading custom reward functions, the reward manager.

Kept free of torch at import time: scoring worker processes import this package, and starting
them should cost a Python start-up, not a torch import. ``RewardManager`` (which needs torch) is
imported lazily.
"""

from __future__ import annotations

from typing import Any

from hybridrl.rewards.default import default_compute_score, supported_data_sources
from hybridrl.rewards.loader import FileRewardFunction, load_reward_function

__all__ = [
    "FileRewardFunction",
    "OverlongBuffer",
    "RewardFunctionError",
    "RewardManager",
    "default_compute_score",
    "load_reward_function",
    "supported_data_sources",
]

_LAZY = {"RewardManager", "OverlongBuffer", "RewardFunctionError"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from hybridrl.rewards import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'hybridrl.rewards' has no attribute {name!r}")
