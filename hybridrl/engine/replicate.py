"""Whole-model replicas over a process group: ``fsdp_config.fsdp_size=1`` (verl's meaning: shard
groups of one rank, every rank holding the whole model, as DDP does).

FSDP2 gathers each block's parameters before its forward and again before its backward, and
reduce-scatters its gradients after: three collectives per block per micro-batch, each a wait for
the slowest rank, plus DTensor dispatch on every parameter op. For a model whose parameters,
gradients and optimizer state fit on each rank, that is pure cost: on two one-thread CPU ranks the
0.7M-parameter tiny model's update took 0.24 s a step sharded and 0.16 s on each rank alone.
Replicas instead run the plain module and sum the gradients once per optimizer step, in a few
flat buckets (``sum_gradients``); every rank then takes the same AdamW step on the same numbers,
so the replicas stay bit-identical. ``broadcast_parameters`` makes them identical to begin with
(a value head or any layer initialised at random on each rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["BUCKET_BYTES", "broadcast_parameters", "sum_gradients"]

BUCKET_BYTES = 32 << 20  # gradient bytes per all-reduce: few calls, and a bounded extra copy


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of one dtype and device, each up to ``bucket_bytes`` (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = out[-1] if out else None
        if last is None or last[0].dtype != t.dtype or last[0].device != t.device or size + nbytes > bucket_bytes:
            out.append([t])
            size = nbytes
        else:
            last.append(t)
            size += nbytes
    return out


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def broadcast_parameters(model: nn.Module, group, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Give every rank of ``group`` the parameters and buffers of its first rank (collective)."""
    src = dist.get_global_rank(group, 0)
    tensors = [t.data for t in list(model.parameters()) + list(model.buffers()) if t.numel()]
    for bucket in _buckets(tensors, bucket_bytes):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, src=src, group=group)
        _copy_back(flat, bucket)


def sum_gradients(params: list[nn.Parameter], group, reduce_dtype: torch.dtype | None = None,
                  bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum each parameter's ``.grad`` over the ranks of ``group``, in place (collective).

    A parameter without a gradient on some ranks (a micro-batch that did not reach it) takes zeros
    there; one without a gradient on every rank keeps ``grad=None``, as it would on one rank, so the
    optimizer leaves it alone. ``params`` must be the same list, in the same order, on every rank."""
    if not params:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=params[0].device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
    grads = []
    for p, any_rank in zip(params, has.tolist()):
        if not any_rank:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        wire = flat.to(reduce_dtype) if reduce_dtype is not None else flat  # no copy when it is the dtype
        dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group)
        _copy_back(wire, bucket)  # copy_ casts back from the reduce dtype
