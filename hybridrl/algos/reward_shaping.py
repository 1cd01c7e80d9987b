"""Sequence scores as token-level rewards, and reward shaping applied to them before advantages
(DAPO, arXiv 2503.14476)."""

from __future__ import annotations

import torch


def scores_at_last_token(scores: torch.Tensor, response_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Sequence scores (B,) as token-level rewards (B, width) float32: each row's score at its last
    response token (column ``length - 1``; column 0 for an empty response), 0 elsewhere."""
    out = torch.zeros(len(scores), width, dtype=torch.float32, device=scores.device)
    if width > 0:
        out[torch.arange(len(scores), device=scores.device), (response_lengths - 1).clamp(min=0)] = scores.float()
    return out


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, overlong_buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to each sequence's score (verl's DAPO reward manager).

    response_lengths (B,) valid response tokens -> penalty (B,) float32, <= 0::

        expected = max_response_length - overlong_buffer_len
        penalty  = min(-(length - expected) / overlong_buffer_len * penalty_factor, 0)

    Zero up to ``expected`` tokens, then linear down to ``-penalty_factor`` at the maximum length
    (config: ``reward_model.overlong_buffer.{len,penalty_factor}``, ``data.max_response_length``).
    """
    if overlong_buffer_len <= 0:
        raise ValueError(
            f"overlong_buffer.len must be > 0 when the overlong penalty is on, got {overlong_buffer_len}"
        )
    if max_response_length < overlong_buffer_len:
        raise ValueError(
            f"max_response_length ({max_response_length}) must be >= overlong_buffer.len ({overlong_buffer_len})"
        )
    expected = max_response_length - overlong_buffer_len
    exceed = response_lengths.to(torch.float32) - expected
    return torch.clamp(-exceed / overlong_buffer_len * penalty_factor, max=0.0)
