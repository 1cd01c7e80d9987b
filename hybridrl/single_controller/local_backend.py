"""The local backend: the same roles and dispatch as Ray, in the driver process, for debugging.

One rank (world size 1) runs in-process: a breakpoint in worker code stops the driver right there.
Arguments and results are deep-copied, as Ray's serialization would, so a worker that mutates its
input (or the driver its output) behaves the same under both backends.

Calls run in the order they were sent, as a Ray actor runs them, when the driver first waits for
one of them (or for a later one): a call sent without waiting (``.submit``) runs at the driver's
next wait, so the time the driver spends waiting for a call is the time that call ran, under both
backends. A call whose result nobody waits for runs only if a later call's result is awaited.
"""

from __future__ import annotations

import copy
import os
import traceback
from collections import deque
from collections.abc import Mapping
from typing import Any

from hybridrl.single_controller.dispatch import CallPlan
from hybridrl.single_controller.errors import WorkerError
from hybridrl.single_controller.worker import RoleSpec, WorkerHost, find_free_port

__all__ = ["LocalBackend"]


class LocalBackend:
    """Runs one :class:`WorkerHost` in this process; calls run in order when awaited (module docstring)."""

    def __init__(self, roles: Mapping[str, RoleSpec], env: Mapping[str, str], world_size: int) -> None:
        if world_size != 1:
            raise ValueError(
                f"backend='local' runs one rank in the driver process; the resource pool has world size "
                f"{world_size}. Use a 1-rank pool (trainer.nnodes=1, trainer.n_gpus_per_node=1) or backend='ray'"
            )
        self.world_size = 1
        self._roles = dict(roles)
        self._host = WorkerHost()
        self._queue: deque[_LocalCall] = deque()
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

    def submit(self, plan: CallPlan, role: str, method: str, joins: tuple = ()) -> _LocalCall:
        """Queue the call with a snapshot of its arguments; it runs at the next ``wait``. ``joins``:
        earlier calls whose results join the first argument when it runs (as on a Ray rank)."""
        call = _LocalCall(role, method, copy.deepcopy(plan.calls), tuple(joins))
        self._queue.append(call)
        return call

    def wait(self, handle: _LocalCall, role: str, method: str) -> list[Any]:
        """Run the queued calls up to this one, in order; its (result, seconds) per rank."""
        while handle.outcomes is None:
            self._run(self._queue.popleft())
        for ok, value in handle.outcomes:
            if not ok:
                raise value from value.__cause__
        return [value for _, value in handle.outcomes]

    def _run(self, call: _LocalCall) -> None:
        outcomes = []
        for rank, (args, kwargs) in enumerate(call.calls):
            try:
                earlier = []
                for join in call.joins:  # sent before this call, so already run
                    ok, value = join.outcomes[rank]
                    if not ok:
                        raise RuntimeError(f"its input from {join.method}() failed: {value.headline()}")
                    earlier.append(copy.deepcopy(value))
                result, seconds = self._host.execute_joined(call.role, call.method, args, kwargs, *earlier)
                outcomes.append((True, (copy.deepcopy(result), seconds)))
            except Exception as exc:
                outcomes.append((False, self._error(call.role, call.method, exc)))
        call.outcomes = outcomes

    def _error(self, role: str, method: str, exc: BaseException) -> WorkerError:
        names = [self._roles[r].cls.__qualname__ for r in role.split(",") if r in self._roles]
        text = "".join(traceback.format_exception(exc))
        err = WorkerError(role, "+".join(names), 0, 1, method, os.getpid(), "localhost", text)
        err.__cause__ = exc
        return err

    def worker_pids(self) -> list[int]:
        return [os.getpid()]

    def shutdown(self) -> None:
        self._queue.clear()
        self._host.roles = {}
        if not self._had_group and _group_initialized():
            from hybridrl.engine.distributed import destroy_distributed

            destroy_distributed()  # the roles' engines, unreachable now, are collected first
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class _LocalCall:
    """A sent call: per rank ``(args, kwargs)`` (a snapshot), the earlier calls it joins, and once
    run, per rank ``(ok, value)``."""

    def __init__(self, role: str, method: str, calls: tuple, joins: tuple = ()) -> None:
        self.role, self.method, self.calls, self.joins = role, method, calls, joins
        self.outcomes: list[tuple[bool, Any]] | None = None


def _group_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()

