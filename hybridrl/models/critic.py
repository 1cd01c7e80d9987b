"""The critic: a causal-LM backbone (``AutoModel``, no LM head) with a scalar value head.

A critic folder is the backbone saved with ``save_pretrained`` plus ``value_head.safetensors``; its
config.json carries ``hybridrl_value_head`` as the marker. ``load_critic`` accepts either such a
folder or a plain causal-LM folder (an actor checkpoint), in which case the head is freshly made.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PreTrainedModel

from hybridrl.models.loading import enable_gradient_checkpointing, load_pretrained, to_torch_dtype
from hybridrl.models.utils import resolve_model_dir

VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_HEAD_MARKER = "hybridrl_value_head"
# Small init keeps the first value estimates near 0, so early GAE advantages are dominated by rewards
# rather than by noise from an untrained head (verl's critic starts from a similarly small init).
VALUE_HEAD_INIT_STD = 1e-3


class CriticModel(nn.Module):
    """Backbone + ``nn.Linear(hidden, 1)``; ``forward`` returns values (B, T) in float32.

    ``values[:, t]`` is the value of the state after token t; the critic worker slices the response
    part (``values[:, P-1:T-1]`` style) as its algorithm requires.
    """

    def __init__(self, backbone: PreTrainedModel, value_head: nn.Linear | None = None, head_seed: int = 0):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        if value_head is None:
            value_head = make_value_head(backbone.config.hidden_size, head_seed, backbone.dtype)
        self.value_head = value_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids/attention_mask/position_ids (B, T) -> values (B, T) float32."""
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        # a fresh tensor, not a view: FSDP2 warns that in-place ops on a returned view skip its hooks
        return self.value_head(out.last_hidden_state).squeeze(-1).float().clone()

    def gradient_checkpointing_enable(self) -> None:
        """Checkpoint the backbone's layers (the head is tiny)."""
        enable_gradient_checkpointing(self.backbone)


def make_value_head(hidden_size: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Linear:
    """Deterministic head: weight ~ N(0, VALUE_HEAD_INIT_STD) from its own generator, bias 0."""
    head = nn.Linear(hidden_size, 1, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = torch.randn(1, hidden_size, generator=gen, dtype=torch.float32) * VALUE_HEAD_INIT_STD
        head.weight.copy_(weight.to(dtype))
        head.bias.zero_()
    return head


def load_critic(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    override_config: dict[str, Any] | None = None,
    head_seed: int = 0,
) -> CriticModel:
    """Critic from a saved critic folder (head restored) or a causal-LM folder (head from ``head_seed``)."""
    backbone = load_pretrained(AutoModel, path, dtype, attn_implementation, trust_remote_code, override_config)
    config, folder, torch_dtype = backbone.config, resolve_model_dir(path), to_torch_dtype(dtype)
    head = None
    if getattr(config, VALUE_HEAD_MARKER, None):
        head = _load_value_head(folder, config.hidden_size, torch_dtype)
    critic = CriticModel(backbone, head, head_seed=head_seed)
    if gradient_checkpointing:
        critic.gradient_checkpointing_enable()
    return critic.eval()


def _load_value_head(folder: Path, hidden_size: int, dtype: torch.dtype) -> nn.Linear:
    head_file = folder / VALUE_HEAD_FILE
    if not head_file.is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} is marked as a critic ({VALUE_HEAD_MARKER}) but lacks {VALUE_HEAD_FILE}"
        )
    state = load_file(str(head_file))
    if tuple(state.get("weight", torch.empty(0)).shape) != (1, hidden_size):
        raise ValueError(
            f"{str(head_file)!r}: expected weight of shape (1, {hidden_size}), got keys/shapes "
            f"{ {k: tuple(v.shape) for k, v in state.items()} }"
        )
    head = nn.Linear(hidden_size, 1, dtype=dtype)
    head.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return head


def save_critic(model: CriticModel, out_dir: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Save backbone (save_pretrained, marked config) + ``value_head.safetensors`` (+ tokenizer if given)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    setattr(model.backbone.config, VALUE_HEAD_MARKER, VALUE_HEAD_FILE)
    model.backbone.save_pretrained(out)
    head_state = {k: v.detach().cpu().contiguous() for k, v in model.value_head.state_dict().items()}
    save_file(head_state, str(out / VALUE_HEAD_FILE))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
