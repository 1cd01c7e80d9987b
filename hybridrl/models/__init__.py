"""Building and loading models and tokenizers: any local HF folder, the critic, the built-in tiny models."""

from hybridrl.models.critic import CriticModel, load_critic, save_critic
from hybridrl.models.loading import (
    load_causal_lm,
    load_config,
    load_reward_model,
    load_tokenizer,
    to_torch_dtype,
)
from hybridrl.models.tiny import (
    PRESETS,
    build_tiny_model,
    default_tiny_dir,
    make_tiny_model_dir,
    preset_num_params,
    tiny_config,
)
from hybridrl.models.tiny_tokenizer import build_tiny_tokenizer, save_tiny_tokenizer
from hybridrl.models.utils import compute_position_ids, count_parameters, models_dir

__all__ = [
    "PRESETS",
    "CriticModel",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "compute_position_ids",
    "count_parameters",
    "default_tiny_dir",
    "load_causal_lm",
    "load_config",
    "load_critic",
    "load_reward_model",
    "load_tokenizer",
    "make_tiny_model_dir",
    "models_dir",
    "preset_num_params",
    "save_critic",
    "save_tiny_tokenizer",
    "tiny_config",
    "to_torch_dtype",
]
