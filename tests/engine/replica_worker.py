"""One rank of the 2-process gloo run in test_replicas.py (run as a script, env vars set there):
``fsdp_size=1`` replicas, checkpoints between replicas and FSDP2 shards, and FSDP2's
``reshard_after_forward`` / ``forward_prefetch``.

The ranks split the batches as dist_worker.py does (rank 0 the longest half), so with a token
budget rank 0 runs more micro-batches than rank 1: replicas need no common count.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from dist_worker import BUDGET, split_by_length  # noqa: E402
from helpers import build_model, make_batch, params_of, pg_loss_fn, rank_main  # noqa: E402

from hybridrl.engine import TrainEngine  # noqa: E402
from hybridrl.engine.replicate import sum_gradients  # noqa: E402


def partial_gradients(rank: int) -> dict:
    """sum_gradients where rank 0 has gradients for a and b, rank 1 for a only, and c has none."""
    a, b, c = (nn.Parameter(torch.zeros(3)) for _ in range(3))
    a.grad = torch.full((3,), float(rank + 1))
    if rank == 0:
        b.grad = torch.tensor([1.0, 2.0, 3.0])
    sum_gradients([a, b, c], None, bucket_bytes=8)  # 8 bytes: a bucket per tensor
    return {"a": a.grad.clone(), "b": b.grad.clone(), "c": c.grad}


def run(out: Path, rank: int, world: int) -> dict:
    batches = [make_batch(batch_size=12, seed=s) for s in (21, 22)]
    tokens = [int(b.batch["response_mask"].sum()) for b in batches]
    local, rows = split_by_length(batches[0], rank, world)
    local2, _ = split_by_length(batches[1], rank, world)

    # rank 1 starts from other random weights: the engine gives it rank 0's
    engine = TrainEngine(build_model(seed=0 if rank == 0 else 9), lr=1e-3, grad_clip=0.5, fsdp_size=1)
    start_equal = all(torch.equal(p, params_of(build_model())[n]) for n, p in params_of(engine.model).items())
    fwd = engine.forward(local, temperature=0.7, calculate_entropy=True, max_token_len=BUDGET)
    m1 = engine.train_step(local, pg_loss_fn(tokens[0]), max_token_len=BUDGET)
    engine.save_checkpoint(out / "ckpt_replicas")
    m2 = engine.train_step(local2, pg_loss_fn(tokens[1]), micro_batch_size=2)
    params = params_of(engine.model)
    full_names = [name for name, _ in engine.iter_full_params()]

    resumed = TrainEngine(build_model(seed=5), lr=1e-3, grad_clip=0.5, fsdp_size=1)
    resumed.load_checkpoint(out / "ckpt_replicas")
    m2_resumed = resumed.train_step(local2, pg_loss_fn(tokens[1]), micro_batch_size=2)
    resumed_equal = all(torch.equal(p, params[n]) for n, p in params_of(resumed.model).items())
    # replicas -> shards, and shards -> replicas
    sharded = TrainEngine(build_model(seed=6), lr=1e-3, grad_clip=0.5)
    sharded.load_checkpoint(out / "ckpt_replicas")
    sharded.save_checkpoint(out / "ckpt_shards")
    m2_sharded = sharded.train_step(local2, pg_loss_fn(tokens[1]), micro_batch_size=2)
    from_shards = TrainEngine(build_model(seed=7), lr=1e-3, grad_clip=0.5, fsdp_size=1)
    from_shards.load_checkpoint(out / "ckpt_shards")
    m2_from_shards = from_shards.train_step(local2, pg_loss_fn(tokens[1]), micro_batch_size=2)

    # FSDP2 keeping gathered blocks from forward to backward, and prefetching the next block
    kept = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5, reshard_after_forward=False, forward_prefetch=True)
    kept_steps = [kept.train_step(local, pg_loss_fn(tokens[0]), max_token_len=BUDGET),
                  kept.train_step(local2, pg_loss_fn(tokens[1]), micro_batch_size=2)]
    return {"rows": rows, "start_equal": start_equal, "log_probs": fwd.batch["log_probs"], "m1": m1, "m2": m2,
            "params": params, "full_names": full_names, "m2_resumed": m2_resumed, "resumed_equal": resumed_equal,
            "m2_sharded": m2_sharded, "m2_from_shards": m2_from_shards, "kept_steps": kept_steps,
            "partial": partial_gradients(rank), "world": dist.get_world_size()}



if __name__ == "__main__":
    rank_main(run)
