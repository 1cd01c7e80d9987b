"""The Ray backend: one Ray actor per rank, each a :class:`WorkerHost` in its own process.

Startup: create the actors in the pool's placement-group bundles, wait (bounded) until they are
scheduled, ask rank 0 for a free rendezvous port on its node, then build the roles on all ranks at
once (their constructors may already join the torch.distributed group).

Failure: results are awaited with ``ray.wait`` on all ranks together, so the first rank to raise
or die ends the wait at once, even while the other ranks are blocked in a collective waiting for
it (collecting ranks in order would hang on the blocked one). The caller then kills every actor.
"""

from __future__ import annotations

import atexit
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridrl.single_controller.dispatch import CallPlan
from hybridrl.single_controller.errors import WorkerDiedError, WorkerError
from hybridrl.single_controller.resource_pool import ResourcePool
from hybridrl.single_controller.worker import RoleSpec, WorkerHost

__all__ = ["RayBackend"]

# Every live backend, so a driver that exits (normally or by an exception) kills its actors
# before Ray's own exit hook runs (atexit is LIFO and ray was imported above this registration).
_LIVE: weakref.WeakSet[RayBackend] = weakref.WeakSet()
# How long a rank's task error waits for its peers, so that a rank that died is reported as the
# cause rather than a peer's "connection closed" error (ray_backend.RayBackend._death_behind).
DEATH_GRACE_S = 5.0

_REMOTE_HOST = None


def _shutdown_all() -> None:
    for backend in list(_LIVE):
        backend.shutdown()


atexit.register(_shutdown_all)


def _remote_host_class():
    global _REMOTE_HOST
    if _REMOTE_HOST is None:
        _REMOTE_HOST = ray.remote(WorkerHost)
    return _REMOTE_HOST


class RayBackend:
    """The actors of one worker group on ``pool``."""

    def __init__(self, pool: ResourcePool, roles: Mapping[str, RoleSpec], env: Mapping[str, str], name: str) -> None:
        if not ray.is_initialized():
            raise RuntimeError("backend='ray' needs a running Ray: call hybridrl.single_controller.init_ray() first")
        self.world_size = pool.world_size
        self._pool, self._roles, self._name = pool, dict(roles), name
        self._actors: list[Any] = []
        self._info: list[dict[str, Any]] = [{} for _ in range(self.world_size)]
        placements = pool.acquire()
        _LIVE.add(self)
        try:
            self._start_actors(placements)
            self._setup_roles(placements, env)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------------------ startup
    def _start_actors(self, placements: list) -> None:
        resources = self._pool.actor_resources()
        suffix = uuid.uuid4().hex[:6]
        host_cls = _remote_host_class()
        for rank, place in enumerate(placements):
            strategy = PlacementGroupSchedulingStrategy(place.placement_group, place.bundle_index)
            self._actors.append(
                host_cls.options(
                    name=f"{self._name}_{suffix}_rank{rank}", scheduling_strategy=strategy,
                    max_restarts=0, max_task_retries=0, **resources,
                ).remote()
            )
        refs = [a.process_info.remote() for a in self._actors]
        try:
            ready = ray.get(refs, timeout=self._pool.ready_timeout_s)
        except GetTimeoutError:
            raise RuntimeError(
                f"worker group {self._name!r}: {self.world_size} actor(s) with {resources} each were not started "
                f"within {self._pool.ready_timeout_s:.0f}s on {self._pool!r}; available: {ray.available_resources()}"
            ) from None
        self._info = ready

    def _setup_roles(self, placements: list, env: Mapping[str, str]) -> None:
        addr, port = ray.get(self._actors[0].rendezvous_endpoint.remote())
        refs = []
        for rank, (actor, place) in enumerate(zip(self._actors, placements)):
            rendezvous = {"RANK": rank, "WORLD_SIZE": self.world_size, "LOCAL_RANK": place.local_rank,
                          "MASTER_ADDR": addr, "MASTER_PORT": port}
            refs.append(actor.setup.remote({**{k: str(v) for k, v in rendezvous.items()}, **env}, self._roles))
        self.wait(list(zip(range(self.world_size), refs)), ",".join(self._roles), "__init__")

    # ------------------------------------------------------------------------------ calls
    def submit(self, plan: CallPlan, role: str, method: str, joins: tuple = ()) -> list[tuple[int, Any]]:
        """Send the call to its ranks; the handle is a list of (rank, ObjectRef of (result, seconds)).
        ``joins``: handles of earlier calls whose per-rank results join the first argument on each
        rank. They go as object references: Ray's core worker holds the task until they are ready
        and delivers them with it, without the driver's Python code waiting for them."""
        earlier = [dict(handle) for handle in joins]  # rank -> ObjectRef, per joined call
        return [
            (rank, self._actors[rank].execute_joined.remote(role, method, args, kwargs, *(e[rank] for e in earlier)))
            for rank, (args, kwargs) in zip(plan.ranks, plan.calls)
        ]

    def wait(self, handle: list[tuple[int, Any]], role: str, method: str) -> list[Any]:
        """Results in handle order; raises WorkerError for the first rank that fails, or
        WorkerDiedError for a rank that died, which takes precedence (see ``_death_behind``)."""
        rank_of = {ref: rank for rank, ref in handle}
        results: dict[Any, Any] = {}
        pending = list(rank_of)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except RayError as err:
                    cause, rank = (err, rank_of[ref])
                    if isinstance(err, RayTaskError):
                        cause, rank = self._death_behind(pending, rank_of) or (cause, rank)
                    raise self._error(cause, rank, role, method) from cause
        return [results[ref] for _, ref in handle]

    @staticmethod
    def _death_behind(pending: list, rank_of: dict, grace_s: float = DEATH_GRACE_S):
        """A rank whose process died, among the calls still pending, as ``(error, rank)``; else None.

        When one rank exits inside a collective, its peers' gloo/NCCL calls fail with "connection
        closed by peer" at about the moment Ray notices the death, and either can reach the driver
        first. The dead rank is the cause, so a task error waits up to ``grace_s`` for the others.
        """
        if not pending:
            return None
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as err:
                return err, rank_of[ref]
            except RayError:
                continue
        return None

    def _error(self, err: RayError, rank: int, role: str, method: str) -> WorkerError:
        names = "+".join(self._roles[r].cls.__qualname__ for r in role.split(",") if r in self._roles)
        info = self._info[rank]
        where = (role, names, rank, self.world_size, method, info.get("pid"), info.get("node_ip"))
        if isinstance(err, RayTaskError):
            return WorkerError(*where, str(err))
        if isinstance(err, RayActorError):
            return WorkerDiedError(*where, f"Ray: {err}")
        return WorkerDiedError(*where, f"Ray: {type(err).__name__}: {err}")

    # ------------------------------------------------------------------------------ teardown
    def worker_pids(self) -> list[int]:
        return [info.get("pid") for info in self._info]

    def shutdown(self) -> None:
        """Kill every actor of this group (idempotent); the processes exit without cleanup."""
        actors, self._actors = self._actors, []
        if actors and ray.is_initialized():
            for actor in actors:
                ray.kill(actor, no_restart=True)
        if self in _LIVE:
            _LIVE.discard(self)
            self._pool.release_share()
