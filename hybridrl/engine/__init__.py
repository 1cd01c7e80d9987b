"""Training engine: FSDP2 TrainEngine, padding removal, dynamic batching, checkpoints.

``TrainEngine`` is imported lazily: it pulls in torch.distributed.checkpoint (several seconds of
imports), which the driver, needing only ``balance_across_ranks``, should not pay for.
"""

from hybridrl.engine.distributed import destroy_distributed, get_rank, get_world_size, init_distributed
from hybridrl.engine.lr_schedule import build_lr_scheduler, lr_multiplier
from hybridrl.engine.seqlen_balancing import balance_across_ranks, karmarkar_karp, partition_micro_batches

__all__ = [
    "LossFn",
    "TrainEngine",
    "balance_across_ranks",
    "build_lr_scheduler",
    "destroy_distributed",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "karmarkar_karp",
    "lr_multiplier",
    "partition_micro_batches",
]


def __getattr__(name: str):
    if name in ("TrainEngine", "LossFn"):
        from hybridrl.engine import train_engine

        return getattr(train_engine, name)
    raise AttributeError(f"module 'hybridrl.engine' has no attribute {name!r}")
