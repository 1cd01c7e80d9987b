"""The critic: values for GAE and the clipped value-loss update."""

from __future__ import annotations

import torch

from hybridrl.algos import compute_value_loss
from hybridrl.model_merger import save_checkpoint_metadata
from hybridrl.models import load_critic, load_tokenizer
from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, Worker, register
from hybridrl.utils.faults import maybe_inject
from hybridrl.utils.numerics import poison, screen_update
from hybridrl.workers.common import (
    LossAccumulator,
    build_engine,
    global_batch_info,
    import_external_lib,
    iter_mini_batches,
    mean_metrics,
    micro_batching,
    optimizer_steps,
    setup_distributed,
)


class CriticWorker(Worker):
    """A value model (backbone + scalar head) in a TrainEngine."""

    def __init__(self, config, total_training_steps: int) -> None:
        setup_distributed()
        self.config = config
        self.critic = config.critic
        self.n = config.actor_rollout_ref.rollout.n
        import_external_lib("critic.model.external_lib", self.critic.model.external_lib)
        model = load_critic(self.critic.model.path, trust_remote_code=self.critic.model.trust_remote_code,
                            gradient_checkpointing=self.critic.model.enable_gradient_checkpointing,
                            override_config=dict(self.critic.model.override_config))
        updates = optimizer_steps(config.data.train_batch_size, self.critic.ppo_mini_batch_size, self.critic.ppo_epochs)
        self.engine = build_engine(model, self.critic.optim, grad_clip=self.critic.grad_clip,
                                   total_steps=total_training_steps, updates_per_step=updates,
                                   fsdp_config=self.critic.model.fsdp_config, model_type="value")

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """``values (B,R)``: the value of the state before each response token."""
        maybe_inject("compute_values")
        return self.engine.forward(data, **micro_batching(self.critic.use_dynamic_bsz,
                                                          self.critic.forward_micro_batch_size_per_gpu,
                                                          self.critic.forward_max_token_len_per_gpu))

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> dict[str, float]:
        if maybe_inject("update_critic"):  # a ":nan" fault drill for trainer.nan_policy
            data.batch["returns"] = poison(data.batch["returns"])
        rows = self.critic.ppo_mini_batch_size * self.n // self.world_size
        step = int(data.meta_info.get("global_step", 0))
        per_step = [self._optimizer_step(mini, step) for mini in iter_mini_batches(
            data, rows, self.critic.ppo_epochs, self.critic.shuffle,
            self.config.actor_rollout_ref.actor.data_loader_seed + step)]
        metrics = mean_metrics(per_step)
        metrics["critic/skipped_updates"] = sum(m["critic/skipped_updates"] for m in per_step)
        return metrics

    def _optimizer_step(self, mini: DataProto, step: int) -> dict[str, float]:
        info = global_batch_info(mini, self.config.actor_rollout_ref.actor.loss_scale_factor)
        acc = LossAccumulator()
        critic = self.critic

        def loss_fn(outputs: dict[str, torch.Tensor], micro: DataProto):
            b = micro.batch
            mask = b["response_mask"].to(outputs["values"].dtype)
            vf_loss, clipfrac = compute_value_loss(outputs["values"], b["returns"], b["values"], mask,
                                                   critic.cliprange_value, critic.loss_agg_mode, **info.as_kwargs())
            acc.add(vf_loss=vf_loss)
            vpred_mean = (outputs["values"] * mask).sum() / mask.sum().clamp(min=1)
            return vf_loss, {"critic/vf_clipfrac": float(clipfrac), "critic/vpred_mean": float(vpred_mean)}

        metrics = self.engine.train_step(mini, loss_fn, **micro_batching(
            critic.use_dynamic_bsz, critic.ppo_micro_batch_size_per_gpu, critic.ppo_max_token_len_per_gpu))
        out = {f"critic/{k}": v for k, v in metrics.items() if k in ("grad_norm", "lr")}
        out.update({k: v for k, v in metrics.items() if k.startswith("critic/")})
        out.update({f"critic/{k}": v for k, v in acc.all_reduced().items()})
        return screen_update(out, metrics, dict(acc.sums), role="critic", step=step, rank=self.rank,
                             policy=self.config.trainer.nan_policy)

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Sharded state under ``<path>/critic``; rank 0 adds ``huggingface/`` (backbone config +
        tokenizer) so ``hybridrl.model_merger`` can turn it into a critic folder."""
        self.engine.save_checkpoint(f"{path}/critic")
        if self.rank == 0:
            model = self.critic.model
            tokenizer = load_tokenizer(model.tokenizer_path or model.path, trust_remote_code=model.trust_remote_code)
            save_checkpoint_metadata(f"{path}/critic", self.engine.model, tokenizer)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(f"{path}/critic")
