"""Checks on a resolved config: allowed values, ranges, batch-size arithmetic, cross-key consistency.

``validate(cfg)`` returns the list of problems (empty when valid); ``load_config`` raises them
together. Batch arithmetic follows verl (N = data.train_batch_size prompts, G = rollout.n, B = N*G):
B must split evenly over the world size; an update role's mini batch (prompts x G) must split into
whole per-device shares, each a multiple of the per-device micro batch, unless micro batches are
formed by a token budget (use_dynamic_bsz), which must then hold one full P + R sequence.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from hybridrl.config.errors import ConfigWarning
from hybridrl.config.schema import HybridRLConfig


def validate(cfg: HybridRLConfig) -> list[str]:
    """Every problem of ``cfg`` as one message naming the key(s), the value and what is allowed."""
    errors = _check_choices(cfg, "")
    errors += _check_ranges(cfg)
    if errors:  # arithmetic on out-of-range values would only add noise
        return errors
    errors += _check_batch_sizes(cfg)
    errors += _check_consistency(cfg)
    return errors


def get(cfg: Any, path: str) -> Any:
    for name in path.split("."):
        cfg = getattr(cfg, name)
    return cfg


def _check_choices(obj: Any, prefix: str) -> list[str]:
    errors: list[str] = []
    for field in dataclasses.fields(obj):
        value, path = getattr(obj, field.name), prefix + field.name
        if dataclasses.is_dataclass(value):
            errors += _check_choices(value, path + ".")
            continue
        choices = field.metadata.get("choices")
        if choices is None or value is None:
            continue
        items = value if isinstance(value, tuple) else (value,)
        bad = [item for item in items if item not in choices]
        if bad:
            errors.append(f"{path}={value!r}: {bad[0]!r} is not allowed; choose from {', '.join(choices)}")
    return errors


def _positive(value: Any) -> bool:
    return value is None or value >= 1


_RANGES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("data.max_prompt_length", _positive, ">= 1"),
    ("data.max_response_length", _positive, ">= 1"),
    ("data.train_batch_size", _positive, ">= 1"),
    ("data.gen_batch_size", _positive, ">= 1"),
    ("data.val_batch_size", _positive, ">= 1 or null"),
    ("data.dataloader_num_workers", lambda v: v >= 0, ">= 0"),
    ("actor_rollout_ref.rollout.n", _positive, ">= 1"),
    ("actor_rollout_ref.rollout.val_kwargs.n", _positive, ">= 1"),
    ("actor_rollout_ref.rollout.temperature", lambda v: v >= 0, ">= 0"),
    ("actor_rollout_ref.rollout.val_kwargs.temperature", lambda v: v >= 0, ">= 0"),
    ("actor_rollout_ref.rollout.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("actor_rollout_ref.rollout.val_kwargs.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("actor_rollout_ref.rollout.gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size", _positive, ">= 1"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", _positive, ">= 1"),
    ("actor_rollout_ref.actor.ppo_epochs", _positive, ">= 1"),
    ("actor_rollout_ref.actor.clip_ratio", lambda v: v > 0, "> 0"),
    ("actor_rollout_ref.actor.clip_ratio_low", lambda v: v > 0, "> 0"),
    ("actor_rollout_ref.actor.clip_ratio_high", lambda v: v > 0, "> 0"),
    ("actor_rollout_ref.actor.clip_ratio_c", lambda v: v > 1, "> 1 (dual-clip lower bound, arXiv 1912.09729)"),
    ("actor_rollout_ref.actor.grad_clip", lambda v: v > 0, "> 0"),
    ("actor_rollout_ref.actor.optim.lr", lambda v: v >= 0, ">= 0"),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("actor_rollout_ref.actor.optim.min_lr_ratio", lambda v: v is None or 0 <= v <= 1, "in [0, 1] or null"),
    ("critic.optim.min_lr_ratio", lambda v: v is None or 0 <= v <= 1, "in [0, 1] or null"),
    ("actor_rollout_ref.actor.optim.num_cycles", lambda v: v > 0, "> 0"),
    ("critic.optim.num_cycles", lambda v: v > 0, "> 0"),
    ("actor_rollout_ref.actor.optim.betas", lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    ("critic.optim.lr", lambda v: v >= 0, ">= 0"),
    ("critic.optim.betas", lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    ("critic.cliprange_value", lambda v: v > 0, "> 0"),
    ("algorithm.gamma", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("algorithm.lam", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("trainer.nnodes", _positive, ">= 1"),
    ("trainer.n_gpus_per_node", _positive, ">= 1"),
    ("trainer.n_cpu_workers", _positive, ">= 1"),
    ("trainer.total_epochs", _positive, ">= 1"),
    ("trainer.total_training_steps", _positive, ">= 1 or null"),
    ("trainer.save_freq", lambda v: v == -1 or v >= 1, "-1 (never) or >= 1"),
    ("trainer.test_freq", lambda v: v == -1 or v >= 1, "-1 (never) or >= 1"),
    ("reward.timeout_s", lambda v: v > 0, "> 0"),
    ("reward.num_workers", lambda v: v >= 0, ">= 0"),
)

_MICRO_KEYS = (
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size_per_gpu",
    "reward_model.micro_batch_size_per_gpu",
)


def _check_ranges(cfg: HybridRLConfig) -> list[str]:
    checks = _RANGES + tuple((key, _positive, ">= 1 or null") for key in _MICRO_KEYS)
    return [f"{path}={get(cfg, path)!r} must be {allowed}" for path, ok, allowed in checks if not ok(get(cfg, path))]


# ------------------------------------------------------------------------------------ batch sizes
def _world_text(cfg: HybridRLConfig) -> str:
    trainer = cfg.trainer
    per_node = ("trainer.n_gpus_per_node", trainer.n_gpus_per_node) if trainer.device == "cuda" else (
        "trainer.n_cpu_workers", trainer.n_cpu_workers)
    return f"world size {trainer.world_size} (trainer.nnodes={trainer.nnodes} x {per_node[0]}={per_node[1]}, device={trainer.device})"


def critic_in_use(cfg: HybridRLConfig) -> bool:
    """verl's rule: a critic exactly for GAE, unless critic.enable says otherwise."""
    enable = cfg.critic.enable
    return cfg.algorithm.adv_estimator == "gae" if enable is None else enable


def ref_in_use(cfg: HybridRLConfig) -> bool:
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def _check_batch_sizes(cfg: HybridRLConfig) -> list[str]:
    n, g, world = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, cfg.trainer.world_size
    errors = []
    if (n * g) % world:
        errors.append(f"data.train_batch_size x actor_rollout_ref.rollout.n = {n} x {g} = {n * g} sequences per "
                      f"step do not split over the {_world_text(cfg)}: {n * g} / {world} = {n * g / world:.4g}")
    actor, arr = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref
    errors += _check_update_role(cfg, "actor_rollout_ref.actor", actor.ppo_mini_batch_size,
                                 actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu)
    if critic_in_use(cfg):
        critic = cfg.critic
        errors += _check_update_role(cfg, "critic", critic.ppo_mini_batch_size, critic.ppo_micro_batch_size_per_gpu,
                                     critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu)
    forward_roles = [("actor_rollout_ref.rollout", arr.rollout, "log_prob_")]
    if ref_in_use(cfg):
        forward_roles.append(("actor_rollout_ref.ref", arr.ref, "log_prob_"))
    for prefix, role, stem in forward_roles:
        errors += _check_forward_role(cfg, prefix, stem, getattr(role, stem + "micro_batch_size_per_gpu"),
                                      getattr(role, stem + "use_dynamic_bsz"), getattr(role, stem + "max_token_len_per_gpu"))
    return errors


def _check_update_role(cfg: HybridRLConfig, prefix: str, mini: int, micro: int | None, dynamic: bool, max_tokens: int) -> list[str]:
    n, g, world = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, cfg.trainer.world_size
    if n < mini:
        return [f"data.train_batch_size={n} is smaller than {prefix}.ppo_mini_batch_size={mini} (both count prompts)"]
    # as in verl, mini need not divide n: a last mini-batch takes the prompts left over, whose
    # sequences split over the ranks wherever the step's and a mini-batch's do (checked here and above)
    mini_seqs = mini * g
    if mini_seqs % world:
        return [f"{prefix}.ppo_mini_batch_size x actor_rollout_ref.rollout.n = {mini} x {g} = {mini_seqs} sequences "
                f"per mini batch do not split over the {_world_text(cfg)}: {mini_seqs} / {world} = {mini_seqs / world:.4g}"]
    if dynamic:
        return _check_token_budget(cfg, f"{prefix}.ppo_max_token_len_per_gpu", max_tokens)
    if micro is None:
        return [f"{prefix}.ppo_micro_batch_size_per_gpu is not set; set it, or set {prefix}.use_dynamic_bsz=true "
                f"with {prefix}.ppo_max_token_len_per_gpu"]
    per_device = mini_seqs // world
    if per_device % micro:
        return [f"{prefix}: the mini batch per device, ppo_mini_batch_size x rollout.n / world size = "
                f"{mini} x {g} / {world} = {per_device} sequences, is not a multiple of "
                f"{prefix}.ppo_micro_batch_size_per_gpu={micro}"]
    return []


def _check_forward_role(cfg: HybridRLConfig, prefix: str, stem: str, micro: int | None, dynamic: bool,
                        max_tokens: int) -> list[str]:
    if dynamic:
        return _check_token_budget(cfg, f"{prefix}.{stem}max_token_len_per_gpu", max_tokens)
    if micro is None:
        return [f"{prefix}.{stem}micro_batch_size_per_gpu is not set; set it, or set "
                f"{prefix}.{stem}use_dynamic_bsz=true with a token budget"]
    return []


def _check_reward_model(cfg: HybridRLConfig) -> list[str]:
    """A reward model's forward batching, and the chat messages its re-templating reads."""
    rm = cfg.reward_model
    if rm.use_dynamic_bsz:
        errors = _check_token_budget(cfg, "reward_model.forward_max_token_len_per_gpu", rm.forward_max_token_len_per_gpu)
    elif rm.micro_batch_size_per_gpu is None:
        errors = ["reward_model.micro_batch_size_per_gpu is not set; set it, or set reward_model.use_dynamic_bsz=true "
                  "with reward_model.forward_max_token_len_per_gpu"]
    else:
        errors = []
    if rm.model.input_tokenizer is not None and not cfg.data.return_raw_chat:
        errors.append("reward_model.model.input_tokenizer is set (by default the policy's path), so the reward model "
                      "re-templates each response with the prompt's chat messages: set data.return_raw_chat=true, or "
                      "reward_model.model.input_tokenizer=null to score the policy's tokens as they are")
    if rm.max_length is not None and rm.max_length < 2:
        errors.append(f"reward_model.max_length={rm.max_length} must be >= 2 or null")
    metric = cfg.algorithm.filter_groups.metric
    if cfg.algorithm.filter_groups.enable and metric not in ("seq_reward", "seq_final_reward"):
        errors.append(f"algorithm.filter_groups.metric={metric} is a reward function's output, but with "
                      "reward_model.enable=true the reward model's score is the only one: use seq_reward or seq_final_reward")
    return errors


def _check_token_budget(cfg: HybridRLConfig, key: str, max_tokens: int) -> list[str]:
    p, r = cfg.data.max_prompt_length, cfg.data.max_response_length
    if max_tokens < p + r:
        return [f"{key}={max_tokens} cannot hold one full sequence: data.max_prompt_length + "
                f"data.max_response_length = {p} + {r} = {p + r} tokens"]
    return []


# ------------------------------------------------------------------------------------ consistency
def _check_consistency(cfg: HybridRLConfig) -> list[str]:
    errors: list[str] = []
    arr, algo, trainer = cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    if algo.adv_estimator == "gae" and cfg.critic.enable is False:
        errors.append("algorithm.adv_estimator=gae needs a critic, but critic.enable=false; "
                      "enable the critic or pick a critic-free estimator (grpo, rloo, ...)")
    if cfg.reward_model.enable:
        errors += _check_reward_model(cfg)
    if cfg.reward_model.reward_manager == "batch" and not cfg.custom_reward_function.path:
        errors.append("reward_model.reward_manager=batch calls the reward function once per batch with lists "
                      "(data_sources, solution_strs, ground_truths, extra_infos); the built-in scorers take one "
                      "sample: set custom_reward_function.path to a batched function")
    if trainer.val_only and not cfg.data.val_files:
        errors.append("trainer.val_only=true validates and exits, but data.val_files is empty")
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        errors.append("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_<N> folder)")
    val = arr.rollout.val_kwargs
    if val.do_sample and val.temperature <= 0:
        errors.append(f"actor_rollout_ref.rollout.val_kwargs.do_sample=true needs val_kwargs.temperature > 0, got {val.temperature}")
    needs_rollout_lp = [k for k, on in (("actor_rollout_ref.actor.tis_imp_ratio_cap", arr.actor.tis_imp_ratio_cap > 0),
                                        ("algorithm.rollout_is_threshold", algo.rollout_is_threshold is not None)) if on]
    if needs_rollout_lp and not arr.rollout.calculate_log_probs:
        errors.append(f"{needs_rollout_lp[0]} needs rollout log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true")
    if algo.filter_groups.enable and arr.rollout.n < 2:
        errors.append("algorithm.filter_groups.enable=true needs actor_rollout_ref.rollout.n >= 2 "
                      "(groups of one sample never vary and would all be dropped)")
    if cfg.data.gen_batch_size != cfg.data.train_batch_size and not algo.filter_groups.enable:
        errors.append(f"data.gen_batch_size={cfg.data.gen_batch_size} differs from data.train_batch_size="
                      f"{cfg.data.train_batch_size}, which only DAPO's dynamic sampling uses "
                      "(algorithm.filter_groups.enable=true: generate until train_batch_size prompts are kept); "
                      "without it each step trains on one generation batch: set the two equal")
    if arr.rollout.kv_cache_dtype != "auto" and arr.rollout.name != "native":
        errors.append(f"actor_rollout_ref.rollout.kv_cache_dtype={arr.rollout.kv_cache_dtype} is the native engine's; "
                      f"rollout.name={arr.rollout.name} keeps its own cache (vLLM: +actor_rollout_ref.rollout.vllm."
                      "kv_cache_dtype=...)")
    tp = arr.rollout.tensor_model_parallel_size
    if arr.rollout.name == "vllm" and tp > 1 and trainer.device == "cpu":
        warnings.warn(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} is ignored on trainer.device=cpu: "
                      "each CPU worker runs its own vLLM engine", ConfigWarning, stacklevel=4)
    elif arr.rollout.name == "vllm" and trainer.world_size % tp:
        errors.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the {_world_text(cfg)}")
    errors += _check_offload(cfg)
    errors += _check_fsdp_size(cfg)
    _warn_unread_fsdp_keys(cfg)
    overlong = cfg.reward_model.overlong_buffer
    if overlong.enable and cfg.reward_model.reward_manager != "dapo":
        warnings.warn(f"reward_model.overlong_buffer.enable=true with reward_model.reward_manager="
                      f"{cfg.reward_model.reward_manager}: hybridrl applies the overlong penalty with any manager, "
                      "verl only with reward_manager=dapo (set it to compare runs)", ConfigWarning, stacklevel=4)
    buffer_end = overlong.max_response_length or cfg.data.max_response_length
    if overlong.enable and not 0 < overlong.len <= buffer_end:
        errors.append(f"reward_model.overlong_buffer.len={overlong.len} must be in [1, {buffer_end}] "
                      "(overlong_buffer.max_response_length, else data.max_response_length) when overlong_buffer.enable=true")
    if overlong.max_response_length is not None and overlong.max_response_length < 1:
        errors.append(f"reward_model.overlong_buffer.max_response_length={overlong.max_response_length} must be >= 1 or null")
    _warn_unread_keys(cfg)
    if arr.actor.use_kl_loss and algo.use_kl_in_reward:
        warnings.warn("both actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward are true: "
                      "the KL to the reference policy is applied twice", ConfigWarning, stacklevel=4)
    return errors


def _fsdp_sections(cfg: HybridRLConfig) -> dict:
    """The ``fsdp_config`` of each role that trains or scores in a TrainEngine, by key prefix."""
    return {"actor_rollout_ref.actor": cfg.actor_rollout_ref.actor.fsdp_config,
            "actor_rollout_ref.ref": cfg.actor_rollout_ref.ref.fsdp_config,
            "critic.model": cfg.critic.model.fsdp_config}


def _check_fsdp_size(cfg: HybridRLConfig) -> list[str]:
    """fsdp_size as verl reads it: -1 (or at least the world size) shards over every rank, 1 keeps a
    whole replica on each, a size between that divides the world shards within groups of that many
    ranks replicated across the groups (HSDP)."""
    world = cfg.trainer.world_size
    return [f"{prefix}.fsdp_config.fsdp_size={fsdp.fsdp_size} with the {_world_text(cfg)}: use -1 (shard over "
            "all ranks), 1 (a whole replica on each rank) or a size that divides the world size (HSDP: shard "
            "groups of that many ranks)" for prefix, fsdp in _fsdp_sections(cfg).items()
            if fsdp.fsdp_size == 0 or (1 < fsdp.fsdp_size < world and world % fsdp.fsdp_size)]


_FULL_RESUME = ("model", "optimizer", "extra")
# verl keys that hybridrl keeps in its schema (so that verl scripts load) and does not act on:
# (key, whether the value asks for something, what hybridrl does instead)
_UNREAD: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("reward_model.launch_reward_fn_async", bool, "rule rewards are scored right after generation, in "
     "reward.num_workers processes (the numbers are the same as verl's either way)"),
    ("data.return_raw_input_ids", bool, "a reward model with its own template re-templates from the chat "
     "messages (data.return_raw_chat), not from raw token ids"),
    ("data.dataloader_num_workers", lambda v: v not in (0, 8), "prompt batches are collated in the driver as they "
     "are drawn"),  # 0 says so; 8 is verl's default
    ("data.filter_overlong_prompts_workers", lambda v: v != 1, "overlong prompts are filtered in the driver"),
    ("actor_rollout_ref.actor.checkpoint.load_contents", lambda v: not set(_FULL_RESUME) <= set(v),
     "resuming always loads the model, the optimizer and the run state"),
    ("critic.checkpoint.load_contents", lambda v: not set(_FULL_RESUME) <= set(v),
     "resuming always loads the model, the optimizer and the run state"),
    ("actor_rollout_ref.nccl_timeout", lambda v: v != 600, "process groups time out after 600 s"),
    ("trainer.log_val_generations", bool, "validation generations are not logged as text; "
     "trainer.validation_data_dir dumps them, with their scores, as jsonl"),
    ("trainer.del_local_ckpt_after_load", bool, "a checkpoint is kept after it is loaded"),
    ("trainer.ray_wait_register_center_timeout", lambda v: v != 300, "worker start-up failures are reported "
     "as they happen"),
    ("ray_kwargs.timeline_json_file", bool, "no Ray timeline is written; wrap a run in torch.profiler instead"),
)


def _warn_unread_keys(cfg: HybridRLConfig) -> None:
    """Each ``_UNREAD`` key whose value asks for something warns, naming what happens instead."""
    for key, asks, instead in _UNREAD:
        value = get(cfg, key)
        if asks(value):
            warnings.warn(f"{key}={value!r} has no effect in hybridrl: {instead}", ConfigWarning, stacklevel=5)
    trainer = cfg.trainer
    if trainer.max_critic_ckpt_to_keep is not None and trainer.max_critic_ckpt_to_keep != trainer.max_actor_ckpt_to_keep:
        warnings.warn(f"trainer.max_critic_ckpt_to_keep={trainer.max_critic_ckpt_to_keep} has no effect in hybridrl: a "
                      "checkpoint folder holds the actor and the critic, and trainer.max_actor_ckpt_to_keep="
                      f"{trainer.max_actor_ckpt_to_keep} decides how many are kept", ConfigWarning, stacklevel=4)


def _warn_unread_fsdp_keys(cfg: HybridRLConfig) -> None:
    """verl's FSDP keys that hybridrl keeps in its schema (so that verl scripts load) but does not
    act on: set to anything but their default, they warn, naming the key and what happens instead."""
    gpu = cfg.trainer.device != "cpu"
    units = "each decoder layer (the model's _no_split_modules) is one FSDP unit, the rest the root unit"
    for prefix, fsdp in _fsdp_sections(cfg).items():
        unread = []
        if fsdp.wrap_policy.min_num_params:
            unread.append((f"wrap_policy.min_num_params={fsdp.wrap_policy.min_num_params}", units))
        if fsdp.wrap_policy.transformer_layer_cls_to_wrap is not None:
            names = ",".join(fsdp.wrap_policy.transformer_layer_cls_to_wrap)
            unread.append((f"wrap_policy.transformer_layer_cls_to_wrap=[{names}]", units))
        for key in ("param_offload", "optimizer_offload") + (("offload_policy",) if gpu else ()):
            if getattr(fsdp, key):
                unread.append((f"{key}=true", "offloading is not implemented, parameters, gradients and optimizer "
                                              "state stay on the device" if gpu else "the CPU already holds them"))
        for key, what in unread:
            warnings.warn(f"{prefix}.fsdp_config.{key} is not used: {what}", ConfigWarning, stacklevel=5)


def _check_offload(cfg: HybridRLConfig) -> list[str]:
    if cfg.trainer.device != "cpu":
        return []
    roles = _fsdp_sections(cfg)
    return [f"{prefix}.fsdp_config.offload_policy=true needs an accelerator (FSDP2 CPUOffloadPolicy fails on "
            "trainer.device=cpu); set it to false" for prefix, fsdp in roles.items() if fsdp.offload_policy]
