"""The local backend: the same roles and dispatch as Ray, in the driver process, for debugging.

One rank (world size 1) runs in-process: a breakpoint in worker code stops the driver right there.
Arguments and results are deep-copied, as Ray's serialization would, so a worker that mutates its
input (or the driver its output) behaves the same under both backends.
"""

from __future__ import annotations

import copy
import os
import traceback
from collections.abc import Mapping
from typing import Any

from hybridrl.single_controller.dispatch import CallPlan
from hybridrl.single_controller.errors import WorkerError
from hybridrl.single_controller.worker import RoleSpec, WorkerHost, find_free_port

__all__ = ["LocalBackend"]


class LocalBackend:
    """Runs one :class:`WorkerHost` in this process. Calls execute eagerly at submit."""

    def __init__(self, roles: Mapping[str, RoleSpec], env: Mapping[str, str], world_size: int) -> None:
        if world_size != 1:
            raise ValueError(
                f"backend='local' runs one rank in the driver process; the resource pool has world size "
                f"{world_size}. Use a 1-rank pool (trainer.nnodes=1, trainer.n_gpus_per_node=1) or backend='ray'"
            )
        self.world_size = 1
        self._roles = dict(roles)
        self._host = WorkerHost()
        rendezvous = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(find_free_port())}
        # The roles run in the driver: remember its env and process-group state so that shutdown
        # leaves the driver as it found it (a later in-process job must not inherit a 1-rank group).
        self._saved_env = {k: os.environ.get(k) for k in {**rendezvous, **env}}
        self._had_group = _group_initialized()
        try:
            self._host.setup({**rendezvous, **env}, self._roles)
        except Exception as exc:
            self.shutdown()
            raise self._error(",".join(self._roles), "__init__", exc) from exc

    def submit(self, plan: CallPlan, role: str, method: str) -> list[tuple[bool, Any]]:
        """Run the call now; the handle is a list of (ok, (result, seconds) or error) per rank."""
        outcomes = []
        for args, kwargs in plan.calls:
            try:
                args, kwargs = copy.deepcopy((args, kwargs))
                result, seconds = self._host.execute_timed(role, method, args, kwargs)
                outcomes.append((True, (copy.deepcopy(result), seconds)))
            except Exception as exc:
                outcomes.append((False, self._error(role, method, exc)))
        return outcomes

    def wait(self, handle: list[tuple[bool, Any]], role: str, method: str) -> list[Any]:
        for ok, value in handle:
            if not ok:
                raise value from value.__cause__
        return [value for _, value in handle]

    def _error(self, role: str, method: str, exc: BaseException) -> WorkerError:
        names = [self._roles[r].cls.__qualname__ for r in role.split(",") if r in self._roles]
        text = "".join(traceback.format_exception(exc))
        err = WorkerError(role, "+".join(names), 0, 1, method, os.getpid(), "localhost", text)
        err.__cause__ = exc
        return err

    def worker_pids(self) -> list[int]:
        return [os.getpid()]

    def shutdown(self) -> None:
        self._host.roles = {}
        if not self._had_group and _group_initialized():
            import torch.distributed as dist

            dist.destroy_process_group()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _group_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()

