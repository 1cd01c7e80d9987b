"""hybridrl's config: one schema (``schema.py``), YAML presets (``presets/``), one loader.

    from hybridrl.config import load_config
    cfg = load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8"], preset="grpo_quickstart")
    cfg.actor_rollout_ref.actor.optim.lr      # frozen dataclasses, verl's key paths
"""

from hybridrl.config.errors import ConfigError, ConfigWarning
from hybridrl.config.loader import (
    DEFAULT_PRESET,
    config_to_dict,
    dump_config_yaml,
    list_presets,
    load_config,
)
from hybridrl.config.schema import HybridRLConfig
from hybridrl.config.validate import critic_in_use, ref_in_use

__all__ = [
    "DEFAULT_PRESET",
    "ConfigError",
    "ConfigWarning",
    "HybridRLConfig",
    "config_to_dict",
    "critic_in_use",
    "dump_config_yaml",
    "list_presets",
    "load_config",
    "ref_in_use",
]
