"""The rollout role: generation with the native KV-cache engine (vLLM adapter where installed),
and the hybrid-engine weight sync from the colocated actor."""

from __future__ import annotations

import numpy as np
import torch

from hybridrl.models import load_causal_lm, load_tokenizer
from hybridrl.protocol import DataProto
from hybridrl.rollout.agent_loop import build_agent_loop
from hybridrl.rollout.base import SamplingParams, eos_ids
from hybridrl.rollout.native import NativeRolloutEngine
from hybridrl.single_controller import Dispatch, Worker, register
from hybridrl.utils.faults import maybe_inject
from hybridrl.workers.common import import_external_lib


class RolloutWorker(Worker):
    """Generates for this rank's share of the prompts; ``actor`` is the colocated ActorWorker."""

    def __init__(self, config, actor=None) -> None:
        arr = config.actor_rollout_ref
        self.config = config
        self.rollout = arr.rollout
        self.actor = actor
        import_external_lib("actor_rollout_ref.model.external_lib", arr.model.external_lib)
        tokenizer = load_tokenizer(arr.model.tokenizer_path or arr.model.path,
                                   trust_remote_code=arr.model.trust_remote_code)
        if self.rollout.name == "vllm":
            self.engine = self._build_vllm(config)
            generation_config = _load_generation_config(arr.model.path)
        else:
            model = load_causal_lm(arr.model.path, trust_remote_code=arr.model.trust_remote_code,
                                   override_config=dict(arr.model.override_config))
            # with a colocated actor the rollout adopts the streamed tensors: at world size 1 they are
            # the actor's own parameters, so later syncs copy nothing and one model copy is freed
            kv_dtype = {"auto": None, "float16": torch.float16}[self.rollout.kv_cache_dtype]
            self.engine = NativeRolloutEngine(model, share_weights=actor is not None, kv_cache_dtype=kv_dtype)
            generation_config = model.generation_config
        eos = eos_ids(tokenizer, generation_config)
        r = self.rollout
        self.train_params = SamplingParams(
            n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.response_length,
            do_sample=r.do_sample, eos_token_id=None if r.ignore_eos else eos,
            pad_token_id=tokenizer.pad_token_id)
        v = r.val_kwargs
        self.val_params = self.train_params.with_updates(
            n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k, do_sample=v.do_sample)
        self.seed = config.data.seed
        # multi-turn: the agent loop drives the same engine turn by turn (tools, interactions)
        self.agent_loop = build_agent_loop(self.engine, tokenizer, r.multi_turn, r.response_length) \
            if r.multi_turn.enable else None

    def _build_vllm(self, config):
        """The vLLM engine (hybridrl.rollout.vllm_engine, the only module importing vllm)."""
        from hybridrl.rollout.vllm_engine import build_vllm_engine

        engine = build_vllm_engine(config.actor_rollout_ref, config.trainer.device, seed=config.data.seed)
        if self.rollout.load_format.startswith("dummy"):
            # vLLM started from random weights (verl's default): take the actor's before any rollout.
            if self.actor is None:
                raise ValueError("actor_rollout_ref.rollout.load_format=dummy needs the actor colocated with "
                                 "the rollout to sync weights from; set load_format=auto")
            engine.update_weights(self.actor.engine.iter_full_params())
        return engine

    @register(Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """B = N x n rows (validation: ``val_kwargs.n``), samples of one prompt adjacent.

        The sampling seed is drawn from (data.seed, step, rank, validate), so a resumed run
        samples exactly what the uninterrupted run sampled.
        """
        maybe_inject("generate_sequences")
        validate = bool(prompts.meta_info.get("validate", False))
        step = int(prompts.meta_info.get("global_step", 0))
        params = self.val_params if validate else self.train_params
        seed = int(np.random.SeedSequence([self.seed, step, self.rank, int(validate)]).generate_state(1)[0])
        generator = self.agent_loop if self.agent_loop is not None else self.engine
        out = generator.generate(prompts, params.with_updates(seed=seed))
        if self.rollout.free_cache_engine and isinstance(self.engine, NativeRolloutEngine):
            # the hybrid engine's rollout sleeps between rollouts (the vLLM adapter sleeps itself):
            # its KV cache and packed decode weights, about the model's size, are not held through
            # the update, and the weights change there anyway, so nothing is lost. Here rather than
            # in the engine: the agent loop calls the engine once per turn, and freeing per turn
            # would repack the weights every turn
            self.engine.free_cache()
        out.meta_info = {}
        return out

    @register(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> None:
        """Stream the actor's full parameters (gathered a bucket at a time) into the rollout model."""
        if self.actor is None:
            raise RuntimeError("sync_weights needs the actor colocated with the rollout")
        self.engine.update_weights(self.actor.engine.iter_full_params())
        self.engine.free_cache()


def _load_generation_config(path):
    """The model folder's generation_config.json, or None when it has none."""
    from transformers import GenerationConfig

    from hybridrl.models.utils import resolve_model_dir

    folder = resolve_model_dir(path)
    return GenerationConfig.from_pretrained(folder) if (folder / "generation_config.json").exists() else None
