"""A preallocated key/value cache for batched decoding with row compaction.

Layout: one tensor (L, 2, rows, Hkv, S, D) for all layers, keys at [:, 0] and values at [:, 1],
so dropping finished rows is a single gather over dim 2 instead of 2L of them. Slot s holds the
token at column s of the (B, T) output layout (left-padded prompt, then response), so a slot's
validity is the prompt attention mask for s < P and 1 for response slots.

Shared prompts (`share_prompts`, for the fused decode kernels): the prefill writes the N prompts
into a store of their own, (L, 2, N, Hkv, P, D), and the N*G live rows hold only the response slots
(slot s at index s - P of a buffer P slots shorter). Every sample reads its prompt's slots from the
store (`source`), so a prompt is kept, and read each step, once instead of G times; compaction moves
only the live rows. With G samples of prompts of P tokens and responses of up to R, the cache holds
N*P + N*G*R slots instead of N*G*(P + R).
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
        self.prompt_store: torch.Tensor | None = None  # (L, 2, N, Hkv, P, D) when prompts are shared
        self.shared = 0  # slots [0, shared) of a live row are its prompt's (in the store)
        self.source: torch.Tensor | None = None  # (rows,) int64: each live row's prompt in the store

    def allocate(self, rows: int, max_rows: int, capacity: int, device: torch.device, prompt_length: int = 0) -> None:
        """Start `rows` sequences with room for `max_rows` of `capacity` slots (the buffer is reused
        when it is big enough). ``prompt_length``: the rows are prompts of that many slots, prefilled
        into a store of their own for `share_prompts`; the buffer then holds only later slots."""
        kept = capacity - prompt_length
        buf = self.buffer
        fits = buf is not None and buf.shape[2] >= max_rows and buf.shape[4] >= kept and buf.device == device
        if not fits:
            self.buffer = None  # drop the old one first so both never coexist in memory
            self.buffer = torch.empty(
                (self.num_layers, 2, max_rows, self.shape_tail[0], kept, self.shape_tail[1]),
                dtype=self.dtype,
                device=device,
            )
        self._clear_sharing()
        if prompt_length:
            self.prompt_store = torch.empty((self.num_layers, 2, rows, self.shape_tail[0], prompt_length,
                                             self.shape_tail[1]), dtype=self.dtype, device=device)
        self.valid = torch.ones(max_rows, capacity, dtype=torch.bool, device=device)
        self.rows, self.length = rows, 0

    def prompt_valid(self) -> torch.Tensor:
        """(rows, S) bool, a view: the validity of the rows being prefilled."""
        return self.valid[: self.rows]

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values (b, Hkv, t, D) of the first b rows at slots [start, start + t) (a prefill
        allocated with a prompt length: into the prompt store)."""
        rows, t = keys.shape[0], keys.shape[2]
        if self.prompt_store is not None and self.source is None:
            target = self.prompt_store[layer].narrow(3, start, t)
        else:  # a view; cheaper than a 5-part index per write
            target = self.buffer[layer].narrow(3, start - self.shared, t)
        target[0, :rows].copy_(keys)
        target[1, :rows].copy_(values)

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (rows, Hkv, length, D) of the active rows (views, no copy); not with shared
        prompts, where a row's first slots live in another row."""
        if self.source is not None:
            raise RuntimeError("StaticKVCache.view: rows share their prompts' slots; read them with layer/prompts")
        kv = self.buffer[layer, :, : self.rows, :, : self.length]
        return kv[0], kv[1]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All slots of one layer's keys and values (max_rows, Hkv, S, D), contiguous per head (with
        shared prompts: slots from `shared` on, slot s at index s - shared)."""
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
        prompt i in the store (see the module doc). Needs `allocate(..., prompt_length=length)`."""
        store = self.prompt_store
        if store is None or self.source is not None or store.shape[4] != self.length:
            raise RuntimeError("share_prompts: allocate with the prompt length and prefill the prompts first")
        n = self.rows
        self.valid[: n * repeats] = self.valid[:n].repeat_interleave(repeats, dim=0)
        self.shared, self.rows = self.length, n * repeats
        self.source = torch.arange(n, device=store.device).repeat_interleave(repeats)

    def prompts(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The prompt store's keys and values of one layer (N, Hkv, P, D), which `source` indexes;
        None when prompts are not shared."""
        return None if self.source is None else (self.prompt_store[layer, 0], self.prompt_store[layer, 1])

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (k,) int64 (ascending), moved to the front of the buffer."""
        filled = self.length - self.shared  # slots in the buffer (the prompts' stay in their store)
        kept = self.buffer[:, :, keep, :, :filled]
        self.buffer[:, :, : keep.numel(), :, :filled] = kept
        self.valid[: keep.numel()] = self.valid[keep]
        if self.source is not None:
            self.source = self.source[keep]
        self.rows = keep.numel()

    def free(self) -> None:
        """Release the buffer; the next `allocate` creates a new one."""
        self.buffer, self.valid, self.rows, self.length = None, None, 0, 0
        self._clear_sharing()
