"""The interaction interface: a scripted or rule-based 'user' that answers between assistant turns
(verl's ``BaseInteraction``, synchronous).

Per episode (``instance_id`` = one sample):

    start_interaction(instance_id, **interaction_kwargs)      before the first turn
    generate_response(instance_id, messages, **interaction_kwargs)
        -> (should_terminate, user_text, reward, metadata)     after each assistant turn without a tool call
    finalize_interaction(instance_id)                          at the end

``interaction_kwargs`` come per sample from ``extra_info["interaction_kwargs"]``; its ``name`` picks
the interaction when several are configured. ``messages`` is the conversation so far as text
(``{"role", "content"}``), the last one the assistant's turn. Each ``reward`` is recorded in
``extra_info["rollout_reward_scores"]["user_turn_rewards"]`` for the reward function.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Interaction(Protocol):
    name: str

    def start_interaction(self, instance_id: str, **kwargs: Any) -> None: ...
    def generate_response(
        self, instance_id: str, messages: list[dict[str, str]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]: ...
    def finalize_interaction(self, instance_id: str) -> None: ...


class BaseInteraction:
    """Convenience base: keeps ``config`` and ``name`` (``config["name"]``); start/finalize are no-ops."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        self.name = str(self.config.get("name", type(self).__name__))

    def start_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Per-sample setup; the default keeps nothing."""

    def generate_response(self, instance_id: str, messages: list[dict[str, str]], **kwargs: Any):
        raise NotImplementedError(f"{type(self).__name__}.generate_response")

    def finalize_interaction(self, instance_id: str) -> None:
        """Per-sample teardown; the default has nothing to free."""


def last_assistant(messages: list[dict[str, str]]) -> str:
    """Content of the last assistant message ('' if none)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""
