"""The PPO/GRPO fit loop: the single controller of the HybridFlow design.

The driver holds no model weights. Each stage of ``fit`` is one method; each sends a DataProto to
the worker group (split across data-parallel ranks) and merges what comes back:

    generate -> reward -> old/ref log-probs -> values -> KL-in-reward -> advantages
             -> critic update -> actor update -> weight sync (hybrid engine)
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from hybridrl import algos
from hybridrl.engine.seqlen_balancing import balance_across_ranks
from hybridrl.protocol import DataProto, to_object_array
from hybridrl.trainer import checkpoint as ckpt
from hybridrl.trainer.dumps import dump_batch
from hybridrl.trainer.metrics import (
    Timer,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
)
from hybridrl.utils import gc_freeze, numerics
from hybridrl.utils.faults import maybe_inject
from hybridrl.workers.actor import UNCHECKED_LOG_PROBS

GEN_KEYS = ["input_ids", "attention_mask", "position_ids"]
# The columns each worker call reads (as verl's workers select them): only these travel to the
# ranks. The forward passes of actor, reference and critic (hybridrl.engine.train_engine) read the
# model inputs; the updates add their losses' inputs (hybridrl.workers.actor / critic).
MODEL_INPUT_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]
ACTOR_UPDATE_KEYS = [*MODEL_INPUT_KEYS, "response_mask", "advantages", "old_log_probs", "ref_log_probs",
                     "rollout_log_probs"]
CRITIC_UPDATE_KEYS = [*MODEL_INPUT_KEYS, "response_mask", "values", "returns"]


def columns_of(rows) -> dict[str, list]:
    """Per-row dicts -> dict of per-key lists (the reward manager's ``reward_extra_info`` layout)."""
    keys = dict.fromkeys(k for row in rows for k in row)
    return {k: [row.get(k) for row in rows] for k in keys}


def columns(batch: DataProto, keys: list[str]) -> DataProto:
    """The tensor columns ``keys`` that ``batch`` has (no non-tensor columns), and its meta_info."""
    return batch.select(batch_keys=[k for k in keys if k in batch.batch], non_tensor_batch_keys=[])


def merge_columns(batch: DataProto, out: DataProto) -> DataProto:
    """Add a worker's output columns to the batch; its meta_info (per-call statistics) is dropped."""
    return batch.union(out.select(meta_info_keys=[]))


class Workers(Protocol):
    """What the driver calls on the (colocated) worker group; each call is SPMD over its ranks."""

    world_size: int

    def generate_sequences(self, prompts: DataProto) -> DataProto: ...
    def compute_log_prob(self, data: DataProto) -> DataProto: ...
    def compute_ref_log_prob(self, data: DataProto) -> DataProto: ...
    def compute_values(self, data: DataProto) -> DataProto: ...
    def compute_rm_score(self, data: DataProto) -> DataProto: ...
    def update_actor(self, data: DataProto) -> DataProto: ...
    def update_critic(self, data: DataProto) -> DataProto: ...
    def sync_weights(self) -> None: ...
    def save_checkpoint(self, path: str) -> None: ...
    def load_checkpoint(self, path: str) -> None: ...
    def freeze_gc(self) -> None: ...
    # one of the calls above, not awaited; ``joins``: earlier sent calls whose outputs join its batch
    def submit(self, name: str, *args: DataProto, joins: tuple = ()) -> Callable[[], object]: ...


def old_log_probs_needed(config) -> bool:
    """False when the actor update is exactly on-policy: one PPO epoch over a single mini-batch, so
    the policy that scores the update's tokens is the one that sampled them and ``old_log_probs``
    equal the update's own log-probs (detached). The separate forward is then skipped, as verl's
    ``dp_actor`` (``on_policy``) and TRL's GRPOTrainer do. KL-in-reward, rollout importance weights
    (applied, or only measured) and loss modes other than ``vanilla`` read the old log-probs before or
    beside the update, so they
    keep the forward; so do ``actor/entropy`` and ``training/rollout_probs_diff_*``, which come from it.
    """
    actor, alg = config.actor_rollout_ref.actor, config.algorithm
    on_policy = actor.ppo_epochs == 1 and actor.ppo_mini_batch_size == config.data.train_batch_size
    return not (on_policy and actor.policy_loss.loss_mode == "vanilla" and not alg.use_kl_in_reward
                and not alg.rollout_is and alg.rollout_is_threshold is None and actor.tis_imp_ratio_cap <= 0)


class PPOTrainer:
    """Runs ``fit()``; everything it needs is built by ``hybridrl.trainer.main_ppo``."""

    def __init__(self, config, workers: Workers, train_loader, val_loader, reward_fn: Callable,
                 val_reward_fn: Callable, tracking, log_dir: str | Path) -> None:
        self.config = config
        self.workers = workers
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn
        self.tracking = tracking
        self.log_dir = Path(log_dir)
        alg = config.algorithm
        self.use_critic = alg.adv_estimator == "gae"
        actor = config.actor_rollout_ref.actor
        self.use_ref = alg.use_kl_in_reward or actor.use_kl_loss
        self.use_rm = config.reward_model.enable
        self.needs_old_log_probs = old_log_probs_needed(config)
        # the actor update can be sent with the log-prob calls when nothing the driver computes
        # before it (advantages, KL in the reward, values) reads them (update_with_log_probs)
        self.joins_log_probs = ((self.needs_old_log_probs or self.use_ref) and not self.use_critic
                                and not alg.use_kl_in_reward and hasattr(workers, "submit"))
        self.kl_ctrl = algos.build_kl_controller(alg.kl_ctrl.type, alg.kl_ctrl.kl_coef,
                                                 alg.kl_ctrl.target_kl, alg.kl_ctrl.horizon) \
            if alg.use_kl_in_reward else None
        self.global_step = 0
        self.skipped_steps = 0  # steps whose update was skipped for NaN/Inf (trainer.nan_policy=skip)
        self.total_steps = self._total_steps()
        self.steps_run = 0  # steps of this fit (after a resume: since it)
        # the next step's prompts, their data epoch and their generation, sent behind this step's
        # update (prepare_next_step)
        self.next_generation: tuple[DataProto, int, Callable[[], DataProto]] | None = None
        self.epoch = 0  # the loader's epoch after this step's prompts were drawn (training/epoch)

    # ------------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, float]:
        """Train for ``total_steps`` steps; returns the last step's metrics. With ``trainer.val_only``
        it validates the (resumed or initial) policy once, logs that at its step and returns it."""
        self._resume()
        trainer = self.config.trainer
        if trainer.val_only:
            metrics = self.validate()
            self.tracking.log(metrics, step=self.global_step)
            return metrics
        if self.val_loader is not None and trainer.val_before_train and self.global_step == 0:
            self.tracking.log(self.validate(), step=0)
        last: dict[str, float] = {}
        try:
            while self.global_step < self.total_steps:
                self.global_step += 1
                last = self.train_step()
                self.steps_run += 1
                if self.freezes_gc_after(self.steps_run):
                    # long-lived objects (compiled graphs, modules) out of the collector's full
                    # passes; between steps, outside their timing (hybridrl.utils.gc_freeze)
                    self.workers.freeze_gc()
                    gc_freeze.freeze_survivors()
                if self.validates_after(self.global_step):
                    last.update(self.validate())
                self.tracking.log(last, step=self.global_step)
                if self.saves_after(self.global_step):
                    self.save_checkpoint()
        finally:
            self.next_generation = None  # sent only where a next step follows; dropped if a step failed
            gc_freeze.release()  # this process's objects collectable again (a notebook's next run)
        return last

    def train_step(self) -> dict[str, float]:
        timer = Timer()
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        with timer("step"):
            batch = self.collect_batch(timer, metrics)
            batch.meta_info["global_step"] = self.global_step
            if self.config.trainer.rollout_data_dir:
                dump_batch(self.config.trainer.rollout_data_dir, self.global_step, self.reward_fn.tokenizer,
                           batch, columns_of(batch.non_tensor_batch["reward_extra"]))
            if self.config.trainer.balance_batch:
                batch = self.balance_batch(batch)
            if self.joins_log_probs:
                batch, finite = self.update_with_log_probs(batch, timer, metrics)
            else:
                batch = self.score_with_models(batch, timer, metrics)
                with timer("adv"):
                    batch = self.compute_rewards_and_advantages(batch, metrics)
                finite = numerics.check_batch(batch.batch, self.global_step, self.config.trainer.nan_policy)
                updates = []
                if self.use_critic and finite:
                    updates.append(("update_critic", "update_critic", columns(batch, CRITIC_UPDATE_KEYS)))
                if finite and self.global_step > self.config.trainer.critic_warmup:
                    updates += [("update_actor", "update_actor", columns(batch, ACTOR_UPDATE_KEYS)),
                                ("update_weights", "sync_weights")]
                for result in self.run_calls(timer, updates, meanwhile=self.prepare_next_step):
                    metrics.update(result or {})  # sync_weights gives None
        self.count_skipped(finite, metrics)
        metrics.update(compute_data_metrics(batch, self.use_critic))
        metrics.update(compute_timing_metrics(batch, dict(timer.timing)))
        metrics.update(compute_throughput_metrics(batch, time.perf_counter() - start, self.workers.world_size))
        if hasattr(self.workers, "busy_since"):
            # time the worker group spent running this step's calls (each call: its slowest rank; a
            # generation sent behind the previous step's update only from this step's start); the
            # step minus this is the controller's share: dispatch, transfers, (de)serialization and
            # the driver's own work (advantages, metrics, and rewards scored in the driver)
            metrics["perf/time_in_workers"] = self.workers.busy_since(start)
        metrics["training/global_step"] = float(self.global_step)
        metrics["training/epoch"] = float(self.epoch)
        return metrics

    def count_skipped(self, finite: bool, metrics: dict[str, float]) -> None:
        """``training/skipped_steps``: steps so far in which NaN/Inf made the driver skip the
        updates or a worker skip an optimizer step (trainer.nan_policy=skip, hybridrl.utils.numerics)."""
        skipped = not finite or any(metrics.get(f"{role}/skipped_updates", 0.0) > 0 for role in ("actor", "critic"))
        self.skipped_steps += int(skipped)
        metrics["training/skipped_steps"] = float(self.skipped_steps)

    # ------------------------------------------------------------------------------- stages
    def collect_batch(self, timer: Timer, metrics: dict[str, float]) -> DataProto:
        """Generate and score until the batch is full.

        Without ``algorithm.filter_groups.enable`` this is one prompt batch. With it (DAPO dynamic
        sampling), groups whose ``filter_groups.metric`` has zero variance carry no GRPO signal and
        are dropped; more prompt batches are generated until ``data.train_batch_size`` prompts are
        kept or ``max_num_gen_batches`` is reached (0 = no limit).
        """
        fg = self.config.algorithm.filter_groups
        n = self.config.actor_rollout_ref.rollout.n
        want = self.config.data.train_batch_size
        kept: list[DataProto] = []
        num_prompts = num_gen = 0
        while True:
            num_gen += 1
            with timer("gen"):
                if self.next_generation is not None:  # sent during the last step's update
                    (prompts, self.epoch, wait), self.next_generation = self.next_generation, None
                    batch = self.finish_generation(prompts, wait())
                else:
                    prompts, self.epoch = self.next_prompts()
                    batch = self.generate(prompts)
            with timer("reward"):
                batch = self.score(self.with_rm_scores(batch), self.reward_fn, metrics)
            if not fg.enable:
                return batch
            batch = self.filter_groups(batch, fg.metric)
            kept.append(batch)
            num_prompts += len(batch) // n
            if num_prompts >= want:
                metrics["train/num_gen_batches"] = float(num_gen)
                return DataProto.concat(kept)[: want * n]
            if 0 < fg.max_num_gen_batches <= num_gen:
                raise RuntimeError(
                    f"dynamic sampling kept {num_prompts} of {want} prompts after {num_gen} generation "
                    f"batches (algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}); "
                    "the data may be too easy or too hard: raise max_num_gen_batches or set it to 0")

    def next_prompts(self) -> tuple[DataProto, int]:
        """The next training prompt batch and the loader's epoch right after it (the step's
        ``training/epoch``, also when the batch is drawn during the step before)."""
        prompts = next(self.train_iter)
        sampler = getattr(self.train_loader, "sampler", None)  # any iterable of batches trains
        return prompts, getattr(sampler, "epoch", 0)

    def generation_input(self, prompts: DataProto, validate: bool, step: int) -> DataProto:
        """What the rollout reads of a prompt batch (given its ``uid`` column here when it has none)."""
        if "uid" not in prompts.non_tensor_batch:
            prompts.non_tensor_batch["uid"] = to_object_array([str(uuid.uuid4()) for _ in range(len(prompts))])
        # multi-turn rollouts read tools_kwargs / interaction_kwargs (extra_info) and the messages
        multi_turn = self.config.actor_rollout_ref.rollout.multi_turn.enable
        gen_keys = [k for k in ("extra_info", "raw_prompt") if multi_turn and k in prompts.non_tensor_batch]
        gen_in = prompts.select(batch_keys=GEN_KEYS, non_tensor_batch_keys=gen_keys)
        gen_in.meta_info = {"validate": validate, "global_step": step}
        return gen_in

    def generate(self, prompts: DataProto, validate: bool = False) -> DataProto:
        """Rollout for one prompt batch: returns B = N*n rows, samples of a prompt adjacent."""
        out = self.workers.generate_sequences(self.generation_input(prompts, validate, self.global_step))
        return self.finish_generation(prompts, out)

    def finish_generation(self, prompts: DataProto, out: DataProto) -> DataProto:
        """The rollout's output ``out`` joined with the columns of its ``prompts`` it does not return."""
        repeat = len(out) // len(prompts)
        # a column the rollout returns (the agent loop's extra_info with num_turns) replaces the prompt's
        rest = prompts.select(batch_keys=[k for k in prompts.batch if k not in GEN_KEYS],
                              non_tensor_batch_keys=[k for k in prompts.non_tensor_batch if k not in out.non_tensor_batch])
        merged = merge_columns(rest.repeat(repeat, interleave=True), out)
        merged.meta_info = {k: v for k, v in out.meta_info.items() if k != "metrics"}
        return merged

    def with_rm_scores(self, batch: DataProto) -> DataProto:
        """The batch with the reward model's ``rm_scores`` (``reward_model.enable``), which the reward
        manager then returns in place of rule-based scores, as verl's do; else the batch as it is."""
        if not self.use_rm:
            return batch
        chat = [k for k in ("raw_prompt",) if k in batch.non_tensor_batch]  # for re-templating
        inputs = batch.select(batch_keys=[k for k in MODEL_INPUT_KEYS if k in batch.batch], non_tensor_batch_keys=chat)
        return merge_columns(batch, self.workers.compute_rm_score(inputs))

    def score(self, batch: DataProto, reward_fn: Callable, metrics: dict[str, float]) -> DataProto:
        """``token_level_scores`` from the reward manager; its per-sample extras ride along as the
        non-tensor column ``reward_extra`` (one dict per row, so filtering and reordering keep them
        aligned), and its metrics join the step's."""
        scores, extra = reward_fn(batch)
        batch.batch["token_level_scores"] = scores
        metrics.update({k: float(v) for k, v in extra.get("metrics", {}).items()})
        per_sample = extra.get("reward_extra_info", {})
        batch.non_tensor_batch["reward_extra"] = to_object_array(
            [{k: v[i] for k, v in per_sample.items()} for i in range(len(batch))])
        return batch

    def filter_groups(self, batch: DataProto, metric: str) -> DataProto:
        """Keep the groups (same uid) whose ``metric`` per sequence varies (DAPO, arXiv 2503.14476)."""
        rows = batch.non_tensor_batch["reward_extra"]
        if metric in ("seq_final_reward", "seq_reward"):
            values = batch.batch["token_level_scores"].sum(-1).numpy()
        elif metric in rows[0] or metric == "acc":
            # a scorer that returns a plain float has no "acc": its score is the accuracy
            values = np.asarray([row.get(metric, row.get("score")) for row in rows], dtype=np.float64)
        else:
            raise KeyError(f"algorithm.filter_groups.metric={metric!r} is not a reward output; "
                           f"available: ['seq_reward', 'seq_final_reward', {', '.join(map(repr, rows[0]))}]")
        uids = batch.non_tensor_batch["uid"]
        by_uid: dict[str, list[float]] = {}
        for uid, v in zip(uids, values):
            by_uid.setdefault(uid, []).append(float(v))
        keep_uid = {u for u, vs in by_uid.items() if len(vs) > 1 and np.std(vs) > 0}
        keep = np.array([u in keep_uid for u in uids], dtype=bool)
        return batch[keep]

    def balance_batch(self, batch: DataProto) -> DataProto:
        """Reorder rows so each data-parallel rank gets a similar number of real tokens."""
        world = self.workers.world_size
        if world <= 1:
            return batch
        lengths = batch.batch["attention_mask"].sum(-1).tolist()
        return batch.reorder(balance_across_ranks(lengths, world))

    def run_calls(self, timer: Timer, calls: list[tuple], meanwhile: Callable[[], None] | None = None,
                  joins: dict[str, tuple[str, ...]] | None = None) -> list:
        """Worker calls ``(timer name, call name, *args)`` that do not need each other's results:
        all are sent, then each is awaited in turn under its timer (the first timer also covers the
        sending). The ranks run them back to back in this order, so the round trip to the workers
        and the (de)serialization of the next call's data overlap the call before it instead of
        adding to the step. ``joins`` maps a timer name to the earlier calls (timer names) whose
        outputs join its batch on the ranks, so it can be sent before they are done.
        ``meanwhile`` is the driver's own work to do while the calls run (only where they run in
        other processes: ``workers.asynchronous``). Returns the results in order."""
        if not calls:
            return []
        joins = joins or {}
        results, sent = [], {}
        with timer(calls[0][0]):
            for phase, name, *args in calls:
                sent[phase] = self.workers.submit(name, *args, joins=tuple(sent[j] for j in joins.get(phase, ())))
            pending = list(sent.values())
            if meanwhile is not None and getattr(self.workers, "asynchronous", False):
                meanwhile()
            results.append(pending[0]())
        for (phase, *_), wait in zip(calls[1:], pending[1:]):
            with timer(phase):
                results.append(wait())
        return results

    def prefetch_prompts(self) -> None:
        """The next step's prompt batch, made while the workers update (``PromptDataLoader.prefetch``:
        the loader's saved state is unchanged, so checkpoints and resumption are not affected)."""
        prefetch = getattr(self.train_loader, "prefetch", None)
        if prefetch is not None and self.global_step < self.total_steps:
            prefetch()

    def prepare_next_step(self) -> None:
        """The driver's work while this step's update runs: the next prompt batch, and where the next
        step follows at once, its generation sent behind the update and the weight sync."""
        self.prefetch_prompts()
        if self.sends_generation_early():
            prompts, epoch = self.next_prompts()
            gen_in = self.generation_input(prompts, False, self.global_step + 1)
            self.next_generation = (prompts, epoch, self.workers.submit("generate_sequences", gen_in))

    def sends_generation_early(self) -> bool:
        """Whether the next step's generation goes out with this step's update (Ray): the ranks run it
        right after the weight sync, so the driver's round trip for it (sending, the rollout's start)
        overlaps the update instead of opening the next step. Only where nothing else runs between
        the two steps, so that every rank runs the same calls in the same order as without it (the
        same numbers, and checkpoints that resume exactly): not on the last step, a validation or
        checkpoint step, the steps whose end freezes the workers' objects, nor with dynamic
        sampling (its generation count depends on the scores)."""
        step = self.global_step
        if not getattr(self.workers, "asynchronous", False) or not hasattr(self.workers, "submit"):
            return False
        if step >= self.total_steps or self.freezes_gc_after(self.steps_run + 1):  # this step not yet counted
            return False
        if self.config.algorithm.filter_groups.enable:
            return False
        return not self.validates_after(step) and not self.saves_after(step)

    @staticmethod
    def freezes_gc_after(steps_run: int) -> bool:
        """Whether the end of this fit's ``steps_run``-th step freezes long-lived objects (gc_freeze)."""
        return steps_run <= gc_freeze.WARMUP_STEPS

    def validates_after(self, step: int) -> bool:
        """Whether step ``step`` ends with a validation (every ``test_freq`` steps and the last)."""
        trainer = self.config.trainer
        return self.val_loader is not None and trainer.test_freq > 0 and (
            step % trainer.test_freq == 0 or step == self.total_steps)

    def saves_after(self, step: int) -> bool:
        """Whether step ``step`` ends with a checkpoint (every ``save_freq`` steps and the last)."""
        save_freq = self.config.trainer.save_freq
        return save_freq > 0 and (step % save_freq == 0 or step == self.total_steps)

    def update_with_log_probs(self, batch: DataProto, timer: Timer, metrics: dict[str, float]) -> tuple[DataProto, bool]:
        """The old / reference log-prob calls, the actor update and the weight sync sent together
        (``joins_log_probs``: GRPO-style advantages, which read neither, so they come first). The
        update takes the log-probs from the calls before it on the ranks, one round trip to the
        workers instead of two. The driver checks the log-probs once they are back; the update
        checks them itself first and does nothing when they are not finite (all ranks agree), so
        ``trainer.nan_policy`` acts as when the update is sent after them."""
        with timer("adv"):
            batch = self.compute_rewards_and_advantages(batch, metrics)
        policy = self.config.trainer.nan_policy
        finite = numerics.check_batch(batch.batch, self.global_step, policy)  # scores, advantages
        update_now = finite and self.global_step > self.config.trainer.critic_warmup
        calls = self.forward_calls(batch)  # no critic here (joins_log_probs)
        forwards = [phase for phase, *_ in calls]
        if update_now:
            update = columns(batch, ACTOR_UPDATE_KEYS)
            update.meta_info[UNCHECKED_LOG_PROBS] = True
            calls += [("update_actor", "update_actor", update), ("update_weights", "sync_weights")]
        results = self.run_calls(timer, calls, meanwhile=self.prepare_next_step,
                                 joins={"update_actor": tuple(forwards)})
        batch = self.merge_forwards(batch, forwards, results, metrics)
        finite = finite and numerics.check_batch(batch.batch, self.global_step, policy)
        if update_now and finite:
            metrics.update(results[len(forwards)])
        return batch, finite

    def score_with_models(self, batch: DataProto, timer: Timer, metrics: dict[str, float]) -> DataProto:
        """Old and reference log-probs and the critic's values, each one call, sent together
        (``run_calls``) with only the model inputs: those forward passes read nothing else."""
        calls = self.forward_calls(batch)
        return self.merge_forwards(batch, [phase for phase, *_ in calls], self.run_calls(timer, calls), metrics)

    def forward_calls(self, batch: DataProto) -> list[tuple]:
        """The ``run_calls`` entries of the forward passes this step needs, on the model inputs only."""
        inputs = columns(batch, MODEL_INPUT_KEYS)
        return [(phase, name, inputs) for phase, name, used in (
            ("old_log_prob", "compute_log_prob", self.needs_old_log_probs),
            ("ref", "compute_ref_log_prob", self.use_ref),
            ("values", "compute_values", self.use_critic)) if used]

    def merge_forwards(self, batch: DataProto, phases: list[str], outputs: list, metrics: dict[str, float]) -> DataProto:
        """The forward passes' outputs (in ``phases`` order) merged into the batch."""
        for phase, out in zip(phases, outputs):
            batch = self.add_old_log_probs(batch, out, metrics) if phase == "old_log_prob" else merge_columns(batch, out)
        return batch

    def add_old_log_probs(self, batch: DataProto, out: DataProto, metrics: dict[str, float]) -> DataProto:
        """Merge ``compute_log_prob``'s output: ``actor/entropy`` and the rollout-vs-trainer metrics."""
        if "entropy" in out.batch:
            entropy = out.pop(batch_keys=["entropy"]).batch["entropy"]
            mask = batch.batch["response_mask"]
            metrics["actor/entropy"] = float(algos.masked_mean(entropy, mask).item())
        batch = merge_columns(batch, out)
        if "rollout_log_probs" in batch.batch:
            metrics.update(self.rollout_mismatch_metrics(batch))
        return batch

    def rollout_mismatch_metrics(self, batch: DataProto) -> dict[str, float]:
        """How far the rollout engine's log-probs are from the trainer's on the same tokens."""
        mask = batch.batch["response_mask"].bool()
        diff = (batch.batch["old_log_probs"] - batch.batch["rollout_log_probs"]).abs()[mask]
        prob_diff = (batch.batch["old_log_probs"].exp() - batch.batch["rollout_log_probs"].exp()).abs()[mask]
        if diff.numel() == 0:
            return {}
        return {"training/rollout_probs_diff_max": prob_diff.max().item(),
                "training/rollout_probs_diff_mean": prob_diff.mean().item(),
                "training/rollout_log_probs_diff_max": diff.max().item()}

    def compute_rewards_and_advantages(self, batch: DataProto, metrics: dict[str, float]) -> DataProto:
        alg = self.config.algorithm
        b = batch.batch
        if alg.use_kl_in_reward:
            rewards, kl_metrics = algos.apply_kl_penalty(
                b["token_level_scores"], b["old_log_probs"], b["ref_log_probs"], b["response_mask"],
                self.kl_ctrl, alg.kl_penalty)
            b["token_level_rewards"] = rewards
            metrics.update(kl_metrics)
        else:
            b["token_level_rewards"] = b["token_level_scores"]
        advantages, returns = algos.compute_advantage(
            alg.adv_estimator, token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"],
            index=batch.non_tensor_batch["uid"], values=b.get("values"), gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo)
        b["advantages"], b["returns"] = advantages, returns
        return batch

    # ---------------------------------------------------------------------------- validation
    def validate(self) -> dict[str, float]:
        """Generate on the whole validation set (``rollout.val_kwargs``) and report per data
        source, as verl names them: ``val-core/<data_source>/acc/mean@<n>`` when the scorer
        returns ``acc``, else ``val-core/<data_source>/reward/mean@<n>``; the other numeric reward
        outputs go under ``val-aux/``."""
        n = self.config.actor_rollout_ref.rollout.val_kwargs.n
        per_source: dict[str, dict[str, list[float]]] = {}
        dumped: list[DataProto] = []
        for prompts in self.val_loader:
            batch = self.generate(prompts, validate=True)
            scores, extra = self.val_reward_fn(self.with_rm_scores(batch))
            extra = extra.get("reward_extra_info", {})
            batch.batch["token_level_scores"] = scores
            dumped.append(batch)
            seq_scores = scores.sum(-1).tolist()
            for i, src in enumerate(batch.non_tensor_batch[self.config.data.reward_fn_key]):
                slot = per_source.setdefault(str(src), {})
                slot.setdefault("reward", []).append(seq_scores[i])
                for key, values in extra.items():
                    if key != "score" and isinstance(values[i], int | float):
                        slot.setdefault(key, []).append(float(values[i]))
        if self.config.trainer.validation_data_dir and dumped:
            joined = DataProto.concat([d.select(non_tensor_batch_keys=[]) for d in dumped])
            dump_batch(self.config.trainer.validation_data_dir, self.global_step, self.val_reward_fn.tokenizer, joined)
        out: dict[str, float] = {}
        for src, series in per_source.items():
            core = "acc" if "acc" in series else "reward"
            for key, values in series.items():
                section = "val-core" if key == core else "val-aux"
                out[f"{section}/{src}/{key}/mean@{n}"] = float(np.mean(values))
        return out

    # ---------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        trainer = self.config.trainer
        stage = ckpt.staging_dir(trainer.default_local_dir, self.global_step)
        self.workers.save_checkpoint(str(stage))
        maybe_inject("commit_checkpoint")  # drill: a driver killed with shards written, not yet published
        state = {"global_step": self.global_step, "skipped_steps": self.skipped_steps,
                 "data": self.train_loader.state_dict(),
                 "kl_coef": self.kl_ctrl.value if self.kl_ctrl is not None else None,
                 "rng": torch.get_rng_state(), "np_rng": np.random.get_state()}
        torch.save(state, stage / "trainer_state.pt")
        ckpt.commit_checkpoint(trainer.default_local_dir, self.global_step, trainer.max_actor_ckpt_to_keep)

    def _resume(self) -> None:
        trainer = self.config.trainer
        path = ckpt.find_resume_checkpoint(trainer.default_local_dir, trainer.resume_mode,
                                           trainer.resume_from_path)
        if path is not None:
            ckpt.verify_checkpoint(path, trainer.default_local_dir)
            self.workers.load_checkpoint(str(path))
            state = torch.load(path / "trainer_state.pt", weights_only=False)
            self.global_step = state["global_step"]
            self.skipped_steps = state.get("skipped_steps", 0)  # absent in checkpoints of older versions
            self.train_loader.load_state_dict(state["data"])
            if self.kl_ctrl is not None and state["kl_coef"] is not None:
                self.kl_ctrl.value = state["kl_coef"]
            torch.set_rng_state(state["rng"])
            np.random.set_state(state["np_rng"])
            self.workers.sync_weights()
            print(f"hybridrl: resumed from {path} at step {self.global_step}", flush=True)
        self.train_iter: Iterator[DataProto] = self._endless(self.train_loader)

    @staticmethod
    def _endless(loader) -> Iterator[DataProto]:
        """Batches across epochs; the loader's sampler state always names the next batch."""
        while True:
            yield from loader

    def _total_steps(self) -> int:
        trainer = self.config.trainer
        if trainer.total_training_steps:
            return int(trainer.total_training_steps)
        return int(math.ceil(len(self.train_loader) * trainer.total_epochs))
