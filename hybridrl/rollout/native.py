"""The native rollout engine: batched KV-cache decoding of an HF causal LM on plain torch.

Per call: prompts are split into chunks of at most `max_num_seqs` rows (N*G); each chunk is
prefilled once per prompt, its cache rows repeated G times, then decoded one token per step for
all live rows. Rows that hit a stop token stop being computed: once enough of them are finished
they are dropped from the batch and the KV cache is compacted (the "equivalent" of continuous
batching when all requests are known up front, as in a rollout step).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import PreTrainedModel

from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.decoder import CompactDecoder, HFDecoder, supports_compact
from hybridrl.rollout.sampling import draw_uniforms, select_tokens

if TYPE_CHECKING:
    from hybridrl.protocol import DataProto

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")
# Finished rows keep riding along until they are at least this fraction of the batch: compaction
# copies the whole cache, so doing it for every single finished row would cost more than it saves.
COMPACT_FRACTION = 1 / 8


class NativeRolloutEngine:
    """`RolloutEngine` on an HF causal LM held in this process (fp32 CPU or any torch device).

    model: the HF model (its parameters are the rollout weights; `update_weights` writes into them).
    max_num_seqs: most sequences (rows) decoded together; bounds KV-cache memory.
    compact: use `CompactDecoder` (Llama/Qwen2); None picks it when the model supports it,
        otherwise the generic HF forward is used.
    share_weights: `update_weights` adopts each given tensor as the parameter's storage (no copy)
        when its dtype and device match, instead of copying it in. For a colocated trainer that
        streams its own parameters (world size 1) the rollout then reads them in place: later
        syncs copy nothing and the rollout's own copy of the model is freed. The caller must not
        change the given tensors while the engine generates (the hybrid engine never does: it
        trains and generates in turn, and syncs after every update).
    pack_weights: decode matmuls through MKL's packed GEMM (`CompactDecoder`); None: where supported.
    fused_kernels: a decode step's other per-layer work as fused C kernels (`CompactDecoder`);
        None: where they apply and build.
    kv_cache_dtype: None keeps the KV cache in the model's dtype; torch.float16 stores an fp32
        model's keys and values rounded to float16, halving what the decode attention reads
        (`CompactDecoder` with the fused kernels; the rollout's log-probs then differ slightly from
        the trainer's, as with any rollout that rounds differently).
    """

    def __init__(self, model: PreTrainedModel, max_num_seqs: int = 256, compact: bool | None = None,
                 share_weights: bool = False, pack_weights: bool | None = None,
                 fused_kernels: bool | None = None, kv_cache_dtype: torch.dtype | None = None) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
        ok, why = supports_compact(model)
        if compact and not ok:
            raise ValueError(f"compact=True but {why}")
        self.model = model.eval()
        self.max_num_seqs = max_num_seqs
        self.share_weights = share_weights
        use_compact = ok if compact is None else compact
        for name, wanted in (("pack_weights", pack_weights), ("fused_kernels", fused_kernels),
                             ("kv_cache_dtype", kv_cache_dtype)):
            if wanted and not use_compact:
                raise ValueError(f"{name}={wanted} needs the compact decoder (Llama/Qwen2 models)"
                                 + ("" if compact is False else f": {why}"))
        self.decoder = (CompactDecoder(model, pack_weights=pack_weights, fused_kernels=fused_kernels,
                                       kv_cache_dtype=kv_cache_dtype)
                        if use_compact else HFDecoder(model))

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """See `RolloutEngine.generate`; non-tensor columns are repeated G times interleaved."""
        return generate_proto(self.generate_tensors, prompts, params)

    @torch.inference_mode()
    def generate_tensors(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        params: SamplingParams,
    ) -> dict[str, torch.Tensor]:
        """Tensor-level `generate`: prompts (N,P) left-padded -> the output columns (B = N*G rows)."""
        check_prompts(input_ids, attention_mask, position_ids)
        full_ids, full_mask = input_ids, attention_mask
        # Prompts come padded to data.max_prompt_length: columns that are padding in every row would be
        # prefilled and attended to (masked) at every decode step for nothing. Outputs keep width P.
        first = int(attention_mask.any(0).int().argmax())
        input_ids, attention_mask, position_ids = input_ids[:, first:], attention_mask[:, first:], position_ids[:, first:]
        n, length = params.n, params.max_new_tokens
        uniforms = None
        if not params.greedy:
            uniforms = draw_uniforms(input_ids.shape[0] * n, length, params.seed).to(input_ids.device)
        per_chunk = max(1, self.max_num_seqs // n)
        responses, log_probs, lengths = [], [], []
        for start in range(0, input_ids.shape[0], per_chunk):
            rows = slice(start, start + per_chunk)
            chunk_uniforms = None if uniforms is None else uniforms[start * n : (start + per_chunk) * n]
            out = self._generate_chunk(input_ids[rows], attention_mask[rows], position_ids[rows], params, chunk_uniforms)
            for acc, value in zip((responses, log_probs, lengths), out):
                acc.append(value)
        return assemble_outputs(full_ids, full_mask, torch.cat(responses), torch.cat(log_probs), torch.cat(lengths), params)

    def _generate_chunk(self, input_ids, attention_mask, position_ids, params, uniforms):
        """Decode one chunk. Returns responses (b,R) int64, log_probs (b,R) float32, lengths (b,)."""
        n, length, device = params.n, params.max_new_tokens, input_ids.device
        num_rows = input_ids.shape[0] * n
        responses = torch.zeros(num_rows, length, dtype=torch.long, device=device)
        log_probs = torch.zeros(num_rows, length, dtype=torch.float32, device=device)
        lengths = torch.full((num_rows,), length, dtype=torch.long, device=device)
        stop_ids = torch.tensor(params.stop_ids, dtype=torch.long, device=device)
        can_stop = stop_ids.numel() > 0  # else (ignore_eos, no stop tokens) every row runs to the limit
        logits = self.decoder.prefill(input_ids, attention_mask, position_ids, n, length).repeat_interleave(n, 0)
        rows = torch.arange(num_rows, device=device)  # output row of each live batch slot
        positions = position_ids[:, -1].repeat_interleave(n) + 1  # position of the next fed token
        done = torch.zeros(num_rows, dtype=torch.bool, device=device)
        for step in range(length):
            step_uniforms = None if uniforms is None else uniforms[rows, step]
            tokens, step_log_probs = select_tokens(logits, params, step_uniforms)
            responses[rows, step] = tokens
            log_probs[rows, step] = step_log_probs
            if step == length - 1:
                break
            if can_stop:
                finished = torch.isin(tokens, stop_ids) & ~done
                lengths[rows[finished]] = step + 1
                done |= finished
                num_done = int(done.sum())
                if num_done == done.numel():
                    break
                if num_done >= max(1, done.numel() * COMPACT_FRACTION):
                    keep = (~done).nonzero().squeeze(1)
                    self.decoder.select(keep)
                    rows, positions, tokens, done = rows[keep], positions[keep], tokens[keep], done[keep]
            logits = self.decoder.decode(tokens, positions)
            positions = positions + 1
        return responses, log_probs, lengths

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy trainer weights (HF state-dict names, full tensors) into the model (or adopt them, with
        `share_weights`), then re-derive the decoder's fused weights. Unknown names and shape
        mismatches raise, naming the key. An empty iterable only re-derives (use it after changing
        the model's parameters in place)."""
        targets = self.model.state_dict(keep_vars=True)
        for name, tensor in named_tensors:
            if name not in targets:
                close = difflib.get_close_matches(name, list(targets), n=3)
                raise KeyError(f"update_weights: unknown parameter {name!r}; closest names: {close}")
            target = targets[name]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}"
                )
            source = tensor.detach()
            if target.data_ptr() == source.data_ptr():
                continue  # already shared: the trainer updated it in place
            if self.share_weights and source.dtype == target.dtype and source.device == target.device:
                target.data = source
            else:
                target.data.copy_(source.to(dtype=target.dtype, device=target.device))
        self.decoder.refresh_weights()

    def free_cache(self) -> None:
        """Release the KV cache; the next `generate` allocates a new one."""
        self.decoder.free()

    def sleep(self) -> None:
        """Between rollouts (hybrid engine): free the cache so training has the memory."""
        self.free_cache()

    def wake(self) -> None:
        """Before rollouts: nothing to do, the cache is allocated lazily by `generate`."""


def generate_proto(generate_tensors, prompts: DataProto, params: SamplingParams) -> DataProto:
    """`RolloutEngine.generate` on top of an engine's `generate_tensors(input_ids, attention_mask,
    position_ids, params)`: checks the prompt columns, repeats non-tensor columns G times interleaved."""
    from hybridrl.protocol import DataProto

    missing = [key for key in PROMPT_KEYS if key not in prompts.batch]
    if missing:
        raise KeyError(f"generate: prompt batch lacks {missing}; it has {sorted(prompts.batch)}")
    tensors = generate_tensors(*(prompts.batch[key] for key in PROMPT_KEYS), params)
    non_tensors = {k: np.repeat(v, params.n, axis=0) for k, v in prompts.non_tensor_batch.items()}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=dict(prompts.meta_info))


def check_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> None:
    """Prompts must be (N,P) with matching shapes and left padding (last column real in every row)."""
    shapes = {"input_ids": input_ids.shape, "attention_mask": attention_mask.shape, "position_ids": position_ids.shape}
    if input_ids.dim() != 2 or len(set(shapes.values())) != 1:
        raise ValueError(f"generate: prompt tensors must all be (N,P); got {shapes}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"generate: empty prompt batch {tuple(input_ids.shape)}")
    bad = (attention_mask[:, -1] == 0).nonzero().flatten()
    if bad.numel():
        raise ValueError(
            f"generate: prompts must be left-padded (attention_mask[:, -1] == 1); rows {bad[:10].tolist()} end in padding"
        )


def assemble_outputs(input_ids, attention_mask, responses, log_probs, lengths, params) -> dict[str, torch.Tensor]:
    """Build the output columns from raw decoded tokens (garbage after each row's length)."""
    n, length = params.n, params.max_new_tokens
    response_mask = torch.arange(length, device=responses.device)[None, :] < lengths[:, None]
    responses = responses.masked_fill(~response_mask, params.pad_token_id)
    log_probs = log_probs.masked_fill(~response_mask, 0.0)
    prompts = input_ids.repeat_interleave(n, dim=0)
    full_mask = torch.cat([attention_mask.repeat_interleave(n, dim=0), response_mask.to(attention_mask.dtype)], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": full_mask,
        "position_ids": (torch.cumsum(full_mask, dim=-1) - 1).clamp(min=0).to(torch.long),
        "response_mask": response_mask.to(attention_mask.dtype),
        "rollout_log_probs": log_probs,
    }
