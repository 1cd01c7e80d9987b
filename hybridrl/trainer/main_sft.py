"""``python -m hybridrl.trainer.main_sft [overrides]`` (or ``hybridrl sft ...``): verl's SFT keys.

    python -m hybridrl.trainer.main_sft data.train_files=train.parquet data.val_files=test.parquet \\
        data.prompt_key=prompt data.response_key=extra_info +data.response_dict_keys=[solution] \\
        model.partial_pretrain=./my_model optim.lr=1e-4 trainer.total_epochs=2

``--preset NAME|FILE`` picks the base values (default: ``sft_trainer``, verl's defaults;
``sft_quickstart``: the built-in tiny model on the addition task). The run folder
``trainer.default_local_dir`` gets ``config.yaml``, ``metrics.jsonl`` (logger ``file``),
``global_step_<N>/`` checkpoints and, at the end, ``hf_model/``: start RL from it with
``actor_rollout_ref.model.path=<default_local_dir>/hf_model``.

World size 1 runs in this process. ``trainer.n_cpu_workers=K`` (device cpu) starts K processes
that train one FSDP2 model over gloo.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from hybridrl.config.cli import split_preset
from hybridrl.config.errors import ConfigError
from hybridrl.config.loader import config_to_dict, dump_config_yaml
from hybridrl.config.sft_schema import DEFAULT_SFT_PRESET, load_sft_config

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def build_loaders(config, tokenizer):
    """(train loader, val loader or None) over ``SFTDataset``s; batches are global (all ranks)."""
    from hybridrl.data.loader import PromptDataLoader
    from hybridrl.data.sft_dataset import sft_dataset_from_config

    data = config.data
    train = PromptDataLoader(sft_dataset_from_config(data.train_files, tokenizer, data), data.train_batch_size,
                             shuffle=data.shuffle, seed=config.trainer.seed)
    if not data.val_files:
        return train, None
    val_ds = sft_dataset_from_config(data.val_files, tokenizer, data)
    val = PromptDataLoader(val_ds, min(len(val_ds), data.train_batch_size), shuffle=False, drop_last=False)
    return train, val


def build_engine(config, total_steps: int):
    """The model of ``model.partial_pretrain`` in a ``TrainEngine`` with ``optim.*``."""
    from hybridrl.engine import TrainEngine
    from hybridrl.models import load_causal_lm
    from hybridrl.workers.common import import_external_lib

    model_cfg, optim = config.model, config.optim
    import_external_lib("model.external_lib", model_cfg.external_lib)
    model = load_causal_lm(model_cfg.partial_pretrain, dtype="float32", trust_remote_code=model_cfg.trust_remote_code,
                           override_config=dict(model_cfg.override_config))
    return TrainEngine(
        model, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay, grad_clip=optim.clip_grad,
        lr_scheduler=optim.lr_scheduler, warmup_steps=int(total_steps * optim.warmup_steps_ratio),
        total_steps=total_steps, min_lr_ratio=optim.min_lr_ratio, param_dtype=DTYPES[model_cfg.fsdp_config.model_dtype],
        gradient_checkpointing=model_cfg.enable_gradient_checkpointing,
    )


def run_rank(config) -> dict[str, float]:
    """Build everything on this rank (world size 1, or a rank of an initialised group) and train."""
    from hybridrl.models import load_tokenizer
    from hybridrl.trainer.sft_trainer import SFTTrainer, total_training_steps
    from hybridrl.trainer.tracking import Tracking
    from hybridrl.utils.malloc import keep_freed_memory

    keep_freed_memory()  # the same large tensors every step: reuse their memory (hybridrl.utils.malloc)

    model_cfg, trainer_cfg = config.model, config.trainer
    tokenizer = load_tokenizer(model_cfg.tokenizer_path or model_cfg.partial_pretrain,
                               trust_remote_code=model_cfg.trust_remote_code)
    train_loader, val_loader = build_loaders(config, tokenizer)
    engine = build_engine(config, total_training_steps(config, len(train_loader)))
    run_dir = Path(trainer_cfg.default_local_dir).expanduser()
    tracking = None
    if engine.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config_yaml(config, run_dir / "config.yaml")
        tracking = Tracking(trainer_cfg.logger, run_dir, trainer_cfg.project_name, trainer_cfg.experiment_name,
                            config_to_dict(config))
    val_prompts = list(config.data.val_files) if trainer_cfg.val_generation_length > 0 else []
    try:
        trainer = SFTTrainer(config, engine, tokenizer, train_loader, val_loader, tracking, run_dir, val_prompts)
        return trainer.fit()
    finally:
        if tracking is not None:
            tracking.close()


def run_sft(config) -> dict[str, float]:
    """Train with ``config`` (an ``SFTConfig``); returns the final metrics (``train/loss``,
    ``val/loss``, ...). The model ends up in ``<default_local_dir>/hf_model``."""
    world = config.trainer.world_size
    if world == 1:
        return run_rank(config)
    import torch.multiprocessing as mp

    from hybridrl.engine.distributed import free_port

    with tempfile.TemporaryDirectory(prefix="hybridrl_sft_") as tmp:
        result = Path(tmp) / "metrics.json"
        mp.start_processes(_rank_main, args=(config, world, free_port(), str(result)), nprocs=world,
                           join=True, start_method="spawn")
        return json.loads(result.read_text())


def _rank_main(rank: int, config, world: int, port: int, result_path: str) -> None:
    """Entry of a spawned rank: join the gloo/NCCL group, train, rank 0 writes the metrics."""
    import torch

    from hybridrl.engine import destroy_distributed, init_distributed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # K processes on the same cores: split the threads instead of oversubscribing them
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_distributed()
    try:
        metrics = run_rank(config)
        if rank == 0:
            Path(result_path).write_text(json.dumps(metrics))
    finally:
        destroy_distributed()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        preset, overrides = split_preset(list(argv))
        if not any(arg == "--preset" or arg.startswith("--preset=") for arg in argv):
            preset = DEFAULT_SFT_PRESET  # split_preset's default is the RL preset
        config = load_sft_config(overrides, preset)
    except ConfigError as err:
        print(f"hybridrl sft: invalid config\n{err}", file=sys.stderr)
        return 1
    metrics = run_sft(config)
    print("hybridrl sft: final " + " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
