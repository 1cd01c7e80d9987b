"""Rollout: the `RolloutEngine` interface, `SamplingParams` and the native KV-cache engine."""

from hybridrl.rollout.base import RolloutEngine, SamplingParams
from hybridrl.rollout.native import NativeRolloutEngine

__all__ = ["NativeRolloutEngine", "RolloutEngine", "SamplingParams"]
