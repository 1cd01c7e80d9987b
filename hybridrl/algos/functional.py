"""Masked statistics, clipping, entropy and log-probs: the tensor helpers the losses build on.

Conventions follow verl's ``verl/utils/torch_functional.py`` so numbers match a verl run:

- ``masked_mean = sum(x * mask) / (sum(mask) + 1e-8)``; values outside the mask never leak in,
  even when they are NaN or inf.
- ``masked_var`` is unbiased (Bessel ``n / (n - 1)``) by default and refuses masks with fewer than
  two valid elements, where that correction divides by zero.
- ``masked_whiten = (x - mean) * rsqrt(var + 1e-8)`` over the mask.
- Log-probs and entropy are computed from ``logits / temperature``: the sampler drew tokens from
  that distribution, so the trainer must score them under the same one.

Shapes: ``B`` sequences, ``R`` response tokens, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MASKED_MEAN_EPS = 1e-8
WHITEN_EPS = 1e-8


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is non-zero (weighted by ``mask``), over ``axis`` or all.

    Entries outside the mask are replaced by 0 before the product, so a NaN/inf there (e.g. a
    log-ratio of a padding token) cannot turn the sum into NaN.
    """
    valid = torch.where(mask.bool(), values, torch.zeros_like(values))
    if axis is None:
        return (valid * mask).sum()
    return (valid * mask).sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """``sum(values * mask) / (sum(mask) + 1e-8)`` over ``axis`` (all elements when None).

    An empty mask gives 0, not NaN, thanks to the 1e-8 (verl's convention).
    """
    total = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / (total + MASKED_MEAN_EPS)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements (scalar), Bessel-corrected when ``unbiased`` (verl default).

    Raises ValueError when the mask selects 0 elements, or exactly 1 with ``unbiased``, where the
    correction ``n / (n - 1)`` would divide by zero: use a larger (mini-)batch.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise ValueError("masked_var: the mask selects no element; at least two are needed")
        if count == 1:
            raise ValueError("masked_var: the mask selects one element; the unbiased variance needs two")
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(values - mean) * rsqrt(var + 1e-8)`` with mean/unbiased var over the mask.

    With ``shift_mean=False`` the mean is added back (only the scale is normalised). Masked-out
    positions are transformed too; callers multiply by the mask when they need zeros there.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def clip_by_value(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Element-wise ``min(max(x, low), high)`` with tensor bounds (``torch.clamp`` order of verl)."""
    return torch.max(torch.min(x, high), low)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``logsumexp(z) - sum(softmax(z) * z)``.

    logits (..., V) -> entropy (...). Divide logits by the temperature first if sampling used one.
    """
    probs = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def entropy_from_logits_chunked(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """:func:`entropy_from_logits` over ``chunk_size`` rows at a time, computed in float32.

    logits (..., V) -> entropy (...) float32. Peak extra memory is ``chunk_size * V`` floats
    instead of a full softmax copy of the logits (the saving is real under ``torch.no_grad``;
    with autograd each chunk's softmax is kept for backward).
    """
    if chunk_size < 1:
        raise ValueError(f"entropy_from_logits_chunked: chunk_size must be >= 1, got {chunk_size}")
    rows = logits.reshape(-1, logits.shape[-1])
    parts = [
        entropy_from_logits(rows[i : i + chunk_size].float()) for i in range(0, rows.shape[0], chunk_size)
    ]
    if not parts:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    return torch.cat(parts).reshape(logits.shape[:-1])


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax(logits / temperature)``.

    logits (..., V), labels (...) int64 -> log-probs (...), dtype of logits.
    float32/64: ``z[label] - logsumexp(z)`` per chunk of ``chunk_size`` rows, so no full
    log-softmax (B, R, V) copy is materialised (verl's ``logprobs_from_logits_v2``); the
    temperature division also happens per chunk. bf16/fp16: per-chunk ``log_softmax`` then
    gather, because logsumexp in half precision loses too much accuracy.
    """
    if temperature <= 0:
        raise ValueError(f"log_probs_from_logits: temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"log_probs_from_logits: chunk_size must be >= 1, got {chunk_size}")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    parts = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        z = flat_logits[start : start + chunk_size]
        z = z / temperature if temperature != 1.0 else z
        idx = flat_labels[start : start + chunk_size].unsqueeze(-1)
        if z.dtype in (torch.float32, torch.float64):
            parts.append(z.gather(-1, idx).squeeze(-1) - torch.logsumexp(z, dim=-1))
        else:
            parts.append(F.log_softmax(z, dim=-1).gather(-1, idx).squeeze(-1))
    if not parts:
        return logits.new_zeros(labels.shape)
    return torch.cat(parts).reshape(labels.shape)
