"""A preallocated key/value cache for batched decoding with row compaction.

Layout: one tensor (L, 2, rows, Hkv, S, D) for all layers, keys at [:, 0] and values at [:, 1],
so dropping finished rows is a single gather over dim 2 instead of 2L of them. Slot s holds the
token at column s of the (B, T) output layout (left-padded prompt, then response), so a slot's
validity is the prompt attention mask for s < P and 1 for response slots.

Shared prompts (`share_prompts`, for the fused decode kernels): the prefill writes prompt i into
row i*G only (`allocate(..., spread=G)`), and every live row reads slots [0, P) from its prompt's
row (`source`) and keeps its own slots from P on. A prompt's keys and values are then read from one
copy by all G samples instead of from G copies, and never copied G times. Compaction moves only
slots from P on, so a prompt's slots stay in place for its samples however the rows move. The
memory is that of G copies (each row keeps room for its prompt's slots).
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

    def _clear_sharing(self, spread: int = 1) -> None:
        self.spread = spread  # the prefill's row i goes to buffer row i * spread
        self.shared = 0  # slots [0, shared) of a live row are its prompt row's
        self.source: torch.Tensor | None = None  # (rows,) int64: each live row's prompt (buffer) row

    def allocate(self, rows: int, max_rows: int, capacity: int, device: torch.device, spread: int = 1) -> None:
        """Start `rows` sequences with room for `max_rows` of `capacity` slots (the buffer is reused
        when it is big enough); the prefill's rows land `spread` rows apart (`share_prompts`)."""
        if rows * spread > max_rows:
            raise ValueError(f"allocate: {rows} rows {spread} apart need {rows * spread} rows; max_rows is {max_rows}")
        buf, total = self.buffer, max_rows
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
        self._clear_sharing(spread)

    def prompt_valid(self) -> torch.Tensor:
        """(rows, S) bool, a view: the validity rows the prefill's rows write (see `allocate`)."""
        return self.valid[: self.rows * self.spread : self.spread]

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values (b, Hkv, t, D) of the first b rows (`spread` apart) at slots [start, start + t)."""
        rows, t = keys.shape[0], keys.shape[2]
        slots = self.buffer[layer].narrow(3, start, t)  # a view; cheaper than a 5-part index per write
        slots[0, : rows * self.spread : self.spread].copy_(keys)
        slots[1, : rows * self.spread : self.spread].copy_(values)

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (rows, Hkv, length, D) of the active rows (views, no copy); not with shared
        prompts, where a row's first slots live in another row."""
        if self.source is not None:
            raise RuntimeError("StaticKVCache.view: rows share their prompts' slots; read them with layer/prompt_layer")
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

    def share_prompts(self, repeats: int) -> None:
        """Like `repeat_rows`, without copying: live row i*repeats + j reads slots [0, length) from
        buffer row i*repeats, where the prefill wrote prompt i (see the module doc). Needs
        `allocate(..., spread=repeats)`."""
        if self.spread != repeats or self.source is not None:
            raise RuntimeError(f"share_prompts({repeats}): allocate with spread={repeats} and prefill first")
        n = self.rows
        self.valid[: n * repeats] = self.prompt_valid().repeat_interleave(repeats, dim=0)
        self.shared, self.rows, self.spread = self.length, n * repeats, 1
        self.source = torch.arange(0, n * repeats, repeats, device=self.buffer.device).repeat_interleave(repeats)

    def prompts(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where rows read their shared prompt slots (`source` indexes it): the layer's own keys and
        values; None when prompts are not shared."""
        return None if self.source is None else self.layer(layer)

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (k,) int64 (ascending), moved to the front of the buffer."""
        first = self.shared  # shared prompt slots stay where the prefill wrote them
        kept = self.buffer[:, :, keep, :, first : self.length]
        self.buffer[:, :, : keep.numel(), :, first : self.length] = kept
        self.valid[: keep.numel()] = self.valid[keep]
        if self.source is not None:
            self.source = self.source[keep]
        self.rows = keep.numel()

    def free(self) -> None:
        """Release the buffer; the next `allocate` creates a new one."""
        self.buffer, self.valid, self.rows, self.length = None, None, 0, 0
        self._clear_sharing()
