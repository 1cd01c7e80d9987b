"""Resource pools: where the ranks of a worker group run, as Ray placement groups.

A pool is ``process_on_nodes`` (ranks per node, e.g. ``[n_gpus_per_node] * nnodes``) plus what
each rank reserves. It creates one placement group per node (STRICT_PACK, one bundle per rank)
lazily, the first time a Ray worker group uses it; the local backend never touches Ray.

Several worker groups may share a pool (separate processes on the same devices, e.g. a critic
beside the actor): each takes ``1 / max_colocate_count`` of every bundle. Colocating roles in ONE
process is done by composition in a single worker group instead (see ``RoleSpec``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RankPlacement", "ResourcePool"]

# On a CPU-only machine the CPUs Ray accounts for are few (2 here) and other actors (reward
# workers, data loaders) hold some: two 1-CPU bundles then never become ready (PLATFORM.md), so
# CPU ranks reserve a fraction of a CPU. Ray only uses the number for scheduling; the threads a
# rank really uses come from OMP_NUM_THREADS (Ray exports 1 for fractional actors unless the
# driver's environment sets it).
DEFAULT_CPUS_PER_CPU_WORKER = 0.1
DEFAULT_CPUS_PER_GPU_WORKER = 1.0


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank runs: bundle ``bundle_index`` of ``placement_group``; ``local_rank`` on its node."""

    placement_group: Any
    bundle_index: int
    local_rank: int


class ResourcePool:
    """Ranks per node and the resources each rank reserves.

    Args:
        process_on_nodes: ranks on each node, e.g. ``[8, 8]`` for 2 nodes of 8 GPUs; world size
            is the sum.
        use_gpu: one GPU per rank (NCCL) when True; CPU-only ranks (gloo) when False.
        num_cpus_per_worker: CPUs each rank reserves; default 1 with GPUs, 0.1 on CPU (see above).
        max_colocate_count: how many worker groups may share this pool (each gets an equal
            fraction of every bundle).
        name: used in placement-group names and error messages.
        ready_timeout_s: how long to wait for the placement groups (and actors) to be scheduled
            before failing with the resources requested and available, instead of hanging.
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int],
        use_gpu: bool = False,
        num_cpus_per_worker: float | None = None,
        max_colocate_count: int = 1,
        name: str = "global_pool",
        ready_timeout_s: float = 120.0,
    ) -> None:
        nodes = [int(n) for n in process_on_nodes]
        if not nodes or any(n <= 0 for n in nodes):
            raise ValueError(f"ResourcePool {name!r}: process_on_nodes must be positive counts, got {list(process_on_nodes)}")
        if max_colocate_count < 1:
            raise ValueError(f"ResourcePool {name!r}: max_colocate_count must be >= 1, got {max_colocate_count}")
        default_cpus = DEFAULT_CPUS_PER_GPU_WORKER if use_gpu else DEFAULT_CPUS_PER_CPU_WORKER
        cpus = default_cpus if num_cpus_per_worker is None else float(num_cpus_per_worker)
        if cpus <= 0:
            raise ValueError(f"ResourcePool {name!r}: num_cpus_per_worker must be > 0, got {num_cpus_per_worker}")
        self.process_on_nodes = tuple(nodes)
        self.use_gpu = bool(use_gpu)
        self.num_cpus_per_worker = cpus
        self.max_colocate_count = int(max_colocate_count)
        self.name = name
        self.ready_timeout_s = float(ready_timeout_s)
        self._placement_groups: list[Any] = []
        self._users = 0

    @classmethod
    def from_trainer(cls, nnodes: int, n_gpus_per_node: int, use_gpu: bool, **kwargs: Any) -> ResourcePool:
        """``trainer.nnodes`` x ``trainer.n_gpus_per_node`` ranks; on CPU (use_gpu=False) the same
        count of CPU workers."""
        return cls([n_gpus_per_node] * nnodes, use_gpu=use_gpu, **kwargs)

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        """The resources one bundle (one rank) reserves."""
        return {"CPU": self.num_cpus_per_worker, **({"GPU": 1.0} if self.use_gpu else {})}

    def actor_resources(self) -> dict[str, float]:
        """``num_cpus``/``num_gpus`` for one actor of one of the ``max_colocate_count`` groups."""
        share = 1.0 / self.max_colocate_count
        return {"num_cpus": self.num_cpus_per_worker * share, "num_gpus": share if self.use_gpu else 0.0}

    def acquire(self) -> list[RankPlacement]:
        """Reserve one group's share of the pool (creating the placement groups on first use)."""
        if self._users >= self.max_colocate_count:
            raise RuntimeError(
                f"ResourcePool {self.name!r} already hosts {self._users} worker group(s), its max_colocate_count; "
                f"raise max_colocate_count or give the new group its own pool"
            )
        if not self._placement_groups:
            self._placement_groups = self._create_placement_groups()
        self._users += 1
        return [
            RankPlacement(pg, i, i)
            for pg, count in zip(self._placement_groups, self.process_on_nodes)
            for i in range(count)
        ]

    def release_share(self) -> None:
        """A worker group using this pool has shut down."""
        self._users = max(0, self._users - 1)

    def release(self) -> None:
        """Remove the placement groups (call after every group on the pool has shut down)."""
        if self._placement_groups:
            from ray.util.placement_group import remove_placement_group

            for pg in self._placement_groups:
                remove_placement_group(pg)
        self._placement_groups = []
        self._users = 0

    def _create_placement_groups(self) -> list[Any]:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        pgs = [
            placement_group([self.bundle()] * count, strategy="STRICT_PACK", name=f"{self.name}_node{i}")
            for i, count in enumerate(self.process_on_nodes)
        ]
        try:
            ray.get([pg.ready() for pg in pgs], timeout=self.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            for pg in pgs:
                remove_placement_group(pg)
            raise RuntimeError(
                f"ResourcePool {self.name!r}: placement groups {list(self.process_on_nodes)} x {self.bundle()} "
                f"were not scheduled within {self.ready_timeout_s:.0f}s; cluster resources available now: "
                f"{ray.available_resources()}. Lower num_cpus_per_worker / the rank count, or free resources."
            ) from None
        return pgs

    def __repr__(self) -> str:
        return (
            f"ResourcePool({self.name!r}, process_on_nodes={list(self.process_on_nodes)}, use_gpu={self.use_gpu}, "
            f"bundle={self.bundle()}, max_colocate_count={self.max_colocate_count})"
        )
