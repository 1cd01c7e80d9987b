"""TrainEngine: the one training interface, FSDP2 over any process group (gloo on CPU, NCCL on GPU).

Over a process group of two or more ranks the model is sharded with ``fully_shard``, or, with
``fsdp_size=1``, kept whole on every rank with its gradients summed once per step
(``hybridrl.engine.replicate``: no gathers, for models that fit on each rank); at world size 1 (no
group, or a group of one rank) the same class runs the plain module, since sharding over one rank
only adds copies (each forward and backward gathers every parameter into a second buffer: 8-10% of
a SmolLM2 step on CPU). Everything else (padding removal, micro-batching, loss accumulation,
clipping, checkpoints, weight streaming) is one code path, and checkpoints move between world
sizes and between sharded and replicated engines either way.

Batch contract (``DataProto`` keys, shape letters as in ``hybridrl.protocol``): ``input_ids``,
``attention_mask`` and optionally ``position_ids`` ``(B, T)``, ``responses (B, R)``, with
``T = P + R``, prompts LEFT-padded and responses RIGHT-padded. Log-prob of response token ``j`` comes
from the logits at position ``P - 1 + j`` divided by the temperature (log_softmax, gathered at
``responses[:, j]``); a critic's value for token ``j`` is its output at the same position (the state
before the token is generated). Outputs are ``(B, R)`` and 0 at response padding.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from hybridrl.algos.reward_shaping import scores_at_last_token
from hybridrl.engine import checkpoint as ckpt
from hybridrl.engine import cpu_attention, fused_head
from hybridrl.engine.compile import compile_blocks
from hybridrl.engine.cpu_layers import use_cpu_layers
from hybridrl.engine.distributed import all_reduce_max, default_device
from hybridrl.engine.fsdp import resolve_dtype, shard_model
from hybridrl.engine.lr_schedule import build_lr_scheduler
from hybridrl.engine.packing import PackedRows, gather_response, pack_rows, real_lengths
from hybridrl.engine.replicate import broadcast_parameters, sum_gradients
from hybridrl.engine.seqlen_balancing import partition_micro_batches
from hybridrl.engine.shared_prefix import (
    prompt_groups,
    prompt_index,
    shareable,
    shared_positions,
    shared_prompt_logits,
)
from hybridrl.protocol import DataProto
from hybridrl.utils.cpu_matmul import use_onednn_linears

__all__ = ["LossFn", "TrainEngine"]

LossFn = Callable[[dict[str, torch.Tensor], DataProto], tuple[torch.Tensor, dict[str, Any]]]
MODEL_TYPES = ("causal_lm", "value", "reward")
# What one more micro-batch costs, in token positions, when a micro-batch of rows of mixed lengths is
# cut into shorter ones of similar lengths (``seqlen_balancing.padding_split``): a model call and
# products of fewer rows. The tiny benchmark model's compiled update (one thread) took 0.46 s in one
# micro-batch of 128 rows x 78 tokens and 0.52 s in four, about 0.02 s a micro-batch, some 430 of its
# positions; SmolLM2's positions cost about 100x more each, its micro-batch calls not much more.
# HYBRIDRL_PADDING_SPLIT=0 keeps the fewest micro-batches the caps allow.
MICRO_BATCH_OVERHEAD_POSITIONS = 256


def padding_split_enabled() -> bool:
    """Whether micro-batches of mixed lengths are cut for padding (``HYBRIDRL_PADDING_SPLIT``, default on)."""
    value = os.environ.get("HYBRIDRL_PADDING_SPLIT", "1").strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"HYBRIDRL_PADDING_SPLIT={value!r}: use 1 (cut micro-batches of mixed lengths) or 0")


class TrainEngine:
    """Owns one model, its AdamW optimizer and LR schedule on every rank of a process group.

    Args:
        model: a causal LM (``model(input_ids, attention_mask, position_ids).logits`` is
            ``(b, t, V)``) or, with ``model_type="value"``, a critic whose output is ``(b, t)``,
            ``(b, t, 1)`` or has such a ``.logits`` / ``.values``; ``model_type="reward"`` takes
            such a model too (a reward model), and ``forward`` gives its output at each row's last
            real token as ``rm_scores``.
        lr, betas, weight_decay, eps: AdamW.
        grad_clip: max global grad norm; ``None`` or ``<= 0`` measures the norm without clipping.
        lr_scheduler, warmup_steps, total_steps, min_lr_ratio, num_cycles: see ``lr_schedule``.
        param_dtype, reduce_dtype: FSDP mixed precision (``"float32"``, ``"bfloat16"``,
            ``"float16"``); master weights and optimizer state stay float32. At world size 1 (no
            sharding) a lower ``param_dtype`` runs the forward under ``torch.autocast``; replicas
            sum their gradients in ``reduce_dtype``.
        process_group: defaults to WORLD when initialised, else no group (plain world size 1).
        gradient_checkpointing: recompute block activations in backward (HF models).
        torch_compile: compile each transformer block's forward (``hybridrl.engine.compile``); the
            first step pays the compilation.
        device: defaults to ``cuda:<LOCAL_RANK>`` with CUDA, else CPU.
        share_prompts: compute a prompt that several rows of a micro-batch share (the ``n``
            samples of GRPO) once for all of them, forward and backward
            (``hybridrl.engine.shared_prefix``); same numbers to float rounding, fewer FLOPs.
        fsdp_size: ranks per shard group, as verl's ``fsdp_config.fsdp_size``: -1 (or at least the
            world size) shards over all ranks; 1 keeps the whole model on every rank and sums the
            gradients once per step (``hybridrl.engine.replicate``; a lower ``param_dtype`` then runs
            under autocast as at world size 1). A size between that divides the world size shards
            within groups of that many ranks, replicated across the groups (HSDP).
        reshard_after_forward, forward_prefetch: FSDP2's, when sharded (``fsdp.shard_model``).
        fused_log_probs: verl's ``use_fused_kernels``: the response log-probs and entropy come
            straight from the last hidden states, a chunk of logits at a time, and no logits-sized
            tensor is kept for the backward (``hybridrl.engine.fused_head``); models it does not
            support take the usual path with a warning.
        entropy_chunking, entropy_checkpointing: verl's ``entropy_from_logits_with_chunking`` and
            ``entropy_checkpointing``, for the entropy with a graph (``entropy_coeff != 0``) on the
            usual path: computed ``ENTROPY_CHUNK_ROWS`` positions at a time, and recomputed in the
            backward instead of keeping its softmax (``_entropy``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.01,
        eps: float = 1e-8,
        grad_clip: float | None = 1.0,
        lr_scheduler: str = "constant",
        warmup_steps: int = 0,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.0,
        num_cycles: float = 0.5,
        param_dtype: str = "float32",
        reduce_dtype: str = "float32",
        process_group: dist.ProcessGroup | None = None,
        gradient_checkpointing: bool = False,
        torch_compile: bool = False,
        model_type: str = "causal_lm",
        device: torch.device | str | None = None,
        share_prompts: bool = True,
        fsdp_size: int = -1,
        reshard_after_forward: bool = True,
        forward_prefetch: bool = False,
        fused_log_probs: bool = False,
        entropy_chunking: bool = False,
        entropy_checkpointing: bool = False,
    ):
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
        self.model_type = model_type
        self.device = torch.device(device) if device is not None else default_device()
        self.group = process_group if process_group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        # fsdp_size as verl reads it: ranks per shard group, -1 (or the world size and above) all of
        # them; 1 makes whole-model replicas that sum their gradients (hybridrl.engine.replicate);
        # sizes in between shard within groups replicated across them (HSDP, fsdp.shard_model)
        if fsdp_size == 0 or (1 < fsdp_size < self.world_size and self.world_size % fsdp_size):
            raise ValueError(f"fsdp_size={fsdp_size} with {self.world_size} ranks: use -1 (shard over all ranks), "
                             "1 (a whole replica on each) or a size that divides the ranks (HSDP)")
        self.param_dtype = resolve_dtype(param_dtype, "param_dtype")
        reduce = resolve_dtype(reduce_dtype, "reduce_dtype")
        model.to(self.device)
        if self.device.type == "cpu" and self.param_dtype == torch.float32:
            # fp32 products through oneDNN where it beats MKL (AMD CPUs: about 2x; hybridrl.utils.cpu_matmul)
            use_onednn_linears(model)
            # attention through hybridrl's AVX-512 kernels instead of torch's (hybridrl.engine.cpu_attention)
            cpu_attention.use_for(model)
            # the gated MLPs' silu(gate) * up and the RMSNorms through the same kernels (hybridrl.engine.cpu_layers)
            use_cpu_layers(model)
        if gradient_checkpointing:
            _enable_gradient_checkpointing(model)
        if torch_compile:
            compile_blocks(model, self.device)  # before sharding: FSDP2's hooks stay outside the graph
        self.replicated = self.world_size > 1 and fsdp_size == 1
        self.sharded = self.world_size > 1 and not self.replicated
        self.reduce_dtype = reduce
        if self.sharded:
            model = shard_model(model, self.group, self.device.type, self.param_dtype, reduce,
                                reshard_after_forward=reshard_after_forward, forward_prefetch=forward_prefetch,
                                shard_size=fsdp_size)
        elif self.replicated:
            broadcast_parameters(model, self.group)
        self.model = model
        self.grad_clip = grad_clip if grad_clip is not None and grad_clip > 0 else float("inf")
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                           fused=_fused_adamw(self.device))
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, lr_scheduler, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio,
            num_cycles=num_cycles,
        )
        self.global_step = 0
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        # decided once: the model's type, attention and checkpointing do not change after this point
        self._shares_prompts = (share_prompts and model_type == "causal_lm" and self._keeps_logits
                                and shareable(model))
        self._fused = fused_log_probs and model_type == "causal_lm" and _fusable(model)
        self._entropy = {"chunking": entropy_chunking, "checkpointing": entropy_checkpointing}

    # ------------------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(
        self,
        data: DataProto,
        *,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
    ) -> DataProto:
        """Per-token outputs for the response part, in the original row order.

        Returns a CPU DataProto with ``log_probs (B, R)`` (+ ``entropy (B, R)`` if asked) for a causal
        LM, ``values (B, R)`` for a critic, ``rm_scores (B, R)`` for a reward model (its score at each
        row's last response token); ``meta_info`` has ``computed_tokens`` / ``real_tokens`` /
        ``needed_tokens`` (as ``train_step``'s ratios count them).
        Micro-batches as in ``train_step``. Collective under FSDP (all ranks call it)."""
        self.model.eval()
        groups = self._micro_batches(data, micro_batch_size, max_token_len)
        parts, counts = [], np.zeros(3, dtype=np.int64)
        for index in groups:
            outputs, micro_counts = self._forward_micro(data[index], temperature, calculate_entropy)
            parts.append(outputs)
            counts += micro_counts
        order = torch.from_numpy(np.concatenate(groups))
        result = {}
        for key in parts[0]:
            merged = torch.cat([p[key] for p in parts]).cpu()
            result[key] = torch.empty_like(merged).index_copy_(0, order, merged)
        computed, real, needed = (int(c) for c in counts)
        return DataProto.from_dict(tensors=result, meta_info={"computed_tokens": computed, "real_tokens": real,
                                                              "needed_tokens": needed})

    # --------------------------------------------------------------------------- train step
    def train_step(
        self,
        data: DataProto,
        loss_fn: LossFn,
        *,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over ``data`` (one mini-batch of this rank).

        ``loss_fn(outputs, micro)`` gets the micro-batch's outputs (``log_probs``, ``entropy``
        or ``values``, each ``(b, R)``, with gradients) and the micro-batch rows as a DataProto,
        and returns ``(loss, metrics)``. **The loss must already be normalised globally**: the
        engine backpropagates the plain sum over micro-batches and ranks (FSDP reduces gradients
        as a sum), so e.g. token-mean is ``sum(l * mask) / total_tokens_of_the_mini_batch_on_all_ranks``.
        Micro-batches: ``micro_batch_size`` rows, or ``max_token_len`` computed tokens
        (dynamic), or the whole batch if neither is given.

        Returns ``loss`` (the global loss: sum over micro-batches and ranks), ``grad_norm``
        (before clipping; the step is skipped if it is not finite), ``lr`` (used by this step),
        ``num_micro_batches``, ``padding_ratio`` (positions computed / positions needed without
        padding, on this rank), ``compute_ratio`` (positions computed / real tokens: below 1 when
        prompts are shared), and the loss_fn metrics averaged over this rank's micro-batches.
        """
        self.model.train()
        groups = self._micro_batches(data, micro_batch_size, max_token_len)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        user_metrics: dict[str, list[float]] = defaultdict(list)
        counts = np.zeros(3, dtype=np.int64)
        for index in groups:
            micro = data[index]
            outputs, micro_counts = self._forward_micro(micro, temperature, calculate_entropy)
            loss, metrics = loss_fn(outputs, micro)
            loss.backward()
            loss_sum += loss.detach().double()
            counts += micro_counts
            for key, value in metrics.items():
                user_metrics[key].append(float(value))
        if self.replicated:
            sum_gradients([p for p in self.model.parameters() if p.requires_grad], self.group, self.reduce_dtype)
        grad_norm = self._clip_and_step()
        lr = self.lr_scheduler.get_last_lr()[0]
        with warnings.catch_warnings():
            # a skipped (non-finite) step still advances the schedule, as in verl; torch warns then
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
            self.lr_scheduler.step()
        self.global_step += 1
        if self.world_size > 1:
            dist.all_reduce(loss_sum, group=self.group)
        out = {key: float(np.mean(values)) for key, values in user_metrics.items()}
        out.update(loss=float(loss_sum), grad_norm=grad_norm, lr=lr, num_micro_batches=len(groups))
        computed, real, needed = (int(c) for c in counts)
        out["padding_ratio"] = computed / max(1, needed)
        out["compute_ratio"] = computed / max(1, real)
        return out

    def _clip_and_step(self) -> float:
        """Clip the global grad norm (all ranks' shards) and step; skip the step if it is not finite.

        The numbers of ``torch.nn.utils.clip_grad_norm_``, which multiplies every gradient by
        min(1, max_norm / (norm + 1e-6)): at 1 that product is the identity and is skipped here (a
        pass over all gradients, about 20 ms of a SmolLM2 step)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        total = total.full_tensor() if hasattr(total, "full_tensor") else total
        norm = float(total)
        if np.isfinite(norm):
            if float(self.grad_clip / (total + 1e-6)) < 1.0:  # clip_grad_norm_'s coefficient, same rounding
                torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, total)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # ----------------------------------------------------------------------- micro-batches
    def _micro_batches(self, data: DataProto, micro_batch_size: int | None, max_token_len: int | None) -> list:
        """Index arrays of the micro-batches, the same count on every rank when sharded."""
        _check_batch(data)
        if micro_batch_size is not None and max_token_len is not None:
            raise ValueError("give micro_batch_size or max_token_len (dynamic batching), not both")
        if micro_batch_size is None and max_token_len is None:
            micro_batch_size = len(data)
        p, r = real_lengths(data.batch["attention_mask"], data.batch["responses"].shape[1])
        sync = None
        if self.sharded:  # every rank gathers each block once per micro-batch: one count for all (replicas need none)
            def sync(count: int) -> int:
                return int(all_reduce_max(count, self.group, self.device))
        split = padding_split_enabled()
        return partition_micro_batches(
            (p + r).tolist(), max_token_len=max_token_len, micro_batch_size=micro_batch_size, sync_count=sync,
            split_overhead=MICRO_BATCH_OVERHEAD_POSITIONS if split else None,
            cost=self._positions_cost(data, p, r) if split else None,
        )

    def _positions_cost(self, data: DataProto, p: torch.Tensor, r: torch.Tensor) -> Callable[[np.ndarray], float]:
        """The token positions ``_forward_micro`` computes for a micro-batch of the given rows: the
        longest row's, for every row, or where prompts are shared and that saves enough
        (``shared_positions``), each distinct prompt once. The rows' prompt numbers are found on the
        first call that needs them (none where no cut is weighed)."""
        shares = self._shares_prompts and int(p.min()) >= 1
        total, p, r = (p + r).cpu().numpy(), p.cpu().numpy(), r.cpu().numpy()
        prompts = None

        def cost(rows: np.ndarray) -> float:
            nonlocal prompts
            full = len(rows) * int(total[rows].max())
            longest = int(r[rows].max())
            if not shares or longest < 2:
                return full
            if prompts is None:
                ids, mask = data.batch["input_ids"], data.batch["attention_mask"]
                prompt_width = ids.shape[1] - data.batch["responses"].shape[1]
                prompts = prompt_index(ids, mask, _position_ids(data.batch), prompt_width, int(p.max()))[1].cpu().numpy()
            shared = shared_positions(len(np.unique(prompts[rows])), int(p[rows].max()), len(rows), longest, full)
            return full if shared is None else shared

        return cost

    def _forward_micro(
        self, micro: DataProto, temperature: float, calculate_entropy: bool
    ) -> tuple[dict[str, torch.Tensor], tuple[int, int, int]]:
        """Outputs ``(b, R)`` for one micro-batch after removing its padding, and its token counts:
        positions computed, real tokens, and the positions the method computes without padding
        (the real tokens, or with shared prompts each distinct prompt once)."""
        batch = {k: v.to(self.device) for k, v in micro.batch.items()}
        response_len = batch["responses"].shape[1]
        position_ids = _position_ids(batch)
        if self._shares_prompts:
            shared = self._shared_prompt_stats(batch, position_ids, temperature, calculate_entropy)
            if shared is not None:
                return shared
        packed = pack_rows(batch["input_ids"], batch["attention_mask"], position_ids, response_len)
        # dense: causal attention alone is exact at real positions, and the unmasked kernel is faster
        kwargs = {"input_ids": packed.input_ids, "attention_mask": None if packed.dense else packed.attention_mask}
        kwargs["position_ids"] = packed.position_ids
        if self.model_type == "causal_lm":
            first_col = max(0, int(packed.prompt_lens.min()) - 1)
            if self._keeps_logits:
                kwargs["logits_to_keep"] = packed.input_ids.shape[1] - first_col
            else:
                first_col = 0
            outputs = self._causal_outputs(kwargs, packed, first_col, batch["responses"], temperature,
                                           calculate_entropy)
        else:
            with self._autocast():
                output = self.model(**kwargs)
            values = _values_of(output)
            if self.model_type == "reward":
                outputs = {"rm_scores": _last_token_scores(values, packed)}
            else:
                values, valid = gather_response(values, packed)
                outputs = {"values": torch.where(valid, values.float(), 0.0)}
        real = packed.real_tokens
        return {k: _pad_right(v, response_len) for k, v in outputs.items()}, (packed.computed_tokens, real, real)

    def _causal_outputs(self, kwargs: dict, packed: PackedRows, first_col: int, responses: torch.Tensor,
                        temperature: float, calculate_entropy: bool) -> dict[str, torch.Tensor]:
        """The causal LM's call on the packed rows and its response log-probs (and entropy), aligned
        to the responses: from its logits, or with fused log-probs from its LM head (``fused_head``)."""
        if not self._fused:
            with self._autocast():
                output = self.model(**kwargs, use_cache=False)
            logits = output.logits if hasattr(output, "logits") else output
            return _token_stats(logits, packed, first_col, responses, temperature, calculate_entropy, **self._entropy)
        targets = _column_targets(responses, packed, first_col, packed.input_ids.shape[1] - first_col)
        with self._autocast(), fused_head.fused_call(self.model, targets, temperature, calculate_entropy):
            output = self.model(**kwargs, use_cache=False)
        return _aligned(_fused_columns(output, calculate_entropy), packed, first_col)

    def _shared_prompt_stats(self, batch: dict, position_ids: torch.Tensor, temperature: float,
                             calculate_entropy: bool) -> tuple[dict[str, torch.Tensor], tuple[int, int, int]] | None:
        """``_forward_micro`` with each distinct prompt computed once (``hybridrl.engine.shared_prefix``),
        or None where it would save too little."""
        ids, mask, responses = batch["input_ids"], batch["attention_mask"], batch["responses"]
        response_len = responses.shape[1]
        p, r = real_lengths(mask, response_len)
        groups = None
        if int(p.min()) >= 1 and int(r.max()) >= 2:  # pack_rows reports a row without prompt
            groups = prompt_groups(ids, mask, position_ids, ids.shape[1] - response_len, p, r)
        if self.sharded and all_reduce_max(int(groups is None), self.group, self.device):
            return None  # every rank makes the same model calls (FSDP gathers in each): all share or none
        if groups is None:
            return None
        # position j of the head's output predicts response token j: the alignment of a row whose prompt is one token
        aligned = PackedRows(input_ids=responses, attention_mask=mask, position_ids=position_ids,
                             prompt_lens=torch.ones_like(p), response_lens=r)
        head = None
        if self._fused:
            targets = _column_targets(responses, aligned, 0, int(r.max()))
            head = fused_head.head_forward(self.model.get_output_embeddings(), targets, temperature, calculate_entropy)
        with self._autocast():
            logits, computed = shared_prompt_logits(self.model, ids, mask, position_ids, response_len, p, r, groups,
                                                    head_forward=head)
        if self._fused:
            outputs = _aligned(_fused_columns(logits, calculate_entropy), aligned, 0)
        else:
            outputs = _token_stats(logits, aligned, 0, responses, temperature, calculate_entropy, **self._entropy)
        first = groups[0]
        needed = int(p[first].sum()) + int((r - 1).clamp(min=0).sum())
        return {k: _pad_right(v, response_len) for k, v in outputs.items()}, (computed, int((p + r).sum()), needed)

    def _autocast(self):
        # FSDP casts through its MixedPrecisionPolicy; the plain module needs autocast instead.
        if not self.sharded and self.param_dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=self.param_dtype)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ checkpoint / weights
    def save_checkpoint(self, path) -> None:
        """Sharded checkpoint of model, optimizer, LR schedule and RNG (collective)."""
        ckpt.save_checkpoint(path, self.model, self.optimizer, self.lr_scheduler, self.group, self.global_step)

    def load_checkpoint(self, path) -> None:
        """Restore ``save_checkpoint``'s state so the next step equals the uninterrupted run's."""
        self.global_step = ckpt.load_checkpoint(path, self.model, self.optimizer, self.lr_scheduler, self.group)

    def export_hf(self, path, tokenizer=None, dtype: torch.dtype | None = None) -> None:
        """Rank 0 writes a Hugging Face folder loadable by ``from_pretrained`` (collective)."""
        ckpt.export_hf(path, self.model, tokenizer=tokenizer, dtype=dtype, group=self.group)

    def iter_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` one at a time, HF names (tied weights once); collective."""
        return ckpt.iter_full_tensors(self.model, dtype)


def _position_ids(batch) -> torch.Tensor:
    """The batch's ``position_ids``, or the count of real tokens before each column where it has none."""
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = (batch["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
    return position_ids


def _fused_adamw(device: torch.device) -> bool | None:
    """torch's fused AdamW (one kernel per tensor for every moment and the update) where it has one.

    On CPU torch otherwise takes its per-tensor loop of about ten ops per parameter, each through
    DTensor's dispatch under FSDP2: for SmolLM2 (272 tensors, 134M values) a step took 1.33 s with
    the loop and 0.22 s fused, with the same parameters after three steps (difference 0.0).
    ``None`` elsewhere leaves torch's own default.
    """
    return True if device.type in ("cpu", "cuda") else None


def _enable_gradient_checkpointing(model: nn.Module) -> None:
    """transformers >= 5.2x names it ``activation_checkpointing_enable``; older ones and
    hybridrl's critic wrapper ``gradient_checkpointing_enable``."""
    for method, kwarg in (
        ("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
        ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs"),
    ):
        enable = getattr(model, method, None)
        if enable is None:
            continue
        if kwarg in inspect.signature(enable).parameters:
            # non-reentrant checkpointing works with FSDP2's hooks and with inputs that need no grad
            enable(**{kwarg: {"use_reentrant": False}})
        else:
            enable()
        return
    raise ValueError(f"gradient_checkpointing=True but {type(model).__name__} has no checkpointing method")


def _check_batch(data: DataProto) -> None:
    missing = [k for k in ("input_ids", "attention_mask", "responses") if k not in data.batch]
    if missing:
        raise KeyError(f"TrainEngine needs batch keys {missing}; present: {sorted(data.batch)}")
    t, r = data.batch["input_ids"].shape[1], data.batch["responses"].shape[1]
    if data.batch["attention_mask"].shape != data.batch["input_ids"].shape or r >= t:
        raise ValueError(
            f"expected input_ids/attention_mask (B, T) and responses (B, R) with R < T; got "
            f"{tuple(data.batch['input_ids'].shape)}, {tuple(data.batch['attention_mask'].shape)}, "
            f"{tuple(data.batch['responses'].shape)}"
        )


def _token_stats(
    logits: torch.Tensor,
    packed: PackedRows,
    first_col: int,
    responses: torch.Tensor,
    temperature: float,
    calculate_entropy: bool,
    chunking: bool = False,
    checkpointing: bool = False,
) -> dict[str, torch.Tensor]:
    """log-probs (and entropy) ``(b, R_mb)`` of the response tokens from ``logits (b, W', V)``.

    Computed per packed column, for the response token that column predicts (placed there from
    ``responses``), then the small ``(b, W')`` results are aligned to the responses: no
    ``(b, R, V)`` copy of the logits is made, and the backward pass writes one ``(b, W', V)``
    gradient (see ``_NextTokenLogProb``). ``chunking`` / ``checkpointing``: how an entropy with a
    graph is computed (``_entropy``).
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = _column_targets(responses, packed, first_col, logits.shape[1])
    if calculate_entropy and not torch.is_grad_enabled() and cpu_attention.token_usable(logits):
        # no graph (the old log-probs): both from one pass of hybridrl's kernel, the same log-probs
        # as below; torch's entropy was four passes over the logits and three logits-sized tensors
        log_probs, entropy = cpu_attention.token_logprob_entropy(logits, targets)
        per_col = {"log_probs": log_probs, "entropy": entropy}
    else:
        per_col = {"log_probs": _NextTokenLogProb.apply(logits, targets, torch.is_grad_enabled())}
        if calculate_entropy:
            per_col["entropy"] = _entropy(logits, chunking, checkpointing)
    return _aligned(per_col, packed, first_col)


def _aligned(per_col: dict[str, torch.Tensor], packed: PackedRows, first_col: int) -> dict[str, torch.Tensor]:
    """Per-column ``(b, W')`` results aligned to the responses ``(b, R_mb)``, 0 where a row has no token."""
    out = {}
    for key, value in per_col.items():
        aligned, valid = gather_response(value, packed, first_col)
        out[key] = torch.where(valid, aligned, 0.0)
    return out


def _fused_columns(output: Any, calculate_entropy: bool) -> dict[str, torch.Tensor]:
    """The per-column log-probs (and entropy) from a model call whose LM head ran ``fused_head.head_forward``."""
    stats = output.logits if hasattr(output, "logits") else output
    per_col = {"log_probs": stats[..., 0]}
    if calculate_entropy:
        per_col["entropy"] = stats[..., 1]
    return per_col


# positions per entropy chunk under entropy_chunking (verl's entropy_from_logits_with_chunking: 2048)
ENTROPY_CHUNK_ROWS = 2048


def _entropy_of(logits: torch.Tensor) -> torch.Tensor:
    # torch's softmax kernels (see _NextTokenLogProb): -sum(p log p)
    return -(torch.softmax(logits, dim=-1) * torch.log_softmax(logits, dim=-1)).sum(-1)


def _entropy(logits: torch.Tensor, chunking: bool, checkpointing: bool) -> torch.Tensor:
    """Each position's entropy from ``logits (..., V)``, with autograd where it records: whole, or
    ``ENTROPY_CHUNK_ROWS`` positions at a time (``chunking``: the softmax and log-softmax temporaries
    are a chunk's, not the logits' size), and with ``checkpointing`` each part under
    ``torch.utils.checkpoint``, which keeps only the logits for the backward and computes the
    softmax again there (with a graph, a plain entropy keeps two logits-sized tensors)."""
    if not (chunking or checkpointing):
        return _entropy_of(logits)
    rows = logits.reshape(-1, logits.shape[-1])
    step = ENTROPY_CHUNK_ROWS if chunking else max(1, rows.shape[0])
    parts = []
    for start in range(0, rows.shape[0], step):
        part = rows[start:start + step]
        if checkpointing and torch.is_grad_enabled():
            parts.append(torch.utils.checkpoint.checkpoint(_entropy_of, part, use_reentrant=False))
        else:
            parts.append(_entropy_of(part))
    if not parts:
        return logits.new_zeros(logits.shape[:-1])
    return torch.cat(parts).view(logits.shape[:-1])


def _fusable(model: nn.Module) -> bool:
    """Whether ``fused_head`` takes ``model``; warns where it was asked for and does not."""
    if fused_head.supported(model):
        return True
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    warnings.warn(f"use_fused_kernels: hybridrl's fused log-probs support model types {fused_head.SUPPORTED_MODEL_TYPES} "
                  f"with a linear LM head, not {model_type!r}; its log-probs are computed from the full logits",
                  stacklevel=3)
    return False


def _column_targets(responses: torch.Tensor, packed: PackedRows, first_col: int, width: int) -> torch.Tensor:
    """``(b, width)`` token ids: at the column predicting response token ``j`` (``p_i - 1 + j -
    first_col``, as in ``gather_response``) that token; 0 at columns that predict no response token."""
    r_mb = max(1, int(packed.response_lens.max()))
    j = torch.arange(r_mb, device=responses.device)
    col = (packed.prompt_lens[:, None] - 1 + j[None, :] - first_col).clamp(0, width - 1)
    # columns of j >= r_i lie after every real one of the row, so they never overwrite a valid target
    return torch.zeros(responses.shape[0], width, dtype=torch.long, device=responses.device).scatter_(
        1, col, responses[:, :r_mb].long())


class _NextTokenLogProb(torch.autograd.Function):
    """``log_softmax(logits)[target]`` per position: ``logits (..., V)``, ``targets (...)`` -> ``(...)``.

    Autograd would build the gradient from a gather backward (zeros + scatter) plus a log_softmax
    backward; here it is one tensor, ``-g * softmax`` made in place, plus ``g`` at the targets. Both
    directions use torch's fused softmax kernels rather than ``logsumexp`` and ``exp_``: on CPU the
    logits are the largest tensors of a small model's step, and for SmolLM2's (16, 32, 49152)
    ``logsumexp`` took 27 ms and ``exp(logits - log_z)`` 25 ms where ``log_softmax`` takes 13 and
    ``softmax`` 11 (one thread; their exponential is vectorised, ``exp_``'s precise one is not).
    fp32 CPU logits take hybridrl's kernels instead (``cpu_attention.token_logprob``): no
    log_softmax tensor in the forward and the gradient in one pass (forward + backward of the tiny
    model's (128, 64, 1024) logits 15 -> 5 ms, SmolLM2's (16, 32, 49152) 31 -> 13 ms, one thread).
    Where a backward will follow, the forward keeps its exponentials in place of the logits, and the
    backward scales them instead of computing them again (the tiny model's 30 -> 20 ms on a Zen 1).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, graph: bool = True) -> torch.Tensor:
        """``graph``: whether the caller records a graph (``torch.is_grad_enabled()`` there; in here it
        is always off), without which nothing is kept for a backward."""
        if cpu_attention.token_usable(logits):  # fp32 CPU: hybridrl's kernels, no log_softmax tensor
            keep = graph and ctx.needs_input_grad[0]
            out, stats, exps = cpu_attention.token_logprob(logits, targets, keep_exps=keep)
            ctx.save_for_backward(exps, targets, stats)
            return out
        ctx.save_for_backward(logits, targets, None)
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved, targets, stats = ctx.saved_tensors  # the kernel's exponentials (with stats), else the logits
        if stats is not None:
            return cpu_attention.token_logprob_backward(saved, targets, stats, grad), None, None
        grad = grad.unsqueeze(-1)
        d_logits = torch.softmax(saved, dim=-1).mul_(-grad)
        return d_logits.scatter_add_(-1, targets.unsqueeze(-1), grad), None, None


def _values_of(output: Any) -> torch.Tensor:
    """The critic's (or reward model's) per-position values ``(b, t)`` from a tensor or a model output
    object (a transformers output is a dict, whose ``.values`` is its method: tensors only count)."""
    for attr in ("values", "logits"):
        if not isinstance(output, torch.Tensor) and isinstance(getattr(output, attr, None), torch.Tensor):
            output = getattr(output, attr)
            break
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"critic output {type(output).__name__} is neither a tensor nor has .values/.logits")
    if output.dim() == 3 and output.shape[-1] == 1:
        output = output.squeeze(-1)
    if output.dim() != 2:
        raise ValueError(f"critic output must be (b, t) or (b, t, 1), got {tuple(output.shape)}")
    return output


def _last_token_scores(values: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """A reward model's scores as token-level rewards ``(b, R_mb)``: each row's output at its last
    real token (packed column ``p_i + r_i - 1``), placed at its last response token (column
    ``r_i - 1``, column 0 for an empty response); 0 elsewhere."""
    rows = torch.arange(values.shape[0], device=values.device)
    last = (packed.prompt_lens + packed.response_lens - 1).clamp(min=0)
    return scores_at_last_token(values[rows, last], packed.response_lens, max(1, int(packed.response_lens.max())))


def _pad_right(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1])) if x.shape[1] < width else x
