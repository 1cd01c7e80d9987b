"""The one config schema of hybridrl: nested frozen dataclasses whose key paths are verl's.

Every default lives here and nowhere else; presets (``presets/*.yaml``) hold values only. Each field has
a ``help`` line in its metadata; a field with ``choices`` is checked against them at load. A default of
the form ``"${other.key}"`` is an OmegaConf interpolation resolved at load, as in verl's
``ppo_trainer.yaml`` (e.g. ``rollout.response_length`` follows ``data.max_response_length``).

Batch-size vocabulary (verl's): ``data.train_batch_size`` = N prompts per step, each sampled
G = ``rollout.n`` times, so B = N*G sequences; ``ppo_mini_batch_size`` counts prompts (x G at use);
``*_micro_batch_size_per_gpu`` counts sequences per device. The deprecated global ``*_micro_batch_size``
keys are divided by the world size at load and folded into the ``*_per_gpu`` keys.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any

import hybridrl.algos as _algos

# Algorithm names come from the registries of hybridrl.algos, so the config accepts exactly what
# the math implements.
LOSS_AGG_MODES = _algos.LOSS_AGG_MODES
KL_TYPES = tuple(_algos.KL_PENALTIES.names())
ADV_ESTIMATORS = tuple(_algos.ADV_ESTIMATORS.names())
POLICY_LOSS_MODES = tuple(_algos.POLICY_LOSSES.names())
STRATEGIES = ("fsdp", "fsdp2")
LOGGERS = ("console", "file", "tensorboard", "wandb", "mlflow")


def opt(default: Any = MISSING, help: str = "", choices: tuple | None = None) -> Any:
    """A schema field: its default, one help line and optionally the allowed values."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(factory: Any, help: str) -> Any:
    """A nested section (a dataclass built by ``factory``)."""
    return field(default_factory=factory, metadata={"help": help})


def ref(path: str) -> Any:
    """Default that follows another key (an OmegaConf interpolation, resolved at load)."""
    return "${" + path + "}"


# ----------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class DataConfig:
    tokenizer: str | None = opt(None, "tokenizer path to use instead of the policy model's (null: the model's)")
    train_files: tuple[str, ...] = opt(("~/data/rlhf/gsm8k/train.parquet",), "training parquet/jsonl files (a path or a list)")
    val_files: tuple[str, ...] = opt(("~/data/rlhf/gsm8k/test.parquet",), "validation parquet/jsonl files (a path or a list)")
    prompt_key: str = opt("prompt", "column holding the prompt (a list of chat messages)")
    reward_fn_key: str = opt("data_source", "column used to route each row to its reward function")
    max_prompt_length: int = opt(512, "P: maximum prompt length in tokens (prompts are left-padded to it)")
    max_response_length: int = opt(512, "R: maximum response length in tokens")
    train_batch_size: int = opt(1024, "N: prompts per training step")
    gen_batch_size: int = opt(ref(".train_batch_size"), "prompts per generation batch (DAPO: with algorithm.filter_groups.enable, batches are generated until N prompts are kept; otherwise it must equal train_batch_size)")
    val_batch_size: int | None = opt(None, "prompts per validation batch (null: the whole validation set at once)")
    return_raw_input_ids: bool = opt(False, "verl: also return the un-templated prompt ids for a reward model with another tokenizer (hybridrl re-templates from return_raw_chat; true warns that it has no effect)")
    return_raw_chat: bool = opt(False, "also return the raw chat messages (needed by async/multi-turn rollout)")
    return_full_prompt: bool = opt(False, "also return the templated prompt text")
    shuffle: bool = opt(True, "shuffle the training data every epoch")
    seed: int = opt(1, "seed of the training-data shuffle")
    validation_shuffle: bool = opt(False, "shuffle the validation data")
    dataloader_num_workers: int = opt(8, "verl: data-loader worker processes (hybridrl collates prompt batches in the driver; values other than 0 and 8 warn)")
    filter_overlong_prompts: bool = opt(False, "drop prompts longer than max_prompt_length at load")
    filter_overlong_prompts_workers: int = opt(1, "verl: processes filtering overlong prompts (hybridrl filters in the driver; other values warn)")
    truncation: str = opt("error", "what to do with a prompt longer than max_prompt_length", ("error", "left", "right"))
    trust_remote_code: bool = opt(False, "allow the tokenizer's remote code")
    apply_chat_template_kwargs: dict[str, Any] = opt({}, "extra keyword arguments to tokenizer.apply_chat_template (add with +key=value)")


# ---------------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class WrapPolicyConfig:
    min_num_params: int = opt(0, "wrap every module with at least this many parameters (not used: each decoder layer is a unit; set, it warns)")
    transformer_layer_cls_to_wrap: tuple[str, ...] | None = opt(None, "layer class names to shard as units (not used: the model's decoder layer is; set, it warns)")


@dataclass(frozen=True)
class FSDPConfig:
    wrap_policy: WrapPolicyConfig = section(WrapPolicyConfig, "which modules become FSDP units")
    param_offload: bool = opt(False, "keep parameters on CPU between uses (GPU only; not implemented: set, it warns)")
    optimizer_offload: bool = opt(False, "keep optimizer state on CPU between steps (GPU only; not implemented: set, it warns)")
    offload_policy: bool = opt(False, "FSDP2 CPUOffloadPolicy for params/grads/optimizer (needs an accelerator; not implemented: set, it warns)")
    reshard_after_forward: bool = opt(True, "free gathered parameters after forward (FSDP2; false: keep them for backward, one gather less per block)")
    fsdp_size: int = opt(-1, "ranks per FSDP shard group: -1 all ranks; 1 a whole replica on each rank, gradients summed once a step (no gathers); a divisor of the world size shards within groups of that many ranks, replicated across groups (HSDP)")
    forward_prefetch: bool = opt(False, "gather the next block's parameters when a block's forward starts (FSDP2)")
    model_dtype: str = opt("fp32", "dtype the model weights are kept in", ("fp32", "bf16", "fp16"))


@dataclass(frozen=True)
class FusedKernelOptions:
    impl_backend: str = opt("torch", "verl's choice of fused-kernel implementation; hybridrl has one (torch ops, its own kernels for fp32 CPU) and runs it for either", ("torch", "triton"))


@dataclass(frozen=True)
class ModelConfig:
    path: str = opt("~/models/deepseek-llm-7b-chat", "policy model: a Hugging Face folder or hub id")
    tokenizer_path: str | None = opt(None, "tokenizer folder (null: the model path)")
    custom_chat_template: str | None = opt(None, "Jinja chat template replacing the tokenizer's")
    external_lib: str | None = opt(None, "module imported before loading the model (registers custom architectures)")
    override_config: dict[str, Any] = opt({}, "entries overriding the model's HF config (add with +key=value)")
    enable_gradient_checkpointing: bool = opt(True, "recompute activations in backward to save memory")
    use_remove_padding: bool = opt(False, "verl: pack sequences without padding (hybridrl always packs them, either way)")
    share_prompt_prefix: bool = opt(True, "compute a prompt shared by several rows of a micro-batch (the n samples of GRPO) once, in training and log-prob forwards (Llama/Qwen2/Qwen3 with sdpa, no activation checkpointing); verl's actor.use_prefix_grouper sets it")
    trust_remote_code: bool = opt(False, "allow the model's remote code")
    use_fused_kernels: bool = opt(False, "log-probs and entropy of the actor and reference straight from the last hidden states, a chunk of logits at a time: no logits-sized tensor kept for backward (Llama/Mistral/Qwen2/Qwen3; others warn and use the full logits)")
    fused_kernel_options: FusedKernelOptions = section(FusedKernelOptions, "options of use_fused_kernels")


# ---------------------------------------------------------------------------------------------- actor
@dataclass(frozen=True)
class OptimConfig:
    lr: float = opt(1e-6, "peak learning rate")
    lr_warmup_steps: int = opt(-1, "warm-up steps (<= 0: use lr_warmup_steps_ratio)")
    lr_warmup_steps_ratio: float = opt(0.0, "warm-up steps as a fraction of total_training_steps")
    lr_scheduler_type: str = opt("constant", "schedule after warm-up (verl's former warmup_style)", ("constant", "cosine"))
    min_lr_ratio: float | None = opt(0.0, "final lr / peak lr (cosine only; null, verl's critic default: 0)")
    num_cycles: float = opt(0.5, "cosine cycles over training (0.5: a half cosine down to min_lr_ratio)")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    betas: tuple[float, float] = opt((0.9, 0.999), "AdamW betas")
    total_training_steps: int = opt(-1, "steps the schedule spans (-1: computed by the trainer from the data)")


@dataclass(frozen=True)
class CheckpointConfig:
    save_contents: tuple[str, ...] = opt(("model", "optimizer", "extra"), "what a checkpoint saves", ("model", "optimizer", "extra", "hf_model"))
    load_contents: tuple[str, ...] = opt(ref(".save_contents"), "what resuming loads (hybridrl always loads model, optimizer and extra; leaving one out warns)", ("model", "optimizer", "extra", "hf_model"))


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = opt("vanilla", "policy loss (arXiv 2505.22617 for clip-cov/kl-cov, 2506.02864 for gpg)", POLICY_LOSS_MODES)
    clip_cov_ratio: float = opt(0.0002, "clip-cov: fraction of tokens whose gradient is clipped")
    clip_cov_lb: float = opt(1.0, "clip-cov: lower bound of the covariance window")
    clip_cov_ub: float = opt(5.0, "clip-cov: upper bound of the covariance window")
    kl_cov_ratio: float = opt(0.0002, "kl-cov: fraction of tokens given the KL penalty")
    ppo_kl_coef: float = opt(0.1, "kl-cov: KL penalty coefficient")


@dataclass(frozen=True)
class ActorConfig:
    strategy: str = opt("fsdp", "training backend (both mean FSDP2 here; fsdp is kept for verl scripts)", STRATEGIES)
    ppo_mini_batch_size: int = opt(256, "prompts per optimizer step (x rollout.n sequences)")
    ppo_micro_batch_size: int | None = opt(None, "[deprecated] global micro batch; divided by the world size into ppo_micro_batch_size_per_gpu")
    ppo_micro_batch_size_per_gpu: int | None = opt(None, "sequences per forward/backward on one device (gradient accumulation)")
    use_dynamic_bsz: bool = opt(False, "form micro batches by a token budget instead of a row count")
    ppo_max_token_len_per_gpu: int = opt(16384, "token budget of one micro batch per device when use_dynamic_bsz")
    grad_clip: float = opt(1.0, "max global gradient norm")
    clip_ratio: float = opt(0.2, "PPO clip epsilon; default of clip_ratio_low/high")
    clip_ratio_low: float = opt(ref(".clip_ratio"), "lower clip epsilon: ratio >= 1 - low")
    clip_ratio_high: float = opt(ref(".clip_ratio"), "upper clip epsilon: ratio <= 1 + high (clip-higher, DAPO)")
    clip_ratio_c: float = opt(3.0, "dual-clip constant for negative advantages (arXiv 1912.09729)")
    loss_agg_mode: str = opt("token-mean", "how token losses are aggregated", LOSS_AGG_MODES)
    loss_scale_factor: float | None = opt(None, "divisor of seq-mean-token-sum-norm (null: response length R)")
    entropy_coeff: float = opt(0.0, "entropy bonus coefficient")
    calculate_entropy: bool = opt(False, "compute entropy even when entropy_coeff is 0 (for the metric)")
    entropy_from_logits_with_chunking: bool = opt(False, "compute the entropy with a graph 2048 positions at a time (smaller softmax temporaries)")
    entropy_checkpointing: bool = opt(False, "recompute the entropy's softmax in backward instead of keeping it (one logits-sized tensor less per micro batch)")
    use_kl_loss: bool = opt(False, "add KL(policy || ref) to the loss (GRPO style)")
    kl_loss_coef: float = opt(0.001, "coefficient of the KL loss")
    kl_loss_type: str = opt("low_var_kl", "KL estimator of the KL loss", KL_TYPES)
    ppo_epochs: int = opt(1, "passes over each batch")
    use_torch_compile: bool = opt(False, "torch.compile each transformer block (and the final norm) for training and log-probs (the first step pays the compile; verl defaults to true)")
    shuffle: bool = opt(False, "shuffle mini batches between PPO epochs")
    data_loader_seed: int = opt(42, "seed of the mini-batch shuffle")
    tis_imp_ratio_cap: float = opt(-1.0, "truncated importance sampling cap on pi_old/pi_rollout (-1: off; needs rollout.calculate_log_probs)")
    policy_loss: PolicyLossConfig = section(PolicyLossConfig, "policy-loss variant and its knobs")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "checkpoint contents")
    optim: OptimConfig = section(OptimConfig, "optimizer and lr schedule")
    fsdp_config: FSDPConfig = section(FSDPConfig, "FSDP sharding and offload")


@dataclass(frozen=True)
class RefConfig:
    strategy: str = opt(ref("actor_rollout_ref.actor.strategy"), "backend of the reference policy", STRATEGIES)
    log_prob_micro_batch_size: int | None = opt(None, "[deprecated] global micro batch; folded into log_prob_micro_batch_size_per_gpu")
    log_prob_micro_batch_size_per_gpu: int | None = opt(None, "sequences per log-prob forward on one device")
    log_prob_use_dynamic_bsz: bool = opt(ref("actor_rollout_ref.actor.use_dynamic_bsz"), "token-budget micro batches for ref log-probs")
    log_prob_max_token_len_per_gpu: int = opt(ref("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"), "token budget per device for ref log-probs")
    use_torch_compile: bool = opt(ref("actor_rollout_ref.actor.use_torch_compile"), "torch.compile each transformer block (and the final norm) of the reference model")
    fsdp_config: FSDPConfig = section(FSDPConfig, "FSDP sharding and offload of the reference model")


# -------------------------------------------------------------------------------------------- rollout
@dataclass(frozen=True)
class SamplingConfig:
    top_k: int = opt(-1, "validation top-k (-1 or 0: off)")
    top_p: float = opt(1.0, "validation nucleus p")
    temperature: float = opt(0.0, "validation temperature (0: greedy)")
    n: int = opt(1, "validation samples per prompt")
    do_sample: bool = opt(False, "sample during validation (False: greedy)")


@dataclass(frozen=True)
class MultiTurnConfig:
    enable: bool = opt(False, "multi-turn rollout with tools/interactions")
    max_assistant_turns: int | None = opt(None, "cap on assistant turns (null: no cap)")
    max_user_turns: int | None = opt(None, "cap on user turns (null: no cap)")
    tool_config_path: str | None = opt(None, "YAML file declaring the tools")
    interaction_config_path: str | None = opt(None, "YAML file declaring the interactions")
    max_parallel_calls: int = opt(1, "tool calls run in parallel within one turn")
    max_tool_response_length: int = opt(256, "tool responses are truncated to this many tokens")
    tool_response_truncate_side: str = opt("middle", "where tool responses are cut", ("left", "middle", "right"))
    use_inference_chat_template: bool = opt(False, "re-template turns with the chat template (False: keep generated ids)")
    tokenization_sanity_check_mode: str = opt("strict", "check turn-by-turn tokenization against whole-chat tokenization", ("disable", "strict", "ignore_strippable"))
    format: str = opt("hermes", "tool-call format")


@dataclass(frozen=True)
class EngineKwargsConfig:
    vllm: dict[str, Any] = opt({}, "extra vllm.LLM keyword arguments (add with +key=value)")


@dataclass(frozen=True)
class RolloutConfig:
    name: str = opt("native", "rollout engine: native (torch, KV cache), vllm, hf (transformers generate)", ("native", "vllm", "hf"))
    mode: str = opt("sync", "sync: one batched generate call; async: request-level engine", ("sync", "async"))
    temperature: float = opt(1.0, "sampling temperature (log-probs are computed from logits / temperature)")
    top_k: int = opt(-1, "top-k (-1 or 0: off)")
    top_p: float = opt(1.0, "nucleus p")
    do_sample: bool = opt(True, "sample (False: greedy)")
    n: int = opt(1, "G: samples per prompt (> 1 for GRPO/RLOO)")
    prompt_length: int = opt(ref("data.max_prompt_length"), "P of the rollout")
    response_length: int = opt(ref("data.max_response_length"), "R: maximum new tokens")
    dtype: str = opt("bfloat16", "rollout weights dtype", ("bfloat16", "float16", "float32"))
    kv_cache_dtype: str = opt("auto", "hybridrl, native engine: the KV cache's dtype; auto = the model's, float16 = an fp32 model's keys and values rounded to float16, half the bytes for the decode attention to read (the fused CPU kernels; rollout log-probs then differ slightly from the trainer's)", ("auto", "float16"))
    ignore_eos: bool = opt(False, "keep generating after EOS")
    calculate_log_probs: bool = opt(False, "return rollout_log_probs (needed by TIS / rollout importance sampling)")
    gpu_memory_utilization: float = opt(0.5, "vllm: fraction of GPU memory for weights + KV cache")
    enforce_eager: bool = opt(False, "vllm: disable CUDA graphs")
    cudagraph_capture_sizes: tuple[int, ...] | None = opt(None, "vllm: batch sizes captured as CUDA graphs")
    free_cache_engine: bool = opt(True, "release the rollout's KV cache (native engine: and packed decode weights) after each generation")
    tensor_model_parallel_size: int = opt(2, "vllm: tensor-parallel size (native/hf: ignored, as verl's hf rollout)")
    max_num_batched_tokens: int = opt(8192, "vllm: tokens per engine step")
    max_model_len: int | None = opt(None, "vllm: max sequence length (null: P + R)")
    max_num_seqs: int = opt(1024, "vllm: concurrent sequences")
    enable_chunked_prefill: bool = opt(True, "vllm: chunked prefill")
    enable_prefix_caching: bool = opt(True, "vllm: prefix caching")
    load_format: str = opt("dummy", "vllm: initial weight format (weights are synced from the actor)")
    disable_log_stats: bool = opt(True, "vllm: silence engine statistics")
    log_prob_micro_batch_size: int | None = opt(None, "[deprecated] global micro batch; folded into log_prob_micro_batch_size_per_gpu")
    log_prob_micro_batch_size_per_gpu: int | None = opt(None, "sequences per old-log-prob forward on one device")
    log_prob_use_dynamic_bsz: bool = opt(ref("actor_rollout_ref.actor.use_dynamic_bsz"), "token-budget micro batches for old log-probs")
    log_prob_max_token_len_per_gpu: int = opt(ref("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"), "token budget per device for old log-probs")
    engine_kwargs: EngineKwargsConfig = section(EngineKwargsConfig, "engine-specific keyword arguments")
    val_kwargs: SamplingConfig = section(SamplingConfig, "sampling during validation")
    multi_turn: MultiTurnConfig = section(MultiTurnConfig, "multi-turn / tool rollout")


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    model: ModelConfig = section(ModelConfig, "the policy model (shared by actor, rollout and ref)")
    actor: ActorConfig = section(ActorConfig, "PPO actor update")
    ref: RefConfig = section(RefConfig, "reference policy (used when use_kl_loss or use_kl_in_reward)")
    rollout: RolloutConfig = section(RolloutConfig, "generation")
    nccl_timeout: int = opt(600, "verl: seconds before a collective times out (hybridrl: 600; other values warn)")


# --------------------------------------------------------------------------------------------- critic
@dataclass(frozen=True)
class CriticModelConfig:
    path: str = opt("~/models/deepseek-llm-7b-chat", "critic model (a value head is added)")
    tokenizer_path: str = opt(ref("actor_rollout_ref.model.path"), "tokenizer of the critic")
    override_config: dict[str, Any] = opt({}, "entries overriding the critic's HF config (add with +key=value)")
    external_lib: str | None = opt(ref("actor_rollout_ref.model.external_lib"), "module imported before loading the critic")
    trust_remote_code: bool = opt(ref("actor_rollout_ref.model.trust_remote_code"), "allow the critic's remote code")
    enable_gradient_checkpointing: bool = opt(True, "recompute activations in backward")
    use_remove_padding: bool = opt(False, "verl: pack sequences without padding (hybridrl always packs them, either way)")
    fsdp_config: FSDPConfig = section(FSDPConfig, "FSDP sharding and offload of the critic")


@dataclass(frozen=True)
class CriticConfig:
    enable: bool | None = opt(None, "use a critic (null: exactly when algorithm.adv_estimator is gae)")
    strategy: str = opt("fsdp", "training backend", STRATEGIES)
    optim: OptimConfig = section(lambda: OptimConfig(lr=1e-5), "critic optimizer and lr schedule")
    model: CriticModelConfig = section(CriticModelConfig, "critic model")
    ppo_mini_batch_size: int = opt(ref("actor_rollout_ref.actor.ppo_mini_batch_size"), "prompts per critic optimizer step (x rollout.n)")
    ppo_micro_batch_size: int | None = opt(None, "[deprecated] global micro batch; folded into ppo_micro_batch_size_per_gpu")
    ppo_micro_batch_size_per_gpu: int | None = opt(None, "sequences per critic forward/backward on one device")
    forward_micro_batch_size_per_gpu: int | None = opt(ref(".ppo_micro_batch_size_per_gpu"), "sequences per value forward on one device")
    use_dynamic_bsz: bool = opt(ref("actor_rollout_ref.actor.use_dynamic_bsz"), "token-budget micro batches")
    ppo_max_token_len_per_gpu: int = opt(32768, "token budget per device for the critic update")
    forward_max_token_len_per_gpu: int = opt(ref(".ppo_max_token_len_per_gpu"), "token budget per device for value forward")
    ppo_epochs: int = opt(ref("actor_rollout_ref.actor.ppo_epochs"), "passes over each batch")
    shuffle: bool = opt(ref("actor_rollout_ref.actor.shuffle"), "shuffle mini batches between epochs")
    grad_clip: float = opt(1.0, "max global gradient norm")
    cliprange_value: float = opt(0.5, "value clipping range")
    loss_agg_mode: str = opt(ref("actor_rollout_ref.actor.loss_agg_mode"), "aggregation of the value loss", LOSS_AGG_MODES)
    checkpoint: CheckpointConfig = section(CheckpointConfig, "checkpoint contents")


# --------------------------------------------------------------------------------------------- reward
@dataclass(frozen=True)
class RewardModelModelConfig:
    input_tokenizer: str | None = opt(ref("actor_rollout_ref.model.path"), "the policy's tokenizer: responses are decoded with it and re-templated with the RM's chat template (needs data.return_raw_chat=true; null: score the policy's token ids as they are)")
    path: str = opt("~/models/FsfairX-LLaMA3-RM-v0.1", "reward model: a sequence- or token-classification checkpoint with one label")
    external_lib: str | None = opt(ref("actor_rollout_ref.model.external_lib"), "module imported before loading the RM")
    trust_remote_code: bool = opt(False, "allow the RM's remote code")
    use_remove_padding: bool = opt(False, "verl: pack sequences without padding (hybridrl always packs them, either way)")
    fsdp_config: FSDPConfig = section(FSDPConfig, "FSDP sharding of the RM")


@dataclass(frozen=True)
class OverlongBufferConfig:
    enable: bool = opt(False, "DAPO soft overlong punishment")
    len: int = opt(0, "length of the penalty buffer before max_response_length")
    penalty_factor: float = opt(1.0, "penalty at the full buffer length")
    log: bool = opt(False, "log the overlong penalty")
    max_response_length: int | None = opt(None, "the length the buffer ends at (null: data.max_response_length; verl's reward_kwargs.max_resp_len)")


@dataclass(frozen=True)
class RewardModelConfig:
    enable: bool = opt(False, "score each response with a reward model (its output at the last token) instead of the reward functions")
    strategy: str = opt("fsdp", "backend of the RM", STRATEGIES)
    model: RewardModelModelConfig = section(RewardModelModelConfig, "reward model")
    micro_batch_size: int | None = opt(None, "[deprecated] global micro batch; folded into micro_batch_size_per_gpu")
    micro_batch_size_per_gpu: int | None = opt(None, "sequences per RM forward on one device")
    max_length: int | None = opt(None, "re-templated RM input length cap, cut on the right (null: P + R)")
    use_dynamic_bsz: bool = opt(ref("critic.use_dynamic_bsz"), "token-budget micro batches")
    forward_max_token_len_per_gpu: int = opt(ref("critic.forward_max_token_len_per_gpu"), "token budget per device")
    reward_manager: str = opt("naive", "how the reward function is called: once per row (naive, prime, dapo; reward.num_workers parallelises) or once per batch with lists (batch)", ("naive", "batch", "prime", "dapo"))
    launch_reward_fn_async: bool = opt(False, "verl: score rule rewards while the log-prob stages run (hybridrl scores them in reward.num_workers processes before those stages; true warns that it has no effect)")
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, "DAPO overlong reward shaping (reward_manager=dapo)")


@dataclass(frozen=True)
class CustomRewardFunctionConfig:
    path: str | None = opt(None, "Python file holding a custom reward function (null: built-in routing)")
    name: str = opt("compute_score", "function name in that file")
    reward_kwargs: dict[str, Any] = opt({}, "extra keyword arguments passed to it (add with +key=value)")


@dataclass(frozen=True)
class RewardConfig:
    """hybridrl addition: how rule-based reward functions are run."""

    timeout_s: float = opt(30.0, "seconds one reward call may take before it counts as failed")
    on_error: str = opt("fail", "a reward call that raises or times out: fail the run, or score 0 and count it", ("fail", "zero"))
    num_workers: int = opt(1, "processes scoring in parallel")


# ------------------------------------------------------------------------------------------ algorithm
@dataclass(frozen=True)
class KLControlConfig:
    type: str = opt("fixed", "in-reward KL coefficient controller", ("fixed", "adaptive"))
    kl_coef: float = opt(0.001, "(initial) coefficient of the in-reward KL penalty")
    horizon: int = opt(10000, "adaptive: horizon of the controller")
    target_kl: float = opt(0.1, "adaptive: KL the controller steers to")


@dataclass(frozen=True)
class FilterGroupsConfig:
    enable: bool = opt(False, "DAPO dynamic sampling: drop groups whose metric is the same for all G samples")
    metric: str = opt("acc", "per-sample metric compared within a group", ("acc", "score", "seq_reward", "seq_final_reward"))
    max_num_gen_batches: int = opt(10, "generation batches tried to fill a step (<= 0: no limit)")


@dataclass(frozen=True)
class AlgorithmConfig:
    gamma: float = opt(1.0, "discount factor")
    lam: float = opt(1.0, "GAE lambda")
    adv_estimator: str = opt("gae", "advantage estimator", ADV_ESTIMATORS)
    norm_adv_by_std_in_grpo: bool = opt(True, "GRPO: divide by the group std (False: Dr. GRPO)")
    use_kl_in_reward: bool = opt(False, "subtract a KL penalty from token rewards")
    kl_penalty: str = opt("kl", "KL estimator of the in-reward penalty", KL_TYPES)
    kl_ctrl: KLControlConfig = section(KLControlConfig, "in-reward KL coefficient")
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "DAPO dynamic sampling")
    rollout_is: bool = opt(False, "apply rollout importance weights pi_old/pi_rollout to the loss (False: metrics only)")
    rollout_is_threshold: float | None = opt(None, "upper bound of rollout IS weights (null: rollout IS off)")
    rollout_is_threshold_lower: float | None = opt(None, "lower bound (null: 1 / upper)")
    rollout_is_level: str = opt("token", "level of rollout IS weights", ("token", "sequence", "geometric"))
    rollout_is_mode: str = opt("truncate", "truncate weights at the bound, or mask tokens outside the bounds", ("truncate", "mask"))
    rollout_is_veto_threshold: float | None = opt(None, "reject a sequence with any token ratio below this (null: off)")


# -------------------------------------------------------------------------------------------- trainer
@dataclass(frozen=True)
class TrainerConfig:
    total_epochs: int = opt(30, "passes over the training data")
    total_training_steps: int | None = opt(None, "stop after this many steps (null: total_epochs x steps per epoch)")
    project_name: str = opt("hybridrl_examples", "project name for loggers and checkpoint paths")
    experiment_name: str = opt("gsm8k", "run name for loggers and checkpoint paths")
    logger: tuple[str, ...] = opt(("console",), "metric sinks (a name or a list)", LOGGERS)
    log_val_generations: int = opt(0, "verl: validation samples logged as text (not done here, > 0 warns: use trainer.validation_data_dir)")
    rollout_data_dir: str | None = opt(None, "dump rollouts as JSONL here (null: no dump)")
    validation_data_dir: str | None = opt(None, "dump validation generations as JSONL here (null: no dump)")
    nnodes: int = opt(1, "nodes")
    n_gpus_per_node: int = opt(8, "GPUs per node (used when device is cuda)")
    device: str = opt("auto", "cuda, cpu, or auto (cuda when available)", ("auto", "cuda", "cpu"))
    backend: str = opt("ray", "hybridrl: run worker groups as Ray actors, or in-process (local, for debugging)", ("ray", "local"))
    n_cpu_workers: int = opt(1, "hybridrl: worker ranks per node when device is cpu")
    save_freq: int = opt(-1, "save a checkpoint every this many steps (-1: never, except at the end if > 0)")
    test_freq: int = opt(-1, "validate every this many steps (-1: never)")
    val_before_train: bool = opt(True, "validate before the first step")
    val_only: bool = opt(False, "validate the initial (or resumed) policy once and exit, whatever val_before_train says")
    critic_warmup: int = opt(0, "steps that update only the critic")
    balance_batch: bool = opt(True, "reorder sequences so each rank gets a similar token count")
    nan_policy: str = opt("skip", "hybridrl: NaN/Inf in rewards, advantages, loss or gradients: skip that update and count it in training/skipped_steps (verl's behaviour), or stop the run with the step, phase and rank", ("skip", "stop"))
    preflight: str = opt("error", "hybridrl: memory estimate before workers start: refuse a run that cannot fit (error), only warn, or off", ("error", "warn", "off"))
    default_local_dir: str = opt("checkpoints/${trainer.project_name}/${trainer.experiment_name}", "checkpoint root (global_step_<N>/ below it)")
    resume_mode: str = opt("auto", "auto: latest checkpoint if any; disable; resume_path: resume_from_path", ("auto", "disable", "resume_path"))
    resume_from_path: str | None = opt(None, "checkpoint folder for resume_mode=resume_path")
    del_local_ckpt_after_load: bool = opt(False, "verl: delete the checkpoint once loaded (not done here: true warns)")
    max_actor_ckpt_to_keep: int | None = opt(None, "keep at most this many actor checkpoints (null: all)")
    max_critic_ckpt_to_keep: int | None = opt(None, "verl: critic checkpoints to keep (hybridrl keeps actor and critic in one folder per step: max_actor_ckpt_to_keep decides; another value warns)")
    ray_wait_register_center_timeout: int = opt(300, "verl: seconds to wait for Ray workers to register (not used here: other values warn)")

    @property
    def world_size(self) -> int:
        """Training ranks: nnodes x (n_gpus_per_node on cuda, n_cpu_workers on cpu)."""
        per_node = self.n_gpus_per_node if self.device == "cuda" else self.n_cpu_workers
        return self.nnodes * per_node


@dataclass(frozen=True)
class RayInitConfig:
    num_cpus: int | None = opt(None, "CPUs Ray may use (null: all)")


@dataclass(frozen=True)
class RayKwargsConfig:
    ray_init: RayInitConfig = section(RayInitConfig, "arguments of ray.init")
    timeline_json_file: str | None = opt(None, "verl: write a Ray timeline here at the end (not done here: set, it warns)")


# --------------------------------------------------------------------------------------------- root
@dataclass(frozen=True)
class HybridRLConfig:
    """The whole resolved config. Build it with ``hybridrl.config.load_config``."""

    data: DataConfig = section(DataConfig, "datasets and batch sizes")
    actor_rollout_ref: ActorRolloutRefConfig = section(ActorRolloutRefConfig, "policy model, actor, rollout, reference")
    critic: CriticConfig = section(CriticConfig, "value model (PPO/GAE)")
    reward_model: RewardModelConfig = section(RewardModelConfig, "model-based reward")
    custom_reward_function: CustomRewardFunctionConfig = section(CustomRewardFunctionConfig, "user reward function")
    reward: RewardConfig = section(RewardConfig, "hybridrl: running reward functions")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "advantages, KL, filtering")
    trainer: TrainerConfig = section(TrainerConfig, "loop, logging, checkpoints, resources")
    ray_kwargs: RayKwargsConfig = section(RayKwargsConfig, "Ray runtime")
