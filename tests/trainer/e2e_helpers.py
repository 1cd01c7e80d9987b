"""Shared set-up for the end-to-end trainer tests: a tiny model, a synthetic task, small configs."""

from __future__ import annotations

import json
import math
from pathlib import Path

from hybridrl.config import load_config
from hybridrl.data.preprocess import prepare
from hybridrl.models import make_tiny_model_dir

EXPECTED_KEYS = (
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
    "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean",
    "response_length/mean", "response_length/clip_ratio", "prompt_length/mean",
    "timing_s/gen", "timing_s/update_actor", "timing_s/step", "perf/throughput", "perf/time_in_workers",
    "training/rollout_probs_diff_max", "training/global_step",
)


def make_assets(root: Path) -> dict[str, str]:
    data = prepare("addition", root / "data", n=64, n_test=8, seed=0, max_digits=2)
    model = make_tiny_model_dir(root / "model", preset="tiny")
    return {"train": str(data["train"]), "test": str(data["test"]), "model": str(model)}


def make_reward_model(root: Path, policy: str, seed: int = 7) -> Path:
    """A tiny reward model folder: the policy's architecture as a one-label token classifier with a
    seeded head (every rank loads the same weights), and the policy's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(policy, num_labels=1)
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(root)
    AutoTokenizer.from_pretrained(policy).save_pretrained(root)
    return root


def small_overrides(assets: dict[str, str], run_dir: Path, **extra: object) -> list[str]:
    """A config a 2-core machine runs in seconds per step: 4 prompts x 2 samples x 8 tokens."""
    base = {
        "data.train_files": f"[{assets['train']}]",
        "data.val_files": f"[{assets['test']}]",
        "data.train_batch_size": 4,
        "data.max_response_length": 8,
        "data.max_prompt_length": 32,
        "data.val_batch_size": 8,
        "actor_rollout_ref.model.path": assets["model"],
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 4,
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 2,
        "trainer.logger": "[file]",
        "trainer.default_local_dir": str(run_dir),
        "trainer.n_cpu_workers": 2,
    }
    base.update({k: v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def config(assets, run_dir, **extra):
    return load_config(small_overrides(assets, run_dir, **extra), preset="grpo_quickstart")


def read_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """The last record logged for each step (a resumed run may log a step twice)."""
    out: dict[int, dict[str, float]] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec.pop("step")] = rec
    return out


def all_finite(metrics: dict[str, float]) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) for v in metrics.values())


def comparable(metrics: dict[str, float]) -> dict[str, float]:
    """Metrics that depend on the computation only (not on wall time)."""
    return {k: v for k, v in metrics.items() if not k.startswith(("timing", "perf/"))}
