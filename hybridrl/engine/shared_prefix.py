"""Prompts computed once per group: the forward (and backward) of rows that share their prompt.

GRPO, RLOO and any run with ``rollout.n > 1`` train on ``n`` rows per prompt that begin with the
same prompt tokens. A causal model's hidden states at those positions do not depend on what follows
them, so every row of a group recomputes the same prompt activations. Here a micro-batch runs as one
model call on one flat sequence (batch 1) of

1. the distinct prompts, once each (``U`` of them, trimmed to the longest, left-padded), then
2. every row's response tokens but the last, which predicts nothing (``b`` rows of ``fed`` tokens),

so that every linear layer, norm and activation runs once on all these positions. Only attention
sees the structure: an attention function registered with transformers (``AttentionInterface``)
splits the flat queries, keys and values back into the prompts (causal over themselves) and the
rows, whose queries read their group's prompt keys and values followed by their own, causally,
and the gradients of all ``n`` rows add up in the one prompt computation. Where hybridrl's CPU
kernels apply, ``cpu_attention.shared_prompt_attention`` does both in one autograd function: the
rows read their prompt's keys in place, the output and the gradients are written straight into the
flat sequence's layout (the tiny model's attention with its copies, 12.0 -> 9.9 ms a layer forward
and backward, 16 prompts x 8 rows x 63 tokens). Elsewhere (``sdpa``) the prompt keys are gathered
per row and each part goes through ``cpu_attention.hf_attention``. An earlier version ran the
prompts and the rows as two model calls: twice the calls per layer, products of fewer rows, and
each weight's two gradients summed;
SmolLM2's update (4 prompts x 4 rows, 36 + 32 tokens) took 3.75 s that way against 3.59 s now
(alternating in one process).

The log-prob of response token 0 comes from the prompt's last position, token ``j > 0`` from
response position ``j - 1``: the LM head runs once on each row's prompt position followed by its
own (its forward is overridden for the call, since FSDP2 gathers parameters in the root module's
forward and the head cannot be called apart). The arithmetic is the same as the full rows' up to
float rounding (matmuls of other shapes); the work drops by ``(b - U) / b`` of the prompt tokens,
e.g. three quarters of them with 4 samples per prompt.

The attention function is active only inside ``shared_prompt_logits``, so the usual path is
untouched. Compiled transformer blocks trace through it: with the kernels it is one custom op and a
block stays one graph; without them (``_gathered_attention``) it runs outside the graph. It reads
only tensors from the call's ``_Share``, whose sizes are symbolic in a compiled block: an integer
read there would be specialised, recompiling every block for each new prompt width. It applies to
models whose attention is plain causal ``sdpa`` or hybridrl's CPU attention (Llama, Qwen2, Qwen3
without sliding windows) and not under activation checkpointing, whose recomputation would run
outside the call that sets up the split.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybridrl.engine import cpu_attention

__all__ = ["ATTENTION_NAME", "prompt_groups", "prompt_index", "shareable", "shared_positions", "shared_prompt_logits"]

ATTENTION_NAME = "hybridrl_shared_prefix"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
MIN_SAVED_FRACTION = 0.1  # share only when it removes at least this share of the computed positions


@dataclass
class _Share:
    """How the flat sequence of ``shared_prompt_logits`` splits: ``U`` prompts of ``width`` positions
    (left padded; ``prompt_mask`` (U, 1, width, width), None when none is padded), then ``b`` rows of
    ``fed`` response positions, row ``i`` reading prompt ``index[i]``'s keys and values through
    ``response_mask`` (b, 1, fed, width + fed); ``heads`` gathers each row's positions for the LM head.
    Tensors only: the sizes are their shapes (see ``_attention``)."""

    index: torch.Tensor
    prompt_mask: torch.Tensor | None
    response_mask: torch.Tensor
    heads: torch.Tensor


def _head_forward(head: nn.Module, share: _Share, forward: Callable[[torch.Tensor], torch.Tensor] | None):
    """A forward for the LM head ``head`` during ``shared_prompt_logits``: from the flat sequence's
    hidden states it takes each row's prompt's last position followed by the row's own and runs
    ``forward`` (the head's own where None) once on all of them, ``(b, fed + 1, E)``."""
    if forward is None:
        forward = functools.partial(type(head).forward, head)

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.squeeze(0).index_select(0, share.heads.view(-1)).view(*share.heads.shape, hidden.shape[-1])
        return forward(rows)

    return head_forward


_active: _Share | None = None


def _attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """Attention over ``shared_prompt_logits``' flat sequence: each prompt causally over itself, each
    row over its prompt's keys and values followed by its own, causally: in one call of hybridrl's
    kernels (``cpu_attention.shared_prompt_attention``, a custom op that compiled blocks trace
    through) where they apply, else ``_gathered_attention``. Returns the flat (1, T, H, D) output
    transformers expects."""
    share = _active
    if cpu_attention.shared_prompt_usable(query, key, value) and cpu_attention.plain(kwargs.get("dropout", 0.0), kwargs):
        return cpu_attention.shared_prompt_attention(query, key, value, share.index, share.prompt_mask,
                                                     share.response_mask, kwargs.get("scaling")), None
    return _gathered_attention(module, query, key, value, share, **kwargs)


@torch.compiler.disable  # traced, its splits at symbolic sizes took inductor minutes of index simplification
def _gathered_attention(module: nn.Module, query, key, value, share: _Share, **kwargs):
    """``_attention`` without the kernels: the prompt keys and values gathered per row, each part
    through ``cpu_attention.hf_attention`` (sdpa)."""
    cut, width, fed = cpu_attention.flat_sizes(query, share.index, share.response_mask)
    (q_prompt, q_rows), (k_prompt, k_rows), (v_prompt, v_rows) = (
        cpu_attention.split_flat(x, cut, width, fed) for x in (query, key, value))
    kwargs.pop("is_causal", None)
    out_prompt, _ = cpu_attention.hf_attention(module, q_prompt, k_prompt, v_prompt, share.prompt_mask,
                                               is_causal=True, **kwargs)
    keys = torch.cat([k_prompt.index_select(0, share.index), k_rows], dim=2)
    values = torch.cat([v_prompt.index_select(0, share.index), v_rows], dim=2)
    out_rows, _ = cpu_attention.hf_attention(module, q_rows, keys, values, share.response_mask,
                                             is_causal=False, **kwargs)
    out = torch.cat([out_prompt.flatten(0, 1), out_rows.flatten(0, 1)])
    return out[None], None


def shareable(model: nn.Module) -> bool:
    """Whether ``model``'s attention admits the shared-prompt forward (see the module docstring)."""
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


def prompt_index(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 prompt_width: int, width: int) -> tuple[int, torch.Tensor]:
    """The number of distinct prompts among the rows (same tokens, padding and positions in the last
    ``width`` of the ``prompt_width`` prompt columns) and each row's prompt number ``(b,)``."""
    cols = slice(prompt_width - width, prompt_width)
    mask = attention_mask[:, cols].long()
    key = torch.cat([input_ids[:, cols] * mask, mask, position_ids[:, cols] * mask], dim=1)
    distinct, index = torch.unique(key, dim=0, return_inverse=True)
    return distinct.shape[0], index


def shared_positions(prompts: int, width: int, rows: int, longest_response: int, full: int) -> int | None:
    """Token positions ``shared_prompt_logits`` computes (each distinct prompt once at the widest
    prompt's width, then every row's response tokens but the last, at the longest response), or None
    where that saves less than ``MIN_SAVED_FRACTION`` of the ``full`` rows' positions (``pack_rows``)."""
    shared = prompts * width + rows * (longest_response - 1)
    return shared if shared <= (1 - MIN_SAVED_FRACTION) * full else None


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  prompt_width: int, prompt_lens: torch.Tensor, response_lens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first (U,), index (b,))``: the first row of each distinct prompt (same tokens, padding and
    positions in the prompt part) and each row's prompt number, or None when sharing would save
    less than ``MIN_SAVED_FRACTION`` of the token positions the full rows compute (``pack_rows``)."""
    b = input_ids.shape[0]
    width = int(prompt_lens.max())
    count, index = prompt_index(input_ids, attention_mask, position_ids, prompt_width, width)
    full = b * int((prompt_lens + response_lens).max())  # what pack_rows computes
    if shared_positions(count, width, b, int(response_lens.max()), full) is None:
        return None
    rows = torch.arange(b, device=index.device)
    first = torch.full((count,), b, dtype=rows.dtype, device=index.device).scatter_reduce_(0, index, rows, "amin")
    return first, index


def shared_prompt_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         position_ids: torch.Tensor, response_length: int, prompt_lens: torch.Tensor,
                         response_lens: torch.Tensor, groups: tuple[torch.Tensor, torch.Tensor],
                         head_forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         ) -> tuple[torch.Tensor, int]:
    """Logits ``(b, R_mb, V)`` whose position ``j`` predicts response token ``j`` of each row
    (``R_mb = max(r_i) >= 2``), and the number of token positions computed. ``head_forward`` replaces
    the LM head's forward on those ``(b, R_mb, E)`` hidden states (``fused_head.head_forward``), and
    what it returns comes back in place of the logits.

    ``input_ids`` / ``attention_mask`` / ``position_ids`` ``(b, P + R)`` as the rollout produced them:
    prompt left-padded to ``P``, response right-padded to ``R = response_length``."""
    global _active
    cpu_attention.register(ATTENTION_NAME, _attention, masks=False)  # it makes its own masks
    first, index = groups
    prompt_width = input_ids.shape[1] - response_length
    width, r_mb = int(prompt_lens.max()), int(response_lens.max())
    cols = slice(prompt_width - width, prompt_width)
    ids, mask, pos = input_ids[first, cols], attention_mask[first, cols].bool(), position_ids[first, cols]
    prompts, b = ids.shape[0], input_ids.shape[0]
    # the last response token predicts nothing: rows feed tokens 0 .. R_mb - 2, which predict 1 .. R_mb - 1
    fed = r_mb - 1
    response = slice(prompt_width, prompt_width + fed)
    device = input_ids.device
    causal = torch.ones(max(width, fed), max(width, fed), dtype=torch.bool, device=device).tril()
    # a padding query sees itself (finite values nobody reads) rather than nothing
    prompt_mask = None if bool(mask.all()) else (causal[:width, :width] & (
        mask[:, None, :] | torch.eye(width, dtype=torch.bool, device=device)))[:, None]
    own = attention_mask[:, None, None, response].bool() & causal[:fed, :fed]
    # (b, 1, fed, width + fed): the row's real prompt tokens, then its own tokens causally
    response_mask = torch.cat([mask[index][:, None, None, :].expand(-1, 1, fed, -1), own], dim=3)
    # the head reads each row's prompt's last position, then the row's own positions
    cut = prompts * width
    heads = torch.cat([(index * width + width - 1)[:, None],
                       cut + torch.arange(b, device=device)[:, None] * fed + torch.arange(fed, device=device)], dim=1)
    # one flat sequence, prompts then rows: every linear layer and norm runs once on all positions
    flat_ids = torch.cat([ids.reshape(-1), input_ids[:, response].reshape(-1)])[None]
    flat_pos = torch.cat([pos.reshape(-1), position_ids[:, response].reshape(-1)])[None]
    config = model.config
    previous = config._attn_implementation
    head = model.get_output_embeddings()
    _active = _Share(index=index, prompt_mask=prompt_mask, response_mask=response_mask, heads=heads)
    config._attn_implementation = ATTENTION_NAME
    head.forward = _head_forward(head, _active, head_forward)  # the instance's own, over its class's, until finally
    try:
        out = model(input_ids=flat_ids, position_ids=flat_pos, use_cache=False)
    finally:
        config._attn_implementation = previous
        del head.forward
        _active = None
    return _logits_of(out), ids.numel() + b * fed


def _logits_of(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output
