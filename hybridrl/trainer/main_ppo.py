"""``python -m hybridrl.trainer.main_ppo [overrides]``: verl's entry point, same overrides.

    python -m hybridrl.trainer.main_ppo algorithm.adv_estimator=grpo \
        data.train_files=train.parquet actor_rollout_ref.model.path=./my_model ...

``--preset NAME|FILE`` picks the base values (default: verl's ``ppo_trainer``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from hybridrl.config import config_to_dict, dump_config_yaml, load_config
from hybridrl.config.cli import split_preset
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import critic_in_use
from hybridrl.data import PromptDataLoader, RLHFDataset
from hybridrl.models import load_tokenizer
from hybridrl.rewards import OverlongBuffer, RewardManager, load_reward_function
from hybridrl.trainer.ppo_trainer import PPOTrainer
from hybridrl.trainer.tracking import Tracking
from hybridrl.utils.preflight import PreflightError, check_memory


def build_dataset(config, tokenizer, files) -> RLHFDataset:
    data = config.data
    return RLHFDataset(list(files), tokenizer, max_prompt_length=data.max_prompt_length, prompt_key=data.prompt_key,
                       truncation=data.truncation, filter_overlong_prompts=data.filter_overlong_prompts,
                       return_raw_chat=data.return_raw_chat, return_full_prompt=data.return_full_prompt,
                       required_columns=(data.reward_fn_key, "reward_model"),
                       apply_chat_template_kwargs=dict(data.apply_chat_template_kwargs))


def build_loaders(config, tokenizer) -> tuple[PromptDataLoader, PromptDataLoader | None]:
    data = config.data
    # a batch of the loader is one generation batch (DAPO's dynamic sampling may draw several a step)
    train = PromptDataLoader(build_dataset(config, tokenizer, data.train_files), data.gen_batch_size,
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
                                  max_response_length=rm.overlong_buffer.max_response_length or config.data.max_response_length)
    return RewardManager(tokenizer, compute_score=fn, reward_kwargs=dict(custom.reward_kwargs),
                         num_workers=config.reward.num_workers, timeout_s=config.reward.timeout_s,
                         on_error=config.reward.on_error, overlong_buffer=overlong,
                         reward_fn_key=config.data.reward_fn_key, batched=rm.reward_manager == "batch")


def total_training_steps(config, train_loader) -> int:
    trainer = config.trainer
    return int(trainer.total_training_steps or len(train_loader) * trainer.total_epochs)


def check_model_paths(config) -> None:
    """A local model folder that is missing or has no ``config.json`` fails here, naming its key,
    not deep inside transformers. Hub ids (``org/name``, not on disk) pass through."""
    paths = {"actor_rollout_ref.model.path": config.actor_rollout_ref.model.path}
    if critic_in_use(config):
        paths["critic.model.path"] = config.critic.model.path
    if config.reward_model.enable:
        paths["reward_model.model.path"] = config.reward_model.model.path
    for key, value in paths.items():
        path = Path(value).expanduser()
        if not path.exists() and str(value).startswith(("/", "~", ".")):
            raise FileNotFoundError(f"{key}={value}: no such folder")
        if path.is_dir() and not (path / "config.json").is_file():
            raise FileNotFoundError(f"{key}={value}: not a Hugging Face model folder (no config.json; expected "
                                    "config.json, *.safetensors and tokenizer files)")


def load_prompt_tokenizer(config):
    """The tokenizer that templates prompts, with ``model.custom_chat_template`` applied; prompts are
    chat messages, so a tokenizer without a chat template is refused here, naming the fix."""
    model = config.actor_rollout_ref.model
    path = config.data.tokenizer or model.tokenizer_path or model.path
    tokenizer = load_tokenizer(path, trust_remote_code=model.trust_remote_code)
    if model.custom_chat_template:
        tokenizer.chat_template = model.custom_chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer at {path} has no chat template (or an empty one), and prompts are chat "
                         "messages: add chat_template.jinja to that folder or set "
                         "actor_rollout_ref.model.custom_chat_template")
    return tokenizer


def save_config(config, run_dir: Path) -> None:
    """Write ``run_dir/config.yaml``; an earlier run's different config there is kept as
    ``config.<its mtime>.yaml`` (a resumed or restarted run must not erase what the folder held)."""
    path = run_dir / "config.yaml"
    tmp = run_dir / "config.yaml.tmp"
    dump_config_yaml(config, tmp)
    if path.exists() and path.read_bytes() != tmp.read_bytes():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        keep, n = run_dir / f"config.{stamp}.yaml", 1
        while keep.exists():
            keep, n = run_dir / f"config.{stamp}.{n}.yaml", n + 1
        path.rename(keep)
    os.replace(tmp, path)


def run(config) -> dict[str, float]:
    """Build tokenizer, data, rewards, workers and trackers from ``config`` and train.

    Everything that can be checked without workers (model folders, tokenizer, data files, reward
    function, memory) is checked before the run folder is written to or a worker starts."""
    from hybridrl.trainer.workers import PPOWorkers  # imports torch/transformers/ray: after config errors

    check_model_paths(config)
    tokenizer = load_prompt_tokenizer(config)
    train_loader, val_loader = build_loaders(config, tokenizer)
    steps = total_training_steps(config, train_loader)
    reward_fn = build_reward_manager(config, tokenizer)
    val_reward_fn = build_reward_manager(config, tokenizer, for_validation=True)
    check_memory(config)  # before any worker starts: a run that cannot fit is refused with the knob to turn
    run_dir = Path(config.trainer.default_local_dir).expanduser()
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir)
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
    try:
        run(config)
    except PreflightError as err:
        print(f"hybridrl: refused to start\n{err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
