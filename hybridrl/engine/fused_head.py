"""Response log-probs and entropy straight from the last hidden states: verl's ``use_fused_kernels``.

The usual path (``train_engine._token_stats``) runs the LM head over every position a micro-batch
needs, ``(N, V)`` logits, and autograd keeps a logits-sized tensor for the backward (the
exponentials, or the logits themselves). With a vocabulary of 150k and a few thousand positions
per micro-batch that is the largest tensor of a step, several GB on a GPU. Here the head, the
temperature and the log-softmax run as one autograd function over ``CHUNK_ELEMENTS`` logits at a
time: the forward keeps the hidden states ``(N, E)``, the targets and (when asked) the entropy,
nothing ``V`` wide; the backward computes each chunk's logits again (one more head product, about
``2 V E`` FLOPs a position) and turns them straight into the hidden states' and the head weight's
gradients. The numbers are the usual path's up to float rounding: the same products row by row, the
same log-softmax and entropy (hybridrl's CPU kernels for fp32 CPU logits, torch's softmax
elsewhere); the logits are made in float32 whatever the weights' dtype, as the usual path casts them.

``head_forward(head, targets, temperature, with_entropy)`` is what the engine puts in place of the
LM head's forward for one model call (``fused_call``). Under FSDP2 the head's parameters are
gathered in the root module's forward, so the computation has to happen inside that call, where the
head's own forward would run; the call's ``.logits`` then hold ``(b, W, 2)``: each position's
log-prob of its target, and its entropy (0 where not asked). Models whose forward changes the head's
output before returning it (soft-capped or scaled logits) cannot take this path (``supported``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.engine import cpu_attention
from hybridrl.utils.cpu_matmul import OneDNNLinear

__all__ = ["CHUNK_ELEMENTS", "SUPPORTED_MODEL_TYPES", "fused_call", "head_forward", "head_log_probs", "supported"]

# logits made at a time, forward and backward: 64 MiB in float32 (341 positions of SmolLM2's
# 49,152-token vocabulary, 110 of Qwen2.5's 151,936)
CHUNK_ELEMENTS = 1 << 24
# transformers causal LMs whose forward returns ``lm_head(hidden_states[:, kept])`` as the logits unchanged
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def supported(model: nn.Module) -> bool:
    """Whether ``model``'s logits are its LM head's output unchanged (no soft-capping or scaling)."""
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (getattr(config, "model_type", None) in SUPPORTED_MODEL_TYPES and isinstance(head, nn.Linear)
            and getattr(config, "final_logit_softcapping", None) is None)


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _chunk_logits(product: Product, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  temperature: float) -> torch.Tensor:
    """One chunk's float32 logits divided by the temperature, ``(n, V)``, as the usual path makes them."""
    logits = product(hidden, weight, bias).float()
    return logits / temperature if temperature != 1.0 else logits


def _stats(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's log-prob of its target, and its entropy ``-sum(p log p)`` where asked."""
    if cpu_attention.token_usable(logits):
        if with_entropy:
            return cpu_attention.token_logprob_entropy(logits, targets)
        return cpu_attention.token_logprob(logits, targets)[0], None
    log_p = torch.log_softmax(logits, dim=-1)
    log_probs = log_p.gather(-1, targets[:, None]).squeeze(-1)
    return log_probs, (-(log_p.exp() * log_p).sum(-1) if with_entropy else None)


def _logits_grad(logits: torch.Tensor, targets: torch.Tensor, grad_lp: torch.Tensor,
                 grad_ent: torch.Tensor | None, entropy: torch.Tensor | None) -> torch.Tensor:
    """d(loss)/d(logits) of one chunk: ``g_lp (onehot - p)`` for the log-probs plus, for the entropy
    ``H = -sum(p log p)``, ``g_H p (-log p - H)``; made in place of the logits."""
    if cpu_attention.token_usable(logits):
        _, stats, exps = cpu_attention.token_logprob(logits, targets, keep_exps=True)
        grad = cpu_attention.token_logprob_backward(exps, targets, stats, grad_lp)
        if grad_ent is None:
            return grad
        # stats: each row's max and sum of exp(logits - max); exps: exp(logits - max)
        log_z = stats[:, :1] + stats[:, 1:].log()
        probs = exps.div_(stats[:, 1:])
        return grad.add_(probs.mul_(log_z - logits - entropy[:, None]).mul_(grad_ent[:, None]))
    log_p = torch.log_softmax(logits, dim=-1)
    probs = log_p.exp()
    grad = probs * -grad_lp[:, None]
    grad.scatter_add_(-1, targets[:, None], grad_lp[:, None])
    if grad_ent is not None:
        grad.add_(probs.mul_(log_p.neg_().sub_(entropy[:, None])).mul_(grad_ent[:, None]))
    return grad


class _HeadLogProb(torch.autograd.Function):
    """``(log_probs (N,), entropy (N,) or None)`` of ``targets (N,)`` under ``softmax(linear(hidden,
    weight, bias) / temperature)``, chunk by chunk (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                temperature: float, with_entropy: bool, product: Product):
        step = _chunk_rows(weight.shape[0])
        log_probs, entropy = [], []
        for start in range(0, hidden.shape[0], step):
            logits = _chunk_logits(product, hidden[start:start + step], weight, bias, temperature)
            lp, ent = _stats(logits, targets[start:start + step], with_entropy)
            log_probs.append(lp)
            entropy.append(ent)
        log_probs = torch.cat(log_probs) if log_probs else hidden.new_zeros(0, dtype=torch.float32)
        entropy = (torch.cat(entropy) if entropy else hidden.new_zeros(0, dtype=torch.float32)) if with_entropy else None
        ctx.temperature, ctx.with_entropy, ctx.product = temperature, with_entropy, product
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_lp: torch.Tensor, grad_ent: torch.Tensor | None):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        if not ctx.with_entropy:
            grad_ent = None
        step = _chunk_rows(weight.shape[0])
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        for start in range(0, hidden.shape[0], step):
            rows = slice(start, start + step)
            logits = _chunk_logits(ctx.product, hidden[rows], weight, bias, ctx.temperature)
            grad = _logits_grad(logits, targets[rows], grad_lp[rows].float().contiguous(),
                                None if grad_ent is None else grad_ent[rows].float(),
                                None if entropy is None else entropy[rows])
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            if need_bias:
                grad_bias.add_(grad.sum(0))
            if need_hidden:
                grad_hidden[rows] = grad.to(weight.dtype) @ weight
            if need_weight:  # summed in float32 over the chunks, cast once
                grad_weight.addmm_(grad.t(), hidden[rows].float())
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def head_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False,
                   product: Product = F.linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``(...)`` of ``targets (...)`` under ``softmax(product(hidden, weight, bias) / temperature)``
    from ``hidden (..., E)``, and the entropies ``(...)`` where asked (else None), without a ``(..., V)``
    tensor kept for the backward. ``product``: how the forward makes the logits (``F.linear``'s
    arithmetic; the backward's products are torch's)."""
    if temperature <= 0 or not math.isfinite(temperature):
        raise ValueError(f"head_log_probs: temperature must be a positive number, got {temperature}")
    shape = targets.shape
    if hidden.shape[:-1] != shape:
        raise ValueError(f"head_log_probs: hidden states {tuple(hidden.shape)} do not match targets {tuple(shape)}")
    flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    log_probs, entropy = _HeadLogProb.apply(flat, weight, bias, targets.reshape(-1).long().contiguous(),
                                            float(temperature), with_entropy, product)
    return log_probs.view(shape), None if entropy is None else entropy.view(shape)


def head_forward(head: nn.Linear, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """A forward for the LM head ``head`` that returns, for hidden states ``(b, W, E)`` and the
    ``(b, W)`` targets of those positions, ``(b, W, 2)``: each position's log-prob and entropy. The
    logits are made by the head's own product (``OneDNNLinear``'s where the engine made it one)."""
    product = head.product if isinstance(head, OneDNNLinear) else F.linear

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != targets.shape:
            raise ValueError(f"fused log-probs: the LM head got hidden states {tuple(hidden.shape)} for targets "
                             f"{tuple(targets.shape)}")
        log_probs, entropy = head_log_probs(hidden, head.weight, head.bias, targets, temperature, with_entropy, product)
        return torch.stack([log_probs, entropy if entropy is not None else torch.zeros_like(log_probs)], dim=-1)

    return forward


@contextlib.contextmanager
def fused_call(model: nn.Module, targets: torch.Tensor, temperature: float, with_entropy: bool) -> Iterator[None]:
    """Within the block, ``model``'s LM head runs ``head_forward`` (the instance's forward over its class's)."""
    head = model.get_output_embeddings()
    head.forward = head_forward(head, targets, temperature, with_entropy)
    try:
        yield
    finally:
        del head.forward
