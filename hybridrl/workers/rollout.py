"""The rollout role: generation with the native KV-cache engine (vLLM adapter where installed),
and the hybrid-engine weight sync from the colocated actor."""

from __future__ import annotations

import numpy as np

from hybridrl.models import load_causal_lm, load_tokenizer
from hybridrl.protocol import DataProto
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.native import NativeRolloutEngine
from hybridrl.single_controller import Dispatch, Worker, register
from hybridrl.utils.faults import maybe_inject


class RolloutWorker(Worker):
    """Generates for this rank's share of the prompts; ``actor`` is the colocated ActorWorker."""

    def __init__(self, config, actor=None) -> None:
        arr = config.actor_rollout_ref
        self.config = config
        self.rollout = arr.rollout
        self.actor = actor
        if self.rollout.name == "vllm":
            raise NotImplementedError("actor_rollout_ref.rollout.name=vllm is not available yet; use native")
        tokenizer = load_tokenizer(arr.model.tokenizer_path or arr.model.path,
                                   trust_remote_code=arr.model.trust_remote_code)
        model = load_causal_lm(arr.model.path, trust_remote_code=arr.model.trust_remote_code,
                               override_config=dict(arr.model.override_config))
        self.engine = NativeRolloutEngine(model)
        eos = _eos_ids(tokenizer, model)
        r = self.rollout
        self.train_params = SamplingParams(
            n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.response_length,
            do_sample=r.do_sample, eos_token_id=None if r.ignore_eos else eos,
            pad_token_id=tokenizer.pad_token_id)
        v = r.val_kwargs
        self.val_params = self.train_params.with_updates(
            n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k, do_sample=v.do_sample)
        self.seed = config.data.seed

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
        out = self.engine.generate(prompts, params.with_updates(seed=seed))
        out.meta_info = {}
        return out

    @register(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> None:
        """Stream the actor's full parameters, one tensor at a time, into the rollout model."""
        if self.actor is None:
            raise RuntimeError("sync_weights needs the actor colocated with the rollout")
        self.engine.update_weights(self.actor.engine.iter_full_params())
        self.engine.free_cache()


def _eos_ids(tokenizer, model) -> tuple[int, ...]:
    """End-of-response ids: the tokenizer's eos plus the model's generation_config eos (which
    chat models often set to the end-of-turn token, e.g. ``<|im_end|>``)."""
    ids = [tokenizer.eos_token_id]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += gen_eos if isinstance(gen_eos, list) else [gen_eos]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))
