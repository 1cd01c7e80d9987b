"""The SFT fit loop on the same TrainEngine, checkpoints and trackers as RL.

Each step takes one global batch of ``data.train_batch_size`` examples (every rank reads the same
batch from the seeded loader), balances it over the ranks by real tokens, and runs one
``TrainEngine.train_step`` per rank with

    loss = -sum(log_probs * response_mask) / (response tokens of the whole global batch)

so the loss and the gradient are the token-mean NLL of the step whatever the micro batching or the
number of ranks (the engine sums micro-batch losses and FSDP sums gradients over ranks). Validation
loss is the same token-mean over the whole validation set. Optionally the validation prompts are
greedy-decoded and scored (``val-core/<data_source>/acc/mean@1``), the number RL then improves.

Shape letters: B rows, P prompt, R response, T = P + R.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybridrl.engine.seqlen_balancing import balance_across_ranks
from hybridrl.protocol import DataProto
from hybridrl.trainer import checkpoint as ckpt

__all__ = ["SFTTrainer", "greedy_accuracy", "sft_loss"]

HF_DIR = "hf_model"


def sft_loss(log_probs: torch.Tensor, response_mask: torch.Tensor, num_tokens: float) -> tuple[torch.Tensor, dict]:
    """``-sum(log_probs * response_mask) / num_tokens`` for ``log_probs, response_mask (b, R)``.

    ``num_tokens`` is the loss-carrying token count of the whole step (all micro batches, all
    ranks), computed by the caller, so summing this over micro batches gives the step's token mean.
    """
    if num_tokens <= 0:
        raise ValueError(f"sft_loss: num_tokens={num_tokens}; the step has no loss-carrying (response) token")
    mask = response_mask.to(log_probs.dtype)
    nll = -(log_probs * mask).sum()
    return nll / num_tokens, {"train/micro_nll_sum": float(nll.detach())}


class SFTTrainer:
    """Runs ``fit()``; everything it needs is built by ``hybridrl.trainer.main_sft``.

    ``engine`` is this rank's ``TrainEngine``; ``train_loader`` / ``val_loader`` yield the same
    global batches on every rank (``PromptDataLoader`` over an ``SFTDataset``); ``tracking`` is
    used on rank 0 only (None elsewhere); ``val_prompt_files`` are scored by greedy decoding when
    ``trainer.val_generation_length > 0`` (world size 1).
    """

    def __init__(self, config, engine, tokenizer, train_loader, val_loader, tracking, run_dir: str | Path,
                 val_prompt_files: Sequence[str] = ()) -> None:
        self.config, self.engine, self.tokenizer = config, engine, tokenizer
        self.train_loader, self.val_loader, self.tracking = train_loader, val_loader, tracking
        self.run_dir = Path(run_dir)
        self.val_prompt_files = list(val_prompt_files)
        self.rank, self.world_size = engine.rank, engine.world_size
        self.global_step = 0
        self.total_steps = total_training_steps(config, len(train_loader))
        data = config.data
        self.micro = {"max_token_len": data.max_token_len_per_gpu} if data.use_dynamic_bsz else {
            "micro_batch_size": data.micro_batch_size_per_gpu}

    # ------------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, float]:
        """Train to ``total_steps``, validating and saving as configured, then export ``hf_model/``.
        Returns the last step's metrics (with the last validation)."""
        self.resume()
        trainer = self.config.trainer
        if self.val_loader is not None and trainer.val_before_train and self.global_step == 0:
            self.log(self.validate(), step=0)
        last: dict[str, float] = {}
        while self.global_step < self.total_steps:
            batch = next(self.train_iter)
            self.global_step += 1
            last = self.train_step(batch)
            is_last = self.global_step == self.total_steps
            if self.val_loader is not None and (is_last or (trainer.test_freq > 0 and self.global_step % trainer.test_freq == 0)):
                last.update(self.validate())
            self.log(last, step=self.global_step)
            if trainer.save_freq > 0 and (is_last or self.global_step % trainer.save_freq == 0):
                self.save_checkpoint()
        if not last and self.val_loader is not None:  # resumed a finished run: report where it stands
            last = self.validate()
        self.export_hf()
        return last

    def train_step(self, batch: DataProto) -> dict[str, float]:
        """One optimizer step on a global batch; returns verl's SFT metric names plus timing."""
        start = time.perf_counter()
        num_tokens = float(batch.batch["response_mask"].sum())
        local = self.shard(batch)

        def loss_fn(outputs: dict[str, torch.Tensor], micro: DataProto):
            return sft_loss(outputs["log_probs"], micro.batch["response_mask"].to(outputs["log_probs"].device), num_tokens)

        out = self.engine.train_step(local, loss_fn, **self.micro)
        elapsed = time.perf_counter() - start
        real_tokens = float(batch.batch["attention_mask"].sum())
        return {
            "train/loss": out["loss"], "train/lr": out["lr"], "train/grad_norm": out["grad_norm"],
            "train/response_tokens": num_tokens, "train/num_micro_batches": float(out["num_micro_batches"]),
            "train/padding_ratio": out["padding_ratio"], "timing_s/step": elapsed,
            "perf/throughput": real_tokens / elapsed / self.world_size,
            "training/global_step": float(self.global_step), "training/epoch": float(self.train_loader.sampler.epoch),
        }

    def shard(self, batch: DataProto) -> DataProto:
        """This rank's rows of a global batch, balanced by real tokens over the ranks."""
        if self.world_size == 1:
            return batch
        lengths = batch.batch["attention_mask"].sum(-1).tolist()
        return batch.reorder(balance_across_ranks(lengths, self.world_size)).chunk(self.world_size)[self.rank]

    # ---------------------------------------------------------------------------- validation
    def validate(self) -> dict[str, float]:
        """``val/loss``: token-mean NLL of the response tokens over the whole validation set
        (+ greedy accuracy when ``trainer.val_generation_length > 0``)."""
        nll = tokens = 0.0
        for batch in self.val_loader:
            batch, pad = batch.pad_to_divisor(self.world_size)
            if pad:  # copies that make the batch split evenly; they must not count
                batch.batch["response_mask"][-pad:] = 0
            local = self.shard(batch)
            log_probs = self.engine.forward(local, **self.micro).batch["log_probs"]
            mask = local.batch["response_mask"].to(log_probs.device, log_probs.dtype)
            nll += float(-(log_probs * mask).sum())
            tokens += float(mask.sum())
        nll, tokens = _all_reduce_sum([nll, tokens], self.world_size, self.engine.device)
        metrics = {"val/loss": nll / max(tokens, 1.0)}
        length = self.config.trainer.val_generation_length
        if length > 0 and self.val_prompt_files:
            data = self.config.data
            metrics.update(greedy_accuracy(self.engine.model, self.tokenizer, self.val_prompt_files,
                                           prompt_key=data.prompt_key, max_prompt_length=data.max_length,
                                           max_new_tokens=length, apply_chat_template_kwargs=dict(data.apply_chat_template_kwargs)))
        return metrics

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracking is not None and self.rank == 0:
            self.tracking.log(metrics, step=step)

    # ---------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """``global_step_<N>/`` with the engine state (``model/``) and ``trainer_state.pt`` (step,
        data position), written to a staging folder and published atomically by rank 0."""
        trainer = self.config.trainer
        root = Path(trainer.default_local_dir).expanduser()
        stage = root / f"global_step_{self.global_step}.tmp"
        if self.rank == 0:
            ckpt.staging_dir(root, self.global_step)
        _barrier(self.world_size)
        self.engine.save_checkpoint(stage / "model")
        _barrier(self.world_size)
        if self.rank == 0:
            state = {"global_step": self.global_step, "data": self.train_loader.state_dict()}
            torch.save(state, stage / "trainer_state.pt")
            ckpt.commit_checkpoint(root, self.global_step, trainer.max_ckpt_to_keep)
        _barrier(self.world_size)
        return root / f"global_step_{self.global_step}"

    def resume(self) -> None:
        """Continue from ``trainer.resume_mode``'s checkpoint, if any, exactly where it stopped."""
        trainer = self.config.trainer
        root = Path(trainer.default_local_dir).expanduser()
        path = ckpt.find_resume_checkpoint(root, trainer.resume_mode, trainer.resume_from_path)
        if path is not None:
            self.engine.load_checkpoint(Path(path) / "model")
            state = torch.load(Path(path) / "trainer_state.pt", weights_only=False)
            self.global_step = int(state["global_step"])
            self.train_loader.load_state_dict(state["data"])
            if self.rank == 0:
                print(f"hybridrl sft: resumed from {path} at step {self.global_step}", flush=True)
        self.train_iter: Iterator[DataProto] = _endless(self.train_loader)

    def export_hf(self) -> Path:
        """The final model as a Hugging Face folder ``<default_local_dir>/hf_model`` (config,
        safetensors, tokenizer), written beside it and renamed into place by rank 0."""
        root = Path(self.config.trainer.default_local_dir).expanduser()
        final, tmp = root / HF_DIR, root / f"{HF_DIR}.tmp"
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        _barrier(self.world_size)
        self.engine.export_hf(tmp, tokenizer=self.tokenizer)
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        _barrier(self.world_size)
        return final


def total_training_steps(config, steps_per_epoch: int) -> int:
    """``trainer.total_training_steps`` or ``total_epochs`` x batches per epoch (verl's rule)."""
    trainer = config.trainer
    return int(trainer.total_training_steps or math.ceil(steps_per_epoch * trainer.total_epochs))


def _endless(loader) -> Iterator[DataProto]:
    """Batches across epochs; the loader's sampler state always names the next batch."""
    while True:
        yield from loader


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def _all_reduce_sum(values: list[float], world_size: int, device: torch.device) -> list[float]:
    if world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


# ---------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def greedy_accuracy(model, tokenizer, files: str | Sequence[str], *, prompt_key: str = "prompt",
                    max_prompt_length: int = 256, max_new_tokens: int = 32, batch_size: int = 256,
                    apply_chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, float]:
    """Greedy-decode every prompt of verl-format RL rows and score it with the default reward.

    Returns ``val-core/<data_source>/acc/mean@1`` per data source (the score's ``acc`` when the
    scorer returns a dict, else the score) and ``val/generation_s``. The model is used as is (an
    unsharded HF causal LM); it is left in eval mode.
    """
    from hybridrl.data import PromptDataLoader, RLHFDataset
    from hybridrl.rewards import default_compute_score
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.native import NativeRolloutEngine

    start = time.perf_counter()
    dataset = RLHFDataset(files, tokenizer, max_prompt_length=max_prompt_length, prompt_key=prompt_key,
                          truncation="left", apply_chat_template_kwargs=apply_chat_template_kwargs)
    loader = PromptDataLoader(dataset, min(batch_size, len(dataset)), shuffle=False, drop_last=False)
    rollout = NativeRolloutEngine(model, max_num_seqs=batch_size)  # built per call: it caches fused weights
    params = SamplingParams(do_sample=False, temperature=0.0, max_new_tokens=max_new_tokens, logprobs=False,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=dataset.pad_token_id)
    per_source: dict[str, list[float]] = {}
    for prompts in loader:
        out = rollout.generate(prompts.select(batch_keys=["input_ids", "attention_mask", "position_ids"]), params)
        lengths = out.batch["response_mask"].sum(-1).tolist()
        columns = prompts.non_tensor_batch
        for i, length in enumerate(lengths):
            text = tokenizer.decode(out.batch["responses"][i, : int(length)].tolist(), skip_special_tokens=True)
            source, truth = str(columns["data_source"][i]), columns["reward_model"][i]["ground_truth"]
            extra = columns["extra_info"][i] if "extra_info" in columns else None
            score = default_compute_score(source, text, truth, extra)
            value = score.get("acc", score["score"]) if isinstance(score, dict) else score
            per_source.setdefault(source, []).append(float(value))
    metrics = {f"val-core/{src}/acc/mean@1": float(np.mean(v)) for src, v in per_source.items()}
    metrics["val/generation_s"] = time.perf_counter() - start
    return metrics
