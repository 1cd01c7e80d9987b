"""``python -m hybridrl.trainer.main_ppo [overrides]``: verl's entry point, same overrides.

    python -m hybridrl.trainer.main_ppo algorithm.adv_estimator=grpo \
        data.train_files=train.parquet actor_rollout_ref.model.path=./my_model ...

``--preset NAME|FILE`` picks the base values (default: verl's ``ppo_trainer``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from hybridrl.config import config_to_dict, dump_config_yaml, load_config
from hybridrl.config.cli import split_preset
from hybridrl.config.errors import ConfigError
from hybridrl.data import PromptDataLoader, RLHFDataset
from hybridrl.models import load_tokenizer
from hybridrl.rewards import OverlongBuffer, RewardManager, load_reward_function
from hybridrl.trainer.ppo_trainer import PPOTrainer
from hybridrl.trainer.tracking import Tracking


def build_dataset(config, tokenizer, files) -> RLHFDataset:
    data = config.data
    return RLHFDataset(list(files), tokenizer, max_prompt_length=data.max_prompt_length, prompt_key=data.prompt_key,
                       truncation=data.truncation, filter_overlong_prompts=data.filter_overlong_prompts,
                       return_raw_chat=data.return_raw_chat, return_full_prompt=data.return_full_prompt,
                       required_columns=(data.reward_fn_key, "reward_model"),
                       apply_chat_template_kwargs=dict(data.apply_chat_template_kwargs))


def build_loaders(config, tokenizer) -> tuple[PromptDataLoader, PromptDataLoader | None]:
    data = config.data
    train = PromptDataLoader(build_dataset(config, tokenizer, data.train_files), data.train_batch_size,
                             shuffle=data.shuffle, seed=data.seed)
    if not data.val_files:
        return train, None
    val_ds = build_dataset(config, tokenizer, data.val_files)
    val = PromptDataLoader(val_ds, data.val_batch_size or len(val_ds), shuffle=data.validation_shuffle,
                           seed=data.seed, drop_last=False)
    return train, val


def build_reward_manager(config, tokenizer, for_validation: bool = False) -> RewardManager:
    custom = config.custom_reward_function
    fn = load_reward_function(custom.path, custom.name) if custom.path else None
    rm = config.reward_model
    overlong = None
    if rm.overlong_buffer.enable and not for_validation:
        overlong = OverlongBuffer(length=rm.overlong_buffer.len, penalty_factor=rm.overlong_buffer.penalty_factor,
                                  max_response_length=config.data.max_response_length)
    return RewardManager(tokenizer, compute_score=fn, reward_kwargs=dict(custom.reward_kwargs),
                         num_workers=config.reward.num_workers, timeout_s=config.reward.timeout_s,
                         on_error=config.reward.on_error, overlong_buffer=overlong,
                         reward_fn_key=config.data.reward_fn_key)


def total_training_steps(config, train_loader) -> int:
    trainer = config.trainer
    return int(trainer.total_training_steps or len(train_loader) * trainer.total_epochs)


def run(config) -> dict[str, float]:
    """Build tokenizer, data, rewards, workers and trackers from ``config`` and train."""
    from hybridrl.trainer.workers import PPOWorkers  # imports torch/transformers/ray: after config errors

    model = config.actor_rollout_ref.model
    tokenizer = load_tokenizer(config.data.tokenizer or model.tokenizer_path or model.path,
                               trust_remote_code=model.trust_remote_code)
    train_loader, val_loader = build_loaders(config, tokenizer)
    steps = total_training_steps(config, train_loader)
    run_dir = Path(config.trainer.default_local_dir).expanduser()
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config_yaml(config, run_dir / "config.yaml")
    reward_fn = build_reward_manager(config, tokenizer)
    val_reward_fn = build_reward_manager(config, tokenizer, for_validation=True)
    tracking = Tracking(config.trainer.logger, run_dir, config.trainer.project_name,
                        config.trainer.experiment_name, config_to_dict(config))
    workers = PPOWorkers(config, steps)
    try:
        trainer = PPOTrainer(config, workers, train_loader, val_loader, reward_fn, val_reward_fn, tracking, run_dir)
        return trainer.fit()
    finally:
        workers.shutdown()
        tracking.close()
        reward_fn.close()
        val_reward_fn.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        preset, overrides = split_preset(list(argv))
        config = load_config(overrides, preset)
    except ConfigError as err:
        print(f"hybridrl: invalid config\n{err}", file=sys.stderr)
        return 1
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
