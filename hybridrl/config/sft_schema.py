"""The SFT trainer's config: verl's ``sft_trainer.yaml`` key paths, loaded by the same loader as RL.

    from hybridrl.config.sft_schema import load_sft_config
    cfg = load_sft_config(["data.train_files=train.parquet", "model.partial_pretrain=./my_model"])

Batch vocabulary (verl's SFT): ``data.train_batch_size`` counts SEQUENCES per optimizer step over all
ranks; each rank takes ``train_batch_size / world_size`` of them and splits its share into micro
batches of ``data.micro_batch_size_per_gpu`` rows, or into token budgets of
``data.max_token_len_per_gpu`` with ``data.use_dynamic_bsz``. The loss is the token-mean over the
response (assistant) tokens of the whole step on all ranks, so micro batching never changes it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hybridrl.config import verl_compat
from hybridrl.config.loader import Schema, load_config
from hybridrl.config.schema import LOGGERS, STRATEGIES, opt, section
from hybridrl.config.validate import _check_choices, get
from hybridrl.config.verl_compat import WARN, Unsupported

DEFAULT_SFT_PRESET = "sft_trainer"
LR_SCHEDULERS = ("cosine", "constant")


# ----------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class MultiturnConfig:
    enable: bool = opt(False, "rows hold a chat (messages_key); loss on every assistant message")
    messages_key: str = opt("messages", "column holding the list of {role, content} messages")


@dataclass(frozen=True)
class SFTDataConfig:
    train_files: tuple[str, ...] = opt(("~/data/gsm8k/train.parquet",), "training parquet/jsonl files (a path or a list)")
    val_files: tuple[str, ...] = opt(("~/data/gsm8k/test.parquet",), "validation files (a path or a list; [] or null: no validation)")
    prompt_key: str = opt("question", "single-turn: column of the prompt (a string, or a list of chat messages)")
    response_key: str = opt("answer", "single-turn: column of the target response (a string)")
    prompt_dict_keys: tuple[str, ...] | None = opt(None, "keys followed inside a dict-valued prompt column, in order")
    response_dict_keys: tuple[str, ...] | None = opt(None, "keys followed inside a dict-valued response column (e.g. [solution] for extra_info)")
    multiturn: MultiturnConfig = section(MultiturnConfig, "multi-turn chat data")
    max_length: int = opt(1024, "maximum prompt + response tokens of one example")
    truncation: str = opt("error", "an example longer than max_length: error, left (drop its first tokens), right (drop its last)",
                          ("error", "left", "right"))
    train_batch_size: int = opt(256, "sequences per optimizer step, over all ranks")
    micro_batch_size_per_gpu: int = opt(4, "sequences per forward/backward on one device (also the validation micro batch)")
    use_dynamic_bsz: bool = opt(False, "form micro batches by a token budget instead of a row count")
    max_token_len_per_gpu: int = opt(8192, "token budget of one micro batch per device when use_dynamic_bsz")
    shuffle: bool = opt(True, "shuffle the training data every epoch (seed: trainer.seed)")
    apply_chat_template_kwargs: dict[str, Any] = opt({}, "extra keyword arguments to tokenizer.apply_chat_template (add with +key=value)")


# ---------------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class SFTFSDPConfig:
    model_dtype: str = opt("fp32", "compute dtype of forward/backward (master weights and AdamW state stay fp32)",
                           ("fp32", "bf16", "fp16"))


@dataclass(frozen=True)
class SFTModelConfig:
    partial_pretrain: str = opt("~/models/gemma-1.1-7b-it", "model to fine-tune: a local Hugging Face folder")
    tokenizer_path: str | None = opt(None, "tokenizer folder (null: partial_pretrain)")
    strategy: str = opt("fsdp2", "training backend (both mean FSDP2 here; fsdp is kept for verl scripts)", STRATEGIES)
    fsdp_config: SFTFSDPConfig = section(SFTFSDPConfig, "FSDP precision")
    external_lib: str | None = opt(None, "module imported before loading the model (registers custom architectures)")
    enable_gradient_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    trust_remote_code: bool = opt(False, "allow the model's and tokenizer's remote code")
    override_config: dict[str, Any] = opt({}, "entries overriding the model's HF config (add with +key=value)")


# ---------------------------------------------------------------------------------------------- optim
@dataclass(frozen=True)
class SFTOptimConfig:
    lr: float = opt(1e-5, "peak learning rate")
    betas: tuple[float, float] = opt((0.9, 0.95), "AdamW betas")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    warmup_steps_ratio: float = opt(0.1, "warm-up steps as a fraction of the total training steps")
    clip_grad: float = opt(1.0, "max global gradient norm")
    lr_scheduler: str = opt("cosine", "schedule after warm-up", LR_SCHEDULERS)
    min_lr_ratio: float = opt(0.0, "final lr / peak lr (cosine only)")


# -------------------------------------------------------------------------------------------- trainer
@dataclass(frozen=True)
class SFTTrainerConfig:
    default_local_dir: str = opt("checkpoints/${trainer.project_name}/${trainer.experiment_name}",
                                 "run folder: global_step_<N>/ checkpoints, metrics, and hf_model/ at the end")
    project_name: str = opt("gsm8k-sft", "project name for loggers")
    experiment_name: str = opt("test", "run name for loggers")
    total_epochs: int = opt(4, "passes over the training data")
    total_training_steps: int | None = opt(None, "stop after this many steps (null: total_epochs x steps per epoch)")
    logger: tuple[str, ...] = opt(("console",), "metric sinks (a name or a list)", LOGGERS)
    seed: int = opt(1, "seed of the data shuffle")
    save_freq: int = opt(-1, "save a checkpoint every this many steps and at the last step (-1: never)")
    test_freq: int = opt(-1, "validation loss every this many steps and at the last step (-1: only at the last step)")
    val_before_train: bool = opt(False, "hybridrl: validation loss before the first step")
    val_generation_length: int = opt(0, "hybridrl: > 0 greedy-decodes the validation prompts (verl RL rows: prompt_key "
                                        "messages, data_source, reward_model) up to this many tokens when validating and "
                                        "logs val-core/<data_source>/acc/mean@1 (0: off)")
    resume_mode: str = opt("auto", "auto: latest checkpoint if any; disable; resume_path: resume_from_path",
                           ("auto", "disable", "resume_path"))
    resume_from_path: str | None = opt(None, "checkpoint folder for resume_mode=resume_path")
    max_ckpt_to_keep: int | None = opt(None, "keep at most this many checkpoints (null: all)")
    nnodes: int = opt(1, "nodes (only 1 is supported by the SFT trainer)")
    n_gpus_per_node: int = opt(1, "GPUs per node (used when device is cuda)")
    device: str = opt("auto", "cuda, cpu, or auto (cuda when available)", ("auto", "cuda", "cpu"))
    n_cpu_workers: int = opt(1, "hybridrl: training processes when device is cpu (gloo)")

    @property
    def world_size(self) -> int:
        """Training ranks: nnodes x (n_gpus_per_node on cuda, n_cpu_workers on cpu)."""
        return self.nnodes * (self.n_gpus_per_node if self.device == "cuda" else self.n_cpu_workers)


@dataclass(frozen=True)
class SFTConfig:
    """The whole resolved SFT config. Build it with ``load_sft_config``."""

    data: SFTDataConfig = section(SFTDataConfig, "datasets, lengths and batch sizes")
    model: SFTModelConfig = section(SFTModelConfig, "the model to fine-tune")
    optim: SFTOptimConfig = section(SFTOptimConfig, "optimizer and lr schedule")
    trainer: SFTTrainerConfig = section(SFTTrainerConfig, "loop, logging, checkpoints, resources")


# ------------------------------------------------------------------------------ verl compatibility
RENAMED_SFT: dict[str, str] = {
    "data.messages_key": "data.multiturn.messages_key",
    "optim.lr_warmup_steps_ratio": "optim.warmup_steps_ratio",
    "optim.warmup_style": "optim.lr_scheduler",
    "optim.lr_scheduler_type": "optim.lr_scheduler",
}

_PADDING = "hybridrl always removes padding before the forward (TrainEngine); the setting has no effect"
UNSUPPORTED_SFT: tuple[Unsupported, ...] = (
    Unsupported("use_remove_padding", WARN, _PADDING),
    Unsupported("model.use_remove_padding", WARN, _PADDING),  # where verl's newer SFT trainer keeps it
    Unsupported("data.pad_mode", WARN, _PADDING),
    Unsupported("ulysses_sequence_parallel_size", (1,), "Ulysses sequence parallelism is not implemented (size must stay 1)"),
    Unsupported("data.balance_dp_token", WARN, "the loss is always normalised by the step's response tokens on all ranks"),
    Unsupported("data.chat_template", (None,), "set the template in the tokenizer folder (tokenizer_config.json)"),
    Unsupported("data.multiturn.tools_key", WARN, "tool schemas are not passed to the chat template"),
    Unsupported("data.multiturn.enable_thinking_key", WARN, "per-row enable_thinking is not supported; "
                "use +data.apply_chat_template_kwargs.enable_thinking=..."),
    Unsupported("data.micro_batch_size", WARN, "deprecated in verl, whose SFT trainer does not read it either: "
                "micro batches are data.micro_batch_size_per_gpu rows"),
    Unsupported("data.num_workers", WARN, "batches are tokenized in the training process"),
    Unsupported("model.fsdp_config.cpu_offload", (False,), "FSDP2 CPU offload needs an accelerator and is not wired"),
    Unsupported("model.fsdp_config.offload_params", (False,), "FSDP2 CPU offload needs an accelerator and is not wired"),
    Unsupported("model.fsdp_config.wrap_policy*", WARN, "FSDP2 shards each decoder layer"),
    Unsupported("model.fsdp_config.reshard_after_forward", WARN, "FSDP2 reshards after forward"),
    Unsupported("trainer.resume_path", (None,), "use trainer.resume_mode=resume_path trainer.resume_from_path=<dir>"),
    Unsupported("trainer.checkpoint.*", WARN, "an SFT checkpoint always holds model, optimizer and data position"),
    Unsupported("trainer.max_hf_ckpt_to_keep", WARN, "only the final model is exported (hf_model/)"),
)
UNSUPPORTED_VALUES_SFT: dict[tuple[str, Any], str] = {
    ("optim.lr_scheduler", "wsd"): "the warmup-stable-decay schedule is not implemented; use cosine or constant",
    ("model.strategy", "megatron"): "the Megatron-LM backend is not implemented; use fsdp or fsdp2",
}


def find_unsupported_sft(key: str) -> Unsupported | None:
    """SFT-specific entries first, then the generic verl table (lora_rank, use_liger, default_hdfs_dir, ...)."""
    for entry in UNSUPPORTED_SFT:
        if fnmatch.fnmatchcase(key, entry.pattern):
            return entry
    return verl_compat.find_unsupported(key)


# -------------------------------------------------------------------------------------- validation
def _positive(value: Any) -> bool:
    return value is None or value >= 1


_RANGES = (
    ("data.max_length", lambda v: v >= 2, ">= 2 (one prompt and one response token)"),
    ("data.train_batch_size", _positive, ">= 1"),
    ("data.micro_batch_size_per_gpu", _positive, ">= 1"),
    ("data.max_token_len_per_gpu", _positive, ">= 1"),
    ("optim.lr", lambda v: v >= 0, ">= 0"),
    ("optim.warmup_steps_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("optim.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("optim.clip_grad", lambda v: v > 0, "> 0"),
    ("optim.betas", lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    ("trainer.total_epochs", _positive, ">= 1"),
    ("trainer.total_training_steps", _positive, ">= 1 or null"),
    ("trainer.save_freq", lambda v: v == -1 or v >= 1, "-1 (never) or >= 1"),
    ("trainer.test_freq", lambda v: v == -1 or v >= 1, "-1 (last step only) or >= 1"),
    ("trainer.val_generation_length", lambda v: v >= 0, ">= 0"),
    ("trainer.nnodes", lambda v: v == 1, "1 (multi-node SFT is not implemented)"),
    ("trainer.n_gpus_per_node", _positive, ">= 1"),
    ("trainer.n_cpu_workers", _positive, ">= 1"),
)


def validate_sft(cfg: SFTConfig) -> list[str]:
    """Every problem of ``cfg``: allowed values, ranges, batch arithmetic, data keys."""
    errors = _check_choices(cfg, "")
    errors += [f"{path}={get(cfg, path)!r} must be {allowed}" for path, ok, allowed in _RANGES if not ok(get(cfg, path))]
    if errors:
        return errors
    data, trainer = cfg.data, cfg.trainer
    world = trainer.world_size
    if data.train_batch_size % world:
        errors.append(f"data.train_batch_size={data.train_batch_size} does not split over the world size {world} "
                      f"(trainer.nnodes x devices per node): {data.train_batch_size} / {world} is not an integer")
    elif not data.use_dynamic_bsz and (data.train_batch_size // world) % data.micro_batch_size_per_gpu:
        share = data.train_batch_size // world
        errors.append(f"each rank's share data.train_batch_size / world size = {data.train_batch_size} / {world} = {share} "
                      f"is not a multiple of data.micro_batch_size_per_gpu={data.micro_batch_size_per_gpu}")
    if data.use_dynamic_bsz and data.max_token_len_per_gpu < data.max_length:
        errors.append(f"data.max_token_len_per_gpu={data.max_token_len_per_gpu} must hold one full example: "
                      f">= data.max_length={data.max_length}")
    if data.multiturn.enable and not data.multiturn.messages_key:
        errors.append("data.multiturn.enable=true needs data.multiturn.messages_key (the column of chat messages)")
    if not data.multiturn.enable and not (data.prompt_key and data.response_key):
        errors.append("single-turn SFT needs data.prompt_key and data.response_key (or set data.multiturn.enable=true)")
    if trainer.val_generation_length > 0 and world > 1:
        errors.append(f"trainer.val_generation_length={trainer.val_generation_length} (greedy decoding of the validation "
                      f"prompts) needs world size 1, got {world}; set it to 0")
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        errors.append("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    return errors


SFT_SCHEMA = Schema(
    SFTConfig,
    validate_sft,
    find_unsupported=find_unsupported_sft,
    renamed=RENAMED_SFT,
    aliases={},
    unsupported_values=UNSUPPORTED_VALUES_SFT,
    global_micro=(),
)


def load_sft_config(overrides: Iterable[str] = (), preset: str | None = DEFAULT_SFT_PRESET) -> SFTConfig:
    """The validated, frozen SFT config: schema defaults <- preset YAML <- overrides (``load_config``'s rules).

    ``preset``: a name in ``hybridrl/config/presets`` (``sft_trainer``: verl's defaults; ``sft_quickstart``:
    the tiny model on a synthetic task), a YAML path, or None for the schema defaults.
    """
    return load_config(overrides, preset, schema=SFT_SCHEMA)
