"""The reference policy: frozen log-probs for the KL loss or KL-in-reward."""

from __future__ import annotations

from hybridrl.engine.train_engine import TrainEngine
from hybridrl.models import load_causal_lm
from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, Worker, register
from hybridrl.utils.faults import maybe_inject
from hybridrl.utils.numerics import poison
from hybridrl.workers.common import import_external_lib, micro_batching, setup_distributed, sharding


class RefWorker(Worker):
    """The initial policy weights, sharded like the actor and never stepped."""

    def __init__(self, config) -> None:
        setup_distributed()
        arr = config.actor_rollout_ref
        self.ref = arr.ref
        self.temperature = arr.rollout.temperature
        import_external_lib("actor_rollout_ref.model.external_lib", arr.model.external_lib)
        model = load_causal_lm(arr.model.path, trust_remote_code=arr.model.trust_remote_code,
                               override_config=dict(arr.model.override_config))
        model.requires_grad_(False)
        # lr 0 and no optimizer steps: the engine is used for its sharded, padding-free forward.
        self.engine = TrainEngine(model, lr=0.0, torch_compile=self.ref.use_torch_compile,
                                  share_prompts=arr.model.share_prompt_prefix, fused_log_probs=arr.model.use_fused_kernels,
                                  **sharding(self.ref.fsdp_config))

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_probs (B,R)`` at the rollout temperature."""
        nan = maybe_inject("compute_ref_log_prob")  # ":nan": a fault drill for trainer.nan_policy
        out = self.engine.forward(data, temperature=self.temperature,
                                  **micro_batching(self.ref.log_prob_use_dynamic_bsz,
                                                   self.ref.log_prob_micro_batch_size_per_gpu,
                                                   self.ref.log_prob_max_token_len_per_gpu))
        out.rename("log_probs", "ref_log_probs")
        if nan:
            out.batch["ref_log_probs"] = poison(out.batch["ref_log_probs"])
        return out
