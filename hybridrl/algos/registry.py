"""Name -> function registries keyed by verl's config strings.

Every algorithm choice in a verl config (``algorithm.adv_estimator``,
``actor_rollout_ref.actor.policy_loss.loss_mode``, ...) is a string. A :class:`Registry` maps
those strings to functions and turns a typo into an error that lists the valid names, so a user
sees ``unknown adv_estimator 'grpoo'; valid: gae, grpo, ...`` at startup rather than a KeyError
deep in the trainer.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """An ordered map from a config name to a function, with actionable lookup errors.

    ``kind`` is the config key the names belong to (e.g. ``"adv_estimator"``); it appears in errors.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator registering a function under one or more names (aliases)."""

        def decorator(fn: F) -> F:
            for name in names:
                known = self._entries.get(name)
                if known is not None and known is not fn:
                    raise ValueError(f"{self.kind} '{name}' is already registered to {known.__qualname__}")
                self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """Return the function registered under ``name``; raise ValueError listing valid names."""
        if name not in self._entries:
            raise ValueError(self.unknown_message(name))
        return self._entries[name]

    def unknown_message(self, name: object) -> str:
        valid = ", ".join(self._entries)
        hint = difflib.get_close_matches(str(name), list(self._entries), n=1)
        suggestion = f" (did you mean '{hint[0]}'?)" if hint else ""
        return f"unknown {self.kind} {name!r}; valid: {valid}{suggestion}"

    def names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
