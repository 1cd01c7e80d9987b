"""load_config: presets, every override form, verl scripts, unsupported keys, round trips."""

import dataclasses
import warnings

import pytest
from verl_script_args import script_overrides

from hybridrl.config import (
    ConfigError,
    ConfigWarning,
    HybridRLConfig,
    config_to_dict,
    dump_config_yaml,
    load_config,
)

# Batch sizes pinned here so the tests do not follow the quickstart preset's tuning.
PINNED = ["trainer.device=cpu", "trainer.n_cpu_workers=2", "data.train_batch_size=16", "actor_rollout_ref.rollout.n=4",
          "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
          "data.max_response_length=32"]
CPU = PINNED  # also keeps the world size independent of the machine running the tests


def quick(*overrides):
    return load_config([*CPU, *overrides], preset="grpo_quickstart")


def test_quickstart_preset_loads_frozen():
    cfg = quick()
    assert isinstance(cfg, HybridRLConfig)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.trainer.world_size == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.total_epochs = 3


def test_interpolations_follow_their_source():
    cfg = quick("data.max_response_length=48", "actor_rollout_ref.actor.clip_ratio=0.3",
                "actor_rollout_ref.actor.clip_ratio_high=0.28", "trainer.experiment_name=exp1")
    assert cfg.actor_rollout_ref.rollout.response_length == 48
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == 0.3
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.28
    assert cfg.trainer.default_local_dir == "checkpoints/hybridrl_quickstart/exp1"
    assert cfg.critic.ppo_mini_batch_size == cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert cfg.actor_rollout_ref.actor.checkpoint.load_contents == ("model", "optimizer", "extra")


def test_user_interpolation_in_an_override():
    cfg = quick("actor_rollout_ref.rollout.val_kwargs.top_p=${actor_rollout_ref.rollout.top_p}",
                "actor_rollout_ref.rollout.top_p=0.9")
    assert cfg.actor_rollout_ref.rollout.val_kwargs.top_p == 0.9


def test_value_forms():
    cfg = quick("trainer.logger=['console','file']", "data.val_batch_size=null", "actor_rollout_ref.actor.optim.lr=3e-6",
                "data.shuffle=False", "trainer.project_name='my proj'", "trainer.experiment_name=\"1e-6\"",
                "actor_rollout_ref.actor.optim.betas=[0.9,0.95]", "data.truncation='left'")
    assert cfg.trainer.logger == ("console", "file")
    assert cfg.data.val_batch_size is None
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-6)
    assert cfg.data.shuffle is False
    assert cfg.trainer.project_name == "my proj" and cfg.trainer.experiment_name == "1e-6"
    assert cfg.actor_rollout_ref.actor.optim.betas == (0.9, 0.95)
    assert quick("trainer.logger=[console,tensorboard]").trainer.logger == ("console", "tensorboard")
    assert quick("trainer.logger=console").trainer.logger == ("console",)
    assert quick("data.train_files=/tmp/a.parquet").data.train_files == ("/tmp/a.parquet",)


def test_extension_points_need_plus_to_add():
    cfg = quick("+actor_rollout_ref.model.override_config.attention_dropout=0.",
                "+custom_reward_function.reward_kwargs.format_score=0.1",
                "+custom_reward_function.reward_kwargs.nested.k=[1,2]",
                "++actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4")
    assert cfg.actor_rollout_ref.model.override_config == {"attention_dropout": 0.0}
    assert cfg.custom_reward_function.reward_kwargs == {"format_score": 0.1, "nested": {"k": [1, 2]}}
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm == {"swap_space": 4}
    changed = quick("+custom_reward_function.reward_kwargs.a=1", "custom_reward_function.reward_kwargs.a=2")
    assert changed.custom_reward_function.reward_kwargs == {"a": 2}
    deleted = quick("+custom_reward_function.reward_kwargs.a=1", "+custom_reward_function.reward_kwargs.b=2",
                    "~custom_reward_function.reward_kwargs.a")
    assert deleted.custom_reward_function.reward_kwargs == {"b": 2}
    with pytest.raises(ConfigError, match=r"not set; add it with \+actor_rollout_ref.model.override_config.x"):
        quick("actor_rollout_ref.model.override_config.x=1")
    with pytest.raises(ConfigError, match="already set; use"):
        quick("+custom_reward_function.reward_kwargs.a=1", "+custom_reward_function.reward_kwargs.a=2")
    with pytest.raises(ConfigError, match="not set, nothing to delete"):
        quick("~custom_reward_function.reward_kwargs.zzz")


def test_tilde_resets_a_schema_key_to_its_default():
    assert quick("~trainer.total_epochs").trainer.total_epochs == 30
    assert quick("~trainer.logger").trainer.logger == ("console",)
    assert quick("~trainer.total_epochs=1").trainer.total_epochs == 30
    with pytest.raises(ConfigError, match="deletes only a matching value"):
        quick("~trainer.total_epochs=7")


def test_plus_on_an_existing_schema_key_sets_it():
    # old verl scripts write +trainer.val_before_train=False from before the key was in verl's YAML
    assert quick("+trainer.val_before_train=False").trainer.val_before_train is False


def test_section_assignment_with_a_mapping():
    cfg = quick("critic.optim={lr: 2e-5, weight_decay: 0.0}")
    assert cfg.critic.optim.lr == pytest.approx(2e-5) and cfg.critic.optim.weight_decay == 0.0


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("actor_rollout_ref.actor.ppo_mini_batchsize=4", ["unknown key actor_rollout_ref.actor.ppo_mini_batchsize",
                                                          "did you mean actor_rollout_ref.actor.ppo_mini_batch_size"]),
        ("actor_rollout_ref.rollout.ppo_mini_batch_size=4", ["did you mean", "actor_rollout_ref.actor.ppo_mini_batch_size"]),
        ("trainer.total_epoch=3", ["did you mean trainer.total_epochs"]),
        ("data.train_batch_size=abc", ["data.train_batch_size must be an integer", "'abc'"]),
        ("data.shuffle=maybe", ["data.shuffle must be true or false"]),
        ("actor_rollout_ref.actor.optim.betas=[0.9]", ["actor_rollout_ref.actor.optim.betas must be a list of 2 numbers"]),
        ("algorithm.adv_estimator=ppo", ["algorithm.adv_estimator='ppo' is not allowed", "gae, grpo"]),
        ("trainer.logger=[console,foo]", ["trainer.logger='foo' is not allowed", "console, file, tensorboard"]),
        ("actor_rollout_ref.actor.loss_agg_mode=mean", ["loss_agg_mode='mean' is not allowed", "token-mean"]),
        ("actor_rollout_ref.actor.strategy=megatron", ["strategy=megatron is not supported", "Megatron-LM"]),
        ("actor_rollout_ref.rollout.name=sglang", ["rollout.name=sglang is not supported", "SGLang"]),
        ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", ["megatron.tensor_model_parallel_size is not supported", "Megatron"]),
        ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", ["ulysses_sequence_parallel_size is not supported", "only 1 is accepted"]),
        ("actor_rollout_ref.model.lora_rank=32", ["lora_rank is not supported", "LoRA"]),
        ("actor_rollout_ref.actor.fsdp_config.grad_offload=True", ["grad_offload is not supported", "only False is accepted"]),
        ("data.custom_cls.path=my.py", ["data.custom_cls.path is not supported", "custom dataset"]),
    ],
)
def test_errors_name_the_key_and_what_is_allowed(override, fragments):
    with pytest.raises(ConfigError) as err:
        quick(override)
    message = str(err.value)
    assert repr(override) in message
    for fragment in fragments:
        assert fragment in message


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as err:
        quick("trainer.total_epoch=3", "data.shuffle=maybe")
    assert "2 problems" in str(err.value)


def test_noop_values_of_unsupported_keys_load_and_warn_keys_warn():
    cfg = quick("actor_rollout_ref.actor.ulysses_sequence_parallel_size=1", "actor_rollout_ref.model.use_liger=False",
                "actor_rollout_ref.actor.fsdp_config.grad_offload=False", "actor_rollout_ref.hybrid_engine=True")
    assert cfg.actor_rollout_ref.rollout.n == 4
    with pytest.warns(ConfigWarning, match="fused_kernel_options.impl_backend has no effect"):
        quick("reward_model.model.fused_kernel_options.impl_backend=torch")


def test_verl_defaults_spelled_out_load_quietly():
    """verl's generated default config writes every key; a script that spells out a default of a
    feature hybridrl lacks (null, false, 0, an empty list) loads without a warning, and verl's
    null min_lr_ratio (the critic's default) is 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = quick("actor_rollout_ref.actor.profiler.ranks=[]", "actor_rollout_ref.actor.profiler.all_ranks=False",
                    "global_profiler.tool=null", "trainer.esi_redundant_time=0",
                    "actor_rollout_ref.actor.profiler.tool_config.torch.step_start=0",
                    "critic.optim.min_lr_ratio=null", "actor_rollout_ref.actor.optim.min_lr_ratio=null")
    assert cfg.critic.optim.min_lr_ratio is None
    with pytest.warns(ConfigWarning, match="global_profiler.steps has no effect"):
        quick("global_profiler.steps=[1,2]")
    with pytest.raises(ConfigError, match=r"min_lr_ratio=1.5 must be in \[0, 1\] or null"):
        quick("critic.optim.min_lr_ratio=1.5")


def test_verl_kernel_switches_load():
    """verl scripts' kernel switches: fused log-probs and the entropy options are hybridrl's own;
    use_liger=True loads with a warning that says it has no effect; the reference's entropy options
    likewise (it computes no entropy); fused kernels for other roles stay an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = quick("actor_rollout_ref.model.use_fused_kernels=True",
                    "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton",
                    "actor_rollout_ref.actor.entropy_from_logits_with_chunking=True",
                    "actor_rollout_ref.actor.entropy_checkpointing=True",
                    "actor_rollout_ref.ref.entropy_checkpointing=False")
    assert cfg.actor_rollout_ref.model.use_fused_kernels is True
    assert cfg.actor_rollout_ref.model.fused_kernel_options.impl_backend == "triton"
    assert cfg.actor_rollout_ref.actor.entropy_from_logits_with_chunking is True
    assert cfg.actor_rollout_ref.actor.entropy_checkpointing is True
    with pytest.warns(ConfigWarning, match=r"use_liger=True has no effect in hybridrl: Liger's Triton kernels"):
        quick("actor_rollout_ref.model.use_liger=True")
    with pytest.warns(ConfigWarning, match=r"ref.entropy_from_logits_with_chunking=True has no effect.*no entropy"):
        quick("actor_rollout_ref.ref.entropy_from_logits_with_chunking=True")
    with pytest.raises(ConfigError, match=r"critic.model.use_fused_kernels is not supported.*actor_rollout_ref.model"):
        quick("critic.model.use_fused_kernels=True")
    with pytest.raises(ConfigError, match="impl_backend"):
        quick("actor_rollout_ref.model.fused_kernel_options.impl_backend=cuda")


def test_dapo_recipe_reward_kwargs_set_the_overlong_buffer():
    """verl's DAPO recipe passes its overlong penalty to the reward manager as reward_kwargs;
    they land in reward_model.overlong_buffer, silently, and the buffer ends at max_resp_len."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = quick("data.max_response_length=64", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                    "+reward_model.reward_kwargs.overlong_buffer_cfg.len=16",
                    "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
                    "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
                    "+reward_model.reward_kwargs.max_resp_len=48", "reward_model.reward_manager=dapo")
    buffer = cfg.reward_model.overlong_buffer
    assert (buffer.enable, buffer.len, buffer.penalty_factor, buffer.log, buffer.max_response_length) == (
        True, 16, 0.5, False, 48)
    assert quick().reward_model.overlong_buffer.max_response_length is None  # data.max_response_length
    with pytest.raises(ConfigError, match=r"overlong_buffer.len=50 must be in \[1, 48\]"):
        quick("reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=50",
              "reward_model.overlong_buffer.max_response_length=48")
    with pytest.raises(ConfigError, match="reward_model.reward_kwargs.unknown_knob"):
        quick("+reward_model.reward_kwargs.unknown_knob=1")


def test_gen_batch_size_defaults_to_train_batch_size_and_needs_dynamic_sampling_to_differ():
    assert quick("data.train_batch_size=8").data.gen_batch_size == 8
    cfg = quick("data.train_batch_size=8", "data.gen_batch_size=24", "algorithm.filter_groups.enable=true")
    assert (cfg.data.train_batch_size, cfg.data.gen_batch_size) == (8, 24)
    with pytest.raises(ConfigError, match="data.gen_batch_size=24 differs from data.train_batch_size=8"):
        quick("data.train_batch_size=8", "data.gen_batch_size=24")


def test_old_verl_use_rmpad_is_renamed():
    with pytest.warns(ConfigWarning, match="use_rmpad was renamed in verl to actor_rollout_ref.model.use_remove_padding"):
        cfg = quick("actor_rollout_ref.model.use_rmpad=True", "critic.model.use_rmpad=True")
    assert cfg.actor_rollout_ref.model.use_remove_padding and cfg.critic.model.use_remove_padding


@pytest.mark.parametrize("value", [True, False])
def test_verl_prefix_grouper_sets_shared_prompts(value):
    """verl's actor.use_prefix_grouper (a group's prompt computed once) is hybridrl's
    model.share_prompt_prefix, on by default: the verl key sets it either way, without a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = quick(f"actor_rollout_ref.actor.use_prefix_grouper={value}")
    assert cfg.actor_rollout_ref.model.share_prompt_prefix is value
    assert quick().actor_rollout_ref.model.share_prompt_prefix is True


def test_renamed_verl_keys_move_with_a_warning():
    with pytest.warns(ConfigWarning, match="renamed"):
        cfg = quick("actor_rollout_ref.actor.optim.warmup_style=cosine", "ray_init.num_cpus=2")
    assert cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    assert cfg.ray_kwargs.ray_init.num_cpus == 2


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ConfigError, match="available presets: .*grpo_quickstart"):
        load_config([], preset="nope")


def test_preset_keys_are_validated(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_epoch: 3\n")
    with pytest.raises(ConfigError, match=r"preset bad.yaml .*unknown key trainer.total_epoch; did you mean trainer.total_epochs"):
        load_config([], preset=str(bad))


def test_dumped_yaml_reloads_identically(tmp_path):
    cfg = quick("+actor_rollout_ref.model.override_config.attention_dropout=0.", "trainer.logger=[console,file]",
                "actor_rollout_ref.actor.optim.lr=1e-5")
    path = tmp_path / "config.yaml"
    dump_config_yaml(cfg, path)
    assert load_config([], preset=str(path)) == cfg
    assert config_to_dict(cfg)["trainer"]["logger"] == ["console", "file"]


# ---------------------------------------------------------------------------- verl's published scripts
VERL_SCRIPTS = ["grpo_run_qwen2-7b.sh", "ppo_run_qwen2-7b_seq_balance.sh", "ppo_run_qwen2-7b_seq_balance_legacy.sh",
                "quickstart.sh", "quickstart_legacy.sh"]


@pytest.mark.parametrize("script", VERL_SCRIPTS)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_verl_scripts_load_unchanged(script, device):
    overrides = script_overrides(script)
    assert overrides and all("=" in o for o in overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        cfg = load_config([*overrides, f"trainer.device={device}"])
    assert cfg.trainer.total_epochs == 15
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)


def test_grpo_script_values():
    cfg = load_config([*script_overrides("grpo_run_qwen2-7b.sh"), "trainer.device=cuda"])
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 5
    assert cfg.trainer.logger == ("console", "wandb") and cfg.trainer.world_size == 8
    assert cfg.trainer.project_name == "verl_grpo_example_gsm8k" and cfg.data.truncation == "error"
    assert cfg.data.train_files == ("/home/user/data/gsm8k/train.parquet",)
    assert cfg.actor_rollout_ref.rollout.response_length == 1024


def test_seq_balance_script_values():
    cfg = load_config([*script_overrides("ppo_run_qwen2-7b_seq_balance.sh"), "trainer.device=cuda"])
    assert cfg.data.train_files == ("/home/user/data/gsm8k/train.parquet", "/home/user/data/math/train.parquet")
    assert cfg.trainer.world_size == 16 and cfg.critic.use_dynamic_bsz is True
    assert cfg.critic.forward_max_token_len_per_gpu == 98304 and cfg.data.return_raw_chat is True


def test_legacy_global_micro_batches_are_divided_by_the_world_size():
    with pytest.warns(ConfigWarning, match="micro_batch_size has no effect"):
        cfg = load_config([*script_overrides("quickstart_legacy.sh"), "trainer.device=cuda"])
    actor, rollout, critic = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.critic
    assert (actor.ppo_micro_batch_size, actor.ppo_micro_batch_size_per_gpu) == (None, 64 // 8)
    assert rollout.log_prob_micro_batch_size_per_gpu == 128 // 8
    assert critic.ppo_micro_batch_size_per_gpu == critic.forward_micro_batch_size_per_gpu == 64 // 8


def test_global_and_per_gpu_micro_batch_together_is_an_error():
    with pytest.raises(ConfigError, match="are both set; remove actor_rollout_ref.actor.ppo_micro_batch_size"):
        quick("actor_rollout_ref.actor.ppo_micro_batch_size=16")
