"""Load any local Hugging Face causal LM and its tokenizer (nothing is downloaded)."""

from __future__ import annotations

import os
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from hybridrl.models.utils import resolve_model_dir

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def to_torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"|"fp32"|"bfloat16"|"bf16"|"float16"|"fp16"`` or a torch.dtype -> torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def load_tokenizer(
    path: str | os.PathLike, trust_remote_code: bool = False, padding_side: str = "left"
) -> PreTrainedTokenizerBase:
    """Tokenizer from a local folder, with a pad token and the requested padding side.

    A tokenizer without a pad token gets ``pad = eos`` (prompts are left-padded and masked, so the pad
    id never reaches the loss). ``padding_side`` is set here because save_pretrained does not keep it.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    folder = resolve_model_dir(path, what="tokenizer")
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer at {str(folder)!r} has neither a pad token nor an eos token")
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def load_config(
    path: str | os.PathLike, trust_remote_code: bool = False, override_config: dict[str, Any] | None = None
) -> PretrainedConfig:
    """``AutoConfig`` of a local folder with ``override_config`` keys applied (unknown keys are errors)."""
    folder = resolve_model_dir(path)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    for key, value in (override_config or {}).items():
        if not hasattr(config, key):
            raise KeyError(
                f"override_config key {key!r} is not a field of {type(config).__name__} in {str(folder)!r}"
            )
        setattr(config, key, value)
    return config


def load_pretrained(auto_cls, path, dtype, attn_implementation: str, trust_remote_code: bool,
                    override_config: dict[str, Any] | None):
    """``auto_cls.from_pretrained`` of a local folder with a checked attention implementation and
    ``override_config`` applied to its config (shared by the policy and the critic backbone)."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}"
        )
    model = auto_cls.from_pretrained(
        resolve_model_dir(path),
        config=load_config(path, trust_remote_code, override_config),
        dtype=to_torch_dtype(dtype),
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    return without_hub_kernels(model)


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def without_hub_kernels(model: ModuleT) -> ModuleT:
    """``model`` with transformers' Hub kernels turned off (``use_kernels = False``) on every model
    within it that has them.

    transformers 5 loads every model with ``use_kernels=True`` when its dependency ``kernels`` is
    installed, and re-kernelizes the layers on each ``train()`` / ``eval()`` that changes the mode.
    The engine switches every step (log-probs under ``eval``, the update under ``train``): a
    ``train()`` and an ``eval()`` of the 25M model took 5.9 ms with them and 3.4 without, and each
    switch replaced the forwards hybridrl gives its norms (``hybridrl.engine.cpu_layers``, and the
    compiled final norm of ``hybridrl.engine.compile``) with the class's. hybridrl brings its own CPU
    kernels, and the Hub's need a download. The loaders here call it, and so do ``use_cpu_layers`` and
    ``compile_blocks`` before they set any forward, for models loaded some other way (a script's own
    ``from_pretrained`` handed to ``TrainEngine``)."""
    for module in model.modules():
        if getattr(module, "use_kernels", False) is True:  # a PreTrainedModel that kernelizes
            module.use_kernels = False
    return model


def load_causal_lm(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    override_config: dict[str, Any] | None = None,
) -> PreTrainedModel:
    """``AutoModelForCausalLM`` from a local folder, on CPU, in eval mode (callers call .train()).

    ``override_config`` patches config fields before the weights load (e.g. ``{"attention_dropout": 0.0}``).
    With ``gradient_checkpointing`` the KV cache is turned off, as the two cannot be used together.
    """
    model = load_pretrained(AutoModelForCausalLM, path, dtype, attn_implementation, trust_remote_code, override_config)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model.eval()


def load_reward_model(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A reward model as verl loads one: ``AutoModelForTokenClassification`` with one label, whose
    output at a sequence's last token is its score. Sequence-classification checkpoints (Llama,
    Qwen2, Mistral RMs) load the same way: their scalar head has the same name and shape."""
    model = load_pretrained(AutoModelForTokenClassification, path, dtype, attn_implementation, trust_remote_code,
                            {"num_labels": 1})
    return model.eval()


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant checkpointing (works with FSDP2 and frozen inputs); disables the KV cache."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x renamed the method
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False
