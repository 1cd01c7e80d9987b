"""Prompts computed once per group: the forward (and backward) of rows that share their prompt.

GRPO, RLOO and any run with ``rollout.n > 1`` train on ``n`` rows per prompt that begin with the
same prompt tokens. A causal model's hidden states at those positions do not depend on what follows
them, so every row of a group recomputes the same prompt activations. Here a micro-batch runs in two
model calls:

1. the distinct prompts, once each (``U`` rows), with the normal causal mask; each attention layer
   keeps its rotated keys and values;
2. every row's response tokens but the last, which predicts nothing (``b`` rows), whose attention
   reads its group's prompt keys and values (gathered per row, so autograd sums the gradients of
   all ``n`` rows into the one prompt computation) followed by its own, causally.

The log-prob of response token 0 comes from the prompt's last position (pass 1), token ``j > 0``
from response position ``j - 1`` (pass 2). The LM head runs once, in pass 2, on each row's prompt
hidden state followed by its own: pass 1 only hands its last hidden states over. A separate head call
for the ``U`` prompt rows cost SmolLM2 a second (49152, 576) weight gradient and its sum with the
first (about 55 ms of a 3 s update), and joining the two logits tensors a copy of all of them. The
arithmetic is the same as the full rows' up to float rounding (matmuls of other shapes); the work
drops by ``(b - U) / b`` of the prompt tokens, e.g. three quarters of them with 4 samples per prompt.

The keys and values pass between the two calls through an attention function registered with
transformers (``AttentionInterface``) that wraps ``cpu_attention.hf_attention`` (hybridrl's CPU
kernels where they apply, transformers' ``sdpa`` elsewhere); it is active only inside
``shared_prompt_logits`` and runs outside ``torch.compile`` (compiled transformer blocks break their
graph around it), so the usual path is untouched. It applies to models whose attention is plain
causal ``sdpa`` or hybridrl's CPU attention (Llama, Qwen2, Qwen3 without sliding windows) and not under activation
checkpointing, whose recomputation would run the response pass without its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hybridrl.engine import cpu_attention

__all__ = ["ATTENTION_NAME", "prompt_groups", "shareable", "shared_prompt_logits"]

ATTENTION_NAME = "hybridrl_shared_prefix"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
MIN_SAVED_FRACTION = 0.1  # share only when it removes at least this share of the computed positions


@dataclass
class _Share:
    """Prompt keys/values of each layer and last hidden states (pass 1), and the prompt (group) of
    each row (pass 2)."""

    index: torch.Tensor
    responding: bool = False
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    prompt_hidden: torch.Tensor | None = None  # (U, 1, E): what pass 1 fed its LM head


def _head_forward(head: nn.Module, share: _Share):
    """A forward for the LM head ``head`` during ``shared_prompt_logits``: in pass 1 it keeps its input
    (the prompts' last hidden states) and computes nothing; in pass 2 it puts each row's prompt hidden
    state before the row's own and runs the head's own forward once on all of them."""
    forward = type(head).forward

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:
        if not share.responding:
            share.prompt_hidden = hidden
            return hidden[:, :0]  # no logits: pass 2 computes the prompts' together with the rows'
        return forward(head, torch.cat([share.prompt_hidden.index_select(0, share.index), hidden], dim=1))

    return head_forward


_active: _Share | None = None


def _attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """``cpu_attention.hf_attention``; inside ``shared_prompt_logits`` it keeps the prompt pass's keys
    and values per layer, and puts each row's prompt keys and values before its own in the response pass."""
    share = _active
    if share is not None:
        if not share.responding:
            share.cache[module.layer_idx] = (key, value)
        else:
            keys, values = share.cache[module.layer_idx]
            key = torch.cat([keys.index_select(0, share.index), key], dim=2)
            value = torch.cat([values.index_select(0, share.index), value], dim=2)
    return cpu_attention.hf_attention(module, query, key, value, attention_mask, **kwargs)


def shareable(model: nn.Module) -> bool:
    """Whether ``model``'s attention admits the two-pass forward (see the module docstring)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", cpu_attention.ATTENTION_NAME):
        return False
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        return False  # the LM head is called once for both passes (``_head_forward``)
    if getattr(config, "use_sliding_window", False) or (config.model_type == "llama" and getattr(config, "sliding_window", None)):
        return False
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x's name
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return not checkpointing


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  prompt_width: int, prompt_lens: torch.Tensor, response_lens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first (U,), index (b,))``: the first row of each distinct prompt (same tokens, padding and
    positions in the prompt part) and each row's prompt number, or None when sharing would save
    less than ``MIN_SAVED_FRACTION`` of the token positions the full rows compute (``pack_rows``)."""
    b = input_ids.shape[0]
    width = int(prompt_lens.max())
    cols = slice(prompt_width - width, prompt_width)
    mask = attention_mask[:, cols].long()
    key = torch.cat([input_ids[:, cols] * mask, mask, position_ids[:, cols] * mask], dim=1)
    distinct, index = torch.unique(key, dim=0, return_inverse=True)
    count = distinct.shape[0]
    shared = count * width + b * (int(response_lens.max()) - 1)
    full = b * int((prompt_lens + response_lens).max())  # what pack_rows computes
    if shared > (1 - MIN_SAVED_FRACTION) * full:
        return None
    rows = torch.arange(b, device=index.device)
    first = torch.full((count,), b, dtype=rows.dtype, device=index.device).scatter_reduce_(0, index, rows, "amin")
    return first, index


def shared_prompt_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         position_ids: torch.Tensor, response_length: int, prompt_lens: torch.Tensor,
                         response_lens: torch.Tensor, groups: tuple[torch.Tensor, torch.Tensor]
                         ) -> tuple[torch.Tensor, int]:
    """Logits ``(b, R_mb, V)`` whose position ``j`` predicts response token ``j`` of each row
    (``R_mb = max(r_i) >= 2``), and the number of token positions computed.

    ``input_ids`` / ``attention_mask`` / ``position_ids`` ``(b, P + R)`` as the rollout produced them:
    prompt left-padded to ``P``, response right-padded to ``R = response_length``."""
    global _active
    cpu_attention.register(ATTENTION_NAME, _attention)  # pass 1 gets sdpa's own masks
    first, index = groups
    prompt_width = input_ids.shape[1] - response_length
    width, r_mb = int(prompt_lens.max()), int(response_lens.max())
    cols = slice(prompt_width - width, prompt_width)
    ids, mask, pos = input_ids[first, cols], attention_mask[first, cols], position_ids[first, cols]
    # the last response token predicts nothing: pass 2 feeds tokens 0 .. R_mb - 2, which predict 1 .. R_mb - 1
    fed = r_mb - 1
    response = slice(prompt_width, prompt_width + fed)
    own = attention_mask[:, None, None, response].bool()
    causal = torch.ones(fed, fed, dtype=torch.bool, device=own.device).tril()
    # (b, 1, fed, P_mb + fed): the row's real prompt tokens, then its own tokens causally. Every
    # input of pass 2 is a fresh contiguous tensor: compiled blocks guard on strides, and views into
    # the (b, P + R) batch would change them with every batch's P.
    full_mask = torch.cat([mask.bool()[index][:, None, None, :].expand(-1, 1, fed, -1), causal & own], dim=3)
    config = model.config
    previous = config._attn_implementation
    head = model.get_output_embeddings()
    _active = share = _Share(index=index)
    config._attn_implementation = ATTENTION_NAME
    head.forward = _head_forward(head, share)  # the instance's own, over its class's, until finally
    try:
        model(input_ids=ids, attention_mask=None if bool(mask.all()) else mask, position_ids=pos,
              use_cache=False, logits_to_keep=1)
        share.responding = True
        response_out = model(input_ids=input_ids[:, response].contiguous(), attention_mask=full_mask,
                             position_ids=position_ids[:, response].contiguous(), use_cache=False)
    finally:
        config._attn_implementation = previous
        del head.forward
        _active = None
    return _logits_of(response_out), ids.numel() + input_ids.shape[0] * fed


def _logits_of(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output
