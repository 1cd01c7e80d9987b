"""DataProto: the batch that moves between the driver and the worker groups.

A ``DataProto`` holds three things:

- ``batch``: named tensors that share their first dimension (the rows);
- ``non_tensor_batch``: named numpy object arrays with the same first dimension (strings, dicts,
  anything picklable: ``uid``, ``data_source``, ``reward_model``, ``extra_info``, ...);
- ``meta_info``: a small dict that is not split by rows (temperature, step, flags).

Every row operation (slice, split, concat, repeat, reorder, pad) is applied to tensors and
non-tensor columns alike, so the two never drift apart.

Key glossary (spell keys exactly so; shape letters: ``N`` prompts, ``G`` samples per prompt
(``rollout.n``), ``B = N*G`` sequences, ``P`` prompt length, ``R`` response length, ``T = P + R``)::

    prompts            (B, P)  prompt token ids, LEFT-padded
    responses          (B, R)  response token ids, RIGHT-padded
    input_ids          (B, T)  cat(prompts, responses)
    attention_mask     (B, T)  1 on real tokens (prompt and response up to and incl. EOS)
    position_ids       (B, T)  clamp(cumsum(attention_mask, -1) - 1, min=0)
    response_mask      (B, R)  1 on response tokens that carry loss (0 on padding and, in
                               multi-turn rollouts, on tool / user tokens)
    rollout_log_probs  (B, R)  log-probs of the sampled tokens as the rollout engine computed them
    old_log_probs      (B, R)  log-probs under the policy before the update (the PPO denominator)
    ref_log_probs      (B, R)  log-probs under the reference policy
    values             (B, R)  critic values
    token_level_scores (B, R)  reward-function scores, the sequence score on the last valid token
    token_level_rewards(B, R)  scores after KL-in-reward (equal to scores without it)
    advantages         (B, R)
    returns            (B, R)

    non-tensor: uid (one per prompt, shared by its G samples), data_source, reward_model
                ({"style", "ground_truth"}), extra_info (dict), raw_prompt (chat messages)

Pickling (for Ray) sends tensors as numpy buffers, which pickle protocol 5 ships without copies.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["DataProto", "to_object_array"]


def to_object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D numpy object array holding ``values`` as they are (dicts and lists stay whole)."""
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


def _as_index(idx: Any) -> np.ndarray | slice:
    if isinstance(idx, slice):
        return idx
    if isinstance(idx, torch.Tensor):
        idx = idx.cpu().numpy()
    arr = np.asarray(idx)
    if arr.dtype == bool:
        return np.nonzero(arr)[0]
    return arr.astype(np.int64).reshape(-1)


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and all(_values_equal(x, y) for x, y in zip(a.tolist(), b.tolist()))
    try:
        return bool(a == b)
    except (ValueError, TypeError):
        return a is b


@dataclass
class DataProto:
    """Named tensors + named non-tensor columns with a common first dimension, plus ``meta_info``.

    See the module docstring for the key glossary.
    """

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.batch = dict(self.batch)
        self.non_tensor_batch = {k: self._to_column(k, v) for k, v in self.non_tensor_batch.items()}
        self.meta_info = dict(self.meta_info)
        self.check_consistency()

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        """Build from dicts; non-tensor values may be lists or numpy arrays (stored as object arrays)."""
        return cls(batch=tensors or {}, non_tensor_batch=non_tensors or {}, meta_info=meta_info or {})

    @staticmethod
    def _to_column(key: str, value: Any) -> np.ndarray:
        if isinstance(value, np.ndarray) and value.dtype == object:
            return value
        if isinstance(value, np.ndarray) and value.ndim == 1:
            return to_object_array(value.tolist())
        if isinstance(value, list | tuple):
            return to_object_array(list(value))
        if isinstance(value, np.ndarray):
            out = np.empty(value.shape[0], dtype=object)
            for i in range(value.shape[0]):
                out[i] = value[i]
            return out
        raise TypeError(f"non-tensor column {key!r} must be a list or numpy array, got {type(value).__name__}")

    def check_consistency(self) -> None:
        """Raise ValueError unless every tensor and non-tensor column has the same first dimension."""
        sizes = {k: int(v.shape[0]) for k, v in self.batch.items() if v.dim() > 0}
        sizes.update({k: int(v.shape[0]) for k, v in self.non_tensor_batch.items()})
        for k, v in self.batch.items():
            if v.dim() == 0:
                raise ValueError(f"tensor {k!r} is a scalar; DataProto tensors need a batch dimension")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"DataProto columns disagree on the batch size: {sizes}")

    # ---------------------------------------------------------------------------------- basics
    def __len__(self) -> int:
        for v in self.batch.values():
            return int(v.shape[0])
        for v in self.non_tensor_batch.values():
            return int(v.shape[0])
        return 0

    @property
    def batch_size(self) -> int:
        return len(self)

    def keys(self) -> list[str]:
        return list(self.batch) + list(self.non_tensor_batch)

    def __contains__(self, key: str) -> bool:
        return key in self.batch or key in self.non_tensor_batch

    def __getitem__(self, idx: Any) -> DataProto:
        """Rows by int, slice, index array/tensor or boolean mask. An int gives a 1-row DataProto."""
        if isinstance(idx, str):
            raise TypeError(f"index rows, not columns: use data.batch[{idx!r}] or data.non_tensor_batch[{idx!r}]")
        if isinstance(idx, int | np.integer):
            n = len(self)
            i = int(idx) + n if idx < 0 else int(idx)
            if not 0 <= i < n:
                raise IndexError(f"row {idx} out of range for a DataProto of {n} rows")
            idx = slice(i, i + 1)
        index = _as_index(idx)
        t_index = index if isinstance(index, slice) else torch.from_numpy(index)
        return DataProto(
            batch={k: v[t_index] for k, v in self.batch.items()},
            non_tensor_batch={k: v[index] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}:{tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}" for k, v in self.batch.items())
        return (
            f"DataProto(len={len(self)}, batch=[{tensors}], "
            f"non_tensor=[{', '.join(self.non_tensor_batch)}], meta={sorted(self.meta_info)})"
        )

    # ----------------------------------------------------------------------------- column ops
    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the named columns (None keeps all of that kind)."""
        batch = self._pick(self.batch, batch_keys, "batch")
        non_tensor = self._pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch")
        meta = self._pick(self.meta_info, meta_info_keys, "meta_info")
        out = DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)
        return copy.deepcopy(out) if deepcopy else out

    @staticmethod
    def _pick(src: dict, keys: Sequence[str] | None, where: str) -> dict:
        if keys is None:
            return dict(src)
        missing = [k for k in keys if k not in src]
        if missing:
            raise KeyError(f"{where} has no key(s) {missing}; present: {sorted(src)}")
        return {k: src[k] for k in keys}

    def pop(
        self,
        batch_keys: Sequence[str] = (),
        non_tensor_batch_keys: Sequence[str] = (),
        meta_info_keys: Sequence[str] = (),
    ) -> DataProto:
        """Remove the named columns from this DataProto and return them as a new one."""
        out = self.select(list(batch_keys), list(non_tensor_batch_keys), list(meta_info_keys))
        for k in batch_keys:
            del self.batch[k]
        for k in non_tensor_batch_keys:
            del self.non_tensor_batch[k]
        for k in meta_info_keys:
            del self.meta_info[k]
        return out

    def union(self, other: DataProto) -> DataProto:
        """Merge the columns of ``other`` into a new DataProto.

        A key present in both must hold equal values; otherwise ValueError names the key, so two
        workers can never silently overwrite each other's results.
        """
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"cannot union DataProtos of {len(self)} and {len(other)} rows")
        merged = []
        for mine, theirs, where in (
            (self.batch, other.batch, "batch"),
            (self.non_tensor_batch, other.non_tensor_batch, "non_tensor_batch"),
            (self.meta_info, other.meta_info, "meta_info"),
        ):
            out = dict(mine)
            for k, v in theirs.items():
                if k in out and not _values_equal(out[k], v):
                    raise ValueError(f"union conflict: {where} key {k!r} differs between the two DataProtos")
                out[k] = v
            merged.append(out)
        return DataProto(*merged)

    def rename(self, old: str, new: str) -> DataProto:
        """Rename a tensor or non-tensor column in place; returns self."""
        for cols in (self.batch, self.non_tensor_batch):
            if old in cols:
                if new in cols:
                    raise ValueError(f"cannot rename {old!r} to {new!r}: {new!r} exists")
                cols[new] = cols.pop(old)
                return self
        raise KeyError(f"no column {old!r}; present: {self.keys()}")

    # -------------------------------------------------------------------------------- row ops
    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` equal parts; the length must divide (pad first with pad_to_divisor)."""
        n = len(self)
        if chunks <= 0 or n % chunks:
            raise ValueError(f"cannot chunk {n} rows into {chunks} equal parts; pad_to_divisor({chunks}) first")
        return self.split(n // chunks)

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of ``split_size`` rows (the last may be shorter)."""
        if split_size <= 0:
            raise ValueError(f"split_size must be positive, got {split_size}")
        n = len(self)
        return [self[i : i + split_size] for i in range(0, n, split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenate row-wise. Columns must match; meta_info is taken from the first part."""
        if not data:
            raise ValueError("concat needs at least one DataProto")
        first = data[0]
        for i, d in enumerate(data[1:], 1):
            if set(d.batch) != set(first.batch) or set(d.non_tensor_batch) != set(first.non_tensor_batch):
                raise ValueError(
                    f"concat: part {i} has columns {sorted(d.keys())}, part 0 has {sorted(first.keys())}"
                )
        batch = {k: torch.cat([d.batch[k] for d in data]) for k in first.batch}
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in first.non_tensor_batch}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(first.meta_info))

    def repeat(self, repeat_times: int, interleave: bool = True) -> DataProto:
        """Repeat rows: interleaved gives a,a,b,b (samples of one prompt adjacent); else a,b,a,b."""
        n = len(self)
        base = np.arange(n)
        index = np.repeat(base, repeat_times) if interleave else np.tile(base, repeat_times)
        return self[index]

    def reorder(self, indices: Any) -> DataProto:
        """Rows in the order given by ``indices`` (a permutation or any index array)."""
        return self[_as_index(indices)]

    def pad_to_divisor(self, divisor: int) -> tuple[DataProto, int]:
        """Append copies of the first rows so the length divides ``divisor``; returns (data, pad_size)."""
        n = len(self)
        if divisor <= 0:
            raise ValueError(f"divisor must be positive, got {divisor}")
        pad = (-n) % divisor
        if pad == 0 or n == 0:
            return self, 0
        index = np.concatenate([np.arange(n), np.arange(pad) % n])
        return self[index], pad

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last ``pad_size`` rows added by pad_to_divisor."""
        return self if pad_size == 0 else self[: len(self) - pad_size]

    def make_iterator(
        self, mini_batch_size: int, epochs: int = 1, seed: int | None = None, shuffle: bool = True
    ) -> Iterator[DataProto]:
        """Mini-batches over ``epochs`` passes, the last of a pass holding the rows left over where
        ``mini_batch_size`` does not divide them (as verl's split does). With a seed, each epoch uses a
        fresh permutation drawn from one generator (reproducible); without shuffle, rows keep their order."""
        n = len(self)
        if mini_batch_size <= 0:
            raise ValueError(f"mini_batch_size must be >= 1, got {mini_batch_size}")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
            for start in range(0, n, mini_batch_size):
                yield self[order[start : start + mini_batch_size]]

    # ---------------------------------------------------------------------------- tensor ops
    def to(self, device: str | torch.device) -> DataProto:
        """Move tensors to ``device`` (in place); returns self."""
        self.batch = {k: v.to(device) for k, v in self.batch.items()}
        return self

    def contiguous(self) -> DataProto:
        self.batch = {k: v.contiguous() for k, v in self.batch.items()}
        return self

    # ------------------------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        # numpy arrays pickle with protocol-5 out-of-band buffers (zero-copy in Ray's object store);
        # bfloat16 has no numpy dtype, so it travels as its int16 bit pattern.
        tensors = {}
        for k, v in self.batch.items():
            v = v.detach().cpu().contiguous()
            if v.dtype == torch.bfloat16:
                tensors[k] = ("bf16", v.view(torch.int16).numpy())
            else:
                tensors[k] = ("np", v.numpy())
        return {"tensors": tensors, "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info}

    def __setstate__(self, state: dict[str, Any]) -> None:
        batch = {}
        for k, (kind, arr) in state["tensors"].items():
            t = torch.from_numpy(np.array(arr, copy=not arr.flags.writeable))
            batch[k] = t.view(torch.bfloat16) if kind == "bf16" else t
        self.batch = batch
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]
