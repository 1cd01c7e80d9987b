"""The driver's view of the colocated worker group (the hybrid engine).

One process per device holds the actor, the rollout (which reads the actor's weights in place),
and, when used, the reference policy and the critic. The trainer calls plain methods here; each
is one SPMD call over the group's ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridrl.config.validate import critic_in_use, ref_in_use
from hybridrl.protocol import DataProto
from hybridrl.single_controller import ResourcePool, RoleSpec, WorkerFuture, WorkerGroup, init_ray
from hybridrl.trainer.metrics import reduce_metrics
from hybridrl.utils import cpu_matmul
from hybridrl.workers import ActorWorker, CriticWorker, RefWorker, RewardModelWorker, RolloutWorker


class PPOWorkers:
    """Actor + rollout (+ ref, + critic, + reward model) colocated in one worker group."""

    def __init__(self, config, total_training_steps: int) -> None:
        trainer = config.trainer
        use_gpu = trainer.device == "cuda"
        roles = {
            "actor": RoleSpec(ActorWorker, config, total_training_steps),
            "rollout": RoleSpec(RolloutWorker, config, uses=("actor",)),
        }
        self.has_ref, self.has_critic = ref_in_use(config), critic_in_use(config)
        if self.has_ref:
            roles["ref"] = RoleSpec(RefWorker, config)
        if self.has_critic:
            roles["critic"] = RoleSpec(CriticWorker, config, total_training_steps)
        if config.reward_model.enable:
            roles["rm"] = RoleSpec(RewardModelWorker, config)
        per_node = trainer.n_gpus_per_node if use_gpu else trainer.n_cpu_workers
        if trainer.backend == "ray":
            init_ray(num_cpus=config.ray_kwargs.ray_init.num_cpus)
        self.pool = ResourcePool([per_node] * trainer.nnodes, use_gpu=use_gpu)
        # on CPU every rank takes the driver's matmul backends, timed once here (see pinned_choices)
        env = {} if use_gpu else cpu_matmul.pinned_choices()
        self.group = WorkerGroup(self.pool, roles, backend=trainer.backend, name="actor_rollout", env=env)
        self.world_size = self.group.world_size
        # whether calls run in other processes while the driver goes on (Ray); the local backend
        # runs them in the driver when it waits for them
        self.asynchronous = trainer.backend == "ray"

    @property
    def busy_s(self) -> float:
        """Seconds the ranks have spent running calls so far (see ``WorkerGroup.busy_s``)."""
        return self.group.busy_s

    def busy_since(self, start: float) -> float:
        """Seconds the ranks spent running calls since ``start`` (see ``WorkerGroup.busy_since``)."""
        return self.group.busy_since(start)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        return self.submit("generate_sequences", prompts)()

    def compute_log_prob(self, data: DataProto) -> DataProto:
        return self.submit("compute_log_prob", data)()

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        return self.submit("compute_ref_log_prob", data)()

    def compute_values(self, data: DataProto) -> DataProto:
        return self.submit("compute_values", data)()

    def compute_rm_score(self, data: DataProto) -> DataProto:
        return self.submit("compute_rm_score", data)()

    def update_actor(self, data: DataProto) -> dict[str, float]:
        return self.submit("update_actor", data)()

    def update_critic(self, data: DataProto) -> dict[str, float]:
        return self.submit("update_critic", data)()

    def sync_weights(self) -> None:
        self.submit("sync_weights")()

    def submit(self, name: str, *args: DataProto, joins: tuple[PendingCall, ...] = ()) -> PendingCall:
        """Send the call ``name`` (one of the methods above) without waiting; calling what this
        returns waits and gives what the method gives. The ranks run calls in the order they were
        sent, so the driver can send the next independent call while one runs (see
        ``PPOTrainer.run_calls``). ``joins``: earlier calls on the same rows whose output columns
        join this call's batch on the ranks (``RemoteMethod.submit_joined``)."""
        if name not in _CALLS:
            raise ValueError(f"unknown worker call {name!r}; allowed: {sorted(_CALLS)}")
        role, finish = _CALLS[name]
        method = self.group.method(role, name)
        future = method.submit_joined(*args, *(j.future for j in joins)) if joins else method.submit(*args)
        return PendingCall(future, finish)

    def save_checkpoint(self, path: str) -> None:
        self.group.actor.save_checkpoint(path)
        if self.has_critic:
            self.group.critic.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.group.actor.load_checkpoint(path)
        if self.has_critic:
            self.group.critic.load_checkpoint(path)

    def export_hf(self, path: str) -> None:
        self.group.actor.export_hf(path)

    def freeze_gc(self) -> None:
        """Freeze the surviving objects of every worker process (``hybridrl.utils.gc_freeze``)."""
        self.group.actor.freeze_gc()

    def shutdown(self) -> None:
        """Kill the worker processes and return the placement groups to Ray."""
        self.group.shutdown()
        self.pool.release()


class PendingCall:
    """A call sent by ``PPOWorkers.submit``; calling it waits and returns the call's value."""

    def __init__(self, future: WorkerFuture, finish: Callable[[Any], Any]) -> None:
        self.future, self._finish = future, finish

    def __call__(self) -> Any:
        return self._finish(self.future.get())


def _mean_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    merged: dict[str, list[float]] = {}
    for metrics in per_rank:
        for key, value in metrics.items():
            merged.setdefault(key, []).append(value)
    return reduce_metrics(merged)


def _same(result: Any) -> Any:
    return result


def _nothing(_: Any) -> None:
    return None


# trainer-facing call -> (role that runs it, how the per-rank results become the call's value)
_CALLS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "generate_sequences": ("rollout", _same),
    "compute_log_prob": ("actor", _same),
    "compute_ref_log_prob": ("ref", _same),
    "compute_values": ("critic", _same),
    "compute_rm_score": ("rm", _same),
    "update_actor": ("actor", _mean_over_ranks),
    "update_critic": ("critic", _mean_over_ranks),
    "sync_weights": ("rollout", _nothing),
}
