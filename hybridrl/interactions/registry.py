"""Interactions from verl's interaction-config YAML::

    interaction:
      - name: retry                     # what extra_info.interaction_kwargs.name selects
        class_name: retry_feedback      # a built-in name or a dotted path to a class
        config: {max_retries: 1}        # passed as the class's ``config`` (with ``name`` added)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from hybridrl.interactions.base import Interaction
from hybridrl.tools.registry import ToolConfigError, import_object

BUILTIN_INTERACTIONS = {"retry_feedback": "hybridrl.interactions.retry_feedback.RetryFeedbackInteraction"}
_ENTRY_KEYS = ("name", "class_name", "config")


def load_interaction_config(path: str | Path) -> dict[str, Interaction]:
    """``{name: interaction}`` from a verl-format interaction-config file; errors name file, entry, key."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ToolConfigError(f"interaction config {path} does not exist "
                              "(actor_rollout_ref.rollout.multi_turn.interaction_config_path)")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("interaction"), list) or not data["interaction"]:
        raise ToolConfigError(f"{path}: the file must be a mapping with a non-empty 'interaction' list")
    out: dict[str, Interaction] = {}
    for i, entry in enumerate(data["interaction"]):
        interaction = _build(entry, f"{path} interaction[{i}]")
        if interaction.name in out:
            raise ToolConfigError(f"{path} interaction[{i}]: the name {interaction.name!r} is used twice")
        out[interaction.name] = interaction
    return out


def _build(entry: Any, where: str) -> Interaction:
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ToolConfigError(f"{where}: each interaction must be a mapping with a string 'class_name'")
    unknown = sorted(set(entry) - set(_ENTRY_KEYS))
    if unknown:
        raise ToolConfigError(f"{where}: unknown key(s) {unknown}; allowed: {list(_ENTRY_KEYS)}")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}.config must be a mapping, got {config!r:.80}")
    name = entry.get("name") or config.get("name") or entry["class_name"].rsplit(".", 1)[-1]
    cls = import_object(BUILTIN_INTERACTIONS.get(entry["class_name"], entry["class_name"]), f"{where}.class_name")
    interaction = cls({**config, "name": name})
    if not isinstance(interaction, Interaction):
        raise ToolConfigError(f"{where}: {entry['class_name']!r} is not an Interaction (needs name, start_interaction, "
                              "generate_response, finalize_interaction)")
    return interaction


def pick_interaction(interactions: dict[str, Interaction], kwargs: dict[str, Any] | None) -> Interaction | None:
    """The interaction of one sample: ``kwargs["name"]``, or the only one configured; None without any."""
    if not interactions:
        return None
    name = (kwargs or {}).get("name")
    if name is None:
        if len(interactions) == 1:
            return next(iter(interactions.values()))
        raise ValueError(f"extra_info.interaction_kwargs needs a 'name' among {sorted(interactions)}")
    if name not in interactions:
        raise ValueError(f"extra_info.interaction_kwargs.name={name!r} is not configured; have {sorted(interactions)}")
    return interactions[name]
