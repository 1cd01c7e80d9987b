"""Batch-size arithmetic and cross-key checks: each error shows the numbers and names the keys."""

import warnings

import pytest

from hybridrl.config import ConfigError, ConfigWarning, load_config

# N=16 prompts, G=4, world size 2 (cpu workers): B=64, mini 8 prompts -> 32 sequences -> 16 per device.
# Batch sizes pinned here so the tests do not follow the quickstart preset's tuning.
PINNED = ["trainer.device=cpu", "trainer.n_cpu_workers=2", "data.train_batch_size=16", "actor_rollout_ref.rollout.n=4",
          "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
          "data.max_response_length=32"]
BASE = PINNED


def errors_of(*overrides):
    with pytest.raises(ConfigError) as err:
        load_config([*BASE, *overrides], preset="grpo_quickstart")
    return str(err.value)


def test_valid_arithmetic_passes():
    cfg = load_config([*BASE, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"], preset="grpo_quickstart")
    assert cfg.trainer.world_size == 2


def test_step_batch_must_split_over_the_world():
    message = errors_of("data.train_batch_size=15", "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=5",
                        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    assert "data.train_batch_size x actor_rollout_ref.rollout.n = 15 x 1 = 15 sequences" in message
    assert "trainer.nnodes=1 x trainer.n_cpu_workers=2" in message and "15 / 2 = 7.5" in message


def test_a_last_mini_batch_takes_the_prompts_left_over():
    """As in verl, ppo_mini_batch_size need not divide train_batch_size: 16 prompts in mini-batches
    of 6 are steps of 6, 6 and 4 (an epoch: 3 optimizer steps). The mini-batch must not exceed the
    batch, and the last one's sequences must split over the ranks like the others."""
    from hybridrl.workers.common import optimizer_steps

    cfg = load_config([*BASE, "actor_rollout_ref.actor.ppo_mini_batch_size=6",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"], preset="grpo_quickstart")
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.actor.ppo_mini_batch_size) == (16, 6)
    assert optimizer_steps(16, 6, 2) == 6 and optimizer_steps(16, 8, 1) == 2
    message = errors_of("actor_rollout_ref.actor.ppo_mini_batch_size=32")
    assert "data.train_batch_size=16 is smaller than actor_rollout_ref.actor.ppo_mini_batch_size=32" in message


def test_mini_batch_per_device_must_be_a_multiple_of_the_micro_batch():
    message = errors_of("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=12")
    assert "8 x 4 / 2 = 16 sequences, is not a multiple of actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=12" in message


def test_mini_batch_sequences_must_split_over_the_world():
    message = errors_of("trainer.n_cpu_workers=3", "data.train_batch_size=24", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                        "actor_rollout_ref.rollout.n=1")
    assert "ppo_mini_batch_size x actor_rollout_ref.rollout.n = 1 x 1 = 1 sequences per mini batch" in message


def test_cuda_world_size_uses_gpus_per_node():
    message = errors_of("trainer.device=cuda", "trainer.n_gpus_per_node=3")
    assert "trainer.nnodes=1 x trainer.n_gpus_per_node=3, device=cuda" in message


def test_missing_micro_batch_names_both_ways_out():
    message = errors_of("~actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu")
    assert "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu is not set" in message
    assert "log_prob_use_dynamic_bsz=true" in message


def test_token_budget_must_hold_one_sequence():
    message = errors_of("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=90")
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=90 cannot hold one full sequence" in message
    assert "64 + 32 = 96 tokens" in message
    # the rollout/ref token budgets follow the actor's through interpolation, so they are reported too
    assert "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=90" in message


def test_critic_checked_only_when_in_use():
    assert "critic.ppo_micro_batch_size_per_gpu is not set" in errors_of("algorithm.adv_estimator=gae")
    assert "needs a critic" in errors_of("algorithm.adv_estimator=gae", "critic.enable=false",
                                         "critic.ppo_micro_batch_size_per_gpu=4")


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n=0 must be >= 1"),
        (["actor_rollout_ref.rollout.top_p=0"], "actor_rollout_ref.rollout.top_p=0.0 must be in (0, 1]"),
        (["actor_rollout_ref.actor.clip_ratio_c=1.0"], "clip_ratio_c=1.0 must be > 1"),
        (["trainer.save_freq=0"], "trainer.save_freq=0 must be -1 (never) or >= 1"),
        (["trainer.resume_mode=resume_path"], "needs trainer.resume_from_path"),
        (["actor_rollout_ref.rollout.val_kwargs.do_sample=true"], "needs val_kwargs.temperature > 0"),
        (["actor_rollout_ref.actor.tis_imp_ratio_cap=2"], "set actor_rollout_ref.rollout.calculate_log_probs=true"),
        (["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
          "actor_rollout_ref.actor.ppo_mini_batch_size=8"], "needs actor_rollout_ref.rollout.n >= 2"),
        (["actor_rollout_ref.actor.fsdp_config.offload_policy=true"], "offload_policy=true needs an accelerator"),
        (["reward_model.overlong_buffer.enable=true"], "reward_model.overlong_buffer.len=0 must be in [1"),
        (["reward_model.enable=true", "data.return_raw_chat=true"],
         "reward_model.micro_batch_size_per_gpu is not set; set it, or set reward_model.use_dynamic_bsz=true"),
        (["reward_model.enable=true", "reward_model.micro_batch_size_per_gpu=4"],
         "re-templates each response with the prompt's chat messages: set data.return_raw_chat=true"),
        (["reward_model.enable=true", "reward_model.micro_batch_size_per_gpu=4", "data.return_raw_chat=true",
          "reward_model.max_length=1"], "reward_model.max_length=1 must be >= 2 or null"),
        (["reward_model.enable=true", "reward_model.micro_batch_size_per_gpu=4", "data.return_raw_chat=true",
          "algorithm.filter_groups.enable=true"], "algorithm.filter_groups.metric=acc is a reward function's output"),
        (["reward_model.reward_manager=batch"], "reward_model.reward_manager=batch calls the reward function once per batch"),
    ],
)
def test_consistency_errors(overrides, fragment):
    assert fragment in errors_of(*overrides)


def test_a_reward_model_loads_with_its_forward_batching():
    cfg = load_config([*BASE, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "reward_model.enable=true",
                       "reward_model.micro_batch_size_per_gpu=4", "reward_model.model.input_tokenizer=null"],
                      preset="grpo_quickstart")
    assert cfg.reward_model.enable and cfg.reward_model.model.input_tokenizer is None


def test_fsdp_size_shards_over_all_ranks_or_replicates():
    for size in (-1, 1, 2, 8):  # world size 2: all ranks, replicas, all ranks, all ranks
        cfg = load_config([*BASE, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                           f"actor_rollout_ref.actor.fsdp_config.fsdp_size={size}",
                           f"critic.model.fsdp_config.fsdp_size={size}"], preset="grpo_quickstart")
        assert cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size == size
    message = errors_of("actor_rollout_ref.ref.fsdp_config.fsdp_size=0")
    assert "actor_rollout_ref.ref.fsdp_config.fsdp_size=0 with the world size 2" in message
    # over 4 ranks: shard groups of 2 replicated twice (HSDP) load; groups of 3 do not divide 4
    four = ["trainer.n_cpu_workers=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]
    cfg = load_config([*BASE, *four, "critic.model.fsdp_config.fsdp_size=2"], preset="grpo_quickstart")
    assert cfg.critic.model.fsdp_config.fsdp_size == 2
    message = errors_of(*four, "critic.model.fsdp_config.fsdp_size=3")
    assert "critic.model.fsdp_config.fsdp_size=3 with the world size 4" in message
    assert "a size that divides the world size (HSDP" in message


def test_fsdp_keys_hybridrl_does_not_act_on_warn_naming_the_key():
    overrides = [*BASE, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                 "critic.model.fsdp_config.wrap_policy.min_num_params=1000",
                 "actor_rollout_ref.ref.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap=[Qwen2DecoderLayer]"]
    with pytest.warns(ConfigWarning) as record:
        load_config(overrides, preset="grpo_quickstart")
    messages = "\n".join(str(w.message) for w in record)
    assert "actor_rollout_ref.actor.fsdp_config.param_offload=true is not used: the CPU already holds them" in messages
    assert "critic.model.fsdp_config.wrap_policy.min_num_params=1000 is not used" in messages
    assert "actor_rollout_ref.ref.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap=[Qwen2DecoderLayer]" in messages
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # the defaults warn about nothing
        load_config([*BASE, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"], preset="grpo_quickstart")


def test_overlong_buffer_outside_dapo_warns_that_verl_would_not_apply_it():
    overrides = [*BASE, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=8"]
    with pytest.warns(ConfigWarning, match="verl only with reward_manager=dapo"):
        load_config(overrides, preset="grpo_quickstart")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # with dapo, as in verl: nothing to say
        load_config([*overrides, "reward_model.reward_manager=dapo"], preset="grpo_quickstart")


@pytest.mark.parametrize(("override", "fragment"), [
    ("reward_model.launch_reward_fn_async=true", "launch_reward_fn_async=True has no effect in hybridrl"),
    ("data.return_raw_input_ids=true", "return_raw_input_ids=True has no effect"),
    ("data.dataloader_num_workers=2", "dataloader_num_workers=2 has no effect"),
    ("actor_rollout_ref.actor.checkpoint.load_contents=[model]", "resuming always loads the model, the optimizer"),
    ("trainer.log_val_generations=10", "trainer.validation_data_dir dumps them"),
    ("trainer.del_local_ckpt_after_load=true", "a checkpoint is kept after it is loaded"),
    ("ray_kwargs.timeline_json_file=/tmp/t.json", "no Ray timeline is written"),
    ("trainer.max_critic_ckpt_to_keep=2", "trainer.max_actor_ckpt_to_keep=None decides how many are kept"),
])
def test_keys_hybridrl_does_not_act_on_warn_when_they_ask_for_something(override, fragment):
    base = [*BASE, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
    with pytest.warns(ConfigWarning, match=fragment):
        load_config([*base, override], preset="grpo_quickstart")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # their defaults (verl's) say nothing
        load_config([*base, "trainer.max_critic_ckpt_to_keep=3", "trainer.max_actor_ckpt_to_keep=3"],
                    preset="grpo_quickstart")


def test_a_float16_kv_cache_is_the_native_engines():
    cfg = load_config([*BASE, "actor_rollout_ref.rollout.kv_cache_dtype=float16"], preset="grpo_quickstart")
    assert cfg.actor_rollout_ref.rollout.kv_cache_dtype == "float16"
    message = errors_of("actor_rollout_ref.rollout.kv_cache_dtype=float16", "actor_rollout_ref.rollout.name=hf")
    assert "actor_rollout_ref.rollout.kv_cache_dtype=float16 is the native engine's; rollout.name=hf" in message
