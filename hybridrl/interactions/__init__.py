"""Interactions: scripted / rule-based users for multi-turn rollouts (see docs/multiturn.md)."""

from hybridrl.interactions.base import BaseInteraction, Interaction
from hybridrl.interactions.registry import load_interaction_config, pick_interaction
from hybridrl.interactions.retry_feedback import RetryFeedbackInteraction

__all__ = ["BaseInteraction", "Interaction", "RetryFeedbackInteraction", "load_interaction_config", "pick_interaction"]
