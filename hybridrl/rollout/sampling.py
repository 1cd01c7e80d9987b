"""Token selection for one decoding step: greedy or temperature / top-k / top-p sampling.

Sampling uses the inverse CDF with one uniform number per (row, step) drawn up front from a
generator seeded by (seed, row). A row's tokens therefore depend only on its own logits and its
own numbers, never on the batch it shares or on when other rows finish.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridrl.rollout import cpu_kernels
from hybridrl.rollout.base import SamplingParams


def draw_uniforms(num_rows: int, num_steps: int, seed: int | None) -> torch.Tensor:
    """Uniform numbers in (0, 1], shape (B, R): row b from a generator seeded by (seed, b).

    (0, 1] rather than [0, 1) so the inverse CDF never lands on a zero-probability token at the
    start of the vocabulary.
    """
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    out = torch.empty(num_rows, num_steps)
    gen = torch.Generator()
    for row in range(num_rows):
        # SeedSequence mixes (seed, row) so nearby seeds / rows give unrelated streams.
        gen.manual_seed(int(np.random.SeedSequence([seed, row]).generate_state(1, np.uint64)[0] >> 1))
        out[row] = torch.rand(num_steps, generator=gen)
    return 1.0 - out


def scaled_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (b,V) / temperature in float32; temperature 0 (greedy) leaves them unscaled."""
    logits = logits.float()
    if params.temperature > 0 and params.temperature != 1.0:
        logits = logits / params.temperature
    return logits


def select_tokens(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of each row and its log-prob.

    logits (b,V) raw model logits; uniforms (b,) in (0, 1]. Returns tokens (b,) int64 and
    log_probs (b,) float32 = log_softmax(logits / temperature)[token] over the full vocabulary,
    before top-k / top-p filtering (verl convention: the trainer recomputes exactly this).
    """
    kernels = _kernels_for(logits, params)
    if kernels is not None:
        return kernels.select_tokens(logits, params.temperature if params.temperature > 0 else 1.0,
                                     None if params.greedy else uniforms.float().contiguous(), params.logprobs)
    scaled = scaled_logits(logits, params)
    if params.greedy:
        tokens = scaled.argmax(dim=-1)
    else:
        tokens = _sample(scaled, params, uniforms)
    if params.logprobs:
        log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    else:
        log_probs = torch.zeros(tokens.shape, dtype=torch.float32)
    return tokens, log_probs


def _kernels_for(logits: torch.Tensor, params: SamplingParams):
    """The fused CPU kernel for fp32 CPU logits when no top-k / top-p filter applies (one pass over
    the vocabulary instead of about ten ops); None otherwise (the torch ops below)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        return None
    if not params.greedy and (params.top_p < 1.0 or 0 < params.top_k < logits.shape[-1]):
        return None
    return cpu_kernels.load()


def _sample(scaled: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling from softmax(scaled) restricted by top-k then top-p. scaled (b,V)."""
    vocab = scaled.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if params.top_p >= 1.0 and top_k == 0:
        probs = torch.softmax(scaled, dim=-1)
        return _invert_cdf(probs, uniforms)
    if params.top_p >= 1.0:
        # top-k alone needs only the k best, in descending order (ties: lowest id first).
        values, order = torch.topk(scaled, top_k, dim=-1, sorted=True)
    else:
        values, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        if top_k:
            values, order = values[:, :top_k], order[:, :top_k]
    probs = torch.softmax(values, dim=-1)
    if params.top_p < 1.0:
        # Keep a token while the mass strictly before it is below top_p: the first always stays.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(mass_before >= params.top_p, 0.0)
    picked = _invert_cdf(probs, uniforms)
    return order.gather(-1, picked[:, None]).squeeze(-1)


def _invert_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index i with cdf[i-1] < u * total <= cdf[i] per row. probs (b,K) >= 0, uniforms (b,) in (0,1]."""
    cdf = torch.cumsum(probs, dim=-1)
    targets = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    picked = torch.searchsorted(cdf, targets).squeeze(-1)
    return picked.clamp_(max=probs.shape[-1] - 1)
