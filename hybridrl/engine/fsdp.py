"""FSDP2 wrapping: one ``fully_shard`` per transformer block plus the root, on any process group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = ["DTYPES", "block_modules", "resolve_dtype", "shard_model"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, what: str) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` -> torch dtype; ``what`` names the argument in errors."""
    if name not in DTYPES:
        raise ValueError(f"{what} must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: HF's ``_no_split_modules`` classes, else the children of the
    largest ``nn.ModuleList`` whose children share one class."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    lists = [m for m in lists if len({type(c) for c in m}) == 1]
    return list(max(lists, key=len)) if lists else []


def shard_model(
    model: nn.Module,
    group: dist.ProcessGroup,
    device_type: str,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    forward_prefetch: bool = False,
    shard_size: int | None = None,
) -> nn.Module:
    """Shard ``model`` in place over ``group`` with FSDP2 and return it.

    Each block is its own FSDP unit (its parameters are gathered only while it runs); the root
    unit holds the rest (embeddings, final norm, head; tied embeddings stay in one unit). Gradients
    are reduced as a SUM over ranks, not a mean: the caller's loss is already normalised by the
    global token count, so the per-rank gradients add up to the gradient of the global loss.

    ``reshard_after_forward=False`` keeps each block's gathered parameters from its forward to its
    backward (one gather per block per micro-batch instead of two, for a block's worth of memory
    each); ``forward_prefetch`` gathers the next block's parameters when a block's forward starts.

    ``shard_size`` between 1 and the group's size (dividing it): HSDP, each parameter sharded over
    groups of that many consecutive ranks and replicated across the groups (a 2-D mesh, replicas x
    shard); gradients are reduce-scattered within a shard group and summed across the groups.
    """
    mesh = _mesh(group, device_type, shard_size)
    mp = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reduce_dtype=None if reduce_dtype == torch.float32 else reduce_dtype,
    )
    blocks = block_modules(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if forward_prefetch:
        for block, following in zip(blocks, blocks[1:]):
            block.set_modules_to_forward_prefetch([following])
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # factor 1 + plain SUM collectives: gloo has no PREMUL_SUM, and one op for both backends
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def _mesh(group: dist.ProcessGroup, device_type: str, shard_size: int | None) -> DeviceMesh:
    """1-D over ``group``, or HSDP's (replicas, shard_size) over the same ranks."""
    world = dist.get_world_size(group)
    if shard_size is None or not 1 < shard_size < world:
        return DeviceMesh.from_group(group, device_type)
    if world % shard_size:
        raise ValueError(f"fsdp_size={shard_size} does not divide the {world} ranks")
    if world != dist.get_world_size():
        # the mesh's shard and replica groups are made collectively over every process
        raise ValueError(f"fsdp_size={shard_size} (HSDP) needs the engine's group to be every process "
                         f"({world} of {dist.get_world_size()} ranks here)")
    ranks = torch.tensor(dist.get_process_group_ranks(group)).view(world // shard_size, shard_size)
    return DeviceMesh(device_type, ranks, mesh_dim_names=("replicate", "shard"))
