"""One rank of the 4-process gloo run in test_replicas.py: fsdp_size=2 over 4 ranks (HSDP, shard
groups of two replicated twice), against world size 1 and against FSDP2 over all four."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import build_model, make_batch, params_of, pg_loss_fn, rank_main  # noqa: E402

from hybridrl.engine import TrainEngine  # noqa: E402


def run(out: Path, rank: int, world: int) -> dict:
    batches = [make_batch(batch_size=12, seed=s) for s in (21, 22)]
    tokens = [int(b.batch["response_mask"].sum()) for b in batches]
    rows = torch.arange(12).chunk(world)[rank]
    engine = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5, fsdp_size=2)
    mesh = next(engine.model.parameters()).device_mesh
    fwd = engine.forward(batches[0][rows], temperature=0.7)
    m1 = engine.train_step(batches[0][rows], pg_loss_fn(tokens[0]))
    engine.save_checkpoint(out / "ckpt_hsdp")
    m2 = engine.train_step(batches[1][rows], pg_loss_fn(tokens[1]), micro_batch_size=2)
    full = params_of(engine.model)
    synced = [name for name, _ in engine.iter_full_params()]
    local_rows = {n: p.to_local().shape[0] for n, p in engine.model.named_parameters()}
    resumed = TrainEngine(build_model(seed=5), lr=1e-3, grad_clip=0.5, fsdp_size=2)
    resumed.load_checkpoint(out / "ckpt_hsdp")
    m2_resumed = resumed.train_step(batches[1][rows], pg_loss_fn(tokens[1]), micro_batch_size=2)
    sharded = TrainEngine(build_model(seed=6), lr=1e-3, grad_clip=0.5)  # FSDP2 over all four ranks
    sharded.load_checkpoint(out / "ckpt_hsdp")
    m2_sharded = sharded.train_step(batches[1][rows], pg_loss_fn(tokens[1]), micro_batch_size=2)
    resumed_equal = all(torch.equal(p, full[n]) for n, p in params_of(resumed.model).items())
    return {"mesh": (tuple(mesh.shape), mesh.mesh_dim_names), "rows": rows, "log_probs": fwd.batch["log_probs"],
            "m1": m1, "m2": m2, "full": full, "synced": synced, "local_rows": local_rows, "m2_resumed": m2_resumed,
            "resumed_equal": resumed_equal, "m2_sharded": m2_sharded}



if __name__ == "__main__":
    rank_main(run)
