"""A preallocated key/value cache for batched decoding with row compaction.

Layout: one tensor (L, 2, rows, Hkv, S, D) for all layers, keys at [:, 0] and values at [:, 1],
so dropping finished rows is a single gather over dim 2 instead of 2L of them. Slot s holds the
token at column s of the (B, T) output layout (left-padded prompt, then response), so a slot's
validity is the prompt attention mask for s < P and 1 for response slots.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """Keys/values of `rows` active sequences, `length` filled slots, capacity fixed at allocation."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.shape_tail = (num_kv_heads, head_dim)
        self.num_layers = num_layers
        self.dtype = dtype
        self.buffer: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None  # (rows, S) bool: slot holds a real token
        self.rows = 0
        self.length = 0

    def allocate(self, rows: int, max_rows: int, capacity: int, device: torch.device) -> None:
        """Start `rows` sequences with room for `max_rows` of `capacity` slots (the buffer is reused
        when it is big enough)."""
        buf = self.buffer
        fits = buf is not None and buf.shape[2] >= max_rows and buf.shape[4] >= capacity and buf.device == device
        if not fits:
            self.buffer = None  # drop the old one first so both never coexist in memory
            self.buffer = torch.empty(
                (self.num_layers, 2, max_rows, self.shape_tail[0], capacity, self.shape_tail[1]),
                dtype=self.dtype,
                device=device,
            )
        self.valid = torch.ones(max_rows, self.buffer.shape[4], dtype=torch.bool, device=device)
        self.rows, self.length = rows, 0

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values (b, Hkv, t, D) of the first b rows at slots [start, start + t)."""
        rows, t = keys.shape[0], keys.shape[2]
        slots = self.buffer[layer].narrow(3, start, t)  # a view; cheaper than a 5-part index per write
        slots[0, :rows].copy_(keys)
        slots[1, :rows].copy_(values)

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (rows, Hkv, length, D) of the active rows (views, no copy)."""
        kv = self.buffer[layer, :, : self.rows, :, : self.length]
        return kv[0], kv[1]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All slots of one layer's keys and values (max_rows, Hkv, S, D), contiguous per head."""
        return self.buffer[layer, 0], self.buffer[layer, 1]

    def attention_mask(self) -> torch.Tensor:
        """(rows, 1, 1, length) bool: which filled slots a new query may attend to."""
        return self.valid[: self.rows, None, None, : self.length]

    def repeat_rows(self, repeats: int) -> None:
        """Row i becomes rows i*repeats .. i*repeats + repeats - 1 (prefill once, decode G samples)."""
        if repeats == 1:
            return
        src = self.buffer[:, :, : self.rows, :, : self.length].clone()
        self.buffer[:, :, : self.rows * repeats, :, : self.length] = src.repeat_interleave(repeats, dim=2)
        self.valid[: self.rows * repeats] = self.valid[: self.rows].repeat_interleave(repeats, dim=0)
        self.rows *= repeats

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (k,) int64 (ascending), moved to the front of the buffer."""
        kept = self.buffer[:, :, keep, :, : self.length]
        self.buffer[:, :, : keep.numel(), :, : self.length] = kept
        self.valid[: keep.numel()] = self.valid[keep]
        self.rows = keep.numel()

    def free(self) -> None:
        """Release the buffer; the next `allocate` creates a new one."""
        self.buffer, self.valid, self.rows, self.length = None, None, 0, 0
