"""A preallocated key/value cache for batched decoding with row compaction.

Layout: one tensor (L, 2, rows, Hkv, S, D) for all layers, keys at [:, 0] and values at [:, 1],
so dropping finished rows is a single gather over dim 2 instead of 2L of them. Slot s holds the
token at column s of the (B, T) output layout (left-padded prompt, then response), so a slot's
validity is the prompt attention mask for s < P and 1 for response slots.

Shared prompts (`share_prompts`, for the fused decode kernels): the N prefilled prompt rows stay at
rows [0, N) and the N*G live rows follow them (`base` = N); a live row reads slots [0, P) from its
prompt's row (`source`) and writes its own from P on, so a prompt's keys and values are read once
per sample from one copy instead of G copies, and never copied G times.
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
        self._clear_sharing()

    def _clear_sharing(self) -> None:
        self.base = 0  # buffer row of live row 0 (the prompt rows come first when shared)
        self.shared = 0  # slots [0, shared) of a live row are its prompt row's
        self.source: torch.Tensor | None = None  # (rows,) int64: each live row's prompt row

    def allocate(self, rows: int, max_rows: int, capacity: int, device: torch.device, prompt_rows: int = 0) -> None:
        """Start `rows` sequences with room for `max_rows` of `capacity` slots (the buffer is reused
        when it is big enough), plus `prompt_rows` rows ahead of them for `share_prompts`."""
        buf, total = self.buffer, prompt_rows + max_rows
        fits = buf is not None and buf.shape[2] >= total and buf.shape[4] >= capacity and buf.device == device
        if not fits:
            self.buffer = None  # drop the old one first so both never coexist in memory
            self.buffer = torch.empty(
                (self.num_layers, 2, total, self.shape_tail[0], capacity, self.shape_tail[1]),
                dtype=self.dtype,
                device=device,
            )
        self.valid = torch.ones(total, self.buffer.shape[4], dtype=torch.bool, device=device)
        self.rows, self.length = rows, 0
        self._clear_sharing()

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values (b, Hkv, t, D) of the first b rows at slots [start, start + t)."""
        rows, t = keys.shape[0], keys.shape[2]
        slots = self.buffer[layer].narrow(3, start, t)  # a view; cheaper than a 5-part index per write
        slots[0, self.base : self.base + rows].copy_(keys)
        slots[1, self.base : self.base + rows].copy_(values)

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (rows, Hkv, length, D) of the active rows (views, no copy); not with shared
        prompts, where a row's first slots live in another row."""
        if self.source is not None:
            raise RuntimeError("StaticKVCache.view: rows share their prompts' slots; read them with layer/prompt_layer")
        kv = self.buffer[layer, :, : self.rows, :, : self.length]
        return kv[0], kv[1]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All slots of one layer's keys and values (max_rows, Hkv, S, D) from live row 0 on,
        contiguous per head."""
        return self.buffer[layer, 0, self.base :], self.buffer[layer, 1, self.base :]

    def prompt_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared prompt rows' keys and values (N, Hkv, S, D), or None when prompts are not shared."""
        if self.source is None:
            return None
        return self.buffer[layer, 0, : self.base], self.buffer[layer, 1, : self.base]

    def live_valid(self) -> torch.Tensor:
        """(max_rows, S) bool from live row 0 on: slot holds a real token."""
        return self.valid[self.base :]

    def attention_mask(self) -> torch.Tensor:
        """(rows, 1, 1, length) bool: which filled slots a new query may attend to."""
        return self.valid[self.base : self.base + self.rows, None, None, : self.length]

    def repeat_rows(self, repeats: int) -> None:
        """Row i becomes rows i*repeats .. i*repeats + repeats - 1 (prefill once, decode G samples)."""
        if repeats == 1:
            return
        src = self.buffer[:, :, : self.rows, :, : self.length].clone()
        self.buffer[:, :, : self.rows * repeats, :, : self.length] = src.repeat_interleave(repeats, dim=2)
        self.valid[: self.rows * repeats] = self.valid[: self.rows].repeat_interleave(repeats, dim=0)
        self.rows *= repeats

    def share_prompts(self, repeats: int) -> None:
        """Like `repeat_rows`, without copying: the prefilled rows (slots [0, length)) become prompt
        rows, and live row i*repeats + j reads those slots from prompt row i (see the module doc).
        Needs `allocate(..., prompt_rows=rows)`."""
        n = self.rows
        if self.base or self.buffer.shape[2] < n + n * repeats:
            raise RuntimeError(f"share_prompts: allocate room for {n} prompt rows and {n * repeats} live rows first")
        self.valid[n : n + n * repeats] = self.valid[:n].repeat_interleave(repeats, dim=0)
        self.base, self.shared, self.rows = n, self.length, n * repeats
        self.source = torch.arange(n, device=self.buffer.device).repeat_interleave(repeats)

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (k,) int64 (ascending), moved to the front of the live rows."""
        base, first = self.base, self.shared  # shared prompt slots stay in their rows
        kept = self.buffer[:, :, base + keep, :, first : self.length]
        self.buffer[:, :, base : base + keep.numel(), :, first : self.length] = kept
        self.valid[base : base + keep.numel()] = self.valid[base + keep]
        if self.source is not None:
            self.source = self.source[keep]
        self.rows = keep.numel()

    def free(self) -> None:
        """Release the buffer; the next `allocate` creates a new one."""
        self.buffer, self.valid, self.rows, self.length = None, None, 0, 0
        self._clear_sharing()
