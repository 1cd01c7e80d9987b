"""Sharded checkpoints (model + optimizer + LR schedule + RNG) and full Hugging Face export.

Layout of a checkpoint directory::

    model_optim/            torch.distributed.checkpoint (DCP): each rank writes its own shards
                            of the model and AdamW state; a load may use another world size
    extra_state_rank_<r>.pt LR-scheduler state, RNG states (torch, CUDA, numpy, python) of rank r
    engine_meta.json        world size and optimizer step count, for humans and sanity checks

Weights leave the engine as full tensors in module order (``iter_full_tensors``): the shards of a
bucket of tensors (up to ``GATHER_BUCKET_BYTES``) are all-gathered in one collective, handed out, and
dropped before the next bucket, so neither a rollout engine nor an HF export ever holds two copies
of the model.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard

__all__ = ["export_hf", "iter_full_tensors", "load_checkpoint", "save_checkpoint"]

_MODEL_OPTIM = "model_optim"
_META = "engine_meta.json"


def _rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes a single process even when ``no_dist=True`` says so; silence that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)", category=UserWarning)
        yield


def save_checkpoint(path, model, optimizer, lr_scheduler, group=None, step: int = 0) -> None:
    """Write the sharded checkpoint of ``model``/``optimizer``/``lr_scheduler`` and this rank's RNG.

    Collective: every rank of ``group`` must call it with the same ``path`` (a shared filesystem)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=str(path / _MODEL_OPTIM),
            process_group=group,
            no_dist=not dist.is_initialized(),
        )
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    extra = {"lr_scheduler": lr_scheduler.state_dict(), "rng": _rng_state(), "step": step}
    torch.save(extra, path / f"extra_state_rank_{rank}.pt")
    if rank == 0:
        (path / _META).write_text(json.dumps({"world_size": world, "step": step}, indent=2))
    if world > 1:
        dist.barrier(group)


def load_checkpoint(path, model, optimizer, lr_scheduler, group=None) -> int:
    """Restore what ``save_checkpoint`` wrote; returns the saved optimizer step count.

    Model and optimizer may be loaded at another world size (DCP reshards); the RNG state is
    restored only when the world size matches (otherwise there is no state for this rank)."""
    path = Path(path)
    if not (path / _MODEL_OPTIM).is_dir():
        raise FileNotFoundError(f"{path} is not an engine checkpoint: {path / _MODEL_OPTIM} is missing")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path / _MODEL_OPTIM), process_group=group, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    saved_world = json.loads((path / _META).read_text())["world_size"]
    own = path / f"extra_state_rank_{rank}.pt"
    extra = torch.load(own if own.exists() else path / "extra_state_rank_0.pt", weights_only=True)
    lr_scheduler.load_state_dict(extra["lr_scheduler"])
    if saved_world == world:
        _set_rng_state(extra["rng"])
    return int(extra["step"])


def _named_state_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (tied ones once, under their first name) and persistent buffers, in module order."""
    yield from model.named_parameters(remove_duplicate=True)
    for mod_name, module in model.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf_name not in module._non_persistent_buffers_set:
                yield (f"{mod_name}.{buf_name}" if mod_name else buf_name), buf


# Sharded tensors are gathered in buckets of up to this many bytes (full size) per collective: one
# all-gather per tensor cost a collective's latency each (the tiny model's 40 tensors over gloo, two
# ranks: about 45 ms a weight sync), while a bucket bounds the extra memory to about twice its size.
GATHER_BUCKET_BYTES = 32 * 2**20


def iter_full_tensors(model: nn.Module, dtype: torch.dtype | None = None,
                      bucket_bytes: int = GATHER_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` pairs in module order. Collective under FSDP: every rank must consume
    the whole iterator in the same order. FSDP2's shards (dim-0 ``Shard`` on a 1-D mesh) are gathered
    a bucket of up to ``bucket_bytes`` at a time in one all-gather (a tensor larger than that alone);
    other tensors one at a time."""
    bucket: list[tuple[str, DTensor]] = []
    size = 0
    for name, tensor in _named_state_tensors(model):
        bucketable, nbytes = _bucketable(tensor), tensor.numel() * tensor.element_size()
        if bucket and not (bucketable and _same_bucket(bucket[0][1], tensor) and size + nbytes <= bucket_bytes):
            yield from _gathered(bucket, dtype)
            bucket, size = [], 0
        if bucketable:
            bucket.append((name, tensor))
            size += nbytes
        else:
            yield name, _full(tensor, dtype)
    if bucket:
        yield from _gathered(bucket, dtype)


def _full(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The whole tensor (a DTensor gathered on its own), detached, in ``dtype`` when given."""
    full = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
    return full.to(dtype) if dtype is not None else full


def _bucketable(tensor: torch.Tensor) -> bool:
    """A DTensor sharded along dim 0 over a 1-D mesh (what FSDP2 makes of every parameter)."""
    if not isinstance(tensor, DTensor) or tensor.device_mesh.ndim != 1 or len(tensor.placements) != 1:
        return False
    placement = tensor.placements[0]
    return isinstance(placement, Shard) and placement.dim == 0 and tensor.dim() > 0


def _same_bucket(first: DTensor, tensor: DTensor) -> bool:
    return (tensor.device_mesh == first.device_mesh and tensor.dtype == first.dtype
            and tensor.device == first.device)


def _shard_rows(rows: int, world: int) -> list[int]:
    """Rows of each rank's dim-0 shard: ``torch.chunk``'s split, as DTensor's ``Shard(0)`` makes it
    (ceil(rows / world) each; the last ones shorter or empty)."""
    per = -(-rows // world) if rows else 0
    return [max(0, min(per, rows - rank * per)) for rank in range(world)]


def _gathered(bucket: list[tuple[str, DTensor]], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The bucket's full tensors from one all-gather of every rank's shards laid end to end."""
    mesh = bucket[0][1].device_mesh
    group, world, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    counts = []  # per tensor: each rank's element count
    for _, tensor in bucket:
        row = tensor.numel() // tensor.shape[0] if tensor.shape[0] else 0
        counts.append([rows * row for rows in _shard_rows(tensor.shape[0], world)])
    local = [tensor.to_local() for _, tensor in bucket]
    if any(part.numel() != count[rank] for part, count in zip(local, counts)):
        # not the split assumed above (another sharding rule): gather these one at a time instead
        for name, tensor in bucket:
            yield name, _full(tensor, dtype)
        return
    length = max(sum(count[r] for count in counts) for r in range(world))
    first = local[0]
    send = first.new_zeros(length)
    offset = 0
    for part in local:
        send[offset: offset + part.numel()].copy_(part.detach().reshape(-1))
        offset += part.numel()
    received = first.new_empty(world, length)
    dist.all_gather(list(received.unbind(0)), send, group=group)
    starts = [0] * world
    for (name, tensor), count in zip(bucket, counts):
        pieces = []
        for r in range(world):
            pieces.append(received[r, starts[r]: starts[r] + count[r]])
            starts[r] += count[r]
        yield name, _full(torch.cat(pieces).view(tensor.shape), dtype)


def export_hf(path, model: nn.Module, tokenizer=None, dtype=None, max_shard_bytes: int = 2**30, group=None) -> None:
    """Write a Hugging Face folder (config, safetensors shards + index, tokenizer) from rank 0.

    Collective (the full tensors are gathered on every rank); only rank 0 writes. Tensors are
    buffered up to ``max_shard_bytes`` per file, so rank 0 holds at most one shard of full weights."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    path = Path(path)
    writer = _ShardWriter(path, max_shard_bytes) if rank == 0 else None
    for name, tensor in iter_full_tensors(model, dtype):
        if writer is not None:
            writer.add(name, tensor.cpu().contiguous())
    if writer is None:
        return
    writer.finish()
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"export_hf: {type(model).__name__} has no .config; only Hugging Face models export")
    config.save_pretrained(path)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


class _ShardWriter:
    """Buffers tensors into safetensors files of at most ``max_bytes`` and writes the index."""

    def __init__(self, path: Path, max_bytes: int):
        path.mkdir(parents=True, exist_ok=True)
        self.path, self.max_bytes = path, max_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.files: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.buffer and sum(t.numel() * t.element_size() for t in self.buffer.values()) + size > self.max_bytes:
            self._flush()
        self.buffer[name] = tensor
        self.total_bytes += size

    def _flush(self) -> None:
        tmp = self.path / f".shard-{len(self.files):05d}.safetensors"
        save_file(self.buffer, str(tmp), metadata={"format": "pt"})
        self.files.append(list(self.buffer))
        self.buffer = {}

    def finish(self) -> None:
        if self.buffer or not self.files:
            self._flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            os.replace(self.path / f".shard-{i:05d}.safetensors", self.path / name)
        if n > 1:
            weight_map = {key: names[i] for i, keys in enumerate(self.files) for key in keys}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
