"""What runs inside a worker process: the role objects of one rank and the env they start with.

A *role* (actor, rollout, ref, critic, ...) is a plain Python class. A :class:`WorkerHost` holds
the role objects of one rank; colocated roles are several objects in one host, so they share the
process (and its device memory) by composition. The Ray backend runs one host per rank as a Ray
actor; the local backend runs one host in the driver process.

Before any role is built the host exports the torch.distributed rendezvous variables ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``, so a role only has to call
``hybridrl.engine.distributed.init_distributed()`` (gloo on CPU, nccl with CUDA).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["RoleSpec", "Worker", "WorkerHost", "find_free_port", "node_ip"]


class RoleSpec:
    """A role class with its constructor arguments, built inside the worker process.

    ``uses`` names roles listed *earlier* in the same colocated group; each is passed to the
    constructor as a keyword argument of that name (e.g. a rollout role that reads the actor's
    weights in-process: ``RoleSpec(RolloutWorker, cfg, uses=("actor",))`` is built as
    ``RolloutWorker(cfg, actor=<the actor object>)``).
    """

    def __init__(self, cls: type, /, *args: Any, uses: tuple[str, ...] = (), **kwargs: Any) -> None:
        if not isinstance(cls, type):
            raise TypeError(f"RoleSpec needs a class, got {cls!r}")
        self.cls, self.args, self.kwargs, self.uses = cls, args, kwargs, tuple(uses)

    def build(self, built: Mapping[str, Any]) -> Any:
        """Instantiate the class; ``built`` holds the roles constructed before this one."""
        deps = {name: built[name] for name in self.uses}
        return self.cls(*self.args, **self.kwargs, **deps)

    def __repr__(self) -> str:
        return f"RoleSpec({self.cls.__qualname__}, uses={self.uses})"


class Worker:
    """Optional base class: ``rank``, ``world_size`` and ``local_rank`` of this worker process.

    Read from the env the host exported, so they hold in ``__init__`` already. Inheriting is not
    required; any class can read the same env vars.
    """

    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", "0"))

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))


def node_ip() -> str:
    """This node's address as Ray sees it (reachable from other nodes); 127.0.0.1 outside Ray.

    Ray is only consulted when this process is already part of a Ray cluster, so the local
    backend never imports it.
    """
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def find_free_port() -> int:
    """A TCP port free on this machine right now (the OS picks it; it is released on return)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class WorkerHost:
    """The role objects of one rank, addressed by role name. One per worker process."""

    def __init__(self) -> None:
        self.roles: dict[str, Any] = {}

    def process_info(self) -> dict[str, Any]:
        """pid and node of this process (the driver names them in error messages)."""
        return {"pid": os.getpid(), "node_ip": node_ip(), "hostname": socket.gethostname()}

    def rendezvous_endpoint(self) -> tuple[str, int]:
        """(MASTER_ADDR, MASTER_PORT) for the group, chosen on this (rank 0's) node."""
        return node_ip(), find_free_port()

    def setup(self, env: Mapping[str, str], roles: Mapping[str, RoleSpec]) -> None:
        """Export ``env`` into this process, then build the roles in order."""
        os.environ.update({k: str(v) for k, v in env.items()})
        built: dict[str, Any] = {}
        for name, spec in roles.items():
            built[name] = spec.build(built)
        self.roles = built

    def execute(self, role: str, method: str, args: tuple, kwargs: dict) -> Any:
        """Run ``roles[role].method(*args, **kwargs)`` in this process."""
        return getattr(self.roles[role], method)(*args, **kwargs)

    def execute_joined(self, role: str, method: str, args: tuple, kwargs: dict, *earlier: tuple[Any, float]) -> tuple[Any, float]:
        """``execute_timed`` with ``args[0]`` (a DataProto) joined with the tensor columns each earlier
        call returned on this rank (their ``(result, seconds)``, resolved by the backend)."""
        if earlier:
            data = args[0]
            for result, _ in earlier:
                data = data.union(result.select(non_tensor_batch_keys=[], meta_info_keys=[]))
            args = (data, *args[1:])
        return self.execute_timed(role, method, args, kwargs)

    def execute_timed(self, role: str, method: str, args: tuple, kwargs: dict) -> tuple[Any, float]:
        """``execute``, and the seconds the method itself ran (what the driver's accounting of time
        spent inside workers adds up; transfer and (de)serialization are outside it)."""
        start = time.perf_counter()
        result = self.execute(role, method, args, kwargs)
        return result, time.perf_counter() - start
