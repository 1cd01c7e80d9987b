"""The actor: old log-probs and the PPO policy update (policy loss, KL loss, entropy bonus)."""

from __future__ import annotations

import torch

from hybridrl.algos import (
    PolicyLossParams,
    agg_loss,
    compute_policy_loss,
    compute_rollout_is_weights,
    kl_penalty,
)
from hybridrl.model_merger import save_checkpoint_metadata
from hybridrl.models import load_causal_lm, load_tokenizer
from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, Worker, register
from hybridrl.utils.faults import maybe_inject
from hybridrl.utils.gc_freeze import freeze_survivors
from hybridrl.utils.numerics import nonfinite_summary, poison, screen_update
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

# meta_info flag of an update whose old / reference log-probs joined it on the ranks, unseen by the
# driver: the update first checks them itself (ActorWorker.update_actor)
UNCHECKED_LOG_PROBS = "unchecked_log_probs"


class ActorWorker(Worker):
    """Holds the policy in a TrainEngine (FSDP2 over the worker group's ranks)."""

    def __init__(self, config, total_training_steps: int) -> None:
        setup_distributed()
        arr = config.actor_rollout_ref
        self.config = config
        self.actor = arr.actor
        self.n = arr.rollout.n
        self.temperature = arr.rollout.temperature
        import_external_lib("actor_rollout_ref.model.external_lib", arr.model.external_lib)
        model = load_causal_lm(arr.model.path, trust_remote_code=arr.model.trust_remote_code,
                               gradient_checkpointing=arr.model.enable_gradient_checkpointing,
                               override_config=dict(arr.model.override_config))
        self.updates_per_step = optimizer_steps(config.data.train_batch_size, self.actor.ppo_mini_batch_size,
                                                self.actor.ppo_epochs)
        self.engine = build_engine(model, self.actor.optim, grad_clip=self.actor.grad_clip,
                                   total_steps=total_training_steps, updates_per_step=self.updates_per_step,
                                   fsdp_config=self.actor.fsdp_config,
                                   torch_compile=self.actor.use_torch_compile,
                                   share_prompts=arr.model.share_prompt_prefix,
                                   fused_log_probs=arr.model.use_fused_kernels,
                                   entropy_chunking=self.actor.entropy_from_logits_with_chunking,
                                   entropy_checkpointing=self.actor.entropy_checkpointing)
        self.policy_params = PolicyLossParams(
            clip_ratio=self.actor.clip_ratio, clip_ratio_low=self.actor.clip_ratio_low,
            clip_ratio_high=self.actor.clip_ratio_high, clip_ratio_c=self.actor.clip_ratio_c,
            clip_cov_ratio=self.actor.policy_loss.clip_cov_ratio, clip_cov_lb=self.actor.policy_loss.clip_cov_lb,
            clip_cov_ub=self.actor.policy_loss.clip_cov_ub, kl_cov_ratio=self.actor.policy_loss.kl_cov_ratio,
            ppo_kl_coef=self.actor.policy_loss.ppo_kl_coef)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs (B,R)`` and ``entropy (B,R)`` under the current policy."""
        nan = maybe_inject("compute_log_prob")  # ":nan": a fault drill for trainer.nan_policy
        rollout = self.config.actor_rollout_ref.rollout
        out = self.engine.forward(data, temperature=self.temperature, calculate_entropy=True,
                                  **micro_batching(rollout.log_prob_use_dynamic_bsz,
                                                   rollout.log_prob_micro_batch_size_per_gpu,
                                                   rollout.log_prob_max_token_len_per_gpu))
        out.rename("log_probs", "old_log_probs")
        if nan:
            out.batch["old_log_probs"] = poison(out.batch["old_log_probs"])
        return out

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO epochs over mini-batches of ``ppo_mini_batch_size x n`` sequences (all ranks)."""
        if maybe_inject("update_actor"):  # a ":nan" fault drill for trainer.nan_policy
            data.batch["advantages"] = poison(data.batch["advantages"])
        rows = self.actor.ppo_mini_batch_size * self.n // self.world_size
        if "old_log_probs" not in data.batch and (self.actor.ppo_epochs != 1 or rows != len(data)):
            raise KeyError(f"update_actor: the batch has no old_log_probs, which only an on-policy update (ppo_epochs=1, "
                           f"one mini-batch) may skip; here ppo_epochs={self.actor.ppo_epochs}, {len(data)} rows in "
                           f"mini-batches of {rows}")
        step = int(data.meta_info.get("global_step", 0))
        if data.meta_info.get(UNCHECKED_LOG_PROBS) and not self._log_probs_finite(data):
            # the driver sent this update before it saw the log-probs it joined (PPOTrainer.run_calls);
            # it will find them non-finite and skip the step or stop the run, as if not sent
            return {}
        per_step = []
        for mini in iter_mini_batches(data, rows, self.actor.ppo_epochs, self.actor.shuffle,
                                      self.actor.data_loader_seed + step):
            per_step.append(self._optimizer_step(mini, step))
        metrics = mean_metrics(per_step)
        metrics["actor/skipped_updates"] = sum(m["actor/skipped_updates"] for m in per_step)
        return metrics

    def _log_probs_finite(self, data: DataProto) -> bool:
        """Old and reference log-probs finite on the response tokens of every rank's rows (one
        all-reduce, so that all ranks skip together)."""
        mask = data.batch["response_mask"]
        bad = any(nonfinite_summary(k, data.batch[k], mask) for k in ("old_log_probs", "ref_log_probs")
                  if k in data.batch)
        flag = torch.tensor([float(bad)])
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return flag.item() == 0.0

    def _optimizer_step(self, mini: DataProto, step: int) -> dict[str, float]:
        info = global_batch_info(mini, self.actor.loss_scale_factor)
        acc = LossAccumulator()
        need_entropy = self.actor.entropy_coeff != 0 or self.actor.calculate_entropy
        loss_fn = self._loss_fn(info, acc, need_entropy)
        metrics = self.engine.train_step(
            mini, loss_fn, temperature=self.temperature, calculate_entropy=need_entropy,
            **micro_batching(self.actor.use_dynamic_bsz, self.actor.ppo_micro_batch_size_per_gpu,
                             self.actor.ppo_max_token_len_per_gpu))
        out = {f"actor/{k}": v for k, v in metrics.items() if k in ("grad_norm", "lr", "padding_ratio", "compute_ratio")}
        out.update({k: v for k, v in metrics.items() if k.startswith(("actor/", "rollout_corr/"))})
        out.update({f"actor/{k}": v for k, v in acc.all_reduced().items()})
        return screen_update(out, metrics, dict(acc.sums), role="actor", step=step, rank=self.rank,
                             policy=self.config.trainer.nan_policy)

    def _loss_fn(self, info, acc: LossAccumulator, need_entropy: bool):
        actor, algorithm = self.actor, self.config.algorithm

        def loss_fn(outputs: dict[str, torch.Tensor], micro: DataProto):
            b = micro.batch
            mask = b["response_mask"].to(outputs["log_probs"].dtype)
            log_prob = outputs["log_probs"]
            is_weights, metrics = self._rollout_is_weights(b, mask, algorithm)
            # on-policy (the trainer skipped the old-log-prob forward): pi_old is this very policy
            old_log_prob = b["old_log_probs"] if "old_log_probs" in b else log_prob.detach()
            pg_loss, pg_metrics = compute_policy_loss(
                actor.policy_loss.loss_mode, old_log_prob, log_prob, b["advantages"], mask,
                actor.loss_agg_mode, params=self.policy_params, rollout_is_weights=is_weights, batch_info=info)
            metrics.update({k: float(v) for k, v in pg_metrics.items()})
            loss = pg_loss
            acc.add(pg_loss=pg_loss)
            if need_entropy:
                entropy = agg_loss(outputs["entropy"], mask, actor.loss_agg_mode, **info.as_kwargs())
                acc.add(entropy_loss=entropy)
                loss = loss - actor.entropy_coeff * entropy
            if actor.use_kl_loss:
                kld = kl_penalty(log_prob, b["ref_log_probs"], actor.kl_loss_type)
                kl_loss = agg_loss(kld, mask, actor.loss_agg_mode, **info.as_kwargs())
                acc.add(kl_loss=kl_loss)
                metrics["actor/kl_coef"] = actor.kl_loss_coef
                loss = loss + actor.kl_loss_coef * kl_loss
            return loss, metrics

        return loss_fn

    def _rollout_is_weights(self, b, mask, algorithm):
        """IS weights pi_old / pi_rollout when configured (verl's rollout correction, or the older
        TIS cap ``actor.tis_imp_ratio_cap``). With ``rollout_is_threshold`` but ``rollout_is=false``
        the weights are measured (``rollout_corr/`` metrics) and not applied, as in verl."""
        cap = self.actor.tis_imp_ratio_cap
        if "rollout_log_probs" not in b:
            return None, {}
        if algorithm.rollout_is_threshold is not None:
            threshold, level = algorithm.rollout_is_threshold, algorithm.rollout_is_level
            lower = algorithm.rollout_is_threshold_lower if algorithm.rollout_is_mode == "mask" else None
            if lower is None and algorithm.rollout_is_mode == "mask":
                lower = 1.0 / threshold
            veto, applied = algorithm.rollout_is_veto_threshold, algorithm.rollout_is
        elif cap > 0:
            threshold, level, lower, veto, applied = cap, "token", None, None, True
        else:
            return None, {}
        weights, metrics = compute_rollout_is_weights(b["old_log_probs"], b["rollout_log_probs"], mask, level=level,
                                                      threshold=threshold, threshold_lower=lower, veto_threshold=veto)
        return (weights if applied else None), {k: float(v) for k, v in metrics.items()}

    # ----------------------------------------------------------------------------- checkpoints
    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Sharded state under ``<path>/actor``; with ``hf_model`` in ``checkpoint.save_contents``
        also a Hugging Face folder ``<path>/actor/hf_model`` (with the tokenizer). Rank 0 adds
        ``<path>/actor/huggingface/`` (config + tokenizer) so ``hybridrl.model_merger`` can merge it."""
        self.engine.save_checkpoint(f"{path}/actor")
        if self.rank == 0:
            save_checkpoint_metadata(f"{path}/actor", self.engine.model, self._tokenizer())
        if "hf_model" in self.actor.checkpoint.save_contents:
            self.export_hf(f"{path}/actor/hf_model")

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(f"{path}/actor")

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        self.engine.export_hf(path, tokenizer=self._tokenizer())

    @register(Dispatch.ONE_TO_ALL)
    def freeze_gc(self) -> int:
        """Freeze this worker process's surviving objects after warm-up (``hybridrl.utils.gc_freeze``;
        every role of the process shares it); returns how many are frozen."""
        return freeze_survivors()

    def _tokenizer(self):
        model = self.config.actor_rollout_ref.model
        return load_tokenizer(model.tokenizer_path or model.path, trust_remote_code=model.trust_remote_code)
