"""One rank of the 2-process gloo run in test_distributed.py (run as a script, env vars set there).

Rank 0 gets the longest half of the batch and rank 1 the shortest, so dynamic batching needs more
micro-batches on rank 0 and the engine must agree on one count (otherwise FSDP would hang).
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import VOCAB, build_model, make_batch, make_group_batch, params_of, pg_loss_fn, rank_main  # noqa: E402

from hybridrl.engine import TrainEngine  # noqa: E402
from hybridrl.engine import checkpoint as ckpt  # noqa: E402
from hybridrl.engine.packing import real_lengths  # noqa: E402
from hybridrl.engine.seqlen_balancing import partition_micro_batches  # noqa: E402
from hybridrl.utils import cpu_matmul  # noqa: E402
from hybridrl.utils.cpu_matmul import OneDNNLinear  # noqa: E402

BUDGET = 40


def split_by_length(data, rank, world):
    p, r = real_lengths(data.batch["attention_mask"], data.batch["responses"].shape[1])
    order = torch.argsort(-(p + r), stable=True)
    rows = order.chunk(world)[rank]
    return data[rows], rows


def run(out: Path, rank: int, world: int) -> dict:
    batches = [make_batch(batch_size=12, seed=s) for s in (21, 22)]
    tokens = [int(b.batch["response_mask"].sum()) for b in batches]
    local, rows = split_by_length(batches[0], rank, world)
    local2, _ = split_by_length(batches[1], rank, world)
    p, r = real_lengths(local.batch["attention_mask"], local.batch["responses"].shape[1])
    local_count = len(partition_micro_batches((p + r).tolist(), max_token_len=BUDGET))

    engine = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5)
    fwd = engine.forward(local, temperature=0.7, calculate_entropy=True, max_token_len=BUDGET)
    m1 = engine.train_step(local, pg_loss_fn(tokens[0]), max_token_len=BUDGET)
    engine.save_checkpoint(out / "ckpt")
    m2 = engine.train_step(local2, pg_loss_fn(tokens[1]), micro_batch_size=2)
    full = {name: (tuple(t.shape), t.clone()) for name, t in engine.iter_full_params()}
    # bucketed gathers (one tensor a bucket, a few, all at once) against one full_tensor() per tensor;
    # an odd vocabulary and key/value width shard unevenly (rank 1 gets fewer rows)
    odd = TrainEngine(build_model(vocab_size=VOCAB + 3, hidden_size=35, num_attention_heads=5,
                                  num_key_value_heads=1), lr=0.0)
    buckets_equal = []
    for eng in (engine, odd):
        singly = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
                  for name, t in ckpt._named_state_tensors(eng.model)}
        for bucket_bytes in (0, 4096, 1 << 30):
            got = list(ckpt.iter_full_tensors(eng.model, bucket_bytes=bucket_bytes))
            buckets_equal.append([n for n, _ in got] == list(singly)
                                 and all(torch.equal(t, singly[n]) for n, t in got))
    uneven = [n for n, p in odd.model.named_parameters() if p.shape[0] % world]
    # the split the buckets assume is FSDP2's (else they fall back to one full_tensor() each)
    split_rule = all(ckpt._shard_rows(p.shape[0], world)[rank] == p.to_local().shape[0]
                     for eng in (engine, odd) for p in eng.model.parameters())
    engine.export_hf(out / "hf")

    resumed = TrainEngine(build_model(seed=5), lr=1e-3, grad_clip=0.5)
    resumed.load_checkpoint(out / "ckpt")
    m2_resumed = resumed.train_step(local2, pg_loss_fn(tokens[1]), micro_batch_size=2)
    resumed_equal = all(torch.equal(a, params_of(engine.model)[n]) for n, a in params_of(resumed.model).items())
    # a checkpoint written at world size 1 (an unsharded module; test_distributed writes it first)
    from_single = TrainEngine(build_model(seed=6), lr=1e-3, grad_clip=0.5)
    from_single.load_checkpoint(out / "ckpt_ws1")
    m2_from_ws1 = from_single.train_step(local2, pg_loss_fn(tokens[1]), micro_batch_size=2)
    local_shapes = {n: tuple(p.to_local().shape) for n, p in engine.model.named_parameters()}
    # compiled blocks under FSDP2: the gathers stay in eager hooks around the compiled forward (in
    # the run test_distributed.py asks for it with DIST_WORKER_COMPILED=1: most of a run's time)
    compiled_fwd, compiled_steps = None, None
    if os.environ.get("DIST_WORKER_COMPILED") == "1":
        compiled = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5, torch_compile=True)
        compiled_fwd = compiled.forward(local, temperature=0.7, calculate_entropy=True, max_token_len=BUDGET)
        compiled_steps = [compiled.train_step(local, pg_loss_fn(tokens[0]), max_token_len=BUDGET),
                          compiled.train_step(local2, pg_loss_fn(tokens[1]), micro_batch_size=2)]
    # GRPO-style groups split across the ranks: each rank computes its rows' prompts once
    grouped = make_group_batch(prompts=3, group=4, seed=23)
    group_rows = torch.arange(len(grouped)).chunk(world)[rank]
    sharing = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5)
    group_fwd = sharing.forward(grouped[group_rows], calculate_entropy=True)
    # rank 1 has no shared prompts: both ranks must then run the full rows (same model calls, no hang)
    mixed = sharing.forward(grouped[group_rows] if rank == 0 else make_batch(batch_size=6, seed=24))
    group_step = sharing.train_step(grouped[group_rows], pg_loss_fn(int(grouped.batch["response_mask"].sum())))
    # verl's use_fused_kernels under FSDP2: the head's product inside the root module's forward,
    # its weight gradient reduce-scattered with the rest; full rows and shared prompts
    fused = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5, fused_log_probs=True)
    fused_fwd = fused.forward(local, temperature=0.7, calculate_entropy=True, max_token_len=BUDGET)
    fused_steps = [fused.train_step(local, pg_loss_fn(tokens[0]), max_token_len=BUDGET),
                   fused.train_step(local2, pg_loss_fn(tokens[1]), micro_batch_size=2)]
    fused_sharing = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5, fused_log_probs=True)
    fused_group_fwd = fused_sharing.forward(grouped[group_rows], calculate_entropy=True)
    fused_group_step = fused_sharing.train_step(grouped[group_rows], pg_loss_fn(int(grouped.batch["response_mask"].sum())))
    return {
        "fused_log_probs": fused_fwd.batch["log_probs"], "fused_entropy": fused_fwd.batch["entropy"],
        "fused_steps": fused_steps, "fused_params": params_of(fused.model),
        "fused_group_log_probs": fused_group_fwd.batch["log_probs"], "fused_group_entropy": fused_group_fwd.batch["entropy"],
        "fused_group_step": fused_group_step,
        "group_rows": group_rows, "group_log_probs": group_fwd.batch["log_probs"], "group_entropy": group_fwd.batch["entropy"], "group_step": group_step,
        "group_tokens": (group_fwd.meta_info["computed_tokens"], group_fwd.meta_info["real_tokens"]),
        "mixed_log_probs": mixed.batch["log_probs"], "mixed_computed": mixed.meta_info["computed_tokens"],
        "rows": rows, "log_probs": fwd.batch["log_probs"], "entropy": fwd.batch["entropy"],
        "m1": m1, "m2": m2, "m2_resumed": m2_resumed, "resumed_equal": resumed_equal, "m2_from_ws1": m2_from_ws1,
        "full": full, "buckets_equal": buckets_equal, "uneven": uneven, "split_rule": split_rule, "local_shapes": local_shapes, "local_count": local_count,
        "compiled_log_probs": None if compiled_fwd is None else compiled_fwd.batch["log_probs"], "compiled_steps": compiled_steps,
        "matmul_backend": cpu_matmul.backend(),
        "weight_grad_backend": cpu_matmul.weight_grad_backend(),
        "onednn_linears": sum(type(m) is OneDNNLinear for m in engine.model.modules()),
    }



if __name__ == "__main__":
    rank_main(run)
