"""Padding removal that is exact with any attention implementation (sdpa, eager, flash).

Rows arrive as ``prompt (LEFT-padded, width P) + response (RIGHT-padded, width R)``, so the real
tokens of row ``i`` are the contiguous span ``[P - p_i, P + r_i)`` of the ``T = P + R`` columns,
with ``p_i`` real prompt tokens and ``r_i`` real response tokens. ``pack_rows`` shifts every span
to column 0 and trims the micro-batch to its longest span ``W = max(p_i + r_i)``: all remaining
padding is on the right, where a causal model cannot see it, and it is masked as keys anyway. The
numbers at real positions therefore equal those of the padded batch (to float rounding of the
smaller matmuls), unlike packing several sequences into one row, which needs a block-diagonal mask
and costs attention over the whole packed row on CPU.

The engine sorts rows by length before cutting micro-batches (``seqlen_balancing``), so computed
tokens ``b * W`` stay close to the real tokens ``sum(p_i + r_i)``.

When every span is unbroken (no zero inside it) and its positions count up by one, the mask says
nothing causal attention does not: a real column only sees columns to its left, all real. Such a
micro-batch is marked ``dense`` and the engine drops the mask, so attention takes its unmasked
causal kernel (a few percent of a CPU training step) with identical numbers at real positions. The
padding columns then get positions that continue each row's count, so that Hugging Face does not
read the batch as several sequences packed into one row (it splits rows where positions restart).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedRows", "gather_response", "pack_rows", "real_lengths"]


def real_lengths(attention_mask: torch.Tensor, response_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Real prompt and response lengths ``(p, r)``, each ``(B,)`` long, from ``attention_mask (B, T)``.

    ``p_i`` counts from the first 1 of the prompt part to its end (left padding); ``r_i`` from the
    response start to the last 1 of the response part (right padding; zeros inside the span, e.g.
    masked tool tokens, stay inside it).
    """
    prompt_len = attention_mask.shape[1] - response_length
    mask = attention_mask.bool()
    prompt, response = mask[:, :prompt_len], mask[:, prompt_len:]
    cols = torch.arange(prompt_len, device=mask.device)
    first = torch.where(prompt, cols, prompt_len).amin(dim=1)
    p = prompt_len - first
    rcols = torch.arange(1, response_length + 1, device=mask.device)
    r = torch.where(response, rcols, 0).amax(dim=1) if response_length else torch.zeros_like(p)
    return p, r


@dataclass
class PackedRows:
    """A micro-batch with its padding removed; all tensors ``(b, W)``.

    ``prompt_lens`` / ``response_lens`` are ``(b,)``; response token ``j`` of row ``i`` is predicted
    by the logits at column ``prompt_lens[i] - 1 + j``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    dense: bool = False  # every span unbroken with positions +1 per column: the mask can be dropped

    @property
    def computed_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def real_tokens(self) -> int:
        return int((self.prompt_lens + self.response_lens).sum())


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
) -> PackedRows:
    """Shift each row's real span ``[P - p_i, P + r_i)`` to column 0 and trim to the longest span."""
    p, r = real_lengths(attention_mask, response_length)
    if bool(((p == 0) & (r > 0)).any()):
        row = int(((p == 0) & (r > 0)).nonzero()[0])
        raise ValueError(f"row {row} of the micro-batch has no prompt token; a response needs a prompt before it")
    total = p + r
    width = max(1, int(total.max()))
    start = attention_mask.shape[1] - response_length - p
    cols = torch.arange(width, device=input_ids.device)
    index = (start[:, None] + cols[None, :]).clamp(max=input_ids.shape[1] - 1)
    inside = cols[None, :] < total[:, None]
    mask = attention_mask.gather(1, index) * inside.to(attention_mask.dtype)
    positions = position_ids.gather(1, index)
    counting = positions[:, :1] + cols[None, :]
    dense = bool(mask.sum() == total.sum()) and bool(((positions == counting) | ~inside).all())
    return PackedRows(
        input_ids=input_ids.gather(1, index),
        attention_mask=mask,
        position_ids=counting if dense else positions,
        prompt_lens=p,
        response_lens=r,
        dense=dense,
    )


def gather_response(x: torch.Tensor, packed: PackedRows, first_col: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Response-aligned slice of a per-column output ``x (b, W', ...)``, whose column 0 is packed
    column ``first_col``. Returns ``(y (b, R_mb, ...), valid (b, R_mb) bool)`` with
    ``R_mb = max(r_i)``; ``y[i, j]`` is ``x`` at packed column ``p_i - 1 + j`` where ``valid``."""
    r_mb = max(1, int(packed.response_lens.max()))
    j = torch.arange(r_mb, device=x.device)
    col = (packed.prompt_lens[:, None] - 1 + j[None, :] - first_col).clamp(0, x.shape[1] - 1)
    valid = j[None, :] < packed.response_lens[:, None]
    index = col.view(*col.shape, *([1] * (x.dim() - 2))).expand(*col.shape, *x.shape[2:])
    return x.gather(1, index), valid
