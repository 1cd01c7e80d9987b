"""WorkerGroup: the driver's handle on the ranks of one (possibly colocated) set of roles.

    pool = ResourcePool([2])                                   # 2 CPU ranks on one node
    wg = WorkerGroup(pool, {"actor": RoleSpec(ActorWorker, cfg),
                            "ref": RoleSpec(RefWorker, cfg)})  # both in one process per rank
    out = wg.actor.compute_log_prob(batch)                     # dispatch as @register says
    fut = wg.ref.compute_ref_log_prob.submit(batch)            # a WorkerFuture; fut.get()
    wg.shutdown()

A failing rank makes the call raise :class:`WorkerError` (or :class:`WorkerDiedError`) naming
the role, class, rank, method and pid, with the worker's traceback. After a failure the group
kills all of its actors (the others may be stuck in a collective waiting for the failed rank)
and refuses further calls: an SPMD group with a failed rank cannot continue.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

from hybridrl.protocol import DataProto
from hybridrl.single_controller.decorator import Dispatch, MethodSpec, registered_methods
from hybridrl.single_controller.dispatch import CallPlan, collect_results, plan_call
from hybridrl.single_controller.errors import WorkerError
from hybridrl.single_controller.resource_pool import ResourcePool
from hybridrl.single_controller.worker import RoleSpec

__all__ = ["RemoteMethod", "RoleProxy", "WorkerFuture", "WorkerGroup"]

BACKENDS = ("ray", "local")
DEFAULT_ROLE = "worker"
BUSY_RECORDS = 4096  # finished calls ``WorkerGroup.busy_since`` can look back over


class Backend(Protocol):
    """What a WorkerGroup needs from a backend (Ray actors, or the driver process)."""

    world_size: int

    def submit(self, plan: CallPlan, role: str, method: str, joins: tuple = ()) -> Any: ...
    def wait(self, handle: Any, role: str, method: str) -> list[Any]: ...  # per rank: (result, seconds it ran)
    def worker_pids(self) -> list[int]: ...
    def shutdown(self) -> None: ...


class WorkerFuture:
    """A call in flight. ``get()`` waits for all its ranks and returns the merged result once."""

    def __init__(self, group: WorkerGroup, plan: CallPlan, handle: Any, role: str, method: str) -> None:
        self._group, self._plan, self._handle, self._role, self._method = group, plan, handle, role, method
        self._done, self._value = False, None

    def get(self) -> Any:
        if not self._done:
            timed = self._group._wait(self._handle, self._role, self._method)
            # the ranks run concurrently: the call kept the group busy as long as its slowest rank
            self._group._count_busy(max((seconds for _, seconds in timed), default=0.0))
            self._value, self._done = collect_results(self._plan, [result for result, _ in timed]), True
        return self._value


class RemoteMethod:
    """``wg.<role>.<method>``: call it (blocking as registered) or ``.submit(...)`` for a future."""

    def __init__(self, group: WorkerGroup, role: str, method: str, spec: MethodSpec) -> None:
        self._group, self._role, self._method, self.spec = group, role, method, spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        future = self.submit(*args, **kwargs)
        return future.get() if self.spec.blocking else future

    def submit(self, *args: Any, **kwargs: Any) -> WorkerFuture:
        return self._group._submit(self._role, self._method, self.spec, args, kwargs)

    def submit_joined(self, data: DataProto, *earlier: WorkerFuture) -> WorkerFuture:
        """Send the call on ``data`` joined, on each rank, with the columns each ``earlier`` call
        (sent before, on the same rows) returned there. The results travel as Ray object references
        that Ray resolves itself, so this call can be sent before they are done and the driver never
        waits for, receives or re-sends them for it. Both must be
        ``DP_COMPUTE_PROTO`` calls of this group over the same number of rows."""
        return self._group._submit(self._role, self._method, self.spec, (data,), {}, earlier)

    def __repr__(self) -> str:
        return f"<remote {self._role}.{self._method} {self.spec.dispatch_mode.name} blocking={self.spec.blocking}>"


class RoleProxy:
    """``wg.<role>``: attribute access gives the role's registered methods as RemoteMethods."""

    def __init__(self, group: WorkerGroup, role: str) -> None:
        self._group, self._role = group, role

    def __getattr__(self, method: str) -> RemoteMethod:
        if method.startswith("__"):
            raise AttributeError(method)
        return self._group.method(self._role, method)

    def __dir__(self) -> list[str]:
        return sorted(self._group._methods[self._role])


class WorkerGroup:
    """The ranks of ``pool`` running ``roles``; see the module docstring.

    Args:
        pool: the :class:`ResourcePool` (world size = number of ranks).
        roles: a class, a :class:`RoleSpec`, or ``{role name: class or RoleSpec}``; several
            roles are colocated (built in this order in one process per rank). A single class or
            RoleSpec becomes the role ``"worker"`` and its methods are also reachable as
            ``wg.<method>``.
        backend: ``"ray"`` (one actor per rank; needs ``init_ray()``) or ``"local"`` (world
            size 1, in this process, for debugging).
        env: extra environment variables set in each worker before the roles are built.
        name: prefix of the Ray actor names (visible in ``ray list actors``).
    """

    def __init__(
        self,
        pool: ResourcePool,
        roles: type | RoleSpec | Mapping[str, type | RoleSpec],
        backend: str = "ray",
        env: Mapping[str, str] | None = None,
        name: str = "wg",
    ) -> None:
        self.roles = _normalize_roles(roles)
        self._methods = {role: registered_methods(spec.cls) for role, spec in self.roles.items()}
        self.name, self.backend_name, self._failure = name, backend, None
        # seconds the ranks spent running calls (per call, its slowest rank), summed over finished
        # calls: the driver's wall time minus this is time outside every worker (dispatch,
        # transfer, (de)serialization, the driver's own work)
        self.busy_s = 0.0
        # (driver clock when the results arrived, the slowest rank's seconds) of the latest calls,
        # for ``busy_since``
        self._finished: deque[tuple[float, float]] = deque(maxlen=BUSY_RECORDS)
        self._closed = False
        self._backend = _make_backend(backend, pool, self.roles, dict(env or {}), name)
        self.world_size = self._backend.world_size

    # -------------------------------------------------------------------------- addressing
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        roles = self.__dict__.get("roles", {})
        if name in roles:
            return RoleProxy(self, name)
        if len(roles) == 1:
            try:
                return self.method(next(iter(roles)), name)
            except AttributeError as err:
                raise AttributeError(f"worker group {self.__dict__.get('name')!r} has no role {name!r} and {err}") from None
        raise AttributeError(f"worker group {self.__dict__.get('name')!r} has no role {name!r}; roles: {list(roles)}")

    def method(self, role: str, method: str) -> RemoteMethod:
        """The RemoteMethod for ``role.method``; errors name the registered methods."""
        if role not in self.roles:
            raise AttributeError(f"worker group {self.name!r} has no role {role!r}; roles: {list(self.roles)}")
        spec = self._methods[role].get(method)
        if spec is None:
            cls = self.roles[role].cls.__qualname__
            raise AttributeError(
                f"{cls}.{method} (role {role!r}) is not callable from the driver: decorate it with @register(...); "
                f"registered methods: {sorted(self._methods[role])}"
            )
        return RemoteMethod(self, role, method, spec)

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``wg.call("actor", "update_policy", data)`` == ``wg.actor.update_policy(data)``."""
        return self.method(role, method)(*args, **kwargs)

    # -------------------------------------------------------------------------- execution
    def _submit(self, role: str, method: str, spec: MethodSpec, args: tuple, kwargs: dict,
                joins: tuple[WorkerFuture, ...] = ()) -> WorkerFuture:
        self._check_open()
        plan = plan_call(spec.dispatch_mode, self.world_size, args, kwargs)
        for earlier in joins:
            dp = Dispatch.DP_COMPUTE_PROTO
            if earlier._group is not self or plan.mode is not dp or earlier._plan.mode is not dp \
                    or earlier._plan.rows != plan.rows:
                raise ValueError(
                    f"{role}.{method}: can only join the results of an earlier DP_COMPUTE_PROTO call of this group on "
                    f"the same rows; {earlier._role}.{earlier._method} had {earlier._plan.rows} (padded) rows, this call "
                    f"{plan.rows}")
        handle = self._backend.submit(plan, role, method, tuple(f._handle for f in joins))
        return WorkerFuture(self, plan, handle, role, method)

    def _wait(self, handle: Any, role: str, method: str) -> list[Any]:
        self._check_open()
        try:
            return self._backend.wait(handle, role, method)
        except WorkerError as err:
            self._failure = err.headline()
            self.shutdown()
            raise

    def _count_busy(self, seconds: float) -> None:
        self.busy_s += seconds
        self._finished.append((time.perf_counter(), seconds))

    def busy_since(self, start: float) -> float:
        """Seconds the ranks spent running calls since ``start`` (a ``time.perf_counter()`` of this
        process): each call collected since then, for its slowest rank, counting only the part that
        can have run after ``start``. A call sent before ``start`` (a generation sent behind the
        previous step's update) counts at most from ``start`` to when its results arrived, so the
        sum never exceeds the wall time of calls that run one after another. Looks back over the
        latest ``BUSY_RECORDS`` calls."""
        return sum(min(seconds, done - start) for done, seconds in self._finished if done > start)

    def _check_open(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"worker group {self.name!r} was shut down after a failure: {self._failure}")
        if self._closed:
            raise RuntimeError(f"worker group {self.name!r} is shut down")

    # -------------------------------------------------------------------------- lifecycle
    def worker_pids(self) -> list[int]:
        """The process id of each rank (the driver's own pid for the local backend)."""
        return self._backend.worker_pids()

    def shutdown(self) -> None:
        """Kill the worker processes (Ray) or drop the role objects (local). Idempotent."""
        self._closed = True
        self._backend.shutdown()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, backend={self.backend_name!r}, world_size={self.world_size}, roles={list(self.roles)})"


# Attributes of WorkerGroup itself: a role of that name could not be reached as wg.<role>.
_RESERVED = frozenset(n for n in dir(WorkerGroup) if not n.startswith("_")) | {
    "roles", "name", "backend_name", "world_size"
}


def _normalize_roles(roles: type | RoleSpec | Mapping[str, type | RoleSpec]) -> dict[str, RoleSpec]:
    if isinstance(roles, type | RoleSpec):
        roles = {DEFAULT_ROLE: roles}
    if not isinstance(roles, Mapping) or not roles:
        raise TypeError(f"roles must be a class, a RoleSpec or a non-empty dict of them, got {roles!r}")
    out: dict[str, RoleSpec] = {}
    for name, spec in roles.items():
        spec = spec if isinstance(spec, RoleSpec) else RoleSpec(spec)
        missing = [u for u in spec.uses if u not in out]
        if missing:
            raise ValueError(
                f"role {name!r} uses {missing}, which must be listed before it in the same group; order: {list(roles)}"
            )
        if not name.isidentifier() or name.startswith("_") or name in _RESERVED:
            raise ValueError(
                f"role name {name!r} must be a Python identifier, not start with '_' and not be one of {sorted(_RESERVED)}"
            )
        out[name] = spec
    return out


def _make_backend(backend: str, pool: ResourcePool, roles: dict[str, RoleSpec], env: dict, name: str) -> Backend:
    if backend == "local":
        from hybridrl.single_controller.local_backend import LocalBackend

        return LocalBackend(roles, env, pool.world_size)
    if backend == "ray":
        from hybridrl.single_controller.ray_backend import RayBackend

        return RayBackend(pool, roles, env, name)
    raise ValueError(f"unknown worker-group backend {backend!r}; allowed: {list(BACKENDS)} (trainer.backend)")
