"""Process-group setup and the few collectives the engine needs, identical on gloo and NCCL.

The Ray worker group (or ``torchrun``) sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``; ``init_distributed`` reads them. Without an initialised process group the engine
runs at world size 1 with no collectives at all, so a single process needs no setup.
"""

from __future__ import annotations

import gc
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_max",
    "all_reduce_sum",
    "default_device",
    "destroy_distributed",
    "free_port",
    "get_rank",
    "get_world_size",
    "init_distributed",
]

_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` where CUDA is available, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default process group from the env vars; returns ``(rank, world_size)``.

    ``backend=None`` picks ``nccl`` when CUDA is available and ``gloo`` otherwise. Calling it again
    in an initialised process returns the existing group's rank and size.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in _REQUIRED_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_distributed: environment variable(s) {missing} are not set; the launcher (Ray worker "
            f"group or torchrun) must set {list(_REQUIRED_ENV)}"
        )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"init_distributed: backend must be 'gloo' or 'nccl', got {backend!r}")
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return dist.get_rank(), dist.get_world_size()


def destroy_distributed() -> None:
    """Tear down the default process group if one exists.

    Unreachable objects that still hold the group (an engine gone out of scope, kept alive by a
    reference cycle of its modules and hooks) are collected first: freed later, during the
    interpreter's exit, gloo's destructors aborted the process after a finished run
    ("terminate called without an active exception", 2 in 30 two-rank runs; none in 30 with the
    collection first)."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: the ``MASTER_PORT`` of a group whose ranks share this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """Rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Size of ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _all_reduce(value: float, op: dist.ReduceOp, group, device: torch.device) -> float:
    if get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def all_reduce_max(value: float, group=None, device: torch.device | None = None) -> float:
    """Maximum of ``value`` over the ranks of ``group`` (identity at world size 1)."""
    return _all_reduce(value, dist.ReduceOp.MAX, group, device or default_device())


def all_reduce_sum(value: float, group=None, device: torch.device | None = None) -> float:
    """Sum of ``value`` over the ranks of ``group`` (identity at world size 1)."""
    return _all_reduce(value, dist.ReduceOp.SUM, group, device or default_device())
