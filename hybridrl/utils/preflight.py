"""Memory preflight: estimate a run's peak memory from its config before any worker starts.

Reads the models' ``config.json`` (no weights) and the batch settings, and estimates per rank:

    parameters + gradients + AdamW state   16 bytes/param (fp32 master weights), sharded over the W ranks
    reference policy                       4 bytes/param, sharded
    rollout weights                        one full copy in the rollout dtype
    training activations                   per micro-batch: layer activations (only the layer inputs
                                           with gradient checkpointing), attention probabilities (CPU
                                           only: no flash attention there) and the response logits
                                           (logits, log-softmax and their gradient: 3 x mb x R x V x 4 B)
    log-prob forward                       2 x mb x R x V x 4 B
    KV cache                               (prompts x n / W) x T x layers x 2 x kv_heads x head_dim x dtype
    runtime                                a fixed allowance per process (Python, torch, Ray)

On CPU every rank of a node shares the host's memory, so the node total (ranks per node x per
rank + the driver) is compared with the memory available now (``MemAvailable``, capped by the
cgroup limit). On GPU the per-rank total is compared with the device memory. The estimate aims high
(by design: a refused run costs seconds, an OOM kill hours) and names the largest term with the
config knob that shrinks it. ``trainer.preflight``: ``error`` refuses, ``warn`` prints, ``off`` skips.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

GiB = float(1 << 30)
RUNTIME_PER_RANK = 1.0 * GiB  # torch + transformers + a Ray worker, measured ~0.7 GiB RSS here
RUNTIME_DRIVER = 1.0 * GiB  # the driver, Ray's own processes and the reward workers
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


class PreflightError(RuntimeError):
    """The run cannot fit; the message lists the estimate and the knob to turn."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from an HF ``config.json``."""

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    bias_per_layer: int = 0

    @property
    def num_params(self) -> int:
        """Dense decoder parameters (Llama/Qwen2/Mistral layout; tied embeddings counted once)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate + 2 * h + self.bias_per_layer
        embeddings = self.vocab * h * (1 if self.tied else 2)
        return embeddings + self.layers * per_layer + h


def read_model_shape(model_path: str) -> ModelShape:
    """Parse ``<model_path>/config.json``; a missing file or key raises PreflightError naming it."""
    path = Path(model_path).expanduser() / "config.json"
    if not path.is_file():
        raise PreflightError(f"memory preflight: {path} not found (actor_rollout_ref.model.path / critic.model.path "
                             "must be a Hugging Face model folder)")
    cfg = json.loads(path.read_text())
    cfg = {**cfg.get("text_config", {}), **cfg}

    def pick(*names: str, default=None):
        for name in names:
            if cfg.get(name) is not None:
                return cfg[name]
        if default is None:
            raise PreflightError(f"memory preflight: {path} has none of {list(names)}; set trainer.preflight=off "
                                 "to start without an estimate")
        return default

    hidden, heads = pick("hidden_size", "n_embd", "d_model"), pick("num_attention_heads", "n_head")
    kv_heads, head_dim = pick("num_key_value_heads", default=heads), pick("head_dim", default=hidden // heads)
    intermediate = pick("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    qkv = (heads + 2 * kv_heads) * head_dim
    # Qwen2: q/k/v biases; Llama/Mistral attention_bias: q/k/v/o; mlp_bias: gate/up/down
    bias = qkv if cfg.get("model_type") in ("qwen2", "qwen2_vl") else 0
    bias = qkv + hidden if cfg.get("attention_bias") else bias
    bias += (2 * intermediate + hidden) if cfg.get("mlp_bias") else 0
    return ModelShape(vocab=pick("vocab_size"), hidden=hidden, layers=pick("num_hidden_layers", "n_layer", "num_layers"),
                      intermediate=intermediate, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      tied=bool(cfg.get("tie_word_embeddings", False)), bias_per_layer=bias)


@dataclass
class Estimate:
    """Bytes per rank by term, with the knob that shrinks each; ``ranks_per_node`` share a host."""

    terms: dict[str, float] = field(default_factory=dict)
    knobs: dict[str, str] = field(default_factory=dict)
    ranks_per_node: int = 1
    on_gpu: bool = False

    def add(self, name: str, nbytes: float, knob: str) -> None:
        self.terms[name] = self.terms.get(name, 0.0) + nbytes
        self.knobs[name] = knob

    @property
    def per_rank(self) -> float:
        return sum(self.terms.values()) + RUNTIME_PER_RANK

    @property
    def host_total(self) -> float:
        """Host bytes of one node: all its ranks (on CPU) plus the driver."""
        per_rank = self.per_rank if not self.on_gpu else RUNTIME_PER_RANK + self.terms.get("model load (host)", 0.0)
        return self.ranks_per_node * per_rank + RUNTIME_DRIVER

    def largest(self, k: int = 3) -> list[tuple[str, float]]:
        return sorted(self.terms.items(), key=lambda kv: -kv[1])[:k]


def estimate(config) -> Estimate:
    """The per-rank memory estimate of a resolved hybridrl config (see the module docstring)."""
    from hybridrl.config.validate import critic_in_use, ref_in_use

    trainer, arr = config.trainer, config.actor_rollout_ref
    on_gpu = trainer.device == "cuda"
    world = trainer.world_size
    est = Estimate(ranks_per_node=trainer.n_gpus_per_node if on_gpu else trainer.n_cpu_workers, on_gpu=on_gpu)
    actor = read_model_shape(arr.model.path)
    _add_weights(est, "actor", actor, world, trainable=True)
    if ref_in_use(config):
        _add_weights(est, "reference", actor, world, trainable=False)
    est.add("rollout weights", actor.num_params * _DTYPE_BYTES[arr.rollout.dtype],
            "actor_rollout_ref.rollout.dtype, or a smaller model")
    if on_gpu:
        est.add("model load (host)", actor.num_params * 4.0, "a smaller model")
    _add_training(est, config, actor, on_gpu)
    _add_kv_cache(est, config, actor, world)
    if critic_in_use(config):
        critic = read_model_shape(config.critic.model.path)
        _add_weights(est, "critic", critic, world, trainable=True)
    if config.reward_model.enable:  # counted as a causal LM: its one-label head is smaller than an LM head
        _add_weights(est, "reward model", read_model_shape(config.reward_model.model.path), world, trainable=False)
    return est


def _add_weights(est: Estimate, role: str, shape: ModelShape, world: int, trainable: bool) -> None:
    per_param = 16.0 if trainable else 4.0  # fp32 weights (+ grads + AdamW exp_avg, exp_avg_sq)
    what = "parameters, gradients, optimizer" if trainable else "parameters"
    est.add(f"{role} {what}", shape.num_params * per_param / world,
            "a smaller model, or more nodes to shard over (trainer.nnodes)")


def _micro_rows(use_dynamic: bool, micro_batch: int | None, max_tokens: int, fallback: int, t: int) -> int:
    """Sequences of length ``t`` in the largest micro-batch (the whole mini-batch when unset)."""
    if use_dynamic:
        return max(1, max_tokens // t)
    return micro_batch or fallback


def _add_training(est: Estimate, config, shape: ModelShape, on_gpu: bool) -> None:
    """Activations of the largest actor micro-batch and logits of the log-prob forward."""
    arr, data = config.actor_rollout_ref, config.data
    p, r = data.max_prompt_length, data.max_response_length
    t, actor = p + r, arr.actor
    rows = max(1, actor.ppo_mini_batch_size * arr.rollout.n // config.trainer.world_size)
    mb = _micro_rows(actor.use_dynamic_bsz, actor.ppo_micro_batch_size_per_gpu, actor.ppo_max_token_len_per_gpu, rows, t)
    knob = ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu" if actor.use_dynamic_bsz
            else f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (now {actor.ppo_micro_batch_size_per_gpu})")
    layers_kept = 1 if arr.model.enable_gradient_checkpointing else shape.layers
    per_token_layer = (10 * shape.hidden + 3 * shape.intermediate) * 4.0
    acts = mb * t * (shape.layers * shape.hidden * 4.0 + layers_kept * per_token_layer)
    if not on_gpu:  # the CPU attention kernel keeps the probabilities for backward
        acts += layers_kept * mb * shape.heads * t * t * 4.0
    est.add("actor activations", acts, f"{knob}, or actor_rollout_ref.model.enable_gradient_checkpointing=true")
    est.add("actor logits", 3.0 * mb * r * shape.vocab * 4.0, f"{knob}, or data.max_response_length (now {r})")
    lp = arr.rollout
    lp_mb = _micro_rows(lp.log_prob_use_dynamic_bsz, lp.log_prob_micro_batch_size_per_gpu,
                             lp.log_prob_max_token_len_per_gpu, rows, t)
    est.add("log-prob logits", 2.0 * lp_mb * r * shape.vocab * 4.0,
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu / ref.log_prob_micro_batch_size_per_gpu")


def _add_kv_cache(est: Estimate, config, shape: ModelShape, world: int) -> None:
    """KV cache of the largest generation batch on one rank (training or validation)."""
    data, rollout = config.data, config.actor_rollout_ref.rollout
    train_seqs = data.train_batch_size * rollout.n
    val_seqs = (data.val_batch_size or 0) * rollout.val_kwargs.n
    seqs = math.ceil(max(train_seqs, val_seqs) / world)
    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * _DTYPE_BYTES[rollout.dtype]
    t = data.max_prompt_length + data.max_response_length
    knob = (f"data.train_batch_size (now {data.train_batch_size}), actor_rollout_ref.rollout.n (now {rollout.n}) "
            f"or data.max_response_length (now {data.max_response_length})")
    if val_seqs > train_seqs:
        knob = f"data.val_batch_size (now {data.val_batch_size}) or data.max_response_length"
    est.add("rollout KV cache", seqs * t * per_token, knob)


def available_host_bytes() -> float:
    """Memory this process could still get: MemAvailable, capped by a cgroup v2 limit if set."""
    meminfo = Path("/proc/meminfo")
    avail = math.inf
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024.0
    limit, current = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    if limit.exists() and current.exists() and limit.read_text().strip() != "max":
        avail = min(avail, int(limit.read_text()) - int(current.read_text()))
    return avail


def check_memory(config, available_host: float | None = None, available_device: float | None = None) -> Estimate:
    """Estimate and compare; raises PreflightError (``trainer.preflight=error``) or warns (``warn``)."""
    mode = config.trainer.preflight
    if mode == "off":
        return Estimate()
    est = estimate(config)
    problems = []
    host = available_host_bytes() if available_host is None else available_host
    if est.host_total > host:
        problems.append(f"host memory: needs about {est.host_total / GiB:.1f} GiB per node "
                        f"({est.ranks_per_node} rank(s) x {(est.per_rank if not est.on_gpu else 0) / GiB:.1f} GiB "
                        f"+ driver {RUNTIME_DRIVER / GiB:.1f} GiB), {host / GiB:.1f} GiB available")
    if est.on_gpu:
        device = _device_bytes() if available_device is None else available_device
        if est.per_rank > device:
            problems.append(f"device memory: needs about {est.per_rank / GiB:.1f} GiB per GPU, {device / GiB:.1f} GiB there")
    if problems:
        _report(est, problems, mode)
    return est


def _report(est: Estimate, problems: list[str], mode: str) -> None:
    lines = [f"memory preflight: this run does not fit: {'; '.join(problems)}.", "largest terms per rank:"]
    lines += [f"  {name}: {nbytes / GiB:.2f} GiB -> lower {est.knobs[name]}" for name, nbytes in est.largest()]
    top = est.largest(1)[0][0]
    lines.append(f"turn first: {est.knobs[top]}. (trainer.preflight=warn starts anyway; the estimate aims high)")
    message = "\n".join(lines)
    if mode == "error":
        raise PreflightError(message)
    print(f"hybridrl: warning: {message}", file=sys.stderr, flush=True)


def _device_bytes() -> float:
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else math.inf
