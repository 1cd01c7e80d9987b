"""What every training role shares: building a TrainEngine from a config section, global
loss normalizers, and looping PPO epochs over mini-batches."""

from __future__ import annotations

import importlib
import os
from collections import defaultdict
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from hybridrl.algos import GlobalBatchInfo, count_normalizers
from hybridrl.engine.distributed import init_distributed
from hybridrl.engine.train_engine import TrainEngine
from hybridrl.protocol import DataProto
from hybridrl.utils.malloc import keep_freed_memory

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def setup_distributed() -> None:
    """Join the worker group's process group (the host exported RANK/WORLD_SIZE/MASTER_*).

    On CPU the ranks of one node share its cores: each gets an equal share of threads, since
    oversubscribed BLAS threads make every rank slower (PLATFORM.md: 2 cores, 2 ranks). An explicit
    ``HYBRIDRL_NUM_THREADS`` wins: on a machine shared with other jobs, fewer threads than cores
    avoid OpenMP barriers that wait for a descheduled thread (docs/performance.md).
    Freed memory stays in the process for the next step (``hybridrl.utils.malloc``).
    """
    init_distributed()
    keep_freed_memory()
    if not torch.cuda.is_available():
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE", "1"))
        threads = os.environ.get("HYBRIDRL_NUM_THREADS")
        torch.set_num_threads(int(threads) if threads else max(1, (os.cpu_count() or 1) // local_world))


def import_external_lib(key: str, module: str | None) -> None:
    """Import a role's ``external_lib`` (a module that registers custom architectures with
    transformers' Auto classes) before its model loads; a module that fails to import names the key."""
    if not module:
        return
    try:
        importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{key}={module}: cannot import it ({err}); it must be importable in every worker "
                          "process (installed, or on PYTHONPATH)") from err


def sharding(fsdp_config) -> dict:
    """A role's ``fsdp_config`` section as TrainEngine's sharding arguments (shard groups, model dtype)."""
    return {"fsdp_size": fsdp_config.fsdp_size, "reshard_after_forward": fsdp_config.reshard_after_forward,
            "forward_prefetch": fsdp_config.forward_prefetch, "param_dtype": _DTYPES[fsdp_config.model_dtype]}


def build_engine(model: torch.nn.Module, optim, *, grad_clip: float, total_steps: int, updates_per_step: int,
                 fsdp_config, model_type: str = "causal_lm", torch_compile: bool = False,
                 share_prompts: bool = True, **options) -> TrainEngine:
    """A TrainEngine from an ``optim`` and an ``fsdp_config`` config section; ``options`` go to the
    engine as they are (e.g. ``fused_log_probs``).

    The engine steps its LR schedule once per optimizer step; verl's schedules count training
    steps, so warm-up and horizon are scaled by the optimizer steps in one training step.
    """
    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps > 0 else int(optim.lr_warmup_steps_ratio * total_steps)
    return TrainEngine(
        model,
        lr=optim.lr,
        betas=tuple(optim.betas),
        weight_decay=optim.weight_decay,
        grad_clip=grad_clip,
        lr_scheduler=optim.lr_scheduler_type,
        warmup_steps=warmup * updates_per_step,
        total_steps=max(1, total_steps) * updates_per_step,
        min_lr_ratio=optim.min_lr_ratio or 0.0,  # null: 0, as verl reads it
        num_cycles=optim.num_cycles,
        model_type=model_type,
        torch_compile=torch_compile,
        share_prompts=share_prompts,
        **sharding(fsdp_config),
        **options,
    )


def global_batch_info(mini_batch: DataProto, loss_scale_factor: float | None) -> GlobalBatchInfo:
    """Valid tokens and sequences of the whole mini-batch on all ranks.

    The engine sums gradients over micro-batches and ranks, so losses are normalised by these
    global counts with ``dp_size=1`` (see hybridrl.algos.loss_agg).
    """
    tokens, seqs = count_normalizers(mini_batch.batch["response_mask"])
    counts = torch.stack([tokens.double(), seqs.double()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    return GlobalBatchInfo(dp_size=1, batch_num_tokens=counts[0].item(), global_batch_size=counts[1].item(),
                           loss_scale_factor=loss_scale_factor)


def optimizer_steps(train_batch_size: int, ppo_mini_batch_size: int, ppo_epochs: int) -> int:
    """Optimizer steps in one training step, one per mini-batch and epoch: the last mini-batch of an
    epoch holds the prompts left over where ``ppo_mini_batch_size`` does not divide ``train_batch_size``
    (verl's split)."""
    return ppo_epochs * -(-train_batch_size // ppo_mini_batch_size)


def iter_mini_batches(data: DataProto, rows_per_rank: int, epochs: int, shuffle: bool, seed: int) -> Iterator[DataProto]:
    """``epochs`` passes over ``data`` in mini-batches of ``rows_per_rank`` rows, the last of a pass
    holding the rows left over (``optimizer_steps``).

    Every rank holds as many rows and draws the same permutation (same seed), so mini-batch k of
    each rank belongs to the same optimizer step.
    """
    if rows_per_rank <= 0:
        raise ValueError(f"mini-batches of {rows_per_rank} rows on this rank; "
                         "check ppo_mini_batch_size x rollout.n against the number of workers")
    yield from data.make_iterator(rows_per_rank, epochs=epochs, seed=seed, shuffle=shuffle)


class LossAccumulator:
    """Sums per-micro-batch loss shares into the mini-batch loss (exact under global normalizers)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)

    def add(self, **values: torch.Tensor) -> None:
        for key, value in values.items():
            self.sums[key] += float(value.detach())

    def all_reduced(self) -> dict[str, float]:
        if not self.sums:
            return {}
        keys = sorted(self.sums)
        t = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the optimizer steps of one update."""
    merged: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        for key, value in row.items():
            merged[key].append(value)
    return {key: float(np.mean(values)) for key, values in merged.items()}


def micro_batching(use_dynamic_bsz: bool, micro_batch_size: int | None, max_token_len: int) -> dict:
    """Engine keyword arguments: a token budget when dynamic, else a row count."""
    if use_dynamic_bsz:
        return {"max_token_len": max_token_len}
    return {"micro_batch_size": micro_batch_size}


LossFn = Callable[[dict[str, torch.Tensor], DataProto], tuple[torch.Tensor, dict]]
