"""One thin class per role (actor, rollout, reference, critic, reward model) on the two engines.

Roles are plain classes composed into one process per device by the worker group (the hybrid
engine: actor + rollout + ref share a process and the rollout reads the actor's weights in
place). Each role reads its section of the config and passes flat arguments to its engine.
"""

from hybridrl.workers.actor import ActorWorker
from hybridrl.workers.critic import CriticWorker
from hybridrl.workers.ref import RefWorker
from hybridrl.workers.reward_model import RewardModelWorker
from hybridrl.workers.rollout import RolloutWorker

__all__ = ["ActorWorker", "CriticWorker", "RefWorker", "RewardModelWorker", "RolloutWorker"]
