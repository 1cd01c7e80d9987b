"""verl keys that are not in hybridrl's schema: renamed ones, and the ones hybridrl does not support.

Nothing here is silently dropped:

- ``RENAMED``: an old verl key path is moved to its new path, with a ``ConfigWarning``.
- ``ALIASES``: a verl key whose setting is a hybridrl key of another name, moved there silently.
- ``UNSUPPORTED``: each pattern (``fnmatch``, ``*`` spans dots) says why. ``accepts`` is the value(s)
  that mean "feature off", which hybridrl already does, so verl scripts that spell out the default
  still load; any other value is an error with the reason, or where ``otherwise`` is ``WARN`` loads
  with a warning that it has no effect (switches of verl's kernels that hybridrl does its own way).
  ``WARN`` accepts any value with a warning (knobs that only tune performance of something hybridrl
  does another way), except an empty one (``is_empty``). ``NEVER`` always errors.
- ``UNSUPPORTED_VALUES``: supported keys whose particular verl values are not implemented.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

NEVER = "never"
WARN = "warn"

RENAMED: dict[str, str] = {
    "actor_rollout_ref.actor.optim.warmup_style": "actor_rollout_ref.actor.optim.lr_scheduler_type",
    "critic.optim.warmup_style": "critic.optim.lr_scheduler_type",
    "actor_rollout_ref.actor.optim.clip_grad": "actor_rollout_ref.actor.grad_clip",
    "critic.optim.clip_grad": "critic.grad_clip",
    "actor_rollout_ref.actor.checkpoint.contents": "actor_rollout_ref.actor.checkpoint.save_contents",
    "critic.checkpoint.contents": "critic.checkpoint.save_contents",
    "actor_rollout_ref.actor.use_remove_padding": "actor_rollout_ref.model.use_remove_padding",
    "critic.forward_micro_batch_size": "critic.ppo_micro_batch_size",
    "ray_init.num_cpus": "ray_kwargs.ray_init.num_cpus",
    "ray_init.timeline_json_file": "ray_kwargs.timeline_json_file",
    "actor_rollout_ref.model.use_rmpad": "actor_rollout_ref.model.use_remove_padding",
    "critic.model.use_rmpad": "critic.model.use_remove_padding",
    "reward_model.model.use_rmpad": "reward_model.model.use_remove_padding",
}

# verl's switch for computing a group's shared prompt once (PrefixGrouper) is hybridrl's
# share_prompt_prefix, which is on by default: true keeps it on, false turns it off as in verl
ALIASES: dict[str, str] = {
    "actor_rollout_ref.actor.use_prefix_grouper": "actor_rollout_ref.model.share_prompt_prefix",
    # verl's DAPO recipe configures its reward manager through reward_kwargs; hybridrl's overlong
    # penalty is the reward_model.overlong_buffer section, with any manager
    **{f"reward_model.reward_kwargs.overlong_buffer_cfg.{key}": f"reward_model.overlong_buffer.{key}"
       for key in ("enable", "len", "penalty_factor", "log")},
    "reward_model.reward_kwargs.max_resp_len": "reward_model.overlong_buffer.max_response_length",
}


@dataclass(frozen=True)
class Unsupported:
    pattern: str
    accepts: Any  # NEVER, WARN, or a tuple of no-op values
    reason: str
    otherwise: str = NEVER  # other values than ``accepts``: NEVER an error, WARN a warning


_MEGATRON = "the Megatron-LM backend is not implemented; hybridrl trains with FSDP2 (strategy=fsdp|fsdp2)"
_SGLANG = "SGLang is not supported; use rollout.name=native|vllm|hf"
_PROFILER = "built-in profiler integration is not implemented; wrap a run in torch.profiler yourself"
_LORA = "LoRA training is not implemented (full fine-tuning only)"
_MM = "multi-modal (image/video) inputs are not supported"
_ULYSSES = "Ulysses sequence parallelism is not implemented (size must stay 1)"
_AGENT = "the agent-loop rollout server is not implemented; multi-turn runs through rollout.multi_turn"
_PERF = "a performance knob of verl's kernels; hybridrl has no equivalent and the setting has no effect"

UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("*megatron*", NEVER, _MEGATRON),
    Unsupported("global_profiler*", WARN, _PROFILER),
    Unsupported("*.profiler", (None, {}), _PROFILER),
    Unsupported("*.profiler.enable", (False,), _PROFILER),
    Unsupported("*.profiler.*", WARN, _PROFILER),
    Unsupported("npu_profile*", NEVER, "Ascend NPU profiling is not supported"),
    Unsupported("*.ulysses_sequence_parallel_size", (1,), _ULYSSES),
    Unsupported("*.fsdp_config.grad_offload", (False,), "removed from verl: gradients are offloaded with param_offload"),
    Unsupported("*.fsdp_config.use_orig_params", WARN, "FSDP2 always keeps original parameters"),
    Unsupported("*.fsdp_config.mixed_precision*", NEVER, "mixed precision is set by fsdp_config.model_dtype"),
    Unsupported("*.use_shm", (False,), "loading models from /dev/shm is not implemented"),
    Unsupported("*.enable_activation_offload", (False,), "activation offload is not implemented; use enable_gradient_checkpointing"),
    Unsupported("*.lora_rank", (0,), _LORA),
    Unsupported("*.lora_alpha", WARN, _LORA + "; lora_alpha only matters with lora_rank > 0"),
    Unsupported("*.target_modules", WARN, _LORA + "; target_modules only matters with lora_rank > 0"),
    Unsupported("*.exclude_modules", WARN, _LORA + "; exclude_modules only matters with lora_rank > 0"),
    Unsupported("*.lora.*", NEVER, _LORA),
    Unsupported("*.lora_adapter_path", (None,), _LORA),
    Unsupported("*.use_liger", (False,), "Liger's Triton kernels are not integrated; hybridrl's own fused CPU kernels "
                "(RMSNorm, SwiGLU, RoPE, attention) run where they apply", otherwise=WARN),
    Unsupported("*.use_fused_kernels", (False,), "fused log-probs apply to the policy: set actor_rollout_ref.model.use_fused_kernels"),
    Unsupported("*.fused_kernel_options.*", WARN, _PERF),
    Unsupported("*.use_torch_compile", WARN, _PERF),
    Unsupported("actor_rollout_ref.ref.entropy_*", (False,), "the reference policy computes log-probs only, no entropy",
                otherwise=WARN),
    Unsupported("*.entropy_from_logits_with_chunking", (False,), "chunked entropy is implemented for the actor only"),
    Unsupported("*.entropy_checkpointing", (False,), "entropy recomputation is implemented for the actor only"),
    Unsupported("*.fsdp_config.forward_only", WARN, "set by hybridrl per role"),
    Unsupported("*.fsdp_config.strategy", WARN, "the strategy key of the role decides"),
    Unsupported("*.fsdp_config.model_dtype_for_rollout", NEVER, "rollout dtype is actor_rollout_ref.rollout.dtype"),
    Unsupported("actor_rollout_ref.hybrid_engine", (True,), "actor, rollout and ref are always colocated (the hybrid engine)"),
    Unsupported("actor_rollout_ref.actor.freeze_vision_tower", (False,), _MM),
    Unsupported("actor_rollout_ref.actor.router_replay.*", WARN, "MoE router replay is not implemented"),
    Unsupported("actor_rollout_ref.actor.tau_pos", WARN, "SAPO (loss_mode=sapo) is not implemented"),
    Unsupported("actor_rollout_ref.actor.tau_neg", WARN, "SAPO (loss_mode=sapo) is not implemented"),
    Unsupported("*.rollout_n", NEVER, "derived from actor_rollout_ref.rollout.n; set that instead"),
    Unsupported("*.checkpoint.async_save", (False,), "asynchronous checkpoint saving is not implemented"),
    Unsupported("actor_rollout_ref.ref.model", (None,), "the reference policy is the initial policy model"),
    Unsupported("actor_rollout_ref.rollout.engine_kwargs.sglang*", (None, {}), _SGLANG),
    Unsupported("actor_rollout_ref.rollout.multi_stage_wake_up", (False,), _SGLANG),
    Unsupported("actor_rollout_ref.rollout.update_weights_bucket_megabytes", WARN, "SGLang-only bucketing of weight updates"),
    Unsupported("actor_rollout_ref.rollout.layered_summon", (False,), "layered weight gathering is only for LoRA"),
    Unsupported("actor_rollout_ref.rollout.over_sample_rate", (0, 0.0), "early-abort over-sampling is not implemented"),
    Unsupported("actor_rollout_ref.rollout.agent*", WARN, _AGENT),
    Unsupported("actor_rollout_ref.rollout.chat_scheduler", (None,), _AGENT),
    Unsupported("actor_rollout_ref.rollout.trace*", WARN, "rollout tracing (mlflow/weave) is not implemented"),
    Unsupported("actor_rollout_ref.rollout.skip_rollout", (False,), "rollout caching is not implemented"),
    Unsupported("actor_rollout_ref.rollout.skip_dump_dir", WARN, "rollout caching is not implemented"),
    Unsupported("actor_rollout_ref.rollout.skip_tokenizer_init", WARN, "set by hybridrl"),
    Unsupported("actor_rollout_ref.rollout.use_fire_sampling", (False,), "FIRE sampling is not implemented"),
    Unsupported("actor_rollout_ref.rollout.data_parallel_size", (1,), "vLLM data parallelism is not implemented"),
    Unsupported("actor_rollout_ref.rollout.expert_parallel_size", (1,), "expert parallelism is not implemented"),
    Unsupported("actor_rollout_ref.rollout.micro_batch_size", WARN, "removed from verl (old HF-rollout micro batch); hybridrl's native engine batches the whole step"),
    Unsupported("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", (None,), "repeated interaction rollouts are not implemented"),
    Unsupported("actor_rollout_ref.rollout.val_kwargs._target_", WARN, "verl's dataclass target; not used"),
    Unsupported("*._target_", WARN, "verl's dataclass target; hybridrl's schema decides the types"),
    Unsupported("critic.forward_micro_batch_size", (None,), "folded into critic.ppo_micro_batch_size"),
    Unsupported("reward_model.sandbox_fusion.url", (None,), "Sandbox Fusion code execution is not integrated"),
    Unsupported("reward_model.sandbox_fusion.*", WARN, "Sandbox Fusion code execution is not integrated"),
    Unsupported("reward_model.enable_resource_pool", (False,), "a separate reward-model resource pool is not implemented"),
    Unsupported("reward_model.n_gpus_per_node", (0,), "a separate reward-model resource pool is not implemented"),
    Unsupported("reward_model.nnodes", (0,), "a separate reward-model resource pool is not implemented"),
    Unsupported("reward_model.model.fused_kernel_options*", WARN, _PERF),
    Unsupported("data.use_shm", (False,), "loading data from /dev/shm is not implemented"),
    Unsupported("data.image_key", ("images",), _MM),
    Unsupported("data.video_key", ("videos",), _MM),
    Unsupported("data.return_multi_modal_inputs", WARN, _MM),
    Unsupported("data.custom_cls.*", (None,), "custom dataset classes are not supported; write verl's parquet row format"),
    Unsupported("data.sampler.*", (None,), "custom (curriculum) samplers are not supported"),
    Unsupported("data.datagen.*", (None,), "dynamic data generation is not supported"),
    Unsupported("algorithm.use_pf_ppo", (False,), "preference-feedback PPO reweighting is not implemented"),
    Unsupported("algorithm.pf_ppo.*", WARN, "preference-feedback PPO reweighting is not implemented"),
    Unsupported("algorithm.rollout_correction*", NEVER, "use the flat keys algorithm.rollout_is, rollout_is_threshold, rollout_is_level, rollout_is_mode"),
    Unsupported("algorithm.filter_groups.filter_function", WARN, "hybridrl keeps groups whose metric varies (DAPO's rule)"),
    Unsupported("algorithm.filter_groups.filter_kwargs*", WARN, "hybridrl keeps groups whose metric varies (DAPO's rule)"),
    Unsupported("trainer.default_hdfs_dir", (None,), "HDFS upload is not implemented"),
    Unsupported("trainer.esi_redundant_time", WARN, "ESI (elastic instance) saving is not implemented"),
    Unsupported("trainer.use_legacy_worker_impl", WARN, "hybridrl has one worker implementation"),
    Unsupported("trainer.profile_steps", (None,), _PROFILER),
    Unsupported("trainer.controller_nsight_options*", WARN, _PROFILER),
    Unsupported("trainer.worker_nsight_options*", WARN, _PROFILER),
    Unsupported("transfer_queue*", NEVER, "the transfer-queue data path is not implemented"),
)

UNSUPPORTED_VALUES: dict[tuple[str, Any], str] = {
    ("actor_rollout_ref.actor.strategy", "megatron"): _MEGATRON,
    ("actor_rollout_ref.ref.strategy", "megatron"): _MEGATRON,
    ("critic.strategy", "megatron"): _MEGATRON,
    ("reward_model.strategy", "megatron"): _MEGATRON,
    ("actor_rollout_ref.rollout.name", "sglang"): _SGLANG,
    ("actor_rollout_ref.rollout.name", "trtllm"): "TensorRT-LLM rollout is not supported; use native|vllm|hf",
    ("actor_rollout_ref.actor.kl_loss_type", "full"): "the full-vocabulary KL needs all logits; use low_var_kl, kl, abs or mse",
    ("algorithm.kl_penalty", "full"): "the full-vocabulary KL needs all logits; use kl, abs, mse or low_var_kl",
    ("actor_rollout_ref.actor.policy_loss.loss_mode", "sapo"): "SAPO is not implemented",
}


def find_unsupported(key: str) -> Unsupported | None:
    """The first table entry whose pattern matches ``key`` (None: not a known verl key)."""
    for entry in UNSUPPORTED:
        if fnmatch.fnmatchcase(key, entry.pattern):
            return entry
    return None


def is_empty(value: Any) -> bool:
    """Whether a value sets nothing (null, false, 0, an empty string, list or dict): a ``WARN`` key
    spelled out so, as verl's own default config does, loads without a warning."""
    return value is None or value is False or (type(value) in (int, float) and value == 0) or (
        isinstance(value, str | list | tuple | dict) and len(value) == 0)


def is_noop(entry: Unsupported, value: Any) -> bool:
    """Whether ``value`` switches the unsupported feature off (bools compare strictly)."""
    if entry.accepts in (NEVER, WARN):
        return entry.accepts == WARN
    return any(type(value) is type(ok) and value == ok for ok in entry.accepts) or (
        value is None and None in entry.accepts)
